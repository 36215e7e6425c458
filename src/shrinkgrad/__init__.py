"""shrinkgrad: communication-compressed distributed optimization.

Faithful implementations of distributed gradient methods with unbiased quantizers and stale
gradients (Khirirat, Feyzmahdavian, Johansson 2018) and of EF21 / EF21-W with contractive
compressors (Richtárik, Gasanov, Burlachenko, ICLR 2024), with theory-exact step sizes and honest
bit counts, as a vectorised simulator, a CLI and torch.distributed training.

``import shrinkgrad as sg`` is light (no torch, scipy, pandas): the public names below and the
subpackages (``sg.problems``, ``sg.datasets``, ``sg.theory``, ``sg.methods``, ``sg.distributed``,
...) are imported on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import (  # noqa: F401  (the lazily imported subpackages, for type checkers)
        cli,
        compressors,
        datasets,
        distributed,
        experiments,
        methods,
        plotting,
        problems,
        registry,
        rng,
        sim,
        theory,
    )
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


#: subpackages and modules reachable as attributes without an explicit import
#: (``sg.datasets.load("a9a")``), each imported on first use
_SUBMODULES: tuple[str, ...] = (
    "cli",
    "compressors",
    "datasets",
    "distributed",
    "experiments",
    "methods",
    "plotting",
    "problems",
    "registry",
    "rng",
    "sim",
    "theory",
)


def _read_version() -> str:
    """The installed distribution's version; in a source checkout that is not installed, the
    version in the checkout's pyproject.toml ("0+unknown" when neither is readable)."""
    from importlib import metadata

    try:
        return metadata.version("shrinkgrad")
    except metadata.PackageNotFoundError:
        pass
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return "0+unknown"
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project is None or not re.search(r'^name\s*=\s*"shrinkgrad"', project.group(1), re.M):
        return "0+unknown"
    version = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return version.group(1) if version else "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _read_version()
    elif name in _SUBMODULES:
        value = import_module(f".{name}", __name__)
    elif name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'shrinkgrad' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES) | {"__version__"})


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
