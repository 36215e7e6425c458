"""Objectives f = (1/n) Σ f_i over client splits of real or synthetic data, with L, L_i, μ.

Build a problem with a function or by name::

    from shrinkgrad.problems import logistic_regression, make_problem
    p = logistic_regression("a9a", n_clients=100, split="contiguous", lam=0.1)
    p = make_problem("logistic_regression[dataset=a9a,n_clients=100,split=shuffled[seed=0]]")

Datasets: :mod:`shrinkgrad.problems.datasets` (also importable as :mod:`shrinkgrad.datasets`);
splits: :mod:`shrinkgrad.problems.splits`; exact λ_max: :mod:`shrinkgrad.problems.smoothness`.
"""

from .base import PROBLEMS, Problem, make_problem
from .datasets import BUNDLED, Dataset, DatasetError, available, load
from .linear import LinearModelProblem, least_squares, logistic_regression
from .rare import RareFeatures, rare_features
from .splits import SPLITS, ExplicitSplit, Split, make_split, resolve_split
from .synthetic import synthetic_L_i, synthetic_least_squares

__all__ = [
    "BUNDLED",
    "PROBLEMS",
    "SPLITS",
    "Dataset",
    "DatasetError",
    "ExplicitSplit",
    "LinearModelProblem",
    "Problem",
    "RareFeatures",
    "Split",
    "available",
    "least_squares",
    "load",
    "logistic_regression",
    "make_problem",
    "make_split",
    "rare_features",
    "resolve_split",
    "synthetic_L_i",
    "synthetic_least_squares",
]
