"""The [K18] methods of the simulator against loops written from methods.md alone.

Every trajectory test runs a method through :func:`shrinkgrad.sim.simulate` and compares each
iterate, to round-off, with a plain per-client Python loop written from the shared reference
../shared/docs/methods.md §3: DCGD (l. 76-79), delayed / asynchronous compressed GD (l. 81-84)
and the compressed IAG (l. 86-88). The loops share with the library only its documented keyed
randomness (docs/methods.md §1, "Randomness"): the compressor draw of client i in the step
producing round r uses ``Keys.derive(seed, round=r, client=i, stream="compressor")`` (round 0 for
the IAG's initial table; the shared-seed compressor one key ``client=0`` of stream
``"compressor/shared"``), the random delays ⌊w·(τ+1)/2³²⌋ with w the first 32-bit word of
``(seed, "delay", i, r)`` (``speeds``: round 0), and the random IAG order ⌊w·n/2³²⌋ of
``(seed, "order", 0, r)``. Gradients come from the raw data (the fixture's A_i, y_i; a1a's rows
from ``shrinkgrad.problems.load``), not from the problems' batched oracles. The theory step
sizes are the formulas of methods.md §4 (l. 130; DCGD's 1/(L + 2ωL_max/n) of docs/methods.md
§4) evaluated here, and the bits are counted from the compressors' formulas of methods.md §2
(l. 57, 59) times the messages each client sends.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from methods_fixtures import LeastSquares, UnbiasedRandK
from methods_reference import A1A, LAM

from shrinkgrad.compressors import make_compressor
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate

F64 = torch.float64
SEED = 7
K = 2

Q = Callable[[torch.Tensor, int, int], torch.Tensor]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


@pytest.fixture(scope="module")
def lsq() -> LeastSquares:
    return LeastSquares(n=4, d=6, m=5, seed=3)


def x_start(d: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, d, dtype=F64)


def grad_i(p: LeastSquares, i: int, x: torch.Tensor) -> torch.Tensor:
    """∇f_i(x) = A_iᵀ(A_i x − y_i)/m for f_i = ‖A_i x − y_i‖²/(2m)."""
    return p.A[i].T @ (p.A[i] @ x - p.y[i]) / p.m


def randk(d: int, seed: int = SEED, dtype: torch.dtype = F64) -> Q:
    """Unbiased rand-k (the fixture's UnbiasedRandK rule): the k smallest keyed uniforms, d/k."""

    def q(v: torch.Tensor, r: int, i: int) -> torch.Tensor:
        v = v.to(dtype)
        u = Keys.derive(seed, round=r, client=i, stream="compressor").uniform(d, F64)
        idx = torch.argsort(u)[:K]
        out = torch.zeros_like(v)
        out[idx] = v[idx] * (d / K)
        return out.to(F64)

    return q


def library(spec: str, seed: int = SEED) -> Q:
    """The library's compressor applied to one vector with client i's documented key."""
    C = make_compressor(spec)
    shared = bool(getattr(C, "shared_seed", False))

    def q(v: torch.Tensor, r: int, i: int) -> torch.Tensor:
        who = torch.tensor([0 if shared else i])
        stream = "compressor/shared" if shared else "compressor"
        return C(v.unsqueeze(0), Keys.derive(seed, round=r, client=who, stream=stream))[0]

    return q


def word(seed: int, r: int, i: int, stream: str) -> int:
    return int(Keys.derive(seed, round=r, client=i, stream=stream).bits32(1)[0])


def run_lib(p: object, method: object, comp: object, gamma: float, rounds: int, **kw: object):
    """simulate(...) and every iterate x^0 … x^R (x⁰ given; x^1 … through the callback)."""
    x0 = kw.pop("x0")
    assert isinstance(x0, torch.Tensor)
    xs: list[torch.Tensor] = [x0.clone()]

    def keep(r: int, state: object) -> None:
        xs.append(state.x.clone())  # type: ignore[attr-defined]

    res = simulate(p, method, comp, gamma, rounds, SEED, x0, callback=keep, **kw)
    assert len(xs) == rounds + 1
    return res, torch.stack(xs)


# --------------------------------------------------------------------------------------------
# reference loops (methods.md §3)
# --------------------------------------------------------------------------------------------
def dcgd_ref(p: LeastSquares, q: Q, gamma: float, rounds: int) -> torch.Tensor:
    """x^{t+1} = x^t − γ (1/n) Σ_i Q(∇f_i(x^t)) (l. 77-78)."""
    xs = [x_start(p.d)]
    for r in range(1, rounds + 1):
        x = xs[-1]
        xs.append(x - gamma * sum(q(grad_i(p, i, x), r, i) for i in range(p.n)) / p.n)
    return torch.stack(xs)


def delay(model: str, tau: int, t: int, i: int) -> int:
    if model == "fixed":
        return tau
    if model == "random":
        return (word(SEED, t + 1, i, "delay") * (tau + 1)) >> 32
    if model == "speeds":
        return (word(SEED, 0, i, "delay") * (tau + 1)) >> 32
    return (t + i) % (tau + 1)  # cyclic


def delayed_ref(p: LeastSquares, q: Q, gamma: float, rounds: int, tau: int, model: str):
    """As DCGD, client i's message at round t computed at x^{t − τ_i^t}, x^{<0} = x⁰ (l. 81-82)."""
    xs = [x_start(p.d)]
    seen = set()
    for t in range(rounds):
        msg = []
        for i in range(p.n):
            ti = delay(model, tau, t, i)
            seen.add(ti)
            msg.append(q(grad_i(p, i, xs[max(t - ti, 0)]), t + 1, i))
        xs.append(xs[-1] - gamma * sum(msg) / p.n)
    return torch.stack(xs), seen


def iag_ref(p: LeastSquares, q: Q, gamma: float, rounds: int, order: str, init: str):
    """Table ĝ_i, S = Σ ĝ_i; one client i_t sends Q(∇f_{i_t}(x^t)); x^{t+1} = x^t − γS/n
    (l. 86-87)."""
    x = x_start(p.d)
    if init == "compressed":
        table = [q(grad_i(p, i, x), 0, i) for i in range(p.n)]
    elif init == "full":
        table = [grad_i(p, i, x) for i in range(p.n)]
    else:
        table = [torch.zeros(p.d, dtype=F64) for _ in range(p.n)]
    S = sum(table)
    xs, active = [x], []
    for r in range(1, rounds + 1):
        i = (r - 1) % p.n if order == "cyclic" else (word(SEED, r, 0, "order") * p.n) >> 32
        active.append(i)
        new = q(grad_i(p, i, x), r, i)
        S = S - table[i] + new
        table[i] = new
        x = x - gamma * S / p.n
        xs.append(x)
    return torch.stack(xs), active


def async_ref(p: LeastSquares, q: Q, gamma: float, rounds: int, memory: bool):
    """The parameter server applying one message per update (l. 83-84) in round robin: worker
    (t − 1) mod n, its message number k = ⌊(t − 1)/n⌋ + 1 keyed by round k, at the current x.
    DCGD: x ← x − γ Q_i/n; IAG (server keeps ĝ_i, initial table at round 0): S ← S − old + new."""
    x = x_start(p.d)
    table = [q(grad_i(p, i, x), 0, i) for i in range(p.n)] if memory else None
    S = sum(table) if table else None
    xs = [x]
    for r in range(1, rounds + 1):
        i, k = (r - 1) % p.n, (r - 1) // p.n + 1
        new = q(grad_i(p, i, x), k, i)
        if table is None:
            x = x - gamma * new / p.n
        else:
            S = S - table[i] + new
            table[i] = new
            x = x - gamma * S / p.n
        xs.append(x)
    return torch.stack(xs)


# --------------------------------------------------------------------------------------------
# 1. trajectories
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("comp", ["fixture_rand_k", "rand_k[k=2]", "qsgd[s=2]", "shared"])
def test_dcgd_iterates(lsq: LeastSquares, comp: str) -> None:
    if comp == "fixture_rand_k":
        C, q = UnbiasedRandK(K), randk(lsq.d)
    elif comp == "shared":
        C, q = "rand_k[k=2,shared_seed=true]", library("rand_k[k=2,shared_seed=true]")
    else:
        C, q = comp, library(comp)
    res, xs = run_lib(lsq, "dcgd", C, 0.05, 12, x0=x_start(lsq.d))
    close(xs, dcgd_ref(lsq, q, 0.05, 12))
    ref_gns = [float(g @ g) for g in (sum(grad_i(lsq, i, x) for i in range(4)) / 4 for x in xs)]
    np.testing.assert_allclose(res.table.grad_norm_sq.to_numpy(), ref_gns, rtol=1e-12)


@pytest.mark.parametrize("model", ["fixed", "random", "speeds", "cyclic"])
@pytest.mark.parametrize("tau", [1, 3])
def test_delayed_dcgd_iterates(lsq: LeastSquares, tau: int, model: str) -> None:
    C = UnbiasedRandK(K)
    _, xs = run_lib(lsq, f"delayed_dcgd[tau={tau},model={model}]", C, 0.05, 12, x0=x_start(6))
    ref, seen = delayed_ref(lsq, randk(lsq.d), 0.05, 12, tau, model)
    if model in ("random", "cyclic"):
        assert seen == set(range(tau + 1))  # the delays the comparison exercised
    close(xs, ref)


@pytest.mark.parametrize("init", ["compressed", "full", "zero"])
@pytest.mark.parametrize("order", ["cyclic", "random"])
def test_iag_iterates(lsq: LeastSquares, order: str, init: str) -> None:
    C = UnbiasedRandK(K)
    _, xs = run_lib(lsq, f"iag[order={order},init={init}]", C, 0.05, 12, x0=x_start(6))
    ref, active = iag_ref(lsq, randk(lsq.d), 0.05, 12, order, init)
    if order == "random":
        assert active != [(r - 1) % 4 for r in range(1, 13)]
    close(xs, ref)


@pytest.mark.parametrize("wire", [torch.float64, torch.float32])
@pytest.mark.parametrize("inner", ["dcgd", "iag"])
def test_asynchronous_round_robin_iterates(lsq: LeastSquares, inner: str, wire) -> None:
    """The wire rounds the compressor's input to the wire dtype and C computes in it
    (WireConfig): the reference compresses in ``wire`` too."""
    C = UnbiasedRandK(K)
    _, xs = run_lib(lsq, f"asynchronous({inner})", C, 0.05, 13, x0=x_start(6), wire_dtype=wire)
    close(xs, async_ref(lsq, randk(lsq.d, dtype=wire), 0.05, 13, memory=inner == "iag"))


# --------------------------------------------------------------------------------------------
# 2. theory step sizes (methods.md §4, l. 130; docs/methods.md §4 for DCGD's rule)
# --------------------------------------------------------------------------------------------
def delayed_bound(L: float, tau: int) -> float:
    """2/[L(1 + √(1 + 8τ(τ + 1)))] (methods.md l. 130), strict: used at 0.99."""
    return 2.0 / (L * (1.0 + math.sqrt(1.0 + 8.0 * tau * (tau + 1))))


def theory(p: object, method: str, comp: str) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(simulate(p, method, comp, "theory", 0, SEED).stepsize)


def test_theory_steps(lsq: LeastSquares) -> None:
    n, d, L, Lmax = lsq.n, lsq.d, lsq.L, float(lsq.L_i.max())
    om_rk = d / K - 1.0  # rand-k (methods.md l. 57)
    om_q = min(d / 4.0, math.sqrt(d) / 2.0)  # QSGD s = 2 (l. 59)

    def dc(om: float, draws: int = n) -> float:
        return 1.0 / (L + 2.0 * om * Lmax / draws)

    def dl(tau: int, om: float = om_rk, draws: int = n) -> float:
        return min(dc(om, draws), 0.99 * delayed_bound(L, tau)) if tau else dc(om, draws)

    expect = {
        ("dcgd", "rand_k[k=2]"): dc(om_rk),
        ("dcgd", "qsgd[s=2]"): dc(om_q),
        ("dcgd", "identity"): 1.0 / L,
        ("dcgd", "rand_k[k=2,shared_seed=true]"): dc(om_rk, 1),
        ("delayed_dcgd[tau=0]", "rand_k[k=2]"): dl(0),
        ("delayed_dcgd[tau=1]", "rand_k[k=2]"): dl(1),
        ("delayed_dcgd[tau=3,model=random]", "rand_k[k=2]"): dl(3),
        ("delayed_dcgd[tau=5]", "qsgd[s=2]"): dl(5, om_q),
        ("iag", "rand_k[k=2]"): dl(n - 1),  # τ = n − 1 under the cyclic order (l. 88)
        ("iag", "rand_k[k=2,shared_seed=true]"): dl(n - 1, draws=1),
        ("asynchronous(dcgd)", "rand_k[k=2]"): dl(0),
        ("asynchronous(iag)", "rand_k[k=2]"): dl(n - 1),
        ("asynchronous[tau_max=4](dcgd)", "rand_k[k=2]"): dl(4),
        ("asynchronous[tau_max=3](iag)", "rand_k[k=2]"): dl(6),
        ("asynchronous[assume_tau=3](iag)", "rand_k[k=2]"): dl(3),
    }
    got = {key: theory(lsq, *key) for key in expect}
    for key, value in expect.items():
        assert got[key] == pytest.approx(value, rel=1e-14), key


def test_iag_random_order_has_no_theory_step(lsq: LeastSquares) -> None:
    with pytest.raises(ValueError, match="unbounded"):
        theory(lsq, "iag[order=random]", "rand_k[k=2]")


def test_asynchronous_iag_theory_delay_is_at_least_n_minus_1(lsq: LeastSquares) -> None:
    """The round-robin asynchronous IAG is the cyclic IAG (docs/methods.md §3), whose oldest
    table entry is n − 1 updates old (methods.md l. 88: τ = n − 1), whatever bound the
    per-message staleness has: with ``tau_max=T`` the delay of its theory step is max(2T,
    n − 1). (Stop 36's audit: it was 2T, which for 2T < n − 1 is below the actual delay;
    tau_max=0 gave the DCGD step itself, 1.36× the cyclic IAG's rule on this problem.)"""
    n, L, Lmax = lsq.n, lsq.L, float(lsq.L_i.max())
    dc = 1.0 / (L + 2.0 * (lsq.d / K - 1.0) * Lmax / n)
    for T in (0, 1):
        try:
            got = theory(lsq, f"asynchronous[tau_max={T}](iag)", "rand_k[k=2]")
        except ValueError:
            continue  # refused: also correct
        tau = max(2 * T, n - 1)
        assert got == pytest.approx(min(dc, 0.99 * delayed_bound(L, tau)), rel=1e-14), T


def test_delayed_rules_record_the_dcgd_annotations(lsq: LeastSquares) -> None:
    """docs/methods.md §4: the delay rules built on DCGD's take n = 1 for a shared draw and
    record ``(one shared draw: n = 1)``; on a problem not known to be convex they record
    ``(f_i not known to be convex: …)``. (Stop 36's audit: ``delayed_theory`` kept only the
    ``(f_i not convex …)`` note; the step values were right.)"""
    from shrinkgrad.methods.base import SHARED_DRAW
    from shrinkgrad.methods.gd import NOT_KNOWN_CONVEX

    def rule(p: object, method: str, comp: str) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return str(simulate(p, method, comp, "theory", 0, SEED).stepsize_rule)

    assert rule(lsq, "dcgd", "rand_k[k=2,shared_seed=true]").endswith(SHARED_DRAW)
    assert SHARED_DRAW in rule(lsq, "delayed_dcgd[tau=3]", "rand_k[k=2,shared_seed=true]")
    assert SHARED_DRAW in rule(lsq, "iag", "rand_k[k=2,shared_seed=true]")
    unknown = LeastSquares(n=4, d=6, m=5, seed=3)
    unknown.convex = None  # type: ignore[assignment]
    assert NOT_KNOWN_CONVEX in rule(unknown, "delayed_dcgd[tau=3]", "rand_k[k=2]")


# --------------------------------------------------------------------------------------------
# 3. bits (methods.md §2 l. 57, 59: rand-k k(32 + ⌈log₂ d⌉), papers 32k;
#    QSGD 32 + d(1 + ⌈log₂(s+1)⌉))
# --------------------------------------------------------------------------------------------
def test_bits_per_client(lsq: LeastSquares) -> None:
    n, d, R = lsq.n, lsq.d, 10
    up, paper, down = K * (32 + math.ceil(math.log2(d))), 32 * K, 32 * d
    cyc = torch.tensor([sum(1 for r in range(1, R + 1) if (r - 1) % n == i) for i in range(n)])
    rnd = iag_ref(lsq, randk(d), 0.01, R, "random", "zero")[1]
    rnd_count = torch.tensor([rnd.count(i) for i in range(n)])
    every = torch.full((n,), R)
    # (method, messages sent per client after the initialisation, initial message: 0/1/dense)
    cases = [
        ("dcgd", every, "none"),
        ("delayed_dcgd[tau=2,model=random]", every, "none"),
        ("iag", cyc, "compressed"),
        ("iag[order=random]", rnd_count, "compressed"),
        ("iag[init=full]", cyc, "full"),
        ("iag[init=zero]", cyc, "none"),
        ("asynchronous(dcgd)", cyc, "none"),
        ("asynchronous(iag)", cyc, "compressed"),
    ]
    for method, count, init in cases:
        res = simulate(lsq, method, "rand_k[k=2]", 0.01, R, SEED)
        c = count.to(F64)
        first_up = {"none": 0, "compressed": up, "full": 32 * d}[init]
        first_paper = {"none": 0, "compressed": paper, "full": 32 * d}[init]
        first_down = 0 if init == "none" else down
        close(res.bits_up, c * up + first_up)
        close(res.bits_up_paper, c * paper + first_paper)
        close(res.bits_down, c * down + first_down)
        assert float(res.table.bits_up.iloc[-1]) == pytest.approx(float((c * up).mean()) + first_up)
    for s in (1, 2, 3, 7):
        res = simulate(lsq, "dcgd", f"qsgd[s={s}]", 0.01, 3, SEED)
        bits = 3.0 * (32 + d * (1 + math.ceil(math.log2(s + 1))))
        close(res.bits_up, torch.full((n,), bits, dtype=F64))


# --------------------------------------------------------------------------------------------
# 4. a1a (logistic loss, nonconvex regularizer; methods.md §1 l. 34-36), QSGD
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def a1a():
    from shrinkgrad.problems import logistic_regression

    raw = A1A(4)  # contiguous chunks, the last client takes the remainder
    problem = logistic_regression("a1a", n_clients=raw.n, lam=LAM)
    assert problem.client_sizes.tolist() == raw.sizes
    return problem, raw.grad, raw.L, raw.L_i.tolist()


@pytest.mark.filterwarnings("ignore:the DCGD theory step:UserWarning")
def test_a1a_dcgd_delayed_iag(a1a) -> None:
    problem, g, L, L_i = a1a
    n, d, R = 4, problem.d, 8
    x0 = torch.full((d,), 0.01, dtype=F64)
    q = library("qsgd[s=4]")
    om = min(d / 16.0, math.sqrt(d) / 4.0)
    dc = 1.0 / (L + 2.0 * om * max(L_i) / n)
    # DCGD at its theory step (L, L_i from the rows: the library's eigensolver agrees to ~1e-7)
    res, xs = run_lib(problem, "dcgd", "qsgd[s=4]", "theory", R, x0=x0)
    assert res.stepsize == pytest.approx(dc, rel=1e-6)
    gam = res.stepsize
    ref = [x0]
    for r in range(1, R + 1):
        ref.append(ref[-1] - gam * sum(q(g(i, ref[-1]), r, i) for i in range(n)) / n)
    close(xs, torch.stack(ref))
    # delayed DCGD, random delays τ ≤ 2, at its theory step
    res, xs = run_lib(problem, "delayed_dcgd[tau=2,model=random]", "qsgd[s=4]", "theory", R, x0=x0)
    assert res.stepsize == pytest.approx(min(dc, 0.99 * delayed_bound(L, 2)), rel=1e-6)
    gam, ref = res.stepsize, [x0]
    for t in range(R):
        msg = [q(g(i, ref[max(t - delay("random", 2, t, i), 0)]), t + 1, i) for i in range(n)]
        ref.append(ref[-1] - gam * sum(msg) / n)
    close(xs, torch.stack(ref))
    # IAG, random order
    _, xs = run_lib(problem, "iag[order=random]", "qsgd[s=4]", 0.5, R, x0=x0)
    x, table = x0, [q(g(i, x0), 0, i) for i in range(n)]
    S, ref = sum(table), [x0]
    for r in range(1, R + 1):
        i = (word(SEED, r, 0, "order") * n) >> 32
        new = q(g(i, x), r, i)
        S, table[i] = S - table[i] + new, new
        x = x - 0.5 * S / n
        ref.append(x)
    close(xs, torch.stack(ref))
