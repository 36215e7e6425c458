"""The hook contract, driven by the method registry: every method that declares it runs in a DDP
hook (``Method.unsupported("hook") is None``) follows the simulator's trajectory there.

A method added later is picked up by :func:`methods_for`, so it is covered without editing this
file; one that declares hook support but does not follow the simulator fails here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from ddp_helpers import ClientLoss
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, spawn
from shrinkgrad.methods import METHODS, ClientMomentum, ProblemOracle, make_method
from shrinkgrad.methods.base import (
    Config,
    Constants,
    Method,
    NonFiniteError,
    State,
    UnknownConstantError,
    methods_for,
)
from shrinkgrad.methods.rules import SparseMessage
from shrinkgrad.problems import load, logistic_regression, resolve_split
from shrinkgrad.sim import simulate

WORLD, STEPS, LAM = 2, 12, 0.1


def _compressor(method: Method[Any, Any]) -> str:
    """A deterministic compressor the method accepts (random ones draw other keys in the hook:
    its stream is keyed by tensor, the simulator's by client)."""
    return "top_k[k=5]" if method.requires == "contractive" else "identity"


def _cases() -> list[tuple[str, Method[Any, Any], str]]:
    """(label, method, compressor): every hook method of the registry with its defaults, plus
    the combinations the hook builds itself (biased DCGD, client momentum in front of others)."""
    cases = []
    for name in methods_for("hook"):
        m = make_method(name)
        cases.append((name, m, _compressor(m)))
    for m in (
        make_method("dcgd[biased=true]"),
        ClientMomentum(make_method("dcgd[biased=true]"), 0.5),
        ClientMomentum(make_method("ef"), 0.5),
        ClientMomentum(make_method("ef21_w"), 0.5),
    ):
        cases.append((m.name, m, "top_k[k=5]"))
    return cases


def _needs_weights(method: Method[Any, Any]) -> bool:
    try:
        method.client_weights(Constants(WORLD, 1))
    except UnknownConstantError:
        return True
    return False


def _problem() -> Any:
    return logistic_regression("a1a", n_clients=WORLD, split="contiguous", lam=LAM)


def _on_ranks(
    rank: int, world: int, cases: list[tuple[str, Method[Any, Any], str]], gamma: float
) -> dict[str, tuple[list[torch.Tensor], list[int]]]:
    """Every case on this rank: DDP on one client's f_i (one tensor, full gradients, float64)."""
    data = load("a1a")
    parts, _ = resolve_split("contiguous", data, world)
    A = torch.from_numpy(data.X[parts[rank]].toarray())
    y = torch.from_numpy(data.y[parts[rank]])
    L_i = _problem().L_i.tolist()
    out = {}
    for label, method, compressor in cases:
        model = DDP(ClientLoss(A.shape[1], LAM))
        state = CompressionState(
            compressor,
            method=method,
            weights=L_i if _needs_weights(method) else None,
            min_numel=0,
            warmup_steps=0,  # every round compressed, as in the simulator
        )
        model.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=gamma)  # the method's γ: x ← x − γ·D
        xs, rounds = [], []
        for _ in range(STEPS):
            opt.zero_grad()
            model(A, y).backward()
            opt.step()
            xs.append(model.module.x.detach().clone())
            rounds.append(state.memory.states[0].round)  # rounds of the method so far
        out[label] = (xs, rounds)
    return out


def _simulated(method: Method[Any, Any], compressor: str, gamma: float) -> dict[int, torch.Tensor]:
    """x at which the clients of round R + 1 compute, for R = 0 … STEPS: server_pre applied to
    the simulator's state after round R (the hook's parameters after R rounds)."""
    problem = _problem()
    states: dict[int, State[Any, Any]] = {}

    def record(r: int, state: State[Any, Any]) -> None:
        states[r] = state

    simulate(problem, method, compressor, stepsize=gamma, rounds=STEPS + 1, callback=record)
    bound = method.bind(problem, compressor, gamma)
    states[0] = bound.init(problem.x0(), ProblemOracle(problem))[0]  # the engine's round 0
    return {r: method.server_pre(bound.cfg, st.server, r + 1).x.clone() for r, st in states.items()}


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_every_hook_method_follows_the_simulator() -> None:
    cases = _cases()
    problem = _problem()
    gamma = 0.5 / problem.L
    got = spawn(_on_ranks, WORLD, (cases, gamma), timeout=220.0)
    checked = set()
    for label, method, compressor in cases:
        want = _simulated(method, compressor, gamma)
        xs, rounds = got[0][label]
        assert got[1][label][1] == rounds
        assert rounds == sorted(rounds) and rounds[-1] >= STEPS - 1, (label, rounds)
        for t in range(STEPS):
            assert torch.equal(xs[t], got[1][label][0][t]), f"{label}: ranks differ at step {t}"
            err = float((xs[t] - want[rounds[t]]).abs().max())
            assert err <= 1e-10, f"{label}: iteration {t} (round {rounds[t]}) is off by {err:.3g}"
        assert float((xs[-1] - problem.x0()).norm()) > 1e-6, f"{label}: the trajectory is still"
        checked.add(label)
    # completeness: every method that declares hook support was run and checked
    assert set(methods_for("hook")) <= checked


def test_every_registered_method_builds_from_its_name() -> None:
    """methods_for (and so the contract above) sees a method only if its name alone builds it:
    a method that needs parameters would silently escape the hook contract."""
    for name in METHODS.names():
        make_method(name)


# --------------------------------------------------------------------------------------------
# the moving frame: a method's fast server_direction equals the generic one
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", [c[0] for c in _cases()])
def test_server_direction_equals_post_then_pre(label: str) -> None:
    """``server_direction`` (overridden for speed) = ``server_post`` then ``server_pre`` with x
    re-centred (:meth:`Method.server_direction` of the base class), on a state after 3 rounds."""
    method, compressor = next((m, c) for lab, m, c in _cases() if lab == label)
    problem = logistic_regression("a1a", n_clients=3, lam=LAM)
    bound = method.bind(problem, compressor, 0.3 / problem.L)
    oracle = ProblemOracle(problem)
    state, _ = bound.init(problem.x0(), oracle)
    for _ in range(3):
        state, _ = bound.step(state, oracle)
    cfg, r = bound.cfg, state.round
    x = torch.zeros(problem.d, dtype=torch.float64)
    server = method.server_pre(cfg, state.server, r + 1)._replace(x=x)
    _, msg = method.client_step(cfg, server, state.clients, oracle, r + 1)
    assert msg.values is not None and msg.weights is not None
    agg = msg.weights @ msg.values
    fast_server, fast = method.server_direction(cfg, server, agg, r + 1)
    slow_server, slow = Method.server_direction(method, cfg, server, agg, r + 1)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-14)
    for a, b in zip(fast_server, slow_server, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert fast_server.x is x  # x stays the zero displacement
    assert float(fast.norm()) > 0


# --------------------------------------------------------------------------------------------
# accumulates_aggregates: the direction depends on earlier aggregates exactly when declared
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", [c[0] for c in _cases()])
def test_accumulates_aggregates_is_declared_exactly(label: str) -> None:
    """The hook sums a 16-bit model's messages in float32 for the methods that declare
    ``accumulates_aggregates`` (a rounded sum would drift their server state away from the
    clients'). The declaration must be exact: from the server states after 2 and after 3 rounds
    (different histories), one and the same aggregate gives different directions if and only
    if the method declares it."""
    method, compressor = next((m, c) for lab, m, c in _cases() if lab == label)
    problem = logistic_regression("a1a", n_clients=3, lam=LAM)
    bound = method.bind(problem, compressor, 0.3 / problem.L)
    oracle = ProblemOracle(problem)
    state, _ = bound.init(problem.x0(), oracle)
    servers = []
    for t in range(3):
        state, _ = bound.step(state, oracle)
        if t >= 1:
            servers.append(state.server)
    cfg, r = bound.cfg, state.round + 1
    agg = torch.randn(problem.d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = torch.zeros(problem.d, dtype=torch.float64)
    directions = []
    for server in servers:
        pre = method.server_pre(cfg, _copy(server), r)._replace(x=x)
        directions.append(method.server_direction(cfg, pre, agg.clone(), r)[1].reshape(-1))
    differ = not torch.equal(directions[0], directions[1])
    assert differ == method.accumulates_aggregates, (label, differ)


# --------------------------------------------------------------------------------------------
# the sparse path: a method that declares sparse_messages takes SparseMessages
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class _SparseConfig(Config):
    """The hook's sparse path in miniature: ``compress`` hands back C(x) as a SparseMessage."""

    def compress(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, *, sent_only: bool = False
    ) -> torch.Tensor:
        c = super().compress(x, ids, round, sent_only=sent_only)
        kept = c.reshape(-1).nonzero().reshape(-1)
        return SparseMessage(kept, c.reshape(-1)[kept], tuple(c.shape))  # type: ignore[return-value]


def _copy(value: Any) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return value._replace(**{k: _copy(getattr(value, k)) for k in value._fields})
    return value.clone() if isinstance(value, torch.Tensor) else value


def _dense(value: Any) -> Any:
    return value.dense() if isinstance(value, SparseMessage) else value


def _rows(value: Any, ids: torch.Tensor) -> Any:
    """A client state restricted to the clients at positions ``ids`` (every tensor field)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return value._replace(**{k: _rows(getattr(value, k), ids) for k in value._fields})
    if isinstance(value, torch.Tensor) and value.ndim:
        return value[ids].clone()
    return value


def _after_rounds(
    method: Method[Any, Any], compressor: str, rounds: int
) -> tuple[Any, ProblemOracle, State[Any, Any], dict[str, Any]]:
    """(problem, oracle, the simulator's state after ``rounds`` rounds, the fields of its
    bound Config) for one-round checks of a method's parts (3 clients of a1a, γ = 1)."""
    problem = logistic_regression("a1a", n_clients=3, lam=LAM)
    bound = method.bind(problem, compressor, 1.0)
    oracle = ProblemOracle(problem)
    state, _ = bound.init(problem.x0(), oracle)
    for _ in range(rounds):
        state, _ = bound.step(state, oracle)
    base = {
        f.name: getattr(bound.cfg, f.name)
        for f in dataclasses.fields(Config)
        if not f.name.startswith("_")
    }
    return problem, oracle, state, base


@pytest.mark.parametrize("label", [c[0] for c in _cases() if c[1].sparse_messages])
def test_sparse_messages_give_the_dense_results(label: str) -> None:
    """``sparse_messages`` promises that C(p) only reaches the rules of methods.rules, the
    Message and the server's additions: one client's round (in place, as in the hook) and the
    server's direction with SparseMessages equal the dense ones (a kept coordinate x_j ± c_j,
    the others x_j)."""
    method, compressor = next((m, c) for lab, m, c in _cases() if lab == label)
    problem, oracle, state, base = _after_rounds(method, compressor, 3)
    r, ids = state.round + 1, torch.tensor([1])
    x = torch.zeros(problem.d, dtype=torch.float64)
    results = []
    for cfg in (Config(**{**base, "inplace": True}), _SparseConfig(**{**base, "inplace": True})):
        server = method.server_pre(cfg, _copy(state.server), r)._replace(x=x)
        clients, msg = method.client_step(cfg, server, _rows(state.clients, ids), oracle, r)
        assert msg.values is not None and msg.weights is not None
        values, w = msg.values, float(msg.weights[0])
        assert isinstance(values, SparseMessage) == isinstance(cfg, _SparseConfig)
        if isinstance(values, SparseMessage):
            agg: Any = SparseMessage(values.indices, values.values * w, values.shape)
        else:
            agg = (w * values).reshape(-1)
        new_server, direction = method.server_direction(cfg, server, agg, r)
        results.append((clients, _dense(values), new_server, _dense(direction)))
    (c1, m1, s1, d1), (c2, m2, s2, d2) = results
    assert torch.equal(m1.reshape(-1), m2.reshape(-1))
    torch.testing.assert_close(d1.reshape(-1), d2.reshape(-1), rtol=0, atol=1e-15)
    for a, b in zip(_leaves_of(c1) + _leaves_of(s1), _leaves_of(c2) + _leaves_of(s2), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    assert float(d1.norm()) > 0


def _leaves_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return [t for k in value._fields for t in _leaves_of(getattr(value, k))]
    return [value] if isinstance(value, torch.Tensor) else []


# --------------------------------------------------------------------------------------------
# compresses_gradient_first: the gradient is read first by the compressor call
# --------------------------------------------------------------------------------------------
class _LazyOracle:
    """Hands out the gradient as a NaN tensor; :class:`_LazyConfig` fills it at the compressor
    call (as the hook's port does): a method that reads it before that call sees NaN."""

    fresh = True

    def __init__(self, oracle: ProblemOracle) -> None:
        self.oracle = oracle
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        g = self.oracle.grads(x, ids)
        p = torch.full_like(g, float("nan"))
        self.pending = (p, g)
        return p

    def fill(self, t: torch.Tensor) -> None:
        if self.pending is not None and t.data_ptr() == self.pending[0].data_ptr():
            self.pending[0].copy_(self.pending[1])
        self.pending = None


@dataclasses.dataclass(frozen=True, eq=False)
class _LazyConfig(Config):
    lazy: Any = None

    def compress(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, *, sent_only: bool = False
    ) -> torch.Tensor:
        self.lazy.fill(x)
        return super().compress(x, ids, round, sent_only=sent_only)

    def compress_difference(
        self, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, round: int
    ) -> torch.Tensor | None:
        self.lazy.fill(a)
        return super().compress_difference(a, b, ids, round)


def _lazy_round(method: Method[Any, Any], compressor: str) -> tuple[bool, bool]:
    """One client round with the NaN-until-compressed gradient against the plain one: (the
    results are equal bit for bit, they are finite)."""
    problem, oracle, state, base = _after_rounds(method, compressor, 2)
    r = state.round + 1
    x = torch.zeros(problem.d, dtype=torch.float64)
    lazy = _LazyOracle(oracle)
    results = []
    for cfg, orc in (
        (Config(**{**base, "inplace": True}), oracle),
        (_LazyConfig(**{**base, "inplace": True}, lazy=lazy), lazy),
    ):
        server = method.server_pre(cfg, _copy(state.server), r)._replace(x=x)
        try:
            clients, msg = method.client_step(cfg, server, _copy(state.clients), orc, r)
        except NonFiniteError:  # the NaN gradient reached the compressor: read too early
            return False, False
        assert msg.values is not None
        results.append([*_leaves_of(clients), _dense(msg.values)])
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    return same, all(bool(torch.isfinite(t).all()) for t in results[1])


@pytest.mark.parametrize("label", [c[0] for c in _cases() if c[1].compresses_gradient_first])
def test_compresses_gradient_first_holds(label: str) -> None:
    """A method declaring ``compresses_gradient_first`` reads the oracle's gradient first
    through the compressor call: with a gradient that is NaN until that call, its client round
    is bit for bit the plain one (the DDP hook leaves a bfloat16 gradient's float32 copy
    unfilled on that promise)."""
    method, compressor = next((m, c) for lab, m, c in _cases() if lab == label)
    same, finite = _lazy_round(method, compressor)
    assert same and finite, f"{label} reads its gradient before compressing it"


def test_the_lazy_gradient_check_catches_an_early_read() -> None:
    """The check above fails for methods that read the gradient first (client momentum, EF21+
    and EF21-W do), so a wrong declaration cannot pass it."""
    for method in (ClientMomentum(make_method("ef21"), 0.5), make_method("ef21_plus")):
        assert not method.compresses_gradient_first
        same, finite = _lazy_round(method, "top_k[k=5]")
        assert not (same and finite), method.name
    assert make_method("ef21").compresses_gradient_first
    assert not make_method("ef21_w").compresses_gradient_first


# --------------------------------------------------------------------------------------------
# direction_changes: the direction changes only at the reported entries
# --------------------------------------------------------------------------------------------
def _sparse_aggregate(values: torch.Tensor) -> SparseMessage:
    flat = values.reshape(-1)
    kept = flat.nonzero().reshape(-1)
    return SparseMessage(kept, flat[kept], (flat.numel(),))


@pytest.mark.parametrize("label", [c[0] for c in _cases() if c[1].sparse_messages])
def test_direction_changes_name_every_changed_entry(label: str) -> None:
    """Where ``direction_changes`` answers, two consecutive server steps' directions (the hook's
    in-place state, sparse aggregates) differ only at the reported entries, and do differ
    there somewhere; a method that answers None is converted densely (nothing to check)."""
    method, compressor = next((m, c) for lab, m, c in _cases() if lab == label)
    _, oracle, state, base = _after_rounds(method, compressor, 2)
    cfg = Config(**{**base, "inplace": True})
    r0 = state.round
    server = method.server_pre(cfg, _copy(state.server), r0 + 1)  # away from x⁰: ∇f_i ≠ g_i
    clients = _copy(state.clients)
    directions, changes = [], []
    for r in (r0 + 1, r0 + 2):
        clients, msg = method.client_step(cfg, server, clients, oracle, r)
        assert msg.values is not None and msg.weights is not None
        agg = _sparse_aggregate(msg.weights @ _dense(msg.values))
        server, direction = method.server_direction(cfg, server, agg, r)
        directions.append(_dense(direction).reshape(-1).clone())
        changes.append(method.direction_changes(cfg, agg))
    if changes[1] is None:
        pytest.skip(f"{label} does not report its changes (dense conversion)")
    differ = (directions[1] != directions[0]).nonzero().reshape(-1)
    assert differ.numel() > 0
    assert set(differ.tolist()) <= set(changes[1].tolist()), label
