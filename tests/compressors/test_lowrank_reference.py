"""Low-rank compressors against independent computations (docs/compressors.md, "Low-rank
compressors"): rank_k against numpy's SVD (the residual Σ_{j>r} σ_j², the bits the wire
really carries), PowerSGD under EF21 and EF in the simulator against a torch loop written from
Vogels et al. 2019, Alg. 1 (per-client and shared basis: iterates, state and bits), and the
stateless form of the shared basis for 16-bit inputs (the first step, as ``step`` runs it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shrinkgrad import Keys, make_compressor, make_problem, simulate
from shrinkgrad.compressors import PowerSGD, RankK


def _view(d: int, rows: int | None = None) -> tuple[int, int]:
    """The documented matrix view: rows=m gives m × ⌈d/m⌉; else n = ⌈√d⌉, m = ⌈d/n⌉."""
    if rows is not None:
        return rows, -(-d // rows)
    n = math.ceil(math.sqrt(d))
    return -(-d // n), n


# --------------------------------------------------------------------------------------------
# rank_k: Eckart–Young against numpy, and the bits against the wire
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,rows", [(123, None), (61, 3), (10, 7), (400, None), (300, 40)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rank_k_residual_is_the_dropped_singular_values(
    d: int, rows: int | None, dtype: torch.dtype
) -> None:
    """‖C(x) − x‖² = Σ_{j>r} σ_j² of the zero-padded view (np.linalg.svd in float64), for every
    r ≤ min(m, n), ties and rank-deficient views included; r = min(m, n) returns x."""
    m, n = _view(d, rows)
    rng = np.random.default_rng(d)
    base = rng.standard_normal((m, n))
    u, _, vt = np.linalg.svd(base, full_matrices=False)
    tie = (u * np.r_[3.0, 3.0, np.ones(min(m, n) - 2)]) @ vt  # σ₁ = σ₂, then a plateau
    low = np.outer(rng.standard_normal(m), rng.standard_normal(n))  # rank one
    unit = 2.0**-23 if dtype == torch.float32 else 2.0**-52
    for M in (base, tie, low):
        x = torch.from_numpy(M.reshape(-1)[:d].copy()).to(dtype)
        padded = np.zeros(m * n)
        padded[:d] = x.double().numpy()
        s = np.linalg.svd(padded.reshape(m, n), compute_uv=False)
        norm2 = float((s**2).sum())
        for r in range(1, min(m, n) + 1):
            c = make_compressor(f"rank_k[r={r}" + (f",rows={rows}]" if rows else "]"))
            assert isinstance(c, RankK) and c.matrix_shape(d) == (m, n)
            assert c.alpha(d) == r / min(m, n)
            err = float(((c(x).double() - x.double()) ** 2).sum())
            # the padding's residual is dropped: err ≤ Σ_{j>r} σ_j² (equal without padding)
            want = float((s[r:] ** 2).sum())
            slack = 200 * unit * max(m, n) * norm2
            assert err <= want + slack
            if m * n == d:
                assert err == pytest.approx(want, abs=slack)
            assert err <= (1 - r / min(m, n)) * norm2 + slack


@pytest.mark.parametrize("spec", ["rank_k[r=1]", "rank_k[r=3]", "power_sgd[rank=2]"])
@pytest.mark.parametrize("d", [14, 20, 123, 400])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_bits_are_the_documented_count_and_the_wire(spec: str, d: int, dtype: torch.dtype) -> None:
    """bits = width·min(r(m + n), d), paper_bits = 32 (16 for 16-bit values)·min(r(m + n), d),
    and the payload of encode has exactly bits(d) bits and decodes to C(x)."""
    c = make_compressor(spec)
    m, n = _view(d)
    r = int(spec.split("=")[1].rstrip("]"))
    if r > min(m, n):
        return
    width = {torch.float64: 64, torch.float32: 32, torch.bfloat16: 16}[dtype]
    values = min(r * (m + n), d)
    assert c.bits(d, dtype) == width * values
    assert c.paper_bits(d, dtype) == min(width, 32) * values
    x = torch.from_numpy(np.random.default_rng(d).standard_normal(d)).to(dtype)
    keys = None if c.deterministic else Keys.derive(1, client=2)
    payload = c.encode(x, keys)
    assert payload.numel() * 8 == c.bits(d, dtype)
    assert torch.equal(c.decode(payload, d, dtype, keys), c(x, keys))


# --------------------------------------------------------------------------------------------
# PowerSGD in the simulator: an independent EF21 / EF loop from Vogels et al. 2019, Alg. 1
# --------------------------------------------------------------------------------------------
def _q0(seed: int, clients: int, n: int, r: int, shared: bool) -> torch.Tensor:
    """The documented first Q: standard normals by Box–Muller on the keyed uniforms, keyed by
    (seed, client) at round 0 of the "compressor" stream folded with "state" (per-client), or
    one fixed draw for every client (shared)."""
    if shared:
        k = Keys.derive(0, stream="power_sgd.shared_q0").fold("power_sgd.q0")
    else:
        k = Keys.derive(seed, client=np.arange(clients)).fold("state").fold("power_sgd.q0")
    u = k.uniform(2 * n * r, torch.float64)
    z = torch.sqrt(-2.0 * torch.log(u[..., : n * r])) * torch.cos(2.0 * math.pi * u[..., n * r :])
    return z.reshape(-1, n, r).expand(clients, n, r).clone()


def _vogels(
    X: torch.Tensor, Q: torch.Tensor, r: int, rows: int | None, shared: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One PowerSGD step of the clients' vectors X (B, d) from their Q (B, n, r): P = M Q,
    P̂ = orthogonalize(P) (Gram–Schmidt), Q = Mᵀ P̂, out P̂ Qᵀ; shared: P = Σ_i M_i Q, one P̂,
    the next Q the mean of the Q_i (the all-reduce)."""
    B, d = X.shape
    m, n = _view(d, rows)
    M = torch.nn.functional.pad(X, (0, m * n - d)).reshape(B, m, n)

    def orth(P: torch.Tensor) -> torch.Tensor:
        P = P.clone()
        for j in range(P.shape[1]):
            for i in range(j):
                P[:, j] -= (P[:, i] @ P[:, j]) * P[:, i]
            P[:, j] /= P[:, j].norm()
        return P

    if shared:
        p_hat = orth(torch.stack([M[i] @ Q[0] for i in range(B)]).sum(0))
        Qs = torch.stack([M[i].T @ p_hat for i in range(B)])
        out = torch.stack([p_hat @ Qs[i].T for i in range(B)])
        return out.reshape(B, -1)[:, :d], Qs.mean(0).expand(B, n, r).clone()
    p_hats = [orth(M[i] @ Q[i]) for i in range(B)]
    Qs = torch.stack([M[i].T @ p_hats[i] for i in range(B)])
    out = torch.stack([p_hats[i] @ Qs[i].T for i in range(B)])
    return out.reshape(B, -1)[:, :d], Qs


@pytest.fixture(scope="module")
def problem():  # type: ignore[no-untyped-def]
    return make_problem("synthetic_least_squares[n_clients=4,d=50,m=20,L_var=10.0]")


@pytest.mark.parametrize("method", ["ef21", "ef"])
@pytest.mark.parametrize(
    "r,rows,shared", [(1, None, False), (2, 5, False), (2, None, True), (3, 10, True)]
)
def test_error_feedback_with_power_sgd_follows_an_independent_loop(  # type: ignore[no-untyped-def]
    problem, method: str, r: int, rows: int | None, shared: bool
) -> None:
    """10 rounds of simulate(EF21 / EF, power_sgd) against the methods written from their
    formulas with _vogels: EF21 x ← x − γ g, c_i = C(∇f_i(x) − g_i), g_i += c_i; EF p_i = e_i +
    γ∇f_i(x), v_i = C(p_i), e_i = p_i − v_i, x ← x − mean v_i; each client's Q carried."""
    spec = (
        f"power_sgd[rank={r}"
        + (f",rows={rows}" if rows else "")
        + (",shared=true]" if shared else "]")
    )
    gamma, rounds, seed = 0.02, 10, 7
    res = simulate(problem, method, spec, stepsize=gamma, rounds=rounds, seed=seed, log_every=1)
    nc, d = problem.n, problem.d
    m, n = _view(d, rows)
    x = problem.x0().to(torch.float64)
    Q = _q0(seed, nc, n, r, shared)
    g = problem.client_grads(x).clone()
    e = torch.zeros(nc, d, dtype=torch.float64)
    for _ in range(rounds):
        if method == "ef21":
            x = x - gamma * g.mean(0)
            c, Q = _vogels(problem.client_grads(x) - g, Q, r, rows, shared)
            g = g + c
        else:
            p = e + gamma * problem.client_grads(x)
            v, Q = _vogels(p, Q, r, rows, shared)
            e, x = p - v, x - v.mean(0)
    torch.testing.assert_close(res.x, x, rtol=1e-11, atol=1e-13)
    # the carried Q, up to the sign of each column (QR and Gram–Schmidt may choose either)
    cs = res.state.clients.compressor_state
    signs = torch.sign((cs * Q).sum(1, keepdim=True))
    torch.testing.assert_close(cs, Q * signs, rtol=1e-9, atol=1e-11)
    # bits per client and round: 32 per value (float32 wire), r(m + n) values (shared: always)
    per_round = 32 * (r * (m + n) if shared else min(r * (m + n), d))
    assert set(res.table["bits_up"].diff().iloc[1:]) == {float(per_round)}
    assert set(res.table["bits_up_paper"].diff().iloc[1:]) == {float(per_round)}


# --------------------------------------------------------------------------------------------
# the shared basis with 16-bit inputs: the stateless form is the first step
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "spec,d", [("power_sgd[rank=2,shared=true]", 50), ("power_sgd[rank=3,shared=true]", 400)]
)
def test_shared_basis_16_bit_stateless_form_is_the_first_step(
    spec: str, d: int, dtype: torch.dtype
) -> None:
    """C(x) is the first step from the initial Q (docs/compressors.md, *State*), for the shared
    basis too: its clients send P_i = M_i Q and Q_i = M_iᵀ P̂ in the 16-bit dtype, and P̂ =
    orthonormalize(Σ_i P_i) is formed by every client and never sent, so it is not rounded.
    ``C(x)`` rounded P̂ (and not P_i, Q_i) to the dtype, so it was off ``step``'s result by up
    to 0.0156 (bfloat16, standard-normal entries; 12 ulps on an entry of 0.03), and its message
    carried P̂. The payload now carries P_i and Q_i (still r(m + n) 16-bit values) and decodes
    to C(x)."""
    c = make_compressor(spec)
    assert isinstance(c, PowerSGD)
    rng = np.random.default_rng(d)
    x = torch.from_numpy(rng.standard_normal((3, d))).to(dtype)
    first, _ = c.step(x, None, c.init_state(x, None))
    assert torch.equal(c(x), first)
    one, _ = c.step(x[1], None, c.init_state(x[1], None))
    assert torch.equal(c(x[1]), one)
    payload = c.encode(x[1])
    assert payload.numel() * 8 == c.bits(d, dtype)
    assert torch.equal(c.decode(payload, d, dtype), one)
    # the stages by hand: P_i rounded, P̂ of their sum in float32, Q_i rounded, P̂ Q_iᵀ rounded
    m, n = c.matrix_shape(d)
    q0 = c.init_state(x[:1], None)[0]
    M = torch.nn.functional.pad(x.float(), (0, m * n - d)).reshape(3, m, n)
    P = torch.stack([(M[i] @ q0).to(dtype).float() for i in range(3)]).sum(0)
    p_hat = torch.linalg.qr(P).Q
    Qs = [(M[i].T @ p_hat).to(dtype).float() for i in range(3)]
    want = torch.stack([(p_hat @ Qs[i].T).reshape(-1)[:d] for i in range(3)]).to(dtype)
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1.0)
    assert bool(((c(x).float() - want.float()).abs() <= ulp).all())
