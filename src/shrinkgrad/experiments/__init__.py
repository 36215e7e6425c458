"""Experiments: TOML configs, grids of simulations run in parallel, and paper reproductions.

The public API (docs/experiments.md), imported lazily so that ``import shrinkgrad.experiments``
stays cheap and worker processes can pin their thread pools before torch loads:

* :func:`load_config` / :func:`loads_config` / :func:`parse_config` → :class:`ExperimentConfig`
  (raises :class:`ConfigError` naming the file, the key and the reason);
* :func:`expand` → the :class:`RunSpec` s of a config; :func:`check_runs` builds each problem
  and binds each pairing (impossible combinations are config errors);
* :func:`run_experiment` → :class:`ExperimentResult` (parallel, resumable; DIR/results.parquet);
* :func:`load_results` → the results table of a directory;
* :func:`reproduce` and :data:`REPRODUCTIONS` → the papers' claims (:class:`Claim`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .claims import Claim
    from .config import (
        Arm,
        ConfigError,
        ExperimentConfig,
        ProblemCase,
        RunSettings,
        derive_seed,
        dump_config,
        load_config,
        loads_config,
        parse_config,
    )
    from .grid import ProblemInfo, RunSpec, build_problem, check_runs, expand
    from .reproductions import REPRODUCTIONS, Reproduction, ReproductionResult, reproduce
    from .results import RESULT_COLUMNS, load_results
    from .runner import ExperimentResult, OtherExperimentError, run_experiment

_WHERE = {
    "Claim": "claims",
    "Arm": "config",
    "ConfigError": "config",
    "ExperimentConfig": "config",
    "ProblemCase": "config",
    "RunSettings": "config",
    "derive_seed": "config",
    "dump_config": "config",
    "load_config": "config",
    "loads_config": "config",
    "parse_config": "config",
    "ProblemInfo": "grid",
    "RunSpec": "grid",
    "build_problem": "grid",
    "check_runs": "grid",
    "expand": "grid",
    "REPRODUCTIONS": "reproductions",
    "Reproduction": "reproductions",
    "ReproductionResult": "reproductions",
    "reproduce": "reproductions",
    "RESULT_COLUMNS": "results",
    "load_results": "results",
    "ExperimentResult": "runner",
    "OtherExperimentError": "runner",
    "run_experiment": "runner",
}

__all__ = [
    "REPRODUCTIONS",
    "RESULT_COLUMNS",
    "Arm",
    "Claim",
    "ConfigError",
    "ExperimentConfig",
    "ExperimentResult",
    "OtherExperimentError",
    "ProblemCase",
    "ProblemInfo",
    "Reproduction",
    "ReproductionResult",
    "RunSettings",
    "RunSpec",
    "build_problem",
    "check_runs",
    "derive_seed",
    "dump_config",
    "expand",
    "load_config",
    "load_results",
    "loads_config",
    "parse_config",
    "reproduce",
    "run_experiment",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'shrinkgrad.experiments' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
