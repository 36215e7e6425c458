"""shrinkgrad: communication-compressed distributed optimization.

Faithful implementations of distributed gradient methods with unbiased quantizers and stale
gradients (Khirirat, Feyzmahdavian, Johansson 2018) and of EF21 / EF21-W with contractive
compressors (Richtárik, Gasanov, Burlachenko, ICLR 2024), with theory-exact step sizes and honest
bit counts, as a vectorised simulator, a CLI and torch.distributed training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .compressors import COMPRESSORS, Compressor, make_compressor
from .methods import METHODS, Method, make_method
from .registry import Registry, SpecError, parse_spec
from .rng import Keys, KeyStream

if TYPE_CHECKING:
    from .distributed.ps import PSConfig, PSResult, run_ps
    from .problems import PROBLEMS, Problem, make_problem
    from .sim import SimResult, simulate


def __getattr__(name: str) -> Any:
    # the simulator pulls in pandas and the problems package: imported on first use only
    if name in ("simulate", "SimResult"):
        from . import sim

        return getattr(sim, name)
    if name in ("PROBLEMS", "Problem", "make_problem"):  # scipy/numba: imported on first use
        from . import problems

        return getattr(problems, name)
    if name in ("PSConfig", "PSResult", "run_ps"):  # the parameter server: torch.distributed
        from .distributed import ps

        return getattr(ps, name)
    raise AttributeError(f"module 'shrinkgrad' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "METHODS",
    "PROBLEMS",
    "Compressor",
    "KeyStream",
    "Keys",
    "Method",
    "PSConfig",
    "PSResult",
    "Problem",
    "Registry",
    "SimResult",
    "SpecError",
    "__version__",
    "make_compressor",
    "make_method",
    "make_problem",
    "parse_spec",
    "run_ps",
    "simulate",
]
