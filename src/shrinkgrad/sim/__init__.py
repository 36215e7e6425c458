"""The vectorised simulator: :func:`simulate` runs any method on any problem with clients on a
tensor axis and returns a tidy table (docs/simulator.md).

How a run is carried out is one :class:`RunOptions` (with its :class:`Divergence` rule). Its
engine (:mod:`~shrinkgrad.sim.engine`: :func:`setup_run`, :func:`run_rounds` and a
:class:`Runtime`) also drives the distributed runner, whose ranks each run a share of the clients.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .engine import (
    METRIC_COLUMNS,
    LocalRuntime,
    Progress,
    RunSetup,
    Runtime,
    run_rounds,
    setup_run,
    table_columns,
)
from .options import Divergence, RunOptions
from .simulate import COLUMNS, SimResult, SimulationInterrupted, simulate

__all__ = [
    "COLUMNS",
    "METRIC_COLUMNS",
    "Divergence",
    "LocalRuntime",
    "Progress",
    "RunOptions",
    "RunSetup",
    "Runtime",
    "SimResult",
    "SimulationInterrupted",
    "load_checkpoint",
    "run_rounds",
    "save_checkpoint",
    "setup_run",
    "simulate",
    "table_columns",
]
