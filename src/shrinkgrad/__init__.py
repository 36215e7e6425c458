"""shrinkgrad: communication-compressed distributed optimization.

Faithful implementations of distributed gradient methods with unbiased quantizers and stale
gradients (Khirirat, Feyzmahdavian, Johansson 2018) and of EF21 / EF21-W with contractive
compressors (Richtárik, Gasanov, Burlachenko, ICLR 2024), with theory-exact step sizes and honest
bit counts, as a vectorised simulator, a CLI and torch.distributed training.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .compressors import COMPRESSORS, Compressor, make_compressor
    from .distributed.ps import PSConfig, PSResult, run_ps
    from .methods import METHODS, Method, make_method
    from .problems import PROBLEMS, Problem, make_problem
    from .registry import Registry, SpecError, parse_spec
    from .rng import Keys, KeyStream
    from .sim.simulate import SimResult, simulate

#: public name -> the submodule that defines it. Everything is imported on first use, so that
#: ``import shrinkgrad`` (and ``shrinkgrad --help``) does not pay for torch, pandas, scipy and
#: numba until a name that needs them is touched.
_LAZY: dict[str, str] = {
    **dict.fromkeys(("COMPRESSORS", "Compressor", "make_compressor"), "compressors"),
    **dict.fromkeys(("METHODS", "Method", "make_method"), "methods"),
    **dict.fromkeys(("PROBLEMS", "Problem", "make_problem"), "problems"),
    **dict.fromkeys(("Registry", "SpecError", "parse_spec"), "registry"),
    **dict.fromkeys(("Keys", "KeyStream"), "rng"),
    **dict.fromkeys(("SimResult", "simulate"), "sim"),
    **dict.fromkeys(("PSConfig", "PSResult", "run_ps"), "distributed.ps"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shrinkgrad' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
