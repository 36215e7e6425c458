"""Problems built by name with the shared name[param=value] syntax."""

from __future__ import annotations

import pytest
import torch

from shrinkgrad.problems import PROBLEMS, Problem, logistic_regression, make_problem
from shrinkgrad.registry import SpecError


def test_registered_problem_names() -> None:
    assert {"logistic_regression", "least_squares", "synthetic_least_squares"} <= set(
        PROBLEMS.names()
    )


def test_make_problem_equals_the_python_api() -> None:
    p = make_problem(
        "logistic_regression[dataset=australian_scale,n_clients=7,split=shuffled[seed=2],lam=0.05]"
    )
    q = logistic_regression("australian_scale", n_clients=7, split="shuffled[seed=2]", lam=0.05)
    assert isinstance(p, Problem) and p.split == "shuffled[seed=2]"
    x = torch.linspace(-1, 1, 14, dtype=torch.float64)
    assert torch.equal(p.client_grads(x), q.client_grads(x))
    assert p.L == q.L and torch.equal(p.L_i, q.L_i)
    assert p.info()["spec"] == (
        "logistic_regression[dataset=australian_scale,n_clients=7,split=shuffled[seed=2],lam=0.05]"
    )
    assert make_problem(p) is p


def test_make_problem_float32_and_synthetic() -> None:
    p = make_problem("least_squares[dataset=australian_scale,n_clients=3,dtype=float32]")
    assert p.dtype == torch.float32
    s = make_problem("synthetic_least_squares[n_clients=30,d=4,m=5,L_var=50]")
    assert s.n == 30 and s.L_var == pytest.approx(50.0, rel=1e-9)


def test_make_problem_errors_name_the_mistake() -> None:
    with pytest.raises(SpecError, match="unknown problem 'logistic'"):
        make_problem("logistic[dataset=a9a]")
    with pytest.raises(SpecError, match="has no parameter 'clients'"):
        make_problem("logistic_regression[dataset=a9a,clients=3]")
    with pytest.raises(SpecError, match="needs parameter 'dataset'"):
        make_problem("logistic_regression[n_clients=3]")
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        make_problem("logistic_regression[dataset=nope,n_clients=3]")
    with pytest.raises(SpecError, match=r"unknown split 'by_lable'.*did you mean 'by_label'"):
        make_problem("logistic_regression[dataset=a1a,n_clients=3,split=by_lable]")
