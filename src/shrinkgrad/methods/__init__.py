"""Every method of methods.md §3 as an init/step pair over explicit state.

Build one by name (``make_method("ef21_pp[p=0.5]")``), bind it to a problem, a compressor, a
step size and a seed (:meth:`Method.bind`), then call ``init`` and ``step``. The client part of
every step runs on any group of clients, and the reduction over clients is pluggable, so the
distributed runtime reuses exactly this code (see docs/methods.md, "running a method on a subset
of clients").
"""

from . import asynchronous, delayed, diana, ef, ef21, ef21_plus, ef21_sgdm, gd
from .asynchronous import Asynchronous
from .base import (
    METHODS,
    BoundMethod,
    Config,
    Constants,
    DenseTraffic,
    GradientOracle,
    Message,
    Method,
    State,
    Traffic,
    make_method,
    methods_for,
    weighted_sum,
)
from .delayed import IAG, DelayedDCGD
from .diana import DIANA
from .ef import EF
from .ef21 import EF21
from .ef21_plus import EF21Plus
from .ef21_sgdm import EF21SGDM, ClientMomentum
from .gd import DCGD, GD
from .oracle import ProblemOracle
from .stepsize import StepSize, parse_stepsize

__all__ = [
    "DCGD",
    "DIANA",
    "EF",
    "EF21",
    "EF21SGDM",
    "GD",
    "IAG",
    "METHODS",
    "Asynchronous",
    "BoundMethod",
    "ClientMomentum",
    "Config",
    "Constants",
    "DelayedDCGD",
    "DenseTraffic",
    "EF21Plus",
    "GradientOracle",
    "Message",
    "Method",
    "ProblemOracle",
    "State",
    "StepSize",
    "Traffic",
    "asynchronous",
    "delayed",
    "diana",
    "ef",
    "ef21",
    "ef21_plus",
    "ef21_sgdm",
    "gd",
    "make_method",
    "methods_for",
    "parse_stepsize",
    "weighted_sum",
]
