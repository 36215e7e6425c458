"""A client whose f_i is constant (L_i = 0: all its data rows are zero) is a valid problem.

w1a holds 207 all-zero rows; the ``heterogeneous_smoothness[key=norm]`` split sorts them into
client 0. Every unweighted method runs on it (the constants L_AM, L_QM and the EF21 rule
1/(L + L_QM ξ(α)) are finite with an L_i = 0); only EF21-W, which weighs client i by
w_i = L_i / Σ L_j and has it send ∇f_i/(n w_i) ([EFR] Alg. 2), is undefined and says so.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import shrinkgrad as sg
from shrinkgrad import theory as T
from shrinkgrad.methods.base import Constants

SPEC = (
    "logistic_regression[dataset=w1a,n_clients=20,split=heterogeneous_smoothness[key=norm],lam=0]"
)


@pytest.fixture(scope="module")
def problem() -> sg.Problem:
    return sg.make_problem(SPEC)


def test_the_zero_client_is_constant(problem: sg.Problem) -> None:
    grads = problem.client_grads(torch.randn(problem.d, dtype=torch.float64))
    assert float(problem.L_i[0]) == 0.0 and bool((problem.L_i[1:] > 0).all())
    assert float(grads[0].abs().max()) == 0.0  # ∇f_0 ≡ 0: f_0 is constant


@pytest.mark.parametrize(
    "method, compressor",
    [("gd", None), ("ef21", "top_k[k=1]"), ("ef", "top_k[k=1]"), ("dcgd", "rand_k[k=2]")],
)
def test_every_unweighted_method_runs(problem: sg.Problem, method: str, compressor: str) -> None:
    r = sg.simulate(problem, method, compressor, stepsize=0.5, rounds=5)
    losses = np.asarray(r.table["loss"], dtype=float)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_the_ef21_theory_step_counts_the_zero_constant(problem: sg.Problem) -> None:
    L_i = problem.L_i.numpy()
    L_QM = math.sqrt(float(np.mean(L_i**2)))  # the 0 enters the quadratic mean
    alpha = 1 / problem.d  # top_k[k=1]
    want = T.stepsize_ef21(problem.L, L_QM, alpha)
    r = sg.simulate(problem, "ef21", "top_k[k=1]", stepsize="theory", rounds=1)
    assert r.stepsize == pytest.approx(want, rel=1e-12)


def test_ef21_w_names_the_client_it_cannot_weigh(problem: sg.Problem) -> None:
    with pytest.raises(ValueError, match=r"client 0 \(L_i = 0.*ef21\[rule=reloaded\]"):
        sg.simulate(problem, "ef21_w", "top_k[k=1]", stepsize=0.1, rounds=1)


def test_constants_take_zero_and_refuse_negative_smoothness() -> None:
    assert Constants(2, 3, 1.0, torch.tensor([0.0, 2.0])).L_AM == 1.0
    with pytest.raises(ValueError, match=">= 0"):
        Constants(2, 3, 1.0, torch.tensor([-1.0, 2.0]))
