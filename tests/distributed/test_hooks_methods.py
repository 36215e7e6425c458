"""The hook contract, driven by the method registry: every method that declares it runs in a DDP
hook (``Method.unsupported("hook") is None``) follows the simulator's trajectory there.

A method added later is picked up by :func:`methods_for`, so it is covered without editing this
file; one that declares hook support but does not follow the simulator fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ddp_helpers import ClientLoss
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, spawn
from shrinkgrad.methods import METHODS, ClientMomentum, ProblemOracle, make_method
from shrinkgrad.methods.base import Constants, Method, State, UnknownConstantError, methods_for
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
