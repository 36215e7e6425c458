"""Low-rank compressors: the matrix view, rank_k's exact bound, PowerSGD's step, state and
factor all-reduce, and both under EF21 and EF in the simulator (contract: test_contract.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shrinkgrad import Keys, make_compressor, make_method, make_problem, simulate
from shrinkgrad.compressors import ConstantUnknownError, PowerSGD, RankK, matrix_shape
from shrinkgrad.sim import SimulationInterrupted


# --------------------------------------------------------------------------------------------
# the matrix view
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [*range(1, 200), 1728, 10**6, 10**6 + 1, 123457])
def test_flat_reshape_rule_is_the_most_square_padded_view(d: int) -> None:
    m, n = matrix_shape(d)
    assert n == math.ceil(math.sqrt(d)) and m == -(-d // n)
    assert m <= n and m * n >= d and m * n - d < n  # fewer than one row of padding


def test_explicit_views() -> None:
    assert matrix_shape(20) == (4, 5)
    assert matrix_shape(20, rows=5) == (5, 4)
    assert matrix_shape(21, rows=5) == (5, 5)  # 4 zeros of padding
    c = make_compressor("rank_k[r=2]")
    conv = c.for_shape((64, 3, 3, 3))  # a conv weight: 64 × 27, as torch's PowerSGD views it
    assert isinstance(conv, RankK) and conv.spec == "rank_k[r=2,rows=64]"
    assert conv.matrix_shape(64 * 27) == (64, 27) and conv.bits(64 * 27) == 32 * 2 * (64 + 27)
    assert c.for_shape((100,)) is c  # a flat tensor keeps the flat rule
    p = make_compressor("power_sgd[rank=4,alpha=0.2]").for_shape(torch.Size([32, 16]))
    assert p.spec == "power_sgd[rank=4,alpha=0.2,rows=32]" and p.alpha(512) == 0.2
    assert make_compressor(p.spec).matrix_shape(512) == (32, 16)
    with pytest.raises(ValueError, match=r"rows=30 exceeds the vector length d=20"):
        make_compressor("rank_k[r=1,rows=30]").bits(20)
    with pytest.raises(ValueError, match=r"rank 5 exceeds min\(m, n\) = 4 of the 4 × 5 view"):
        make_compressor("rank_k[r=5]").alpha(20)
    with pytest.raises(ValueError, match=r"rank_k needs the rank >= 1, got 0"):
        make_compressor("rank_k[r=0]")
    with pytest.raises(ValueError, match=r"rows \(the matrix view\) >= 1"):
        make_compressor("rank_k[r=1,rows=0]")


# --------------------------------------------------------------------------------------------
# rank_k: the truncated SVD, α = r/min(m, n), attained by equal singular values
# --------------------------------------------------------------------------------------------
def _svd_reference(x: np.ndarray, r: int, m: int, n: int) -> np.ndarray:
    M = np.zeros(m * n)
    M[: x.size] = x
    u, s, vt = np.linalg.svd(M.reshape(m, n), full_matrices=False)
    return ((u[:, :r] * s[:r]) @ vt[:r]).reshape(-1)[: x.size]


@pytest.mark.parametrize("d,rows", [(20, None), (14, None), (123, None), (60, 12), (61, 3)])
@pytest.mark.parametrize("r", [1, 2, 3])
def test_rank_k_is_the_truncated_svd(d: int, rows: int | None, r: int) -> None:
    spec = f"rank_k[r={r}" + (f",rows={rows}]" if rows else "]")
    c = make_compressor(spec)
    m, n = c.matrix_shape(d)
    x = np.random.default_rng(d + r).standard_normal(d)
    y = c(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, _svd_reference(x, r, m, n), rtol=0, atol=1e-12 * np.abs(x).max())


def _orthogonal(m: int, n: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((max(m, n), min(m, n))))
    return q if m >= n else q.T


@pytest.mark.parametrize("m,n", [(4, 4), (4, 5), (6, 3), (8, 8), (10, 25)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_k_attains_its_bound_on_equal_singular_values(
    m: int, n: int, dtype: torch.dtype
) -> None:
    """Orthogonal matrices (all σ_j equal) attain ‖C(x) − x‖² = (1 − r/min(m, n))‖x‖², to
    round-off; α cannot be larger."""
    u = 2.0**-20 if dtype == torch.float32 else 2.0**-50
    for r in range(1, min(m, n)):
        c = make_compressor(f"rank_k[r={r},rows={m}]")
        for scale, seed in ((1.0, 0), (3e5, 1), (1e-7, 2)):
            x = torch.from_numpy(scale * _orthogonal(m, n, seed).reshape(-1)).to(dtype)
            err = float(((c(x) - x).double() ** 2).sum())
            norm2 = float((x.double() ** 2).sum())
            assert err == pytest.approx((1 - c.alpha(m * n)) * norm2, rel=50 * u * m * n)


def _adversarial_matrices(m: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(m * 100 + n)
    out = [np.ones((m, n)), np.eye(m, n), np.zeros((m, n))]
    out.append(np.outer(rng.standard_normal(m), rng.standard_normal(n)))  # rank one
    out.append(_orthogonal(m, n, 3) * np.linspace(1, 1 + 1e-9, min(m, n))[: min(m, n)].mean())
    gap = rng.standard_normal((m, n))
    u, s, vt = np.linalg.svd(gap, full_matrices=False)
    out.append((u * np.r_[1.0, 1.0, 1e-8 * np.ones(len(s) - 2)][: len(s)]) @ vt)  # a tie at σ₁
    out.append((u * np.geomspace(1, 1e-12, len(s))) @ vt)
    out.append(rng.standard_normal((m, n)) * 10.0 ** rng.integers(-5, 5, (m, n)))
    spike = np.zeros((m, n))
    spike[-1, -1] = 7.0
    out.append(spike)
    return out


@pytest.mark.parametrize("m,n", [(2, 2), (3, 7), (5, 5), (9, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_k_bound_holds_on_adversarial_matrices(m: int, n: int, dtype: torch.dtype) -> None:
    u = 2.0**-20 if dtype == torch.float32 else 2.0**-50
    for r in range(1, min(m, n) + 1):
        c = make_compressor(f"rank_k[r={r},rows={m}]")
        for M in _adversarial_matrices(m, n):
            x = torch.from_numpy(M.reshape(-1)).to(dtype)
            err = float(((c(x) - x).double() ** 2).sum())
            norm2 = float((x.double() ** 2).sum())
            assert err <= (1 - c.alpha(m * n)) * norm2 + 50 * u * m * n * norm2
    full = make_compressor(f"rank_k[r={min(m, n)},rows={m}]")
    x = torch.randn(m * n, dtype=dtype)
    assert torch.equal(full(x), x)  # full rank: exactly x, no SVD round-off


def test_rank_k_padding_keeps_the_bound() -> None:
    """d = 14 → a 4 × 4 view with 2 zeros: the bound r/4 holds on x's own entries."""
    c = make_compressor("rank_k[r=1]")
    assert c.matrix_shape(14) == (4, 4) and c.alpha(14) == 0.25
    rng = np.random.default_rng(5)
    for _ in range(200):
        x = torch.from_numpy(rng.standard_normal(14) * rng.integers(0, 2, 14))
        if not bool((x != 0).any()):
            continue
        err = float(((c(x) - x) ** 2).sum())
        assert err <= 0.75 * float((x**2).sum()) * (1 + 1e-12)


@pytest.mark.parametrize(
    "spec", ["rank_k[r=1]", "power_sgd[rank=1]", "power_sgd[rank=1,shared=true]"]
)
def test_a_finite_input_whose_factors_overflow_is_an_error_not_inf(spec: str) -> None:
    """docs/compressors.md, Errors: float32 entries of 3e38 are finite, but the view's
    singular value (and PowerSGD's norms) exceed 3.4e38; C(x) said inf, and now refuses,
    in compress, the 16-bit path and encode, while float64 compresses the same vector."""
    x = torch.full((1, 6), 3e38, dtype=torch.float32)
    C = make_compressor(spec)
    with pytest.raises(ValueError, match=r"overflows torch\.float32.*float64"):
        C.compress(x, seed=0)
    with pytest.raises(ValueError, match=r"overflows torch\.float32"):
        C.compress(x.to(torch.bfloat16), seed=0)
    y = C.compress(x.double(), seed=0)
    want = float(x.double().max())  # the rank-1 matrix of equal entries is its own C(x)
    assert bool(torch.isfinite(y).all()) and float(y.max()) == pytest.approx(want, rel=1e-9)


def test_low_rank_bits_and_dense_fallback() -> None:
    """r(m + n) values while shorter than the vector, else the d values of C(x) themselves."""
    c = make_compressor("rank_k[r=2]")
    assert c.bits(10**6) == 32 * 2 * 2000 and c.bits(10**6, torch.bfloat16) == 16 * 2 * 2000
    assert c.paper_bits(10**6) == c.bits(10**6)
    assert not c.dense_message(10**6) and c.dense_message(14)  # 2·(4 + 4) = 16 ≥ 14
    assert c.bits(14) == 32 * 14
    x = torch.randn(14)
    payload = c.encode(x)
    assert payload.numel() == 14 * 4 and torch.equal(c.decode(payload, 14, torch.float32), c(x))


# --------------------------------------------------------------------------------------------
# power_sgd: Vogels et al. Alg. 1, explicit state, no worst-case α
# --------------------------------------------------------------------------------------------
def _vogels_reference(Ms: list[np.ndarray], Q: np.ndarray) -> list[np.ndarray]:
    """An independent numpy transcription of PowerSGD's compression (Vogels et al. 2019, Alg. 1
    with one worker): P = M Q; P̂ = orthogonalize(P) (Gram–Schmidt); Q = Mᵀ P̂; out P̂ Qᵀ."""
    outs = []
    for M in Ms:
        P = M @ Q
        for j in range(P.shape[1]):  # Gram–Schmidt
            for i in range(j):
                P[:, j] -= (P[:, i] @ P[:, j]) * P[:, i]
            P[:, j] /= np.linalg.norm(P[:, j])
        Q = M.T @ P
        outs.append(P @ Q.T)
    return outs


def test_power_sgd_steps_equal_the_paper_algorithm() -> None:
    c = make_compressor("power_sgd[rank=2]")
    assert isinstance(c, PowerSGD)
    d = 30  # a 5 × 6 view
    rng = np.random.default_rng(0)
    xs = [torch.from_numpy(rng.standard_normal(d)) for _ in range(6)]
    keys = Keys.derive(4, client=3)
    state = c.init_state(xs[0], keys)
    assert state.shape == (6, 2) and state.dtype == torch.float64
    ref = _vogels_reference([x.numpy().reshape(5, 6) for x in xs], state.numpy().copy())
    for x, want in zip(xs, ref, strict=True):
        y, state = c.step(x, keys, state)
        np.testing.assert_allclose(y.numpy(), want.reshape(-1), atol=1e-12)
    # the stateless form is the first step from the keyed initial Q
    first, _ = c.step(xs[0], keys, c.init_state(xs[0], keys))
    assert torch.equal(c(xs[0], keys), first)


def test_power_sgd_state_is_keyed_shaped_and_checked() -> None:
    c = make_compressor("power_sgd[rank=3]")
    x = torch.randn(4, 100, dtype=torch.float32)
    k = Keys.derive(1, client=np.arange(4))
    q = c.init_state(x, k)
    assert q.shape == (4, 10, 3) and q.dtype == torch.float32
    assert torch.equal(q, c.init_state(x, k)) and not torch.equal(q[0], q[1])
    assert torch.equal(q[2], c.init_state(x[2], k[2]))  # a client's Q0 is its own
    assert c.init_state(x.double(), k).dtype == torch.float64
    y, q2 = c.step(x, k, q)
    ys = [c.step(x[i], k[i], q[i]) for i in range(4)]
    assert all(torch.equal(y[i], ys[i][0]) and torch.equal(q2[i], ys[i][1]) for i in range(4))
    with pytest.raises(ValueError, match=r"the state must be Q of shape \(4, 10, 3\)"):
        c.step(x, k, q[:, :, :2])
    with pytest.raises(ValueError, match=r"must be torch\.float32"):
        c.step(x, k, q.double())


def test_power_sgd_has_no_worst_case_alpha() -> None:
    """An input whose row space is orthogonal to the previous Q (and whose column space is
    orthogonal to the basis QR gives a zero P) compresses to 0: ‖C(x) − x‖² = ‖x‖², α = 0.
    Yet it is a projection: never an expansion, ‖C(x) − x‖² = ‖x‖² − ‖C(x)‖²."""
    c = make_compressor("power_sgd[rank=2,rows=6]")
    m, n = 6, 8
    assert c.matrix_shape(m * n) == (m, n)
    keys = Keys.derive(2)
    q = torch.zeros(n, 2, dtype=torch.float64)  # a previous Q spanning e₀, e₁
    q[0, 0] = q[1, 1] = 1.0
    p0 = PowerSGD.orthonormalize(torch.zeros(1, m, 2, dtype=torch.float64))[0]
    assert torch.equal(p0, torch.eye(m, 2, dtype=torch.float64))  # QR of a zero P: e₀, e₁
    rng = np.random.default_rng(1)
    u, v = torch.from_numpy(rng.standard_normal(m)), torch.from_numpy(rng.standard_normal(n))
    u[:2] = 0.0  # u ⊥ span(P̂)
    v[:2] = 0.0  # v ⊥ span(Q): M Q = 0 exactly
    x = torch.outer(u, v).reshape(-1)
    y, _ = c.step(x, keys, q)
    assert torch.equal(y, torch.zeros_like(x)) and bool((x != 0).any())
    with pytest.raises(ConstantUnknownError, match=r"no worst-case α.*rank=2,alpha=0.1\]"):
        c.alpha(m * n)
    # the shared mode's message suggests a spelling that keeps the mode, and that spelling works
    with pytest.raises(ConstantUnknownError, match=r"e\.g\. power_sgd\[rank=2,shared=true,alpha"):
        make_compressor("power_sgd[rank=2,shared=true]").alpha(m * n)
    assert make_compressor("power_sgd[rank=2,shared=true,alpha=0.1]").alpha(m * n) == 0.1
    for seed in range(20):  # the projection identity on random inputs and states
        xr = torch.from_numpy(np.random.default_rng(seed).standard_normal(m * n))
        yr, _ = c.step(
            xr, keys, torch.from_numpy(np.random.default_rng(99 + seed).standard_normal((n, 2)))
        )
        err, n2, c2 = (float(((yr - xr) ** 2).sum()), float((xr**2).sum()), float((yr**2).sum()))
        assert err <= n2 * (1 + 1e-12) and err == pytest.approx(n2 - c2, rel=1e-10, abs=1e-12)


def test_power_sgd_warm_start_converges_to_the_truncated_svd() -> None:
    """Reusing Q on a fixed matrix is subspace iteration: with a spectral gap its result tends
    to rank_k's (the reason PowerSGD reuses it)."""
    rng = np.random.default_rng(3)
    u, _, vt = np.linalg.svd(rng.standard_normal((10, 12)), full_matrices=False)
    M = (u * np.geomspace(10, 0.1, 10)) @ vt
    x = torch.from_numpy(M.reshape(-1))
    c = make_compressor("power_sgd[rank=2,rows=10]")
    keys = Keys.derive(0)
    q = c.init_state(x, keys)
    for _ in range(40):
        y, q = c.step(x, keys, q)
    want = make_compressor("rank_k[r=2,rows=10]")(x)
    np.testing.assert_allclose(y.numpy(), want.numpy(), atol=1e-9)


def test_factor_all_reduce_equals_the_operator_on_the_mean() -> None:
    """The hook's recipe (factor_collective): n ranks share Q; P = Σ Mᵢ Q (all-reduce), P̂ =
    orthonormalize(P), Q_sum = Σ Mᵢᵀ P̂ (all-reduce); the mean result P̂ Q_sumᵀ/n and the next
    Q equal one step of the operator on the mean matrix."""
    c = make_compressor("power_sgd[rank=3]")
    assert isinstance(c, PowerSGD)
    d, ranks = 95, 4  # a 10 × 10 view with 5 zeros of padding
    plan = c.factor_collective(d, torch.bfloat16)
    assert plan.matrix == (10, 10) and plan.rank == 3
    assert [(s.name, s.shape, s.reduce) for s in plan.stages] == [
        ("P", (10, 3), "sum"),
        ("Q", (10, 3), "sum"),
    ]
    assert plan.bits == c.bits(d, torch.bfloat16) == 16 * 3 * 20
    rng = np.random.default_rng(7)
    xs = [torch.from_numpy(rng.standard_normal(d)) for _ in range(ranks)]
    keys = Keys.derive(5)
    q = c.init_state(xs[0], keys)
    Ms = [c._matrices(x, torch.float64)[0] for x in xs]
    P = sum(PowerSGD.left(M, q[None]) for M in Ms)
    p_hat = PowerSGD.orthonormalize(P)
    q_sum = sum(PowerSGD.right(M, p_hat) for M in Ms)
    mean_result = (PowerSGD.combine(p_hat, q_sum) / ranks).reshape(-1)[:d]
    want, q_next = c.step(sum(xs) / ranks, keys, q)
    torch.testing.assert_close(mean_result, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(q_sum[0] / ranks, q_next, rtol=0, atol=1e-12)


def test_power_sgd_alpha_parameter() -> None:
    c = make_compressor("power_sgd[rank=2,alpha=0.25]")
    assert c.constant_known and c.alpha(100) == 0.25
    for bad, err in (("0", ValueError), ("1.5", ValueError), ("true", TypeError)):
        with pytest.raises((err, ValueError), match="alpha"):
            make_compressor(f"power_sgd[rank=2,alpha={bad}]")


# --------------------------------------------------------------------------------------------
# methods: EF21 and EF run with both, on linear problems via the reshape rule
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def problem():  # type: ignore[no-untyped-def]
    return make_problem("logistic_regression[dataset=australian_scale,n_clients=6]")


@pytest.mark.parametrize("method", ["ef21", "ef", "ef21_w", "ef21_pp[p=0.5]", "ef21_sgd[b=4]"])
@pytest.mark.parametrize("spec", ["rank_k[r=1]", "power_sgd[rank=1]", "power_sgd[rank=2]"])
def test_error_feedback_runs_with_low_rank_compressors(problem, method: str, spec: str) -> None:  # type: ignore[no-untyped-def]
    res = simulate(problem, method, spec, stepsize=0.3, rounds=150, seed=1, log_every=50)
    assert res.status == "completed"
    t = res.table
    assert float(t["grad_norm_sq"].iloc[-1]) < float(t["grad_norm_sq"].iloc[0])
    c = make_compressor(spec)
    per_round = c.bits(problem.d)  # d = 14: a 4 × 4 view
    assert per_round == (32 * 14 if c.dense_message(14) else 32 * c.r * 8)
    cs = res.state.clients.compressor_state
    if spec.startswith("power_sgd"):
        assert cs is not None and cs.shape == (6, 4, c.r)
    else:  # stateless: an empty tensor with the clients on its first axis
        assert cs is not None and cs.shape == (6, 0)


def test_ef21_with_power_sgd_equals_a_hand_written_loop(problem) -> None:  # type: ignore[no-untyped-def]
    """One client: the simulator's EF21 + power_sgd is g ← g + C(∇f(x) − g) with C.step and
    the state threaded by hand (keys of the compressor stream, state keyed at round 0)."""
    p1 = make_problem("logistic_regression[dataset=australian_scale,n_clients=1]")
    C = make_compressor("power_sgd[rank=1]")
    gamma, rounds = 0.5, 25
    res = simulate(p1, "ef21", C, stepsize=gamma, rounds=rounds, seed=3, log_every=rounds)
    cfg = make_method("ef21").bind(p1, C, gamma, seed=3).cfg
    ids = torch.arange(1)
    x = p1.x0().to(torch.float64)
    g = p1.client_grads(x)
    state = C.init_state(g, cfg.keys("compressor", ids, 0).fold("state"))
    for r in range(1, rounds + 1):
        x = x - gamma * g.mean(0)
        c, state = C.step(p1.client_grads(x) - g, cfg.keys("compressor", ids, r), state)
        g = g + c
    torch.testing.assert_close(res.x, x, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(res.state.clients.compressor_state, state, rtol=1e-12, atol=1e-14)


def test_partial_participation_keeps_absent_clients_state(problem) -> None:  # type: ignore[no-untyped-def]
    bound = make_method("ef21_pp[p=0.5]").bind(problem, "power_sgd[rank=1]", 0.3, seed=2)
    from shrinkgrad.methods.oracle import ProblemOracle

    oracle = ProblemOracle(problem)
    state, _ = bound.init(problem.x0(), oracle)
    before = state.clients.compressor_state.clone()
    state2, traffic = bound.step(state, oracle)
    sent = traffic.up > 0
    after = state2.clients.compressor_state
    assert bool(sent.any()) and not bool(sent.all())
    assert torch.equal(after[~sent], before[~sent])
    assert not torch.equal(after[sent], before[sent])


def test_checkpoint_resume_with_power_sgd_is_exact(problem, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = {"stepsize": 0.3, "rounds": 30, "seed": 4, "log_every": 5}
    full = simulate(problem, "ef21", "power_sgd[rank=2]", **args)
    path = tmp_path / "ps.ckpt"

    def interrupt(r: int, state: object) -> None:
        if r == 15:  # a logged round (log_every=5)
            raise KeyboardInterrupt

    with pytest.raises(SimulationInterrupted):
        simulate(problem, "ef21", "power_sgd[rank=2]", checkpoint=path, callback=interrupt, **args)
    resumed = simulate(problem, "ef21", "power_sgd[rank=2]", checkpoint=path, **args)
    assert torch.equal(resumed.x, full.x)
    assert torch.equal(resumed.state.clients.compressor_state, full.state.clients.compressor_state)


def test_theory_needs_an_explicit_alpha_and_other_methods_refuse_state(problem) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConstantUnknownError, match=r"ef21: power_sgd\[rank=1\] has no worst-case"):
        simulate(problem, "ef21", "power_sgd[rank=1]", stepsize="theory", rounds=2)
    res = simulate(problem, "ef21", "power_sgd[rank=1,alpha=0.2]", stepsize="theory", rounds=2)
    top = make_method("ef21").bind(problem, "top_k[k=3]", "theory")  # α = 3/14 ≈ 0.214
    assert res.stepsize_rule == top.cfg.stepsize_rule == "stepsize_ef21"
    assert res.stepsize < top.stepsize  # α = 0.2 < 3/14
    rk = make_method("ef21").bind(problem, "rank_k[r=1]", "theory")
    assert rk.cfg.alpha == 0.25  # rank_k's α = 1/4 on the 4 × 4 view
    with pytest.raises(
        ValueError, match=r"keeps state between rounds .* which ef21_plus|which dcgd"
    ):
        make_method("dcgd").bind(problem, "power_sgd[rank=1]", 0.1)
    # ef21_plus is an EF21 but draws cfg.compress without the state: refused at bind, in one
    # line (it inherited EF21's carries_compressor_state and failed at round 1 with a TypeError)
    with pytest.raises(ValueError, match=r"keeps state between rounds .* which ef21_plus"):
        simulate(problem, "ef21_plus", "power_sgd[rank=1,alpha=0.5]", stepsize=0.1, rounds=2)
    cfg = make_method("ef21").bind(problem, "power_sgd[rank=1]", 0.1).cfg
    with pytest.raises(TypeError, match="compress_with_state"):
        cfg.compress(torch.zeros(2, problem.d, dtype=torch.float64), torch.arange(2), 1)
    with pytest.raises(ValueError, match="compose\\(\\) takes stateless compressors"):
        make_compressor("compose(power_sgd[rank=1],qsgd[s=2])")
