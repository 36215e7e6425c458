"""The EF21 variants of the simulator against loops written from methods.md alone.

Every test runs a method through :func:`shrinkgrad.sim.simulate` (the vectorised simulator, its
sparse message batches and bit counters included) and compares, to round-off, with a plain
per-client loop written from the shared reference ../shared/docs/methods.md §3 (EF21 l. 93-95,
EF21-W l. 97-98, EF21-SGD l. 103, EF21-PP / EF21-W-PP l. 105-106) and docs/methods.md (EF21+,
DIANA), or, for the theory step sizes, with the formulas of methods.md §4 evaluated here (the PP
optimum over the free parameters s, ρ by a numerical search). Gradients come from the raw data
(the fixture's A_i, y_i; a1a's rows from ``shrinkgrad.problems.load``), not from the problems'
batched oracles. What the loops share with the library is only its documented randomness: the
keyed uniforms of ``Keys.derive(seed, round=r, client=i, stream=...)`` for participation (client
i takes part iff u < p_i), minibatches (the b_i samples with the smallest keyed uniforms,
without replacement) and the draws of the random compressors (applied through the compressor
object with client i's key).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from methods_fixtures import LeastSquares
from methods_reference import A1A, LAM, uniform

from shrinkgrad.compressors import make_compressor
from shrinkgrad.methods import make_method
from shrinkgrad.methods.ef21 import EF21
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate

F64 = torch.float64


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def log2ceil(d: int) -> int:
    return math.ceil(math.log2(d))


def xi(alpha: float) -> float:
    """ξ(α) = √(β/θ), θ = 1 − √(1 − α), β = (1 − α)/θ (methods.md §4, l. 117)."""
    th = 1.0 - math.sqrt(1.0 - alpha)
    return math.sqrt((1.0 - alpha) / th / th)


def top_k(v: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.argsort(v.abs(), descending=True, stable=True)[:k]
    out = torch.zeros_like(v)
    out[idx] = v[idx]
    return out


# --------------------------------------------------------------------------------------------
# the fixture problem: f_i(x) = (1/(2m)) ‖A_i x − y_i‖²
# --------------------------------------------------------------------------------------------
def lsq_grad(P: LeastSquares, i: int, x: torch.Tensor) -> torch.Tensor:
    return P.A[i].T @ (P.A[i] @ x - P.y[i]) / P.m


def compressor_fn(spec: str, seed: int) -> tuple[Callable[..., torch.Tensor], Callable[..., float]]:
    """(C(v, r, i), honest bits of a message c) for the compressors the tests use. Top-k is
    written here; the random ones apply the library's operator with client i's key of round r
    (the draws are shared, the algorithm around them is not). Bits: methods.md §2 table."""
    d_bits = {
        "top_k[k=2]": lambda c, d: 2.0 * (32 + log2ceil(d)),
        "scaled(rand_k[k=2])": lambda c, d: 2.0 * (32 + log2ceil(d)),
        "natural": lambda c, d: 9.0 * d,
        "bernoulli[p=0.7]": lambda c, d: 32.0 + int((c != 0).sum()) * (32 + log2ceil(d)),
    }[spec]
    if spec == "top_k[k=2]":
        return (lambda v, r, i: top_k(v, 2)), (lambda c: d_bits(c, c.numel()))
    C = make_compressor(spec)

    def apply(v: torch.Tensor, r: int, i: int) -> torch.Tensor:
        key = Keys.derive(seed, round=r, client=i, stream="compressor").reshape(1)
        return C(v.unsqueeze(0), key)[0]

    return apply, (lambda c: d_bits(c, c.numel()))


def ef21_loop(
    grad: Callable[[int, torch.Tensor], torch.Tensor],
    n: int,
    x0: torch.Tensor,
    gamma: float,
    rounds: int,
    seed: int,
    compress: Callable[..., torch.Tensor],
    msg_bits: Callable[[torch.Tensor], float],
    *,
    L_i: torch.Tensor | None = None,
    p: Sequence[float] | None = None,
    init: str = "full",
    minibatch: Callable[[int, torch.Tensor, int], torch.Tensor] | None = None,
) -> dict[str, object]:
    """EF21 ([EF21] Alg. 1), EF21-W (weights w_i = L_i/Σ L_j when ``L_i`` is given: clients
    compress ∇f_i/(n w_i) − g_i, server adds Σ w_i c_i), -PP (client i takes part w.p. p_i, the
    others send nothing and keep g_i) and -SGD (``minibatch(i, x, r)`` replaces ∇f_i), straight
    from methods.md §3. Returns the iterates, final g_i and g, participation counts and bits."""
    d = x0.numel()
    w = [1.0 / n] * n if L_i is None else [float(L_i[i] / L_i.sum()) for i in range(n)]
    x = x0.clone()
    if init == "full":
        g_i = [grad(i, x) / (n * w[i]) for i in range(n)]
        up = [32.0 * d] * n
    elif init == "compressed":
        g_i = [compress(grad(i, x) / (n * w[i]), 0, i) for i in range(n)]
        up = [msg_bits(g_i[i]) for i in range(n)]
    else:
        g_i = [torch.zeros_like(x) for _ in range(n)]
        up = [0.0] * n
    down = [0.0 if init == "zero" else 32.0 * d] * n
    g = sum(w[i] * g_i[i] for i in range(n))
    xs, counts, sizes = [x], [0] * n, []
    for r in range(1, rounds + 1):
        x = x - gamma * g  # step 1: x^{t+1} = x^t − γ g^t
        agg = torch.zeros_like(x)
        taking_part = 0
        for i in range(n):
            if p is not None and not float(uniform(seed, r, i, "participation")[0]) < p[i]:
                continue  # sends nothing, keeps g_i
            taking_part += 1
            gr = grad(i, x) if minibatch is None else minibatch(i, x, r)
            c = compress(gr / (n * w[i]) - g_i[i], r, i)  # step 2
            g_i[i] = g_i[i] + c
            agg = agg + w[i] * c
            counts[i] += 1
            up[i] += msg_bits(c)
            down[i] += 32.0 * d
        g = g + agg  # step 3: only the participants' messages
        xs.append(x)
        sizes.append(taking_part)
    return {
        "xs": xs,
        "g_i": torch.stack(g_i),
        "g": g,
        "counts": counts,
        "sizes": sizes,
        "up": torch.tensor(up, dtype=F64),
        "down": torch.tensor(down, dtype=F64),
        "w": w,
    }


def run_sim(problem, method, compressor, gamma, rounds, seed):  # type: ignore[no-untyped-def]
    xs: list[torch.Tensor] = [problem.x0()]
    seen: list[int] = []

    def keep(r: int, state) -> bool:  # type: ignore[no-untyped-def]
        seen.append(r)
        xs.append(state.x.clone())
        return False

    res = simulate(
        problem,
        method,
        compressor,
        gamma,
        rounds=rounds,
        seed=seed,
        callback=keep,
    )
    assert res.status == "completed", res.message
    assert seen == list(range(1, rounds + 1))  # called after rows 1..R; x⁰ is the problem's
    return res, torch.stack(xs)


# --------------------------------------------------------------------------------------------
# 1. EF21-PP and EF21-W-PP
# --------------------------------------------------------------------------------------------
PER_CLIENT_P = [0.2, 0.5, 0.8, 0.95]


@pytest.mark.parametrize(
    ("weighted", "comp", "p", "init"),
    [
        (False, "top_k[k=2]", 0.5, "full"),
        (True, "top_k[k=2]", 0.5, "full"),
        (False, "scaled(rand_k[k=2])", 0.5, "compressed"),
        (True, "natural", 0.5, "zero"),  # random and not positively homogeneous: W ≠ plain
        (False, "bernoulli[p=0.7]", PER_CLIENT_P, "full"),  # random-size messages
        (True, "natural", PER_CLIENT_P, "compressed"),
        (True, "top_k[k=2]", PER_CLIENT_P, "zero"),
    ],
)
def test_pp_simulator_equals_loop_from_methods_md(
    weighted: bool, comp: str, p: float | list[float], init: str
) -> None:
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    seed, rounds = 8, 40
    gamma = 0.3 / float(P.L_i.max())
    if isinstance(p, float):  # the registered names ...
        method: object = f"ef21{'_w' if weighted else ''}_pp[p={p}" + (
            "]" if init == "full" else f",init={init}]"
        )
        ps = [p] * P.n
    else:  # ... and per-client probabilities (Python API)
        method, ps = EF21(weighted=weighted, p=p, init=init), p  # type: ignore[arg-type]
    res, traj = run_sim(P, method, comp, gamma, rounds, seed)
    C, bits = compressor_fn(comp, seed)
    ref = ef21_loop(
        lambda i, x: lsq_grad(P, i, x),
        P.n,
        P.x0(),
        gamma,
        rounds,
        seed,
        C,
        bits,
        L_i=P.L_i.to(F64) if weighted else None,
        p=ps,
        init=init,
    )
    # the draws of this seed give rounds with nobody, everybody and some clients taking part
    sizes = ref["sizes"]
    assert 0 in sizes and P.n in sizes and any(0 < s < P.n for s in sizes)  # type: ignore[operator]
    close(traj, torch.stack(ref["xs"]))  # type: ignore[arg-type]
    close(res.state.clients.g, ref["g_i"])  # type: ignore[arg-type]
    close(res.state.server.g, ref["g"])  # type: ignore[arg-type]
    w = torch.tensor(ref["w"], dtype=F64)
    close(res.state.server.g, w @ res.state.clients.g)  # g = Σ w_i g_i
    # uplink: the participants' messages only (and round 0); downlink: x to participants
    torch.testing.assert_close(res.bits_up, ref["up"], rtol=0, atol=0)
    torch.testing.assert_close(res.bits_down, ref["down"], rtol=0, atol=0)
    assert float(res.table.bits_up.iloc[-1]) == pytest.approx(float(ref["up"].mean()))  # type: ignore[union-attr]
    # the logged metrics are those of the full f at x^t (methods.md l. 112)
    grads = [sum(lsq_grad(P, i, x) for i in range(P.n)) / P.n for x in traj]
    losses = [
        float(sum(((P.A[i] @ x - P.y[i]) ** 2).sum() for i in range(P.n))) / (2 * P.m * P.n)
        for x in traj
    ]
    close(
        torch.tensor(res.table.grad_norm_sq.values), torch.stack([g.square().sum() for g in grads])
    )
    close(torch.tensor(res.table.loss.values), torch.tensor(losses, dtype=F64))


def test_pp_paper_bits_count_participants_only() -> None:
    """bits_up_paper (32 bits per sent float, indices free: 32k for Top-k, methods.md l. 68)."""
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    res, _ = run_sim(P, "ef21_w_pp[p=0.5]", "top_k[k=2]", 0.01, 40, 8)
    C, bits = compressor_fn("top_k[k=2]", 8)
    ref = ef21_loop(
        lambda i, x: lsq_grad(P, i, x),
        P.n,
        P.x0(),
        0.01,
        40,
        8,
        C,
        bits,
        L_i=P.L_i.to(F64),
        p=[0.5] * P.n,
    )
    want = torch.tensor([32.0 * P.d + 64.0 * c for c in ref["counts"]], dtype=F64)  # type: ignore[attr-defined]
    torch.testing.assert_close(res.bits_up_paper, want, rtol=0, atol=0)


def test_pp_participation_frequency_is_p() -> None:
    """Statistics of the participation draws seen through the simulator alone: the number of
    rounds each client took part in (its downlink bits / 32d, less round 0) is Binomial(R, p_i);
    all within 4.5 standard deviations, and no two clients always together."""
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    p, R = [0.1, 0.3, 0.6, 0.9], 1500
    res = simulate(P, EF21(p=p), "top_k[k=2]", 1e-3, rounds=R, seed=3, log_every=R)
    counts = (res.bits_down / (32.0 * P.d) - 1.0).tolist()
    for c, q in zip(counts, p, strict=True):
        assert abs(c - R * q) < 4.5 * math.sqrt(R * q * (1 - q)), (c, q)


def test_pp_with_p_one_is_ef21() -> None:
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    a, ta = run_sim(P, "ef21_w_pp[p=1.0]", "scaled(rand_k[k=2])", 0.01, 20, 2)
    b, tb = run_sim(P, "ef21_w", "scaled(rand_k[k=2])", 0.01, 20, 2)
    assert torch.equal(ta, tb) and torch.equal(a.bits_up, b.bits_up)


# --------------------------------------------------------------------------------------------
# 2. EF21-SGD on a1a: minibatches without replacement, keyed by (seed, "minibatch", i, r)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a1a() -> tuple[A1A, object]:
    from shrinkgrad.problems import logistic_regression

    raw = A1A(6)
    problem = logistic_regression("a1a", n_clients=6, lam=LAM)
    assert problem.client_sizes.tolist() == raw.sizes  # the same contiguous chunks
    return raw, problem


@pytest.mark.parametrize(
    ("weighted", "batch", "p"),
    [
        (False, [16] * 6, None),
        (True, [7] * 6, None),
        (False, [3, 5, 7, 9, 11, 267], None),
        (True, [4] * 6, [0.3, 0.5, 0.7, 0.9, 0.2, 0.6]),
    ],
)
def test_sgd_simulator_equals_loop_on_a1a(
    a1a: tuple[A1A, object], weighted: bool, batch: list[int], p: list[float] | None
) -> None:
    raw, problem = a1a
    seed, rounds, gamma = 11, 15, 0.8
    bs = batch[0] if len(set(batch)) == 1 else batch
    method = EF21(weighted=weighted, batch=bs, p=1.0 if p is None else p)
    res, traj = run_sim(problem, method, "top_k[k=3]", gamma, rounds, seed)
    ref = ef21_loop(
        raw.grad,
        raw.n,
        torch.zeros(raw.d, dtype=F64),
        gamma,
        rounds,
        seed,
        lambda v, r, i: top_k(v, 3),
        lambda c: 3.0 * (32 + log2ceil(c.numel())),
        L_i=raw.L_i if weighted else None,
        p=p,
        minibatch=lambda i, x, r: raw.minibatch(i, x, r, batch[i], seed),
    )
    close(traj, torch.stack(ref["xs"]))  # type: ignore[arg-type]
    close(res.state.clients.g, ref["g_i"])  # type: ignore[arg-type]
    torch.testing.assert_close(res.bits_up, ref["up"], rtol=0, atol=0)
    # the logged ‖∇f(x^t)‖² is the full gradient's, not the estimator's (methods.md l. 112)
    gns = [float((sum(raw.grad(i, x) for i in range(raw.n)) / raw.n).square().sum()) for x in traj]
    close(torch.tensor(res.table.grad_norm_sq.values), torch.tensor(gns, dtype=F64))


@pytest.mark.parametrize("weighted", [False, True])
def test_sgd_theory_step_alpha_nu(a1a: tuple[A1A, object], weighted: bool) -> None:
    """γ = 1/(L + L̃ ξ(α_ν)), α_ν = 1 − (1 + ν)(1 − α) at the default ν = α/(2(1 − α)), i.e.
    α_ν = α/2 (docs/theory.md, EF21-SGD), with σ² (σ_w² = (1/n) Σ (L_AM/L_i) σ_i² for -W)
    recomputed from the data; σ² = 0 gives the EF21 step (the authors' choice)."""
    raw, problem = a1a
    b = 7
    spec = f"ef21{'_w' if weighted else ''}_sgd[b={b}]"
    bound = make_method(spec).bind(problem, "top_k[k=3]", "theory")  # type: ignore[arg-type]
    L_i = raw.L_i
    L_AM, L_QM = float(L_i.mean()), float(L_i.square().mean().sqrt())
    Lt = L_AM if weighted else L_QM
    alpha = 3 / raw.d
    nu = alpha / (2 * (1 - alpha))
    alpha_nu = 1 - (1 + nu) * (1 - alpha)
    assert bound.cfg.stepsize == pytest.approx(1 / (raw.L + Lt * xi(alpha_nu)), rel=1e-12)
    s2 = raw.sigma2_i([b] * raw.n)
    sigma2 = (
        float(np.mean([L_AM / float(L_i[i]) * s2[i] for i in range(raw.n)]))
        if weighted
        else float(np.mean(s2))
    )
    assert f"[sigma2={sigma2:.4g}]" in bound.cfg.stepsize_rule
    zero = make_method(spec[:-1] + ",sigma2=0]").bind(problem, "top_k[k=3]", "theory")  # type: ignore[arg-type]
    assert zero.cfg.stepsize == pytest.approx(1 / (raw.L + Lt * xi(alpha)), rel=1e-12)


# --------------------------------------------------------------------------------------------
# 3. theory steps of EF21-W and the PP variants (methods.md §4)
# --------------------------------------------------------------------------------------------
def pp_ratio_optimum(alpha: float, p_min: float, p_max: float) -> float:
    """min over s, ρ > 0 of B/(L̃² θ_p) of methods.md l. 126, by a grid and Nelder-Mead."""
    from scipy.optimize import minimize

    def ratio(z: np.ndarray) -> float:
        s, rho = math.exp(z[0]), math.exp(z[1])
        th, be = 1 - (1 + s) * (1 - alpha), (1 + 1 / s) * (1 - alpha)
        theta_p = rho * p_min + th * p_max - rho - (p_max - p_min)
        B = be * p_max + (1 + 1 / rho) * (1 - p_min)
        return B / theta_p if theta_p > 0 else 1e300

    grid = [
        (ratio(np.array([a, b])), a, b)
        for a in np.linspace(-10, 5, 46)
        for b in np.linspace(-12, 3, 46)
    ]
    best = min(grid)
    opt = minimize(
        ratio,
        np.array(best[1:]),
        method="Nelder-Mead",
        options={"xatol": 1e-12, "fatol": 1e-15, "maxiter": 20000},
    )
    return min(best[0], float(opt.fun))


@pytest.mark.parametrize(
    ("weighted", "p"),
    [(False, 0.5), (True, 0.5), (False, [0.6, 0.8, 0.7, 0.8]), (True, [0.9, 1.0, 0.95, 0.9])],
)
def test_pp_and_w_theory_steps(weighted: bool, p: float | list[float]) -> None:
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    # smoothness constants from the raw data (f_i = (1/(2m))‖A_i x − y_i‖²: L_i = λ_max(A_iᵀA_i)/m)
    H = [(P.A[i].T @ P.A[i]).numpy() / P.m for i in range(P.n)]
    L_i = np.array([np.linalg.eigvalsh(h)[-1] for h in H])
    L = float(np.linalg.eigvalsh(sum(H) / P.n)[-1])
    L_AM, L_QM = float(L_i.mean()), float(np.sqrt((L_i**2).mean()))
    Lt = L_AM if weighted else L_QM
    alpha = 0.5  # top_k[k=4] of d = 8
    ps = [p] * P.n if isinstance(p, float) else p
    method = EF21(weighted=weighted, p=p)
    bound = method.bind(P, "top_k[k=4]", "theory")
    want = 1 / (L + Lt * math.sqrt(pp_ratio_optimum(alpha, min(ps), max(ps))))
    assert bound.cfg.stepsize == pytest.approx(want, rel=1e-8)
    if weighted:  # w_i = L_i/Σ L_j, and EF21-W's own step 1/(L + L_AM ξ(α)) ([EFR] Thm 2)
        close(bound.cfg.weights, torch.tensor(L_i / L_i.sum(), dtype=F64))
        w = make_method("ef21_w").bind(P, "top_k[k=4]", "theory")
        assert w.cfg.stepsize == pytest.approx(1 / (L + L_AM * xi(alpha)), rel=1e-12)


# --------------------------------------------------------------------------------------------
# 4. EF21+ and DIANA
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("comp", "init"),
    [("scaled(rand_k[k=2])", "full"), ("top_k[k=2]", "compressed"), ("natural", "zero")],
)
def test_ef21_plus_equals_loop(comp: str, init: str) -> None:
    """EF21+ (docs/methods.md): with one draw C = C_i^r, b = g_i + C(G − g_i), m = C(G);
    g_i ← m if ‖m − G‖ < ‖b − G‖ else b; the message costs C's bits plus one flag bit."""
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    seed, rounds, gamma, n = 9, 30, 0.02, P.n
    C, bits = compressor_fn(comp, seed)
    x = P.x0().clone()
    if init == "full":
        g = [lsq_grad(P, i, x) for i in range(n)]
        up = [32.0 * P.d] * n
    elif init == "compressed":
        g = [C(lsq_grad(P, i, x), 0, i) for i in range(n)]
        up = [bits(g[i]) for i in range(n)]
    else:
        g, up = [torch.zeros_like(x) for _ in range(n)], [0.0] * n
    xs, switched = [x], 0
    for r in range(1, rounds + 1):
        x = x - gamma * sum(g) / n  # type: ignore[operator]
        for i in range(n):
            G = lsq_grad(P, i, x)
            c_ef, c_cg = C(G - g[i], r, i), C(G, r, i)
            b = g[i] + c_ef
            if float((c_cg - G).square().sum()) < float((b - G).square().sum()):
                g[i], sent, switched = c_cg, c_cg, switched + 1
            else:
                g[i], sent = b, c_ef
            up[i] += bits(sent) + 1.0
        xs.append(x)
    assert switched > 0  # both branches of the rule are exercised
    spec = "ef21_plus" + ("" if init == "full" else f"[init={init}]")
    res, traj = run_sim(P, spec, comp, gamma, rounds, seed)
    close(traj, torch.stack(xs))
    close(res.state.clients.g, torch.stack(g))
    torch.testing.assert_close(res.bits_up, torch.tensor(up, dtype=F64), rtol=0, atol=0)


@pytest.mark.parametrize("init", ["zero", "full"])
def test_diana_equals_loop(init: str) -> None:
    """DIANA (docs/methods.md): Δ_i = ∇f_i(x) − h_i, ĝ = h + (1/n) Σ Q_i(Δ_i),
    h_i ← h_i + αQ_i(Δ_i), α = 1/(1 + ω)."""
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    seed, rounds, gamma, n = 3, 30, 0.01, P.n
    Q = make_compressor("rand_k[k=2]")
    a = 1.0 / (1.0 + (P.d / 2 - 1))  # ω = d/k − 1 (methods.md §2)
    x = P.x0().clone()
    h = [lsq_grad(P, i, x) if init == "full" else torch.zeros_like(x) for i in range(n)]
    up = [32.0 * P.d if init == "full" else 0.0] * n
    xs = [x]
    for r in range(1, rounds + 1):
        mean_h, total = sum(h) / n, torch.zeros_like(x)
        for i in range(n):
            key = Keys.derive(seed, round=r, client=i, stream="compressor").reshape(1)
            q = Q((lsq_grad(P, i, x) - h[i]).unsqueeze(0), key)[0]
            h[i], total = h[i] + a * q, total + q
            up[i] += 2.0 * (32 + log2ceil(P.d))
        x = x - gamma * (mean_h + total / n)  # type: ignore[operator]
        xs.append(x)
    res, traj = run_sim(
        P, "diana" + ("[init=full]" if init == "full" else ""), Q, gamma, rounds, seed
    )
    close(traj, torch.stack(xs))
    torch.testing.assert_close(res.bits_up, torch.tensor(up, dtype=F64), rtol=0, atol=0)
