"""Every method of methods.md §3 as an init/step pair over explicit state.

Build one by name (``make_method("ef21_pp[p=0.5]")``), bind it to a problem, a compressor, a
step size and a seed (:meth:`Method.bind`), then call ``init`` and ``step``. The client part of
every step runs on any group of clients, and the reduction over clients is pluggable, so the
distributed runtime reuses exactly this code (see docs/methods.md, "running a method on a subset
of clients").
"""

from . import asynchronous, cgd, delayed, ef, ef21, gd
from .asynchronous import Asynchronous
from .base import (
    METHODS,
    BoundMethod,
    Config,
    Constants,
    GradientOracle,
    Message,
    Method,
    State,
    Traffic,
    make_method,
    weighted_sum,
)
from .cgd import CGD
from .delayed import IAG, DelayedDCGD
from .ef import EF
from .ef21 import EF21
from .gd import DCGD, GD
from .oracle import ProblemOracle
from .stepsize import StepSize, parse_stepsize

__all__ = [
    "CGD",
    "DCGD",
    "EF",
    "EF21",
    "GD",
    "IAG",
    "METHODS",
    "Asynchronous",
    "BoundMethod",
    "Config",
    "Constants",
    "DelayedDCGD",
    "GradientOracle",
    "Message",
    "Method",
    "ProblemOracle",
    "State",
    "StepSize",
    "Traffic",
    "asynchronous",
    "cgd",
    "delayed",
    "ef",
    "ef21",
    "gd",
    "make_method",
    "parse_stepsize",
    "weighted_sum",
]
