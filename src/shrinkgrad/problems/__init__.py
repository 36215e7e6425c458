"""Objectives f = (1/n) Σ f_i over client splits of real or synthetic data, with L, L_i, μ.

Build a problem with a function or by name::

    from shrinkgrad.problems import logistic_regression, make_problem
    p = logistic_regression("a9a", n_clients=100, split="contiguous", lam=0.1)
    p = make_problem("logistic_regression[dataset=a9a,n_clients=100,split=shuffled[seed=0]]")
    q = make_problem("mlp[dataset=a9a,hidden=64,n_clients=20,split=by_label]")  # a network
    q = model_problem(my_torch_module, "digits", n_clients=20, input_shape=(1, 8, 8))

Neural networks: :mod:`shrinkgrad.problems.model` (``model_problem``), registered ``mlp``/``cnn``
in :mod:`shrinkgrad.problems.model_zoo`, local smoothness estimates in
:mod:`shrinkgrad.problems.estimate`. Datasets: :mod:`shrinkgrad.problems.datasets` (also
importable as :mod:`shrinkgrad.datasets`);
splits: :mod:`shrinkgrad.problems.splits`; exact λ_max: :mod:`shrinkgrad.problems.smoothness`.
"""

from .base import PROBLEMS, Problem, make_problem
from .datasets import BUNDLED, IMAGE_DATASETS, Dataset, DatasetError, available, load
from .estimate import SmoothnessEstimate, estimate_smoothness
from .linear import LinearModelProblem, least_squares, logistic_regression
from .model import ModelProblem, model_problem
from .model_losses import LOSSES, ModelLoss
from .model_zoo import cnn, mlp
from .rare import RareFeatures, rare_features
from .splits import SPLITS, ExplicitSplit, Split, make_split, resolve_split
from .synthetic import synthetic_L_i, synthetic_least_squares

__all__ = [
    "BUNDLED",
    "IMAGE_DATASETS",
    "LOSSES",
    "PROBLEMS",
    "SPLITS",
    "Dataset",
    "DatasetError",
    "ExplicitSplit",
    "LinearModelProblem",
    "ModelLoss",
    "ModelProblem",
    "Problem",
    "RareFeatures",
    "SmoothnessEstimate",
    "Split",
    "available",
    "cnn",
    "estimate_smoothness",
    "least_squares",
    "load",
    "logistic_regression",
    "make_problem",
    "make_split",
    "mlp",
    "model_problem",
    "rare_features",
    "resolve_split",
    "synthetic_L_i",
    "synthetic_least_squares",
]
