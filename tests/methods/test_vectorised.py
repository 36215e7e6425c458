"""The vectorised steps equal per-client loops, and EF21's in-place path changes nothing.

That the client step runs on any group of clients (the distributed runtime's contract) is part
of the method contract suite, test_method_contract.py, for every registered method.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from methods_fixtures import LeastSquares, rand_k, run, trajectory
from methods_reference import dcgd_loop, ef21_loop, ef_loop

from shrinkgrad.methods import ProblemOracle, make_method

ROUNDS = 25


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.fixture
def p5() -> LeastSquares:
    return LeastSquares(n=5, d=9, m=7, seed=3, spread=6.0)


@pytest.mark.parametrize(
    ("spec", "comp", "kwargs"),
    [
        ("ef21", "top_k[k=2]", {}),
        ("ef21", "scaled_rand_k", {}),
        ("ef21_w", "top_k[k=2]", {"weighted": True}),
        ("ef21_w", "scaled_rand_k", {"weighted": True}),
        ("ef21_pp[p=0.5]", "scaled_rand_k", {"p": 0.5}),
        ("ef21_w_pp[p=0.6]", "top_k[k=1]", {"weighted": True, "p": 0.6}),
        ("ef21_sgd[b=3]", "top_k[k=2]", {"batch": 3}),
        ("ef21_w_sgd[b=2]", "scaled_rand_k", {"weighted": True, "batch": 2}),
    ],
)
def test_ef21_family_equals_per_client_loop(
    p5: LeastSquares, spec: str, comp: str, kwargs: dict[str, Any]
) -> None:
    C = rand_k(3, scaled=True) if comp == "scaled_rand_k" else comp
    bound, states = run(spec, p5, C, 0.01, ROUNDS, seed=7)
    xs, gs = ef21_loop(p5, bound.cfg.compressor, 0.01, 7, ROUNDS, p5.x0(), **kwargs)  # type: ignore[attr-defined]
    close(trajectory(states), torch.stack(xs))
    for s, g in zip(states, gs, strict=True):
        close(s.clients.g, torch.stack(g))  # type: ignore[attr-defined]


def test_dcgd_equals_per_client_loop(p5: LeastSquares) -> None:
    C = rand_k(2)
    _, states = run("dcgd", p5, C, 0.01, ROUNDS, seed=3)
    close(trajectory(states), torch.stack(dcgd_loop(p5, C, 0.01, 3, ROUNDS, p5.x0())))


def test_ef_equals_per_client_loop(p5: LeastSquares) -> None:
    bound, states = run("ef", p5, "top_k[k=2]", 0.02, ROUNDS)
    ref = ef_loop(p5, bound.cfg.compressor, 0.02, 0, ROUNDS, p5.x0())  # type: ignore[attr-defined]
    close(trajectory(states), torch.stack(ref))


# --------------------------------------------------------------------------------------------
# the in-place path of EF21 on oracles that promise fresh gradients
# --------------------------------------------------------------------------------------------
def test_builtin_problem_gradients_are_fresh_tensors() -> None:
    """``fresh_grads`` is a promise the simulator acts on (it overwrites the result): every
    oracle of the built-in problem must return a new tensor, unchanged by scribbling on the
    previous one."""
    from shrinkgrad.problems import logistic_regression
    from shrinkgrad.rng import Keys

    p = logistic_regression("a1a", n_clients=6, lam=0.1)
    assert p.fresh_grads
    x = torch.linspace(-1, 1, p.d, dtype=torch.float64)
    X = x.expand(p.n, -1).clone()
    keys = Keys.derive(1, client=torch.arange(p.n))
    for call in (
        lambda: p.client_grads(x),
        lambda: p.client_grads_at(X),
        lambda: p.client_stoch_grads(x, 3, keys),
    ):
        first = call()
        want = first.clone()
        first.fill_(float("nan"))
        again = call()
        assert again.data_ptr() != first.data_ptr()
        assert torch.equal(again, want)


@pytest.mark.parametrize("spec", ["ef21", "ef21_w"])
def test_ef21_in_place_difference_changes_nothing(spec: str) -> None:
    """The same iterates, bit for bit, whether the oracle's result may be overwritten or not;
    and the caller's old state is left untouched (the step stays functional)."""
    from shrinkgrad.problems import logistic_regression

    p = logistic_regression("a1a", n_clients=6, lam=0.1, split="heterogeneous_smoothness")
    bound = make_method(spec).bind(p, "top_k[k=3]", "theory")
    fresh, shared = ProblemOracle(p), ProblemOracle(p)
    shared.fresh = False
    assert fresh.fresh
    x0 = torch.zeros(p.d, dtype=torch.float64)
    a, _ = bound.init(x0, fresh)
    b, _ = bound.init(x0, shared)
    for _ in range(8):
        before = a.clients.g.clone()
        old = a
        a, _ = bound.step(a, fresh)
        b, _ = bound.step(b, shared)
        assert torch.equal(old.clients.g, before)
        assert torch.equal(a.server.x, b.server.x) and torch.equal(a.clients.g, b.clients.g)
