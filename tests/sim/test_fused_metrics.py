"""Metrics from the round's own gradient pass (issue 17): the logged ‖∇f‖² and f equal the
separate evaluation ``problem.grad(x)``, ``problem.loss(x)`` bit for bit, for every method and
problem; caching changes no iterate; a logged round makes one pass over the data, not three."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from methods_fixtures import LeastSquares

from shrinkgrad.methods import METHODS, ProblemOracle, make_method
from shrinkgrad.problems import (
    LinearModelProblem,
    Problem,
    least_squares,
    logistic_regression,
    synthetic_least_squares,
)
from shrinkgrad.sim import simulate


def _torch_backend() -> LinearModelProblem:
    p = logistic_regression("a1a", n_clients=5)
    p.backend = "torch"  # the index_add path of non-CPU devices, here on the CPU
    return p


PROBLEMS: dict[str, Any] = {
    "logreg_sparse": lambda: logistic_regression("a1a", n_clients=7),
    "logreg_sparse_2_threads": lambda: logistic_regression("a1a", n_clients=7, threads=2),
    "logreg_float32": lambda: logistic_regression("a1a", n_clients=7, dtype="float32"),
    "logreg_l2_dense": lambda: logistic_regression("australian_scale", n_clients=4, reg="l2"),
    "logreg_dense_2_threads": lambda: logistic_regression(
        "australian_scale", n_clients=4, threads=2
    ),
    "least_squares": lambda: least_squares("australian_scale", n_clients=6),
    "synthetic": lambda: synthetic_least_squares(n_clients=6, d=5, m=4, lam=0.1, L_var=10.0),
    "torch_backend": _torch_backend,
    "fixture_no_fused_pass": lambda: LeastSquares(n=5, d=8, m=6, seed=3),
}


@functools.cache
def _problem(name: str) -> Any:
    return PROBLEMS[name]()


def _methods() -> list[str]:
    out = []
    for name in METHODS.names():
        try:
            METHODS.make(name)
        except (TypeError, ValueError):
            continue
        out.append(name)
    return out


def _compressor(method: str) -> str | None:
    requires = make_method(method).requires
    return {"contractive": "top_k[k=2]", "unbiased": "rand_k[k=2]", "none": None}[requires]


def _step(p: Problem, method: str) -> float:
    try:
        return make_method(method).bind(p, _compressor(method), "theory").stepsize
    except ValueError:
        return make_method("ef21").bind(p, "top_k[k=2]", "theory").stepsize


def _squares_in_order(g: torch.Tensor) -> float:
    """‖g‖² as the row defines it (shrinkgrad._sums): float64 squares added in index order."""
    acc = 0.0
    for v in g.tolist():
        acc += v * v
    return acc


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("method", _methods())
def test_logged_metrics_equal_the_separate_evaluation_bit_for_bit(
    method: str, problem: str
) -> None:
    p = _problem(problem)
    xs: list[torch.Tensor] = []
    step = _step(p, method)
    res = simulate(
        p, method, _compressor(method), step, rounds=6, seed=2, log_every=1,
        callback=lambda r, s: xs.append(s.x.clone()),
    )  # fmt: skip
    t = res.table
    assert res.status == "completed" and len(t) == 7
    for k, x in enumerate([p.x0(), *xs]):
        assert t["grad_norm_sq"].iloc[k] == _squares_in_order(p.grad(x)), k
        assert t["loss"].iloc[k] == float(p.loss(x)), k
    # the cache changes no iterate: a run logging only its last round is the same run
    sparse = simulate(p, method, _compressor(method), step, rounds=6, seed=2, log_every=6)
    assert torch.equal(sparse.x, res.x)
    assert t["grad_norm_sq"].iloc[-1] == sparse.table["grad_norm_sq"].iloc[-1]


@pytest.mark.parametrize("problem", [k for k in PROBLEMS if k != "fixture_no_fused_pass"])
def test_the_fused_pass_is_the_separate_oracles(problem: str) -> None:
    p = _problem(problem)
    x = torch.linspace(-2.0, 3.0, p.d, dtype=p.dtype)
    G, losses = p.client_grads_and_losses(x)
    assert torch.equal(G, p.client_grads(x)) and torch.equal(losses, p.client_losses(x))
    m = ProblemOracle(p).metrics(x)
    assert m is not None
    assert torch.equal(m.grad, p.grad(x)) and m.loss == p.loss(x)


class Counting(LinearModelProblem):
    """Counts the passes over the data."""

    passes: dict[str, int]

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        self.passes["grads"] += 1
        return super().client_grads(x)

    def client_grads_losses_and_mean(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.passes["fused"] += 1  # client_grads_and_losses calls it
        return super().client_grads_losses_and_mean(x)

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        self.passes["grads"] += 1
        return super().grad(x)

    def client_losses(self, x: torch.Tensor) -> torch.Tensor:
        self.passes["losses"] += 1
        return super().client_losses(x)


def _counting() -> Counting:
    base = logistic_regression("a1a", n_clients=4)
    parts = [range(base.offsets[i], base.offsets[i + 1]) for i in range(4)]
    p = Counting(base.data_matrix(), base._y64, parts, loss="logistic", lam=0.1)
    p.passes = {"grads": 0, "fused": 0, "losses": 0}
    return p


@pytest.mark.parametrize(
    ("method", "compressor", "passes"),
    [
        # EF21 evaluates every ∇f_i at the new iterate: the row reads that pass
        ("ef21", "top_k[k=1]", {"grads": 0, "fused": 11, "losses": 0}),
        ("ef21_w", "top_k[k=1]", {"grads": 0, "fused": 11, "losses": 0}),
        # GD evaluates at x^t in the step after the row of round t: the row's pass is reused
        # (round 0's and the last row's passes are not followed by a step at their point)
        ("gd", None, {"grads": 0, "fused": 11, "losses": 0}),
        ("dcgd", "rand_k[k=3]", {"grads": 0, "fused": 11, "losses": 0}),
        ("ef", "top_k[k=1]", {"grads": 0, "fused": 11, "losses": 0}),
        # partial participation evaluates a subset: one pass for the step, one for the row
        ("ef21_pp[p=0.5]", "top_k[k=1]", {"grads": 0, "fused": 21, "losses": 0}),
    ],
)
def test_a_logged_round_costs_one_pass_when_the_method_evaluates_every_client(
    method: str, compressor: str | None, passes: dict[str, int]
) -> None:
    p = _counting()
    simulate(p, method, compressor, 0.05, rounds=10, log_every=1)
    got = dict(p.passes)
    if method == "ef21_pp[p=0.5]":  # some rounds may draw every client (then the pass is shared)
        assert got["fused"] + got["grads"] <= 21 and got["losses"] == 0
        assert got["fused"] >= 11
    else:
        assert got == passes


def test_time_s_still_counts_the_gradient_pass_a_step_reused() -> None:
    """GD's step takes its gradients from the row's metric pass: time_s is charged for them."""
    p = logistic_regression("a9a", n_clients=50)
    logged = simulate(p, "gd", None, "theory", rounds=30, log_every=1)
    assert logged.table["time_s"].iloc[-1] > 0
    oracle = ProblemOracle(p)
    m = oracle.metrics(p.x0())
    assert m is not None
    oracle.grads(p.x0(), torch.arange(p.n))  # consumes the kept gradients
    assert oracle.take_prepaid() > 0 and oracle.take_prepaid() == 0.0


def test_kept_metrics_hold_only_while_their_point_is_unchanged() -> None:
    """The oracle keeps the point's tensor and its version counter, not a copy: the same
    unchanged tensor or an equal one reuses the metrics; an in-place change of the point (or of
    the gradients' point before the next step) makes them be recomputed, correctly."""
    p = logistic_regression("a1a", n_clients=5)
    o = ProblemOracle(p)
    x = torch.linspace(-1.0, 1.0, p.d, dtype=p.dtype)
    m = o.metrics(x)
    assert m is not None and o.metrics(x) is m and o.metrics(x.clone()) is m
    x.mul_(0.5)  # in place: the version moves, the kept values are not x's any more
    m2 = o.metrics(x)
    assert m2 is not None and m2 is not m
    assert torch.equal(m2.grad, p.grad(x)) and m2.loss == p.loss(x)
    x.add_(0.25)  # the kept client gradients were for the old values
    assert torch.equal(o.grads(x, torch.arange(p.n)), p.client_grads(x))
    with torch.inference_mode():  # tensors without a version counter: a private copy
        y = torch.linspace(-1.0, 1.0, p.d, dtype=p.dtype)
        o2 = ProblemOracle(p)
        m3 = o2.metrics(y)
        assert m3 is not None and m3.version == -1 and o2.metrics(y.clone()) is m3
        y.mul_(2.0)
        m4 = o2.metrics(y)
        assert m4 is not None and m4 is not m3 and m4.loss == p.loss(y)
