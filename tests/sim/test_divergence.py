"""Divergence: every method on every kind of problem stops as ``diverged`` at an absurd step size,
and no ordinary run is flagged (issue 12.1; docs/simulator.md, "Status, divergence")."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from methods_fixtures import LeastSquares

from shrinkgrad.methods import METHODS, make_method
from shrinkgrad.problems import (
    Problem,
    least_squares,
    logistic_regression,
    synthetic_least_squares,
)
from shrinkgrad.sim import Divergence, RunOptions, SimulationInterrupted, simulate
from shrinkgrad.sim.options import DivergenceReference


class NoBound(LeastSquares):
    """The fixture least squares without any known lower bound, minimiser or optimal value."""

    def __init__(self) -> None:
        super().__init__(n=4, d=6, m=5, seed=1)
        self.f_star = None
        self.x_star = None


def _problems() -> dict[str, Problem]:
    return {
        "logreg_nonconvex": logistic_regression("a1a", n_clients=6, lam=0.1),
        "logreg_l2": logistic_regression("australian_scale", n_clients=5, reg="l2", lam=0.01),
        "least_squares": least_squares("australian_scale", n_clients=5),
        "synthetic_nonconvex": synthetic_least_squares(n_clients=6, d=5, m=4, lam=0.1, L_var=10.0),
        "fixture_lsq": LeastSquares(n=5, d=8, m=6, seed=3),
        "no_bound": NoBound(),
    }


PROBLEMS = _problems()


def _methods() -> list[str]:
    names = []
    for name in METHODS.names():
        try:
            METHODS.make(name)
        except (TypeError, ValueError):  # needs parameters to be built
            continue
        names.append(name)
    return names


def _compressor(method: str) -> str | None:
    requires = make_method(method).requires
    return {"contractive": "top_k[k=1]", "unbiased": "rand_k[k=1]", "none": None}[requires]


def _run(problem: Problem, method: str, stepsize: Any, rounds: int, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return simulate(problem, method, _compressor(method), stepsize, rounds=rounds, **kw)


def _finite_table(res: Any) -> bool:
    values = torch.tensor(res.table[["grad_norm_sq", "loss"]].to_numpy())
    return bool(torch.isfinite(values).all()) and not res.table.isna().any().any()


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("method", _methods())
def test_an_absurd_step_size_is_a_divergence(method: str, problem: str) -> None:
    res = _run(PROBLEMS[problem], method, 1e6, rounds=60, log_every=3)
    assert res.status == "diverged", (res.status, res.table[["round", "grad_norm_sq", "loss"]])
    assert res.message.startswith("diverged at round") and "1e+06 (constant)" in res.message
    assert res.rounds < 60 and _finite_table(res)


def _ordinary_step(p: Problem, method: str) -> float:
    """4× the method's theory step for the EF21 family (the reproductions go to 64×), its theory
    step otherwise; without one (EF, EF21-SGD without a variance bound), 4× EF21's, as [EF21]
    runs its EF baseline."""
    m = 4.0 if method.startswith("ef21") else 1.0
    try:
        return m * make_method(method).bind(p, _compressor(method), "theory").stepsize
    except ValueError:
        return 4.0 * make_method("ef21").bind(p, "top_k[k=1]", "theory").stepsize


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("method", _methods())
def test_ordinary_runs_are_never_flagged(method: str, problem: str) -> None:
    p = PROBLEMS[problem]
    res = _run(p, method, _ordinary_step(p, method), rounds=100, log_every=10)
    assert res.status in ("completed", "converged"), res.message


def test_the_saturated_logistic_run_of_the_issue_is_diverged() -> None:
    """EF21 + Top-1 with γ = 10⁶ on w1a: f from 0.69 to ~10⁴ at round 1 while ‖∇f‖² shrinks
    (the sigmoids saturate): the loss test stops it, not the gradient test."""
    p = logistic_regression("w1a", n_clients=10)
    with pytest.warns(RuntimeWarning, match="the loss grew from 0.6931"):
        res = simulate(p, "ef21", "top_k[k=1]", stepsize=1e6)
    t = res.table
    assert res.status == "diverged" and res.rounds == 1
    assert t["grad_norm_sq"].iloc[-1] < t["grad_norm_sq"].iloc[0]  # the gradient shrank
    assert t["loss"].iloc[-1] > 100 * t["loss"].iloc[0]
    # without the loss test the run is "completed": the old behaviour of the issue
    only_grad = Divergence(loss_factor=None)
    res = simulate(p, "ef21", "top_k[k=1]", 1e6, rounds=20, divergence_factor=only_grad)
    assert res.status == "completed"


class Cauchy(Problem):
    """f_i(x) = (1/d) Σ_k c_i log(1 + x_k²): bounded gradient (|f'| ≤ c_i), logarithmic loss,
    minimiser x* = 0. A huge step sends x from 3 to ~10⁶ while f grows only ~12× and ∇f shrinks:
    only the iterate test sees it."""

    name = "cauchy"
    dataset = "none"

    def __init__(self, n: int = 3, d: int = 4) -> None:
        self.n, self.d = n, d
        self.c = torch.linspace(1.0, 2.0, n, dtype=torch.float64)
        self.L_i = 2 * self.c / d
        self.L = float(self.L_i.mean())
        self.x_star = torch.zeros(d, dtype=torch.float64)
        self.f_star = self.f_lower = 0.0

    def x0(self) -> torch.Tensor:
        return torch.full((self.d,), 3.0, dtype=torch.float64)

    def loss(self, x: torch.Tensor) -> float:
        return float(self.c.mean() * torch.log1p(x * x).mean())

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        return self.c[:, None] * (2 * x / (1 + x * x) / self.d)[None, :]

    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor:
        return self.c[:, None] * 2 * X / (1 + X * X) / self.d


def test_the_iterate_test_sees_a_run_that_the_loss_and_gradient_tests_miss() -> None:
    p = Cauchy()
    with pytest.warns(RuntimeWarning, match="distance to the minimiser grew"):
        res = simulate(p, "gd", None, 1e7, rounds=10)
    assert res.status == "diverged" and res.rounds == 1
    t = res.table
    assert t["loss"].iloc[-1] < 100 * t["loss"].iloc[0]
    assert t["grad_norm_sq"].iloc[-1] < t["grad_norm_sq"].iloc[0]
    off = Divergence(iterate_factor=None)
    assert simulate(p, "gd", None, 1e7, rounds=10, divergence_factor=off).status == "completed"


def test_without_a_lower_bound_the_loss_is_measured_against_its_magnitude() -> None:
    ref = DivergenceReference(gns0=1.0, loss0=-2.0)
    rule = Divergence(grad_factor=None, loss_factor=10.0)
    assert rule.verdict(ref, 1.0, 17.0) is None  # rose by 19 < 10·|−2|
    assert "initial magnitude" in str(rule.verdict(ref, 1.0, 18.5))
    res = _run(PROBLEMS["no_bound"], "gd", 1e6, rounds=100, divergence_factor=Divergence.off())
    assert res.status == "diverged" and "non-finite" in res.message  # only non-finite stops it


def test_a_start_at_the_minimum_has_no_scale_to_grow_from() -> None:
    """f(x⁰) − f* at rounding level: the loss and gradient tests stay off (no false alarm from
    noise; non-finite values would still stop the run)."""
    p = least_squares("australian_scale", n_clients=5)
    assert p.x_star is not None
    res = simulate(p, "dcgd", "rand_k[k=2]", "theory", rounds=40, x0=p.x_star)
    assert res.status == "completed", res.message
    # the gradient grew from rounding level to DCGD's neighbourhood: no scale either
    assert res.table["grad_norm_sq"].iloc[-1] > 1e8 * res.table["grad_norm_sq"].iloc[0]
    ref = DivergenceReference(gns0=1e-30, loss0=1.0, f_lower=1.0 - 1e-17)
    assert Divergence().verdict(ref, 1.0, 2.0) is None


def test_the_reference_is_round_zero_and_the_verdict_is_checkpointed(tmp_path: Any) -> None:
    """A resumed diverging run stops at the same round with the same message."""
    p = least_squares("australian_scale", n_clients=4)
    step = 2.5 / p.L  # GD's error grows by 1.5× a round: the loss test fires after some rounds

    def interrupt(r: int, state: Any) -> None:
        if r == 2:
            raise KeyboardInterrupt

    full = simulate(p, "gd", None, step, rounds=200)
    assert full.status == "diverged" and full.rounds > 4 and "the loss grew" in full.message
    with pytest.raises(SimulationInterrupted):
        simulate(p, "gd", None, step, rounds=200, checkpoint=tmp_path / "c.pt", callback=interrupt)
    resumed = simulate(p, "gd", None, step, rounds=200, checkpoint=tmp_path / "c.pt")
    assert resumed.status == "diverged"
    assert resumed.message == full.message and resumed.rounds == full.rounds


def test_divergence_options() -> None:
    assert Divergence.of(None) == Divergence.off() and not Divergence.off().active
    assert Divergence.of(1e6) == Divergence(grad_factor=1e6)
    assert RunOptions(divergence=Divergence.of(1e3)).divergence.loss_factor == 1e2
    for bad in (0.5, 1.0, math.nan, "big", True):
        with pytest.raises(ValueError, match="must be a number > 1 or None"):
            Divergence(loss_factor=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divergence_factor must be a number > 1"):
        simulate(PROBLEMS["fixture_lsq"], "gd", None, 0.1, rounds=2, divergence_factor=0.5)


def test_downstream_claims_treat_a_diverged_run_as_failed() -> None:
    """The saturated run ends with a smaller ‖∇f‖² than a converging one: the claims must not
    read that as "reached ε" or as the best final value (issue 12.1: "plots as the best")."""
    import pandas as pd

    from shrinkgrad.experiments.claims import final_value, reach
    from shrinkgrad.experiments.reproductions.common import common_tolerance

    p = logistic_regression("w1a", n_clients=10)
    good = simulate(p, "ef21", "top_k[k=1]", "theory", rounds=20).table.assign(status="completed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bad = simulate(p, "ef21", "top_k[k=1]", 1e6, rounds=20).table.assign(status="diverged")
    assert bad["grad_norm_sq"].iloc[-1] < good["grad_norm_sq"].iloc[-1]
    eps = float(good["grad_norm_sq"].iloc[-1])
    assert reach(bad, eps) == math.inf and final_value(bad) == math.inf
    assert reach(good, eps) < math.inf and final_value(good) == eps
    both = pd.concat(
        [good.assign(run_id="a", problem_label="w1a"), bad.assign(run_id="b", problem_label="w1a")]
    )
    assert common_tolerance(both) == {"w1a": eps}
