"""Client momentum in front of a method (:class:`~shrinkgrad.methods.ClientMomentum`, the suffix
``+momentum``): its names, the methods that draw their own minibatches, and partial
participation.

1. Names: every name a method prints parses back, through the one name parser
   (``make_method``), to an equal method, for every registered method and its example
   configurations, with and without momentum in front (parametrised over the registry: a newly
   registered method is covered automatically).
2. Minibatches: ``ef21_sgd[b=3]+momentum[beta=β]`` averages the inner method's minibatch
   estimators in the momentum: it is EF21-SGDM ([FTR23] Alg. 1) with b = 3, checked against the
   loop of tests/methods/test_momentum_reference.py. Two minibatch sizes (the momentum's and the
   inner method's) are refused when the method is built.
3. Partial participation ([BW] Alg. 4, methods.md §3 "EF21-PP": non-participants compute and
   send nothing): a client that does not take part keeps its momentum v_i, in the simulator and
   in the multi-process runner (the DDP hook refuses partial participation). Checked against a
   loop written from the formulas: client i ∈ S^r (keyed uniform u_i^r < p):
   v_i ← β v_i + (1 − β) ∇̂f_i(x^r); c_i = C(s_i v_i − g_i); g_i ← g_i + c_i; g ← g + w_i c_i.
   The same holds for IAG (one active client per round).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from method_examples import EXAMPLES
from methods_fixtures import LeastSquares
from methods_reference import uniform
from test_momentum_reference import (
    F64,
    Lsq,
    close,
    compressor,
    constants,
    lsq,
    momentum_loop,
    run_sim,
)

from shrinkgrad.distributed import spawn
from shrinkgrad.distributed.runner import run_distributed
from shrinkgrad.methods import EF21SGDM, METHODS, ClientMomentum, ProblemOracle, make_method
from shrinkgrad.methods.base import Method, weighted_sum
from shrinkgrad.methods.ef21 import EF21
from shrinkgrad.methods.ef21_sgdm import _Given
from shrinkgrad.registry import SpecError, parse_spec
from shrinkgrad.sim import simulate


# --------------------------------------------------------------------------------------------
# 1. names round-trip
# --------------------------------------------------------------------------------------------
def configurations() -> list[str]:
    """Every registered method by its name alone, and its example configurations."""
    out: list[str] = []
    for name in METHODS.names():
        out += [s for s in [name, *EXAMPLES.get(name, [])] if s not in out]
    return out


CONFIGS = configurations()


def same(a: Any, b: Any) -> bool:
    """Equal methods: the same class, name and public parameters (recursively; private
    attributes are bind-time caches)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Method):
        va = {k: v for k, v in vars(a).items() if k != "spec" and not k.startswith("_")}
        vb = {k: v for k, v in vars(b).items() if k != "spec" and not k.startswith("_")}
        return a.name == b.name and va.keys() == vb.keys() and all(same(va[k], vb[k]) for k in va)
    return bool(a == b)


def assert_round_trips(method: Method[Any, Any]) -> None:
    name = method.name
    assert str(parse_spec(name)) == name
    again = make_method(name)
    assert same(again, method), f"{name!r} builds {again.name!r}: {vars(again)} != {vars(method)}"
    assert make_method(again.name).name == again.name


@pytest.mark.parametrize("spec", CONFIGS)
def test_every_printed_name_parses_back(spec: str) -> None:
    """make_method(m.name) builds a method equal to m: plain, with momentum (also with the
    momentum's own minibatch and a β that needs all 17 digits), and the momentum by name."""
    method = make_method(spec)
    assert_round_trips(method)
    if isinstance(method, ClientMomentum):  # ef21_sgdm: the momentum is in it already
        for build in (
            lambda: ClientMomentum(method, 0.5),
            lambda: make_method(f"{spec}+momentum[beta=0.5]"),
        ):
            with pytest.raises(ValueError, match="has client momentum already") as e:
                build()
            assert "\n" not in str(e.value)
        return
    wrapped = [ClientMomentum(method, 0.9), ClientMomentum(method, 0.1 + 0.2)]
    if not method.samples_minibatches:
        wrapped.append(ClientMomentum(method, 0.25, batch=3))
    for w in wrapped:
        assert w.name.startswith(f"{method.name}+momentum[beta=")
        assert_round_trips(w)
    by_name = make_method(f"{spec}+momentum[beta=0.5]")
    assert isinstance(by_name, ClientMomentum) and by_name.beta == 0.5 and by_name.batch is None
    assert same(by_name.inner, method)
    assert_round_trips(by_name)


def test_names_of_methods_built_directly_parse_back() -> None:
    for method in [
        EF21SGDM(beta=0.5, batch=4, init="zero"),
        ClientMomentum(EF21(batch=2, init="compressed"), 0.75),
        ClientMomentum(EF21(weighted=True, p=0.3), 0.5, batch=2),
        ClientMomentum(make_method("dcgd[biased=true]"), 0.5),  # the DDP hook's momentum=
    ]:
        assert_round_trips(method)


def test_momentum_names_that_are_wrong_say_why() -> None:
    with pytest.raises(SpecError, match=r"unknown method suffix '\+momentm'.*'\+momentum'"):
        make_method("ef+momentm[beta=0.5]")
    with pytest.raises(SpecError, match=r"'\+momentum' has no parameter 'bta'"):
        make_method("ef+momentum[bta=0.5]")
    with pytest.raises(SpecError, match="takes no component in parentheses"):
        make_method("ef+momentum[beta=0.5](dcgd)")
    with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\)"):
        make_method("ef+momentum[beta=1.0]")
    # keywords are the suffix's parameters, as for any name
    assert make_method("ef+momentum", beta=0.5).name == "ef+momentum[beta=0.5]"


# --------------------------------------------------------------------------------------------
# 2. momentum in front of a method that draws minibatches
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weighted", [False, True])
def test_momentum_averages_the_inner_methods_minibatches(weighted: bool) -> None:
    """``ef21(_w)_sgd[b=3]+momentum[beta=0.7]`` is Alg. 1 of [FTR23] with b = 3 (it failed in
    its first round: the momentum's oracle refused the inner method's minibatch request)."""
    P, data, gamma = lsq()
    inner = "ef21_w_sgd[b=3]" if weighted else "ef21_sgd[b=3]"
    spec = "scaled(rand_k[k=2])"
    res, traj = run_sim(P, ClientMomentum(make_method(inner), 0.7), spec, gamma, 20, 7)
    L_i = constants(P)[1] if weighted else None
    ref = momentum_loop(data, "ef21", 0.7, gamma, 20, 7, spec, b=3, L_i=L_i)
    close(traj, ref["xs"])
    close(res.state.clients.v, ref["v"])
    close(res.state.clients.inner.g, ref["g_i"])
    torch.testing.assert_close(res.bits_up, ref["up"], rtol=0, atol=0)
    # the same keys as the momentum's own minibatch: ef21_sgdm[b=3] (ef21_w+momentum[b=3])
    own = ClientMomentum(make_method("ef21_w"), 0.7, 3) if weighted else EF21SGDM(0.7, 3)
    assert torch.equal(simulate(P, own, spec, gamma, rounds=20, seed=7).x, res.x)
    assert ClientMomentum(make_method(inner), 0.7).samples_minibatches


def test_two_minibatch_sizes_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match="give the minibatch size once") as e:
        ClientMomentum(make_method("ef21_sgd[b=2]"), 0.9, batch=3)
    assert "\n" not in str(e.value)


def test_the_inner_methods_minibatch_is_checked_at_bind() -> None:
    """b larger than a client's m_i is refused at bind, naming the method (it got through bind
    and failed at the first round)."""
    P = LeastSquares(n=3, d=4, m=5, seed=1)
    P.client_sizes = torch.full((3,), 5)
    with pytest.raises(ValueError, match=r"ef21_sgd\[b=6\]: minibatch size b = 6 is larger"):
        ClientMomentum(make_method("ef21_sgd[b=6]"), 0.5).bind(P, "top_k[k=2]", 0.1)


# --------------------------------------------------------------------------------------------
# 3. partial participation: a client that does not take part keeps v_i
# --------------------------------------------------------------------------------------------
def pp_momentum_loop(
    data: Lsq,
    beta: float,
    gamma: float,
    rounds: int,
    seed: int,
    spec: str,
    p: float,
    *,
    b: int | None = None,
    L_i: torch.Tensor | None = None,
) -> dict[str, Any]:
    """EF21(-W)-PP with client momentum, from the formulas (module docstring); init: every
    client takes part, v_i⁰ = (1 − β)∇f_i(x⁰), g_i⁰ = s_i v_i⁰. Returns the iterates, the
    momenta and the estimators, and how many clients took part in each round."""
    n, d = data.n, data.d
    C = compressor(spec, seed)
    w = [1.0 / n] * n if L_i is None else [float(L_i[i] / L_i.sum()) for i in range(n)]
    s = [1.0 / (n * w[i]) for i in range(n)]
    x = torch.zeros(d, dtype=F64)
    v = [(1.0 - beta) * data.grad(i, x) for i in range(n)]
    g_i = [s[i] * v[i] for i in range(n)]
    g = sum(w[i] * g_i[i] for i in range(n))
    xs, counts = [x], []
    for r in range(1, rounds + 1):
        x = x - gamma * g
        taking_part = [i for i in range(n) if float(uniform(seed, r, i, "participation")[0]) < p]
        for i in taking_part:
            grad = data.grad(i, x) if b is None else data.minibatch(i, x, r, b, seed)
            v[i] = beta * v[i] + (1.0 - beta) * grad
            c = C(s[i] * v[i] - g_i[i], r, i)
            g_i[i] = g_i[i] + c
            g = g + w[i] * c
        xs.append(x)
        counts.append(len(taking_part))
    return {"xs": torch.stack(xs), "v": torch.stack(v), "g_i": torch.stack(g_i), "counts": counts}


PP_CASES = [("ef21_pp[p=0.5]", None), ("ef21_pp[p=0.5]", 3), ("ef21_w_pp[p=0.5]", None)]


@pytest.mark.parametrize(("inner", "b"), PP_CASES, ids=["ef21_pp", "ef21_pp-b3", "ef21_w_pp"])
def test_non_participants_keep_their_momentum(inner: str, b: int | None) -> None:
    """``ef21(_w)_pp[p=0.5]+momentum[beta=0.7]`` (and the momentum's own minibatch b = 3): in
    the old code every client's v_i moved every round (each computed a gradient), so a client
    back after missing rounds compressed a momentum made of gradients it never computed."""
    P, data, gamma = lsq()
    spec = "scaled(rand_k[k=2])"
    L_i = constants(P)[1] if inner.startswith("ef21_w") else None
    ref = pp_momentum_loop(data, 0.7, gamma, 20, 5, spec, 0.5, b=b, L_i=L_i)
    assert any(0 < c < P.n for c in ref["counts"])  # some rounds are partial
    method = ClientMomentum(make_method(inner), 0.7, b)
    res, traj = run_sim(P, method, spec, gamma, 20, 5)
    close(traj, ref["xs"])
    close(res.state.clients.v, ref["v"])
    close(res.state.clients.inner.g, ref["g_i"])


def test_a_client_that_does_not_take_part_computes_nothing() -> None:
    """Exact counts: in each round the momenta that change are those of the participants, and
    the oracle is asked for exactly those clients' gradients."""
    P, _, gamma = lsq()
    bound = ClientMomentum(make_method("ef21_pp[p=0.5]"), 0.6).bind(P, "top_k[k=2]", gamma, 3)
    inner = bound.method.inner
    assert isinstance(inner, EF21)

    class Counting(ProblemOracle):
        asked = 0

        def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            Counting.asked += ids.numel()
            return super().grads(x, ids)

    oracle = Counting(P)
    state, _ = bound.init(torch.zeros(P.d, dtype=F64), oracle)
    ids = torch.arange(P.n)
    for r in range(1, 16):
        before, Counting.asked = state.clients.v.clone(), 0
        state, _ = bound.step(state, oracle)
        part = inner.participants(bound.cfg, ids, r)
        assert part is not None
        moved = (state.clients.v != before).any(dim=1)
        assert torch.equal(moved, part), r
        assert Counting.asked == int(part.sum())


def test_iag_clients_that_are_not_active_keep_their_momentum() -> None:
    """IAG (cyclic, identity): one active client per round computes ∇f_i and sends its table
    entry; with momentum in front only its v_i moves: v_i ← βv_i + (1 − β)∇f_i(x^t), table_i =
    v_i, x ← x − γ mean(table)."""
    P, data, gamma = lsq()
    beta, rounds = 0.6, 12
    res, traj = run_sim(P, ClientMomentum(make_method("iag"), beta), "identity", gamma, rounds, 1)
    x = torch.zeros(P.d, dtype=F64)
    v = [(1.0 - beta) * data.grad(i, x) for i in range(P.n)]
    xs = [x]
    for r in range(1, rounds + 1):
        i = (r - 1) % P.n
        v[i] = beta * v[i] + (1.0 - beta) * data.grad(i, x)
        x = x - gamma * torch.stack(v).mean(0)
        xs.append(x)
    close(traj, torch.stack(xs))
    close(res.state.clients.v, torch.stack(v))


def test_a_client_asked_twice_in_a_round_updates_once() -> None:
    P, _, gamma = lsq()
    bound = ClientMomentum(make_method("dcgd"), 0.5).bind(P, "rand_k[k=2]", gamma)
    oracle, ids = ProblemOracle(P), torch.arange(P.n)
    x = torch.full((P.d,), 0.1, dtype=F64)
    v0 = torch.ones(P.n, P.d, dtype=F64)
    method = bound.method
    assert isinstance(method, ClientMomentum)
    given = _Given(method, bound.cfg, oracle, v0, ids, x, 1)
    given.grads(x, ids[:2])
    given.grads(x, ids[1:3])
    want = 0.5 * v0 + 0.5 * P.client_grads(x)
    close(given.v[:3], want[:3])
    assert torch.equal(given.v[3], v0[3])  # never asked: unchanged
    assert torch.equal(v0, torch.ones_like(v0))  # the state handed in is not written (pure)


def test_groups_of_clients_give_the_full_partial_run() -> None:
    """The runner's ranks: each group of clients stepped on its own gives the simulator's run."""
    P, _, gamma = lsq()
    method, spec = ClientMomentum(make_method("ef21_pp[p=0.5]"), 0.7, 3), "scaled(rand_k[k=2])"
    full, traj = run_sim(P, method, spec, gamma, 12, 3)
    bound = method.bind(P, spec, gamma, 3)
    m, cfg, oracle = bound.method, bound.cfg, ProblemOracle(P)
    groups = [torch.tensor([2, 0]), torch.tensor([3, 1])]
    x0 = torch.zeros(P.d, dtype=F64)

    def reduce(msgs: list[Any]) -> torch.Tensor:
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


def _runner(rank: int, world: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    xs: list[torch.Tensor] = []
    res = run_distributed(callback=lambda r, s: xs.append(s.x.clone()), **kwargs)
    return torch.stack(xs), res.state.clients.ids, res.state.clients.v


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_runner_keeps_non_participants_momenta() -> None:
    """Two gloo ranks (clients [0, 1] and [2, 3]) follow the partial-participation loop; the
    DDP hook refuses partial participation (every rank takes part in every collective)."""
    P, data, gamma = lsq()
    spec = "scaled(rand_k[k=2])"
    method = ClientMomentum(make_method("ef21_pp[p=0.5]"), 0.7)
    kwargs = dict(problem=P, method=method, compressor=spec, stepsize=gamma, rounds=12, seed=6)
    out = spawn(_runner, 2, (kwargs,))
    ref = pp_momentum_loop(data, 0.7, gamma, 12, 6, spec, 0.5)
    v = torch.empty_like(ref["v"])
    for xs, ids, v_rank in out:
        close(xs, ref["xs"][1:])
        v[ids] = v_rank
    close(v, ref["v"])
    assert "partial participation" in (method.unsupported("hook") or "")
