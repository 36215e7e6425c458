"""The vectorised simulator: :func:`simulate` runs any method on any problem with clients on a
tensor axis and returns a tidy table (docs/simulator.md)."""

from .checkpoint import load_checkpoint, save_checkpoint
from .simulate import COLUMNS, SimResult, SimulationInterrupted, simulate

__all__ = [
    "COLUMNS",
    "SimResult",
    "SimulationInterrupted",
    "load_checkpoint",
    "save_checkpoint",
    "simulate",
]
