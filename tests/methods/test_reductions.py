"""Exact reductions between methods (design.md principle 10, issue #4 test list)."""

from __future__ import annotations

import itertools

import pytest
import torch
from methods_fixtures import LeastSquares, PowerOfTwo, rand_k, run, trajectory
from methods_reference import delayed_loop, gd_loop, iag_loop

from shrinkgrad.methods import EF21, ProblemOracle, make_method
from shrinkgrad.rng import Keys

ROUNDS = 40


def x0_of(p: LeastSquares) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, p.d, dtype=torch.float64)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gd_is_plain_gradient_descent(lsq: LeastSquares) -> None:
    gamma = 1.0 / lsq.L
    _, states = run("gd", lsq, None, gamma, ROUNDS, x0=x0_of(lsq))
    close(trajectory(states), torch.stack(gd_loop(lsq, gamma, ROUNDS, x0_of(lsq))))
    # on a quadratic, GD at 1/L contracts the distance to x* by at least 1 − μ/L per round
    rate = 1.0 - lsq.mu / lsq.L
    dist = [float((s.x - lsq.x_star).norm()) for s in states]
    for t in range(ROUNDS):
        assert dist[t + 1] <= rate * dist[t] * (1 + 1e-12)


@pytest.mark.parametrize("init", ["full", "compressed"])
@pytest.mark.parametrize("comp", ["top_k[k=1]", "top_k[k=3]", "scaled_rand_k"])
def test_ef21_w_equals_ef21_for_homogeneous_compressors(init: str, comp: str) -> None:
    """methods.md §3: for positively homogeneous C, EF21-W's h_i = n w_i g_i follow EF21 exactly.

    The keyed randomness gives EF21 and EF21-W the same draw for (client, round), and scaled
    rand-k is positively homogeneous draw by draw, so the equality holds for it too.
    """
    p = LeastSquares(n=6, d=10, spread=10.0)
    C = rand_k(3, scaled=True) if comp == "scaled_rand_k" else comp
    gamma = 0.01
    _, a = run(f"ef21[init={init}]", p, C, gamma, ROUNDS, seed=5)
    bound_w, b = run(f"ef21_w[init={init}]", p, C, gamma, ROUNDS, seed=5)
    close(trajectory(b), trajectory(a))
    nw = (p.n * bound_w.cfg.weights).unsqueeze(1)  # type: ignore[attr-defined]
    for sa, sb in zip(a, b, strict=True):
        close(nw * sb.clients.g, sa.clients.g)  # type: ignore[attr-defined]
    assert not torch.allclose(
        bound_w.cfg.weights, torch.full((p.n,), 1.0 / p.n, dtype=torch.float64)
    )  # type: ignore[attr-defined]


def test_ef21_w_differs_from_ef21_for_a_non_homogeneous_compressor() -> None:
    p = LeastSquares(n=6, d=10, spread=10.0)
    _, a = run("ef21", p, PowerOfTwo(), 0.01, ROUNDS)
    _, b = run("ef21_w", p, PowerOfTwo(), 0.01, ROUNDS)
    assert float((trajectory(a) - trajectory(b)).abs().max()) > 1e-4


@pytest.mark.parametrize("model", ["fixed", "random", "speeds", "cyclic"])
def test_delayed_dcgd_with_tau_zero_is_dcgd(lsq: LeastSquares, model: str) -> None:
    C = rand_k(3)
    _, a = run("dcgd", lsq, C, 0.02, ROUNDS, seed=2)
    _, b = run(f"delayed_dcgd[tau=0,model={model}]", lsq, C, 0.02, ROUNDS, seed=2)
    assert torch.equal(trajectory(a), trajectory(b))


@pytest.mark.parametrize("tau", [1, 3])
def test_delayed_dcgd_fixed_delay_matches_a_loop(lsq: LeastSquares, tau: int) -> None:
    C = rand_k(3)
    _, states = run(f"delayed_dcgd[tau={tau},model=fixed]", lsq, C, 0.02, ROUNDS, seed=4)
    ref = delayed_loop(lsq, C, 0.02, 4, ROUNDS, lsq.x0(), tau)
    close(trajectory(states), torch.stack(ref))


@pytest.mark.parametrize("model", ["random", "speeds", "cyclic"])
def test_delay_models_stay_within_tau_and_use_stale_iterates(lsq: LeastSquares, model: str) -> None:
    tau = 3
    m = make_method(f"delayed_dcgd[tau={tau},model={model}]")
    bound = m.bind(lsq, "identity", 0.01, seed=9)
    ids = torch.arange(lsq.n)
    seen = torch.stack([m.delays(bound.cfg, ids, r) for r in range(1, 60)])  # type: ignore[attr-defined]
    assert int(seen.min()) >= 0 and int(seen.max()) <= tau
    if model == "speeds":  # fixed per client over the run, different across clients
        assert torch.equal(seen, seen[:1].expand_as(seen))
        assert seen[0].unique().numel() > 1
    else:  # every delay occurs
        assert set(seen.unique().tolist()) == set(range(tau + 1))
    if model == "cyclic":
        expect = (ids[None, :] + torch.arange(59)[:, None]) % (tau + 1)
        assert torch.equal(seen, expect)
    # with delays the run differs from DCGD
    _, a = run("dcgd", lsq, "identity", 0.01, 20)
    _, b = run(f"delayed_dcgd[tau={tau},model={model}]", lsq, "identity", 0.01, 20, seed=9)
    assert not torch.allclose(trajectory(a), trajectory(b))


def test_iag_identity_cyclic_matches_a_loop(lsq: LeastSquares) -> None:
    gamma = 0.05
    _, states = run("iag[order=cyclic]", lsq, "identity", gamma, ROUNDS)
    order = [t % lsq.n for t in range(ROUNDS)]
    close(trajectory(states), torch.stack(iag_loop(lsq, gamma, ROUNDS, lsq.x0(), order)))


def test_iag_identity_random_order_matches_a_loop(lsq: LeastSquares) -> None:
    gamma, seed = 0.05, 11
    _, states = run("iag[order=random]", lsq, "identity", gamma, ROUNDS, seed=seed)
    # documented draw: i_t = ⌊w · n / 2³²⌋ with w the first word of key (seed, "order", 0, t + 1)
    order = []
    for r in range(1, ROUNDS + 1):
        w = int(Keys.derive(seed, round=r, client=0, stream="order").bits32(1)[0])
        order.append((w * lsq.n) >> 32)
    assert len(set(order)) == lsq.n
    close(trajectory(states), torch.stack(iag_loop(lsq, gamma, ROUNDS, lsq.x0(), order)))


@pytest.mark.parametrize("weighted", [False, True])
def test_pp_with_p_one_is_full_participation(lsq: LeastSquares, weighted: bool) -> None:
    C = rand_k(3, scaled=True)
    w = "_w" if weighted else ""
    _, a = run(f"ef21{w}", lsq, C, 0.01, ROUNDS, seed=1)
    _, b = run(f"ef21{w}_pp[p=1.0]", lsq, C, 0.01, ROUNDS, seed=1)
    assert torch.equal(trajectory(a), trajectory(b))
    _, c = run(f"ef21{w}_pp[p=0.5]", lsq, C, 0.01, ROUNDS, seed=1)
    assert not torch.allclose(trajectory(a), trajectory(c))


class ExactStochastic(ProblemOracle):
    """An oracle whose 'minibatch' estimator is the exact gradient."""

    def stoch_grads(self, x, ids, batch_sizes, keys):  # type: ignore[no-untyped-def]
        return self.grads(x, ids)


@pytest.mark.parametrize("weighted", [False, True])
def test_sgd_with_exact_estimators_is_ef21(lsq: LeastSquares, weighted: bool) -> None:
    C = "top_k[k=2]"
    base = make_method(EF21(weighted=weighted)).bind(lsq, C, 0.01, seed=0)
    sgd = make_method(EF21(weighted=weighted, batch=2)).bind(lsq, C, 0.01, seed=0)
    o = ExactStochastic(lsq)
    sa, _ = base.init(lsq.x0(), o)
    sb, _ = sgd.init(lsq.x0(), o)
    for _ in range(ROUNDS):
        sa, _ = base.step(sa, o)
        sb, _ = sgd.step(sb, o)
    assert torch.equal(sa.x, sb.x)
    # and with real minibatches it differs
    _, c = run("ef21_w_sgd[b=2]" if weighted else "ef21_sgd[b=2]", lsq, C, 0.01, ROUNDS)
    assert not torch.allclose(sa.x, c[-1].x)  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", ["dcgd", "diana"])
def test_a_shared_seed_draw_is_one_draw_for_every_client(lsq: LeastSquares, method: str) -> None:
    """rand_k[shared_seed=true]: every client keeps the same k coordinates in a round (as the
    DDP hook's ranks do, whose all-reduce of the k values needs it), so DCGD's aggregate
    (1/n) Σ_i C(∇f_i) = C(∇f) moves x on k coordinates only, by exactly −γ(d/k)∂_j f; without
    the shared seed the clients' draws are independent (more than k coordinates move). The
    theory steps then take the n = 1 instance of their ω/n terms (one draw), and say so."""
    from shrinkgrad import theory
    from shrinkgrad.methods.base import SHARED_DRAW

    k, gamma = 2, 0.01
    _, states = run(method, lsq, "rand_k[k=2,shared_seed=true]", gamma, 8)
    for s, nxt in itertools.pairwise(states if method == "dcgd" else []):
        step = nxt.x - s.x  # type: ignore[attr-defined]
        moved = step.nonzero().flatten()
        assert 0 < moved.numel() <= k
        want = -gamma * (lsq.d / k) * lsq.grad(s.x)[moved]  # type: ignore[attr-defined]
        torch.testing.assert_close(step[moved], want, rtol=1e-12, atol=0)
    _, independent = run("dcgd", lsq, "rand_k[k=2]", gamma, 8)
    assert max(int((b.x - a.x).count_nonzero()) for a, b in itertools.pairwise(independent)) > k
    # theory: ω/n → ω (one draw); the rule records it
    shared = make_method(method).bind(lsq, "rand_k[k=2,shared_seed=true]", "theory").cfg
    plain = make_method(method).bind(lsq, "rand_k[k=2]", "theory").cfg
    assert shared.n_draws == 1 and plain.n_draws == lsq.n
    omega = lsq.d / k - 1
    L, L_i = lsq.L, lsq.L_i
    if method == "dcgd":
        assert shared.stepsize == theory.stepsize_dcgd(L, float(L_i.max()), omega, 1)
        assert plain.stepsize == theory.stepsize_dcgd(L, float(L_i.max()), omega, lsq.n)
    else:
        q = float(torch.sqrt((L_i**2).mean()))
        assert shared.stepsize == pytest.approx(theory.stepsize_diana(L, q, omega, 1), rel=1e-12)
    assert shared.stepsize < plain.stepsize
    assert shared.stepsize_rule.endswith(SHARED_DRAW) and SHARED_DRAW not in plain.stepsize_rule
