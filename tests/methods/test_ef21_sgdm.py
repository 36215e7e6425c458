"""EF21-SGDM ([FTR23] Alg. 1): the simulator against an independent loop, its reductions, its
theory step, and the multi-process runner."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shrinkgrad.compressors import make_compressor
from shrinkgrad.distributed import spawn
from shrinkgrad.distributed.runner import run_distributed
from shrinkgrad.methods import EF21SGDM, ClientMomentum, make_method
from shrinkgrad.problems import logistic_regression
from shrinkgrad.rng import KeyStream
from shrinkgrad.sim import simulate
from shrinkgrad.theory import L_QM, stepsize_ef21_sgdm

PROBLEM = logistic_regression("a1a", n_clients=5, split="contiguous", lam=0.1)


def _iterates(method: str, compressor: str, gamma: float, rounds: int, seed: int = 0) -> list:
    xs: list[torch.Tensor] = []

    def record(r: int, state: Any) -> None:
        xs.append(state.x.clone())

    simulate(PROBLEM, method, compressor, stepsize=gamma, rounds=rounds, seed=seed, callback=record)
    return xs


def _reference(
    beta: float, compressor: str, gamma: float, rounds: int, b: int | None, seed: int
) -> list[torch.Tensor]:
    """Alg. 1 written out on the n × d arrays: v ← βv + (1−β)∇̂f_i(x); c = C(v − g_i);
    g_i += c; g += mean c; x ← x − γ g. Momentum from v = 0 (v⁰ = (1−β)∇f_i(x⁰), g_i⁰ = v⁰)."""
    p, n = PROBLEM, PROBLEM.n
    C = make_compressor(compressor)
    ids = torch.arange(n)
    x = p.x0()
    v = (1 - beta) * p.client_grads(x)
    G = v.clone()
    g = G.mean(dim=0)
    xs = []
    for r in range(1, rounds + 1):
        x = x - gamma * g
        if b is None:
            grads = p.client_grads(x)
        else:
            keys = KeyStream(seed, ids.numpy(), stream="minibatch").at(r)
            grads = p.client_stoch_grads(x, torch.full((n,), b), keys)
        v = beta * v + (1 - beta) * grads
        keys = None if C.deterministic else KeyStream(seed, ids.numpy(), stream="compressor").at(r)
        c = C(v - G, keys)
        G = G + c
        g = g + c.mean(dim=0)
        xs.append(x.clone())
    return xs


@pytest.mark.parametrize(
    ("spec", "compressor", "b"),
    [
        ("ef21_sgdm[beta=0.7]", "top_k[k=3]", None),
        ("ef21_sgdm[beta=0.9,b=8]", "rand_k_scaled[k=4]", 8),  # keyed minibatches and draws
    ],
)
def test_the_simulator_runs_algorithm_1(spec: str, compressor: str, b: int | None) -> None:
    gamma = 0.5 / PROBLEM.L
    beta = make_method(spec).beta
    got = _iterates(spec, compressor, gamma, 15, seed=3)
    want = _reference(beta, compressor, gamma, 15, b, seed=3)
    for t, (a, w) in enumerate(zip(got, want, strict=True)):
        assert float((a - w).abs().max()) <= 1e-12, f"round {t + 1}"
    assert float((got[-1] - got[0]).norm()) > 1e-4


def test_beta_zero_is_ef21_bit_for_bit() -> None:
    gamma = 0.5 / PROBLEM.L
    a = _iterates("ef21_sgdm[beta=0.0]", "top_k[k=3]", gamma, 10)
    b = _iterates("ef21", "top_k[k=3]", gamma, 10)
    assert all(torch.equal(u, w) for u, w in zip(a, b, strict=True))


def test_minibatches_enter_and_the_exact_oracle_differs() -> None:
    gamma = 0.5 / PROBLEM.L
    exact = _iterates("ef21_sgdm[beta=0.5]", "top_k[k=3]", gamma, 5)
    sgd = _iterates("ef21_sgdm[beta=0.5,b=2]", "top_k[k=3]", gamma, 5)
    assert not torch.equal(exact[-1], sgd[-1])


def test_theory_step_is_the_cited_rule() -> None:
    m = make_method("ef21_sgdm[beta=0.9]")
    bound = m.bind(PROBLEM, "top_k[k=3]", "theory")
    alpha = make_compressor("top_k[k=3]").alpha(PROBLEM.d)
    want = min(alpha / (20 * L_QM(PROBLEM.L_i)), 0.1 / (7 * PROBLEM.L))
    assert bound.cfg.stepsize == pytest.approx(want, rel=1e-12)
    assert bound.cfg.stepsize_rule == "stepsize_ef21_sgdm"
    assert stepsize_ef21_sgdm(2.0, 3.0, 0.5, 1.0) == min(0.5 / 60, 1 / 14)
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="eta"):
            stepsize_ef21_sgdm(1.0, 1.0, 0.5, bad)
    assert "(?)" in m.theory_formula()


def test_names_parameters_and_runtimes() -> None:
    m = make_method("ef21_sgdm[beta=0.5,b=4]")
    assert isinstance(m, EF21SGDM) and m.beta == 0.5 and m.batch == 4
    assert EF21SGDM(beta=0.5, init="zero").name == "ef21_sgdm[beta=0.5,init=zero]"
    assert make_method("ef21_sgdm").unsupported("hook") is None
    assert "minibatches" in (m.unsupported("hook") or "")
    wrapped = ClientMomentum(make_method("ef"), 0.3)
    assert wrapped.name == "ef+momentum[beta=0.3]" and wrapped.unsupported("hook") is None
    assert ClientMomentum(make_method("iag"), 0.3).unsupported("hook") is not None
    with pytest.raises(ValueError, match="needs a contractive compressor"):
        make_method("ef21_sgdm").bind(PROBLEM, "rand_k[k=2]", 0.1)
    for bad in ("ef21_sgdm[beta=1.0]", "ef21_sgdm[beta=-0.1]", "ef21_sgdm[b=0]"):
        with pytest.raises(ValueError):
            make_method(bad)
    with pytest.raises(ValueError, match="no theory step"):
        wrapped.bind(PROBLEM, "top_k[k=3]", "theory")


def _runner(rank: int, world: int, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    xs: list[torch.Tensor] = []
    run_distributed(callback=lambda r, s: xs.append(s.x.clone()), **kwargs)
    return xs


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_runner_follows_the_simulator() -> None:
    kwargs: dict[str, Any] = dict(
        problem=PROBLEM,
        method="ef21_sgdm[beta=0.8,b=8]",
        compressor="rand_k_scaled[k=4]",
        stepsize=0.5 / PROBLEM.L,
        rounds=10,
        seed=4,
    )
    out = spawn(_runner, 3, (kwargs,))
    xs: list[torch.Tensor] = []
    simulate(callback=lambda r, s: xs.append(s.x.clone()), **kwargs)
    assert len(out[0]) == len(xs) == 10
    for t, (a, w) in enumerate(zip(out[0], xs, strict=True)):
        assert torch.equal(a, out[2][t])
        assert float((a - w).abs().max()) <= 1e-10, f"round {t + 1}"
