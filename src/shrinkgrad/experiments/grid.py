"""Grid expansion: a config's problems × arms × networks × seeds as a list of runs with ids.

:func:`expand` lists the runs in a fixed order (problem, arm, network, seed index) and gives
each one an id that is a hash of what determines its result — the problem spec, method,
compressor, step-size spec, seed and the ``[run]`` settings — so the same run has the same id
(and directory) whatever else the config contains. :func:`check_runs` builds every problem once
and binds every arm to it, turning impossible combinations into a :class:`ConfigError` (or
skipping them when the config says ``grid.skip_incompatible = true``) before anything runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from .config import Arm, ConfigError, ExperimentConfig, ProblemCase, RunSettings

__all__ = ["ProblemInfo", "RunSpec", "check_runs", "expand", "problem_info"]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One simulation: a problem, an arm (method, compressor, step size) and a seed."""

    run_id: str
    problem: ProblemCase
    arm: Arm
    seed_index: int
    seed: int
    settings: RunSettings
    #: the network spec this run is modelled on (``run.network``), or None
    network: str | None = None

    @property
    def label(self) -> str:
        """A one-line description for progress displays and messages."""
        on = f" · {self.network}" if self.network is not None else ""
        return f"{self.arm.label} · seed {self.seed_index} · {self.problem.label}{on}"

    def identity(self) -> dict[str, Any]:
        """What determines the run's result (hashed into :attr:`run_id`)."""
        s = self.settings
        return {
            "problem": self.problem.spec,
            "method": self.arm.method,
            "compressor": self.arm.compressor,
            "stepsize": self.arm.stepsize,
            "seed": self.seed,
            "rounds": s.rounds,
            "log_every": s.log_every,
            "tol": s.tol,
            "tol_rel": s.tol_rel,
            "dtype": s.dtype,
            "wire_dtype": s.wire_dtype,
            "divergence_factor": s.divergence_factor,
            # only when given: runs without a network keep their ids
            **({"network": self.network} if self.network is not None else {}),
        }


def _run_id(identity: dict[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, default=str)
    return "r" + hashlib.sha1(text.encode()).hexdigest()[:11]


def expand(config: ExperimentConfig) -> list[RunSpec]:
    """Every run of ``config``: problems × arms × seed indices, in that nesting order."""
    runs: list[RunSpec] = []
    networks: tuple[str | None, ...] = config.run.network or (None,)
    for problem in config.problems:
        for arm in config.arms:
            if not arm.applies_to(problem):
                continue
            for net in networks:
                for index in config.run.seeds:
                    seed = config.seed_of(index)
                    spec = RunSpec("", problem, arm, index, seed, config.run, net)
                    runs.append(dataclasses.replace(spec, run_id=_run_id(spec.identity())))
    return runs


@dataclasses.dataclass(frozen=True)
class ProblemInfo:
    """The constants of a built problem that the results table carries beside every row."""

    n: int
    d: int
    L: float
    L_AM: float
    L_QM: float
    L_max: float
    L_var: float
    mu: float | None

    def columns(self) -> dict[str, Any]:
        return {
            "L": self.L,
            "L_AM": self.L_AM,
            "L_QM": self.L_QM,
            "L_max": self.L_max,
            "L_var": self.L_var,
            "mu": math.nan if self.mu is None else self.mu,
        }


def problem_info(problem: Any) -> ProblemInfo:
    """Read :class:`ProblemInfo` from a built problem (NaN for constants it does not know)."""
    mu = getattr(problem, "mu", None)
    known = getattr(problem, "L", None) is not None and getattr(problem, "L_i", None) is not None
    return ProblemInfo(
        n=int(problem.n),
        d=int(problem.d),
        L=float(problem.L) if known else math.nan,
        L_AM=float(problem.L_AM) if known else math.nan,
        L_QM=float(problem.L_QM) if known else math.nan,
        L_max=float(problem.L_max) if known else math.nan,
        L_var=float(problem.L_var) if known else math.nan,
        mu=None if mu is None else float(mu),
    )


def build_problem(spec: str, dtype: str = "float64") -> Any:
    """Build the problem ``spec`` with its data in ``dtype`` (workers and :func:`check_runs`).

    ``dtype`` is passed to the problem factory when it takes one and the spec does not set it.
    """
    from ..problems import PROBLEMS
    from ..registry import parse_spec

    parsed = parse_spec(spec)
    takes = {p.name for p in PROBLEMS.entry(parsed.name).keyword}
    given = {k for k, _ in parsed.params}
    if "dtype" in takes and "dtype" not in given:
        return PROBLEMS.make(parsed, dtype=dtype)
    return PROBLEMS.make(parsed)


def check_runs(
    config: ExperimentConfig,
    runs: Sequence[RunSpec],
    *,
    build: Callable[[str], Any] | None = None,
) -> tuple[list[RunSpec], list[str], dict[str, ProblemInfo]]:
    """Build each problem once and bind each arm to it; return (runs to do, notes, constants).

    A problem that cannot be built, or an arm that cannot run on it (a method with a compressor
    it does not accept, a step size with no theory rule, ...), raises a :class:`ConfigError`
    naming the config key; with ``grid.skip_incompatible = true``, arms that come from the
    ``[grid]`` are skipped instead (each skip is listed in the notes). Explicit ``[[pairs]]``
    are never skipped.
    """
    from ..methods import make_method
    from ..network import ModelClock, make_network

    make = build or (lambda spec: build_problem(spec, config.run.dtype))
    infos: dict[str, ProblemInfo] = {}
    bad: set[tuple[str, Arm]] = set()
    notes: list[str] = []
    for problem in config.problems:
        try:
            built = make(problem.spec)
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise ConfigError(
                config.source, problem.key, f"cannot build {problem.spec}: {e}"
            ) from None
        infos[problem.spec] = problem_info(built)
        for net in config.run.network:
            try:
                ModelClock.check(make_network(net), int(built.n))
            except ValueError as e:
                raise ConfigError(
                    config.source, "run.network", f"{net} on {problem.label}: {e}"
                ) from None
        for arm in config.arms:
            if not arm.applies_to(problem):
                continue
            try:
                make_method(arm.method).bind(built, arm.compressor, arm.stepsize, 0)
            except (ValueError, TypeError) as e:
                if arm.origin == "grid" and config.skip_incompatible:
                    bad.add((problem.spec, arm))
                    notes.append(f"skipped {arm.label} on {problem.label}: {e}")
                    continue
                hint = (
                    " (set grid.skip_incompatible = true to skip impossible grid combinations)"
                    if arm.origin == "grid"
                    else ""
                )
                where = f" on {problem.label}" if len(config.problems) > 1 else ""
                raise ConfigError(
                    config.source, arm.origin, f"{arm.label}{where}: {e}{hint}"
                ) from None
    kept = [r for r in runs if (r.problem.spec, r.arm) not in bad]
    if not kept:
        raise ConfigError(config.source, "grid", "every combination was skipped: nothing to run")
    return kept, notes, infos
