"""numpy scalars are numbers, and a step that would underflow to 0 is an error (API audit)."""

from __future__ import annotations

import numpy as np
import pytest

import shrinkgrad as sg
from shrinkgrad import theory as T
from shrinkgrad.methods.stepsize import parse_stepsize


def test_a_numpy_step_size_is_the_same_number() -> None:
    p = sg.make_problem("logistic_regression[dataset=australian_scale,n_clients=5]")
    step = np.float32(0.1)
    got = sg.simulate(p, "ef21", "top_k[k=1]", stepsize=step, rounds=3)
    want = sg.simulate(p, "ef21", "top_k[k=1]", stepsize=float(step), rounds=3)
    assert got.stepsize == want.stepsize == float(step)
    assert got.table["loss"].tolist() == want.table["loss"].tolist()
    assert parse_stepsize(np.float64(0.25)).value == 0.25
    with pytest.raises(TypeError, match="got a bool"):
        parse_stepsize(True)


def test_counts_may_be_numpy_integers() -> None:
    args = dict(stepsize=0.1, f_gap=1.0, eps=0.5, L=1, L_max=2, omega=3)
    assert T.rounds_dcgd(**args, n=np.int64(10)) == T.rounds_dcgd(**args, n=10)
    assert T.bits_to_accuracy(np.int64(10), 32) == T.bits_to_accuracy(10, 32) == 320.0
    with pytest.raises(ValueError, match="integer"):
        T.bits_to_accuracy(np.float64(10.0), 32)


@pytest.mark.parametrize(
    "rule, args",
    [(T.stepsize_ef21, (1.0, 1.0, 1e-320)), (T.stepsize_ef21, (1e308, 1e308, 0.5))],
)
def test_a_step_that_would_be_zero_is_refused(rule: object, args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="overflows"):
        rule(*args)  # type: ignore[operator]
