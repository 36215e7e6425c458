"""Client momentum against loops written from the formulas alone: EF21-SGDM ([FTR23] Alg. 1) and
the ``+momentum`` wrappers (:class:`~shrinkgrad.methods.ClientMomentum`: the DDP hook's
``CompressionState(momentum=β)`` in front of EF, DCGD, EF21-W, DIANA).

[FTR23] Fatkhullin, Tyurin, Richtárik, *Momentum Provably Improves Error Feedback!*, NeurIPS
2023, Alg. 1 with η = 1 − β: v_i ← (1 − η) v_i + η ∇̂f_i(x^{t+1}); c_i = C(v_i − g_i);
g_i ← g_i + c_i; g ← g + (1/n) Σ_i c_i; x^{t+1} = x^t − γ g. The library starts the momentum
from v = 0 (v_i⁰ = (1 − β)∇f_i(x⁰), g_i⁰ = v_i⁰, the hook's semantics; docs/theory.md notes that
the paper's Alg. 1 starts from v_i⁰ = g_i⁰ = ∇f_i(x⁰, ξ_i⁰)); the loops below follow the library's
documented choice. The wrappers put the same v_i in front of the inner method's step, in place
of ∇f_i(x^t): EF p_i = e_i + γ v_i, DCGD Q_i(v_i), EF21-W C(v_i/(n w_i) − g_i), DIANA
Q_i(v_i − h_i).

Gradients come from the data (the fixture's A_i, y_i; australian's and a1a's rows), not from the
problems' batched oracles. What the loops share with the library is only its documented keyed
randomness (``Keys.derive(seed, round=r, client=i, stream=...)``): the compressor draws (applied
through the compressor object with client i's key) and the minibatches (the fixture's sampler:
rows ⌊u·m⌋ of b keyed uniforms; the library's problems: the b samples with the smallest keyed
uniforms, without replacement).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from methods_fixtures import LeastSquares
from methods_reference import LAM, NonconvexLogistic, uniform

from shrinkgrad.compressors import make_compressor
from shrinkgrad.distributed import CompressionState, compression_hook, preload, spawn
from shrinkgrad.distributed.runner import run_distributed
from shrinkgrad.methods import ClientMomentum, ProblemOracle, make_method
from shrinkgrad.methods.base import Method, weighted_sum
from shrinkgrad.problems import load, logistic_regression, resolve_split
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate

F64 = torch.float64
Grad = Callable[[int, torch.Tensor, int], torch.Tensor]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def top_k(v: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.argsort(v.abs(), descending=True, stable=True)[:k]
    out = torch.zeros_like(v)
    out[idx] = v[idx]
    return out


def compressor(spec: str, seed: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """C(v, r, i): Top-k written here, the random ones the library's operator with client i's
    key of round r (the draws are shared, the algorithm around them is not)."""
    if spec.startswith("top_k"):
        k = _k(spec)
        return lambda v, r, i: top_k(v, k)
    if spec == "identity":
        return lambda v, r, i: v
    C = make_compressor(spec)

    def apply(v: torch.Tensor, r: int, i: int) -> torch.Tensor:
        key = Keys.derive(seed, round=r, client=i, stream="compressor").reshape(1)
        return C(v.unsqueeze(0), key)[0]

    return apply


def _k(spec: str) -> int:
    """k of a sparsifier's name (``top_k[k=2]``, ``scaled(rand_k[k=2])``)."""
    found = re.search(r"k=(\d+)", spec)
    assert found is not None, spec
    return int(found.group(1))


def sparse_bits(k: int, d: int) -> float:
    """Top-k, rand-k and scaled rand-k: k values and k indices (methods.md §2)."""
    return k * (32.0 + math.ceil(math.log2(d)))


# --------------------------------------------------------------------------------------------
# the data: per-client gradients and minibatch gradients written here
# --------------------------------------------------------------------------------------------
class Lsq:
    """The fixture f_i(x) = (1/(2m)) ‖A_i x − y_i‖²; minibatches: rows ⌊u_j m⌋ of b keyed
    uniforms (the fixture's sampler, with replacement)."""

    def __init__(self, P: LeastSquares) -> None:
        self.P, self.n, self.d = P, P.n, P.d

    def grad(self, i: int, x: torch.Tensor) -> torch.Tensor:
        A, y = self.P.A[i], self.P.y[i]
        return A.T @ (A @ x - y) / self.P.m

    def minibatch(self, i: int, x: torch.Tensor, r: int, b: int, seed: int) -> torch.Tensor:
        rows = (uniform(seed, r, i, "minibatch", b) * self.P.m).long()
        A, y = self.P.A[i][rows], self.P.y[i][rows]
        return A.T @ (A @ x - y) / b


class Libsvm(NonconvexLogistic):
    """A LIBSVM dataset in contiguous chunks, the logistic loss with the nonconvex regularizer
    λ Σ x_k²/(1 + x_k²) (methods.md §1); minibatches: the b samples with the smallest keyed
    uniforms (sample j's key: counter j), without replacement."""

    def __init__(self, name: str, n: int) -> None:
        ds = load(name)
        parts, _ = resolve_split("contiguous", ds, n)
        X = np.asarray(ds.X.toarray() if hasattr(ds.X, "toarray") else ds.X, dtype=np.float64)
        y = np.asarray(ds.y, dtype=np.float64)
        self.A = [torch.tensor(X[p]) for p in parts]
        self.y = [torch.tensor(y[p]) for p in parts]
        self.n, self.d = n, X.shape[1]


# --------------------------------------------------------------------------------------------
# the loops
# --------------------------------------------------------------------------------------------
def momentum_loop(
    data: Lsq | Libsvm,
    inner: str,
    beta: float,
    gamma: float,
    rounds: int,
    seed: int,
    spec: str,
    *,
    b: int | None = None,
    init: str = "full",
    L_i: torch.Tensor | None = None,
    dense_rounds: int = 0,
) -> dict[str, Any]:
    """``inner`` ∈ {ef21, ef, dcgd, diana} with client momentum v_i ← β v_i + (1 − β) ∇̂f_i in
    front (module docstring); ``L_i`` makes EF21 EF21-W (w_i = L_i/Σ L_j). Rounds r ≤
    ``dense_rounds`` use the identity (the DDP hook's warm-up). Returns the iterates x⁰ … x^R
    and the final states and bit counters (honest and per client)."""
    n, d = data.n, data.d
    C = compressor(spec, seed)
    msg_bits = 32.0 * d if spec == "identity" else sparse_bits(_k(spec), d)
    w = [1.0 / n] * n if L_i is None else [float(L_i[i] / L_i.sum()) for i in range(n)]
    x = torch.zeros(d, dtype=F64)
    zeros = [torch.zeros(d, dtype=F64) for _ in range(n)]
    v = [z.clone() for z in zeros]
    up, down = [0.0] * n, [0.0] * n

    def gradient(i: int, x: torch.Tensor, r: int) -> torch.Tensor:
        return data.grad(i, x) if b is None else data.minibatch(i, x, r, b, seed)

    def comp(u: torch.Tensor, r: int, i: int) -> torch.Tensor:
        return u if r <= dense_rounds else C(u, r, i)

    xs = [x]
    if inner == "ef21":
        s = [1.0 / (n * w[i]) for i in range(n)]
        if init != "zero":  # the momentum of the first (exact) gradient, from v = 0
            v = [(1.0 - beta) * data.grad(i, x) for i in range(n)]
            down = [32.0 * d] * n
        if init == "full":
            g_i = [s[i] * v[i] for i in range(n)]
            up = [32.0 * d] * n
        elif init == "compressed":
            g_i = [C(s[i] * v[i], 0, i) for i in range(n)]
            up = [msg_bits] * n
        else:
            g_i = [z.clone() for z in zeros]
        g = sum(w[i] * g_i[i] for i in range(n))
        for r in range(1, rounds + 1):
            x = x - gamma * g  # x^{t+1} = x^t − γ g^t
            agg = torch.zeros(d, dtype=F64)
            for i in range(n):
                v[i] = beta * v[i] + (1.0 - beta) * gradient(i, x, r)
                c = comp(s[i] * v[i] - g_i[i], r, i)
                g_i[i] = g_i[i] + c
                agg = agg + w[i] * c
            g = g + agg
            xs.append(x)
        state = {"g_i": torch.stack(g_i), "g": g}
    else:
        e = [z.clone() for z in zeros]  # EF's e_i, DIANA's h_i
        h = torch.zeros(d, dtype=F64)
        alpha = 1.0 / (1.0 + make_compressor(spec).omega(d)) if inner == "diana" else 0.0
        for r in range(1, rounds + 1):
            agg = torch.zeros(d, dtype=F64)
            for i in range(n):
                v[i] = beta * v[i] + (1.0 - beta) * gradient(i, x, r)  # at x^t
                if inner == "ef":
                    p = e[i] + gamma * v[i]
                    c = comp(p, r, i)
                    e[i] = p - c
                elif inner == "dcgd":
                    c = comp(v[i], r, i)
                else:  # diana
                    c = comp(v[i] - e[i], r, i)
                    e[i] = e[i] + alpha * c
                agg = agg + c / n
            if inner == "ef":
                x = x - agg
            elif inner == "dcgd":
                x = x - gamma * agg
            else:
                x = x - gamma * (h + agg)
                h = h + alpha * agg
            xs.append(x)
        state = {"e": torch.stack(e)}
    for i in range(n):
        up[i] += sum(32.0 * d if r <= dense_rounds else msg_bits for r in range(1, rounds + 1))
        down[i] += 32.0 * d * rounds
    return {
        "xs": torch.stack(xs),
        "v": torch.stack(v),
        "up": torch.tensor(up, dtype=F64),
        "down": torch.tensor(down, dtype=F64),
        **state,
    }


def run_sim(problem: Any, method: Any, spec: str, gamma: float, rounds: int, seed: int) -> Any:
    xs = [torch.zeros(problem.d, dtype=F64)]
    res = simulate(
        problem,
        method,
        spec,
        gamma,
        rounds=rounds,
        seed=seed,
        callback=lambda r, s: xs.append(s.x.clone()),
    )
    assert res.status == "completed", res.message
    return res, torch.stack(xs)


def constants(problem: Any) -> tuple[float, torch.Tensor]:
    """(L, L_i) of a problem that knows them."""
    assert problem.L is not None and problem.L_i is not None
    return float(problem.L), torch.as_tensor(problem.L_i, dtype=F64)


def beta_of(method: str | Method[Any, Any]) -> float:
    m = make_method(method) if isinstance(method, str) else method
    assert isinstance(m, ClientMomentum)
    return m.beta


def lsq() -> tuple[LeastSquares, Lsq, float]:
    P = LeastSquares(n=4, d=8, m=5, seed=4, spread=8.0)
    return P, Lsq(P), 0.3 / float(constants(P)[1].max())


# --------------------------------------------------------------------------------------------
# 1. the simulator
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["top_k[k=2]", "scaled(rand_k[k=2])"])
@pytest.mark.parametrize("b", [None, 3])
@pytest.mark.parametrize("init", ["full", "compressed", "zero"])
def test_ef21_sgdm_is_algorithm_1(spec: str, b: int | None, init: str) -> None:
    P, data, gamma = lsq()
    name = (
        "ef21_sgdm[beta=0.7"
        + ("" if b is None else f",b={b}")
        + ("]" if init == "full" else f",init={init}]")
    )
    res, traj = run_sim(P, name, spec, gamma, 20, 7)
    ref = momentum_loop(data, "ef21", 0.7, gamma, 20, 7, spec, b=b, init=init)
    close(traj, ref["xs"])
    close(res.state.clients.v, ref["v"])
    close(res.state.clients.inner.g, ref["g_i"])
    close(res.state.server.g, ref["g"])
    close(res.state.server.g, res.state.clients.inner.g.mean(dim=0))  # g = (1/n) Σ g_i
    torch.testing.assert_close(res.bits_up, ref["up"], rtol=0, atol=0)
    torch.testing.assert_close(res.bits_down, ref["down"], rtol=0, atol=0)
    assert float((traj[-1] - traj[0]).norm()) > 1e-3


@pytest.mark.parametrize(
    ("inner", "spec", "kind"),
    [
        ("ef", "top_k[k=2]", "ef"),
        ("ef", "scaled(rand_k[k=2])", "ef"),
        ("dcgd[biased=true]", "top_k[k=2]", "dcgd"),
        ("dcgd", "rand_k[k=2]", "dcgd"),
        ("ef21_w", "scaled(rand_k[k=2])", "ef21"),
        ("diana", "rand_k[k=2]", "diana"),
    ],
)
@pytest.mark.parametrize("b", [None, 3])
def test_momentum_in_front_of_a_method(inner: str, spec: str, kind: str, b: int | None) -> None:
    P, data, gamma = lsq()
    method = ClientMomentum(make_method(inner), 0.6, b)
    assert method.name == f"{inner}+momentum[beta=0.6" + ("]" if b is None else f",b={b}]")
    res, traj = run_sim(P, method, spec, gamma, 20, 5)
    L_i = constants(P)[1] if inner == "ef21_w" else None
    ref = momentum_loop(data, kind, 0.6, gamma, 20, 5, spec, b=b, L_i=L_i)
    close(traj, ref["xs"])
    close(res.state.clients.v, ref["v"])
    inner_state = res.state.clients.inner
    if kind == "ef21":
        close(inner_state.g, ref["g_i"])
        close(res.state.server.g, ref["g"])
    elif kind in ("ef", "diana"):
        close(inner_state.e if kind == "ef" else inner_state.h, ref["e"])
    torch.testing.assert_close(res.bits_up, ref["up"], rtol=0, atol=0)
    torch.testing.assert_close(res.bits_down, ref["down"], rtol=0, atol=0)
    # the logged metric is ‖∇f(x^t)‖² of the full f at the round's iterate
    grads = torch.stack([torch.stack([data.grad(i, x) for i in range(P.n)]).mean(0) for x in traj])
    close(torch.tensor(res.table.grad_norm_sq.values), grads.square().sum(dim=1))


@pytest.mark.parametrize(
    ("method", "kind", "spec"),
    [
        ("ef21_sgdm[beta=0.8,b=6]", "ef21", "rand_k_scaled[k=3]"),
        (ClientMomentum(make_method("ef"), 0.7, 6), "ef", "top_k[k=3]"),
    ],
    ids=["ef21_sgdm", "ef+momentum"],
)
def test_on_australian_with_the_librarys_minibatches(method: Any, kind: str, spec: str) -> None:
    problem = logistic_regression("australian", n_clients=4, split="contiguous", lam=LAM)
    data = Libsvm("australian", 4)
    gamma = 0.5 / constants(problem)[0]
    res, traj = run_sim(problem, method, spec, gamma, 20, 5)
    ref = momentum_loop(data, kind, beta_of(method), gamma, 20, 5, spec, b=6)
    torch.testing.assert_close(traj, ref["xs"], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(res.state.clients.v, ref["v"], rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(res.bits_up, ref["up"], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# 2. groups of clients (the runner's ranks), checkpoints
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "spec"),
    [
        (make_method("ef21_sgdm[beta=0.7,b=3,init=compressed]"), "scaled(rand_k[k=2])"),
        (ClientMomentum(make_method("ef"), 0.6, 3), "scaled(rand_k[k=2])"),
        (ClientMomentum(make_method("dcgd"), 0.6), "rand_k[k=2]"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.name,
)
def test_groups_of_clients_give_the_full_run(method: Method[Any, Any], spec: str) -> None:
    """Each group initialised and stepped on its own (its own client states, the reduction
    summed over the groups, as the runner's ranks do) gives the simulator's run."""
    P, _, gamma = lsq()
    full, traj = run_sim(P, method, spec, gamma, 12, 3)
    bound = method.bind(P, spec, gamma, 3)
    m, cfg, oracle = bound.method, bound.cfg, ProblemOracle(P)
    groups = [torch.tensor([2, 0]), torch.tensor([3, 1])]
    x0 = torch.zeros(P.d, dtype=F64)

    def reduce(msgs: list[Any]) -> torch.Tensor | None:
        if msgs[0].values is None:
            return None
        return sum(weighted_sum(msg.values, msg.weights) for msg in msgs)  # type: ignore[return-value]

    inits = [m.init_clients(cfg, x0, oracle, ids) for ids in groups]
    server = m.init_server(cfg, x0, reduce([msg for _, msg in inits]))
    clients = [c for c, _ in inits]
    for r in range(1, 13):
        server = m.server_pre(cfg, server, r)
        steps = [m.client_step(cfg, server, c, oracle, r) for c in clients]
        clients = [c for c, _ in steps]
        server = m.server_post(cfg, server, reduce([msg for _, msg in steps]), r)
        close(server.x, traj[r])
    v = torch.empty_like(full.state.clients.v)
    for ids, c in zip(groups, clients, strict=True):
        v[ids] = c.v
    close(v, full.state.clients.v)


@pytest.mark.parametrize(
    ("method", "spec"),
    [
        ("ef21_sgdm[beta=0.7,b=3]", "scaled(rand_k[k=2])"),
        (ClientMomentum(make_method("dcgd"), 0.6, 3), "rand_k[k=2]"),
    ],
    ids=["ef21_sgdm", "dcgd+momentum"],
)
def test_a_resumed_run_is_the_uninterrupted_one(method: Any, spec: str, tmp_path: Path) -> None:
    P, _, gamma = lsq()
    straight = simulate(P, method, spec, gamma, rounds=16, seed=2)
    path = tmp_path / "ckpt.pt"
    simulate(P, method, spec, gamma, rounds=7, seed=2, checkpoint=path)
    resumed = simulate(P, method, spec, gamma, rounds=16, seed=2, checkpoint=path)
    assert torch.equal(resumed.x, straight.x)
    assert torch.equal(resumed.state.clients.v, straight.state.clients.v)
    assert torch.equal(resumed.bits_up, straight.bits_up)
    assert resumed.table.drop(columns="time_s").equals(straight.table.drop(columns="time_s"))


# --------------------------------------------------------------------------------------------
# 3. what the momentum cannot wrap
# --------------------------------------------------------------------------------------------
def test_a_wrapped_method_asking_for_stale_gradients_is_refused() -> None:
    """The momentum averages gradients at the server's iterate and hands the inner method v_i
    as its gradient. DCGD with delays asks for ∇f_i at stale iterates x^{t−τ}: answering with
    v_i (gradients at x^t) silently dropped the delays (β = 0 ran plain DCGD's iterates, 0.054
    off delayed_dcgd[tau=2]'s in max-norm after 10 rounds). It is refused; without delays it
    is DCGD's momentum."""
    P, _, gamma = lsq()
    with pytest.raises(ValueError, match="stale"):
        simulate(P, ClientMomentum(make_method("delayed_dcgd[tau=2]"), 0.0), "identity", gamma, 10)
    a = simulate(P, ClientMomentum(make_method("delayed_dcgd[tau=0]"), 0.5), None, gamma, 10)
    b = simulate(P, ClientMomentum(make_method("dcgd"), 0.5), None, gamma, 10)
    assert torch.equal(a.x, b.x)


# --------------------------------------------------------------------------------------------
# 4. the multi-process runner and the DDP hook
# --------------------------------------------------------------------------------------------
def _runner(rank: int, world: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    xs: list[torch.Tensor] = []
    res = run_distributed(callback=lambda r, s: xs.append(s.x.clone()), **kwargs)
    return torch.stack(xs), res.state.clients.ids, res.state.clients.v, res.bits_up


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_runner_follows_the_loop(tmp_path: Path) -> None:
    """Two gloo ranks (clients [0, 1] and [2, 3]) run the loop's iterates, momenta and bits, and
    resume from their checkpoints mid-run to the same end."""
    P, data, gamma = lsq()
    for method, kind, spec in [
        (ClientMomentum(make_method("ef"), 0.6, 3), "ef", "scaled(rand_k[k=2])"),
        (make_method("ef21_sgdm[beta=0.7,b=3]"), "ef21", "rand_k_scaled[k=2]"),
    ]:
        kwargs: dict[str, Any] = dict(
            problem=P, method=method, compressor=spec, stepsize=gamma, rounds=12, seed=6
        )
        out = spawn(_runner, 2, (kwargs,))
        ref = momentum_loop(data, kind, beta_of(method), gamma, 12, 6, spec, b=3)
        v = torch.empty_like(ref["v"])
        for xs, ids, v_rank, bits in out:
            close(xs, ref["xs"][1:])
            v[ids] = v_rank
            torch.testing.assert_close(bits, ref["up"], rtol=0, atol=0)
        close(v, ref["v"])
        prefix = str(tmp_path / f"ckpt-{kind}")
        spawn(_runner, 2, (dict(kwargs, rounds=5, checkpoint=prefix),))
        resumed = spawn(_runner, 2, (dict(kwargs, checkpoint=prefix),))
        for r in range(2):
            assert torch.equal(resumed[r][0][-1], out[r][0][-1])
            assert torch.equal(resumed[r][2], out[r][2])


class _ClientLoss(torch.nn.Module):
    """f_i of :class:`Libsvm` as a model with one parameter x (float64, x⁰ = 0)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(d, dtype=F64))

    def forward(self, A: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.x
        loss = torch.nn.functional.softplus(-y * (A @ x)).mean()
        return loss + LAM * (x * x / (1 + x * x)).sum()


HOOK_STEPS = 8


def _hook(rank: int, world: int, cases: list[dict[str, Any]], gamma: float) -> list[Any]:
    data = Libsvm("a1a", world)
    out = []
    for kwargs in cases:
        model = torch.nn.parallel.DistributedDataParallel(_ClientLoss(data.d))
        state = CompressionState(min_numel=0, **kwargs)
        model.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=gamma)  # momentum-free: x ← x − γ·D
        xs = []
        for _ in range(HOOK_STEPS):
            opt.zero_grad()
            model(data.A[rank], data.y[rank]).backward()
            opt.step()
            xs.append(model.module.x.detach().clone())
        out.append((torch.stack(xs), state.method.name, state.momentum))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_hooks_momentum_follows_the_loop() -> None:
    """``CompressionState(momentum=β)`` on two ranks (one client each, full gradients, a
    momentum-free optimizer at the method's γ): after iteration t the model is the loop's
    x^{t+1}; the warm-up iterations are rounds with the identity (iteration 0 of EF21-SGDM is
    its dense initialisation, the others' is round 1)."""
    preload()
    P = logistic_regression("a1a", n_clients=2, split="contiguous", lam=LAM)
    L, L_i = constants(P)
    data, gamma = Libsvm("a1a", 2), 0.5 / L
    top = "top_k[k=5]"
    cases: list[tuple[dict[str, Any], str, str]] = [
        (dict(compressor=top, method="ef21", momentum=0.6, warmup_steps=0), "ef21", "ef21_sgdm"),
        (dict(compressor=top, method="ef21", momentum=0.6, warmup_steps=3), "ef21", "ef21_sgdm"),
        (dict(compressor=top, method="ef21_sgdm[beta=0.6]", warmup_steps=0), "ef21", "ef21_sgdm"),
        (dict(compressor=top, momentum=0.6, warmup_steps=0), "dcgd", "dcgd[biased=true]+"),
        (dict(compressor=top, momentum=0.6, warmup_steps=2), "dcgd", "dcgd[biased=true]+"),
        (dict(compressor=top, method="ef", momentum=0.6, warmup_steps=2), "ef", "ef+"),
        (
            dict(compressor=top, method="ef21_w", weights=L_i.tolist(), momentum=0.6),
            "ef21",
            "ef21_w+",
        ),
        (dict(compressor="identity", method="diana", momentum=0.6), "diana", "diana+"),
    ]
    got = spawn(_hook, 2, ([kw for kw, _, _ in cases], gamma))
    for j, (kwargs, kind, name) in enumerate(cases):
        warm = int(kwargs.get("warmup_steps", 1))
        spec = kwargs["compressor"]
        ref = momentum_loop(
            data,
            kind,
            0.6,
            gamma,
            HOOK_STEPS,
            0,
            spec,
            L_i=L_i if "weights" in kwargs else None,
            dense_rounds=warm - 1 if kind == "ef21" else warm,
        )
        for rank in range(2):
            xs, method, beta = got[rank][j]
            assert method.startswith(name) and beta == 0.6
            torch.testing.assert_close(xs, ref["xs"][1:], rtol=1e-12, atol=1e-15)
