"""One-command reproductions of the papers' claims: a registry of small self-contained entries.

A reproduction (:class:`Reproduction`) is a bundled config (``experiments/configs/<name>.toml``,
with a ``[profiles.quick]`` that finishes in ≤ 2 minutes on 2 cores and a ``[profiles.tiny]``
the test suite runs), a claims function that measures the paper's claims from the results table,
and the figures to draw. :func:`reproduce` runs the config with the sweep runner, draws the
figures, prints nothing, and returns (and writes to ``summary.json``) the claim table.

Adding one (docs/experiments.md, "Adding a reproduction"): write
``experiments/reproductions/<module>.py`` that builds a :class:`Reproduction` and calls
``REPRODUCTIONS.register(...)``, put its config in ``experiments/configs/``, and add the module
name to :data:`MODULES` below.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.resources
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from ..claims import Claim, claims_table
from ..config import ConfigError, ExperimentConfig, load_config
from ..results import Format, write_json

__all__ = [
    "MODULES",
    "REPRODUCTIONS",
    "PlotSpec",
    "Reproduction",
    "ReproductionResult",
    "config_path",
    "reproduce",
]

#: the modules that register reproductions (imported on first use of :data:`REPRODUCTIONS`)
MODULES: list[str] = [
    "ef21w_libsvm",
    "ef21w_synthetic",
    "ef21w_sgd_pp",
    "ef21_vs_ef",
    "k18_quantizers",
    "k18_delays",
    "k18_async",
    "deep_ef",
    "time_to_accuracy",
]


class Outcome(Protocol):
    """What an executor returns: the results table and whether every run finished."""

    @property
    def table(self) -> pd.DataFrame: ...

    @property
    def complete(self) -> bool: ...

    @property
    def interrupted(self) -> bool: ...


#: ``claims(table, params) -> [Claim, ...]``; params = the entry's defaults updated by [claims]
ClaimsFn = Callable[[pd.DataFrame, Mapping[str, Any]], list[Claim]]
#: ``figures(table, params, directory) -> [paths]``: extra figures beyond the :class:`PlotSpec` s
FiguresFn = Callable[[pd.DataFrame, Mapping[str, Any], Path], list[Path]]
#: ``execute(config, out, jobs=, fmt=, progress=, command=) -> Outcome``
ExecuteFn = Callable[..., Outcome]


@dataclasses.dataclass(frozen=True)
class PlotSpec:
    """A convergence figure of :func:`shrinkgrad.plotting.plot_results` to draw."""

    x: str = "bits_paper"
    y: str = "grad_norm_sq"
    name: str | None = None
    logx: bool = False
    facet: str = "problem_label"

    @property
    def stem(self) -> str:
        return self.name or f"{self.y}_vs_{self.x}"


@dataclasses.dataclass(frozen=True)
class Reproduction:
    """A registered reproduction (see the module docstring).

    ``config``: a file name in ``shrinkgrad/experiments/configs`` (or a path);
    ``defaults``: every ``[claims]`` parameter the claims function reads, with its default
    (an unknown key in the config's ``[claims]`` is a config error); ``execute``: how to run
    the config (default: :func:`shrinkgrad.experiments.run_experiment`, the simulator sweep).
    """

    name: str
    title: str
    paper: str
    config: str
    claims: ClaimsFn
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    plots: tuple[PlotSpec, ...] = (PlotSpec(),)
    figures: FiguresFn | None = None
    execute: ExecuteFn | None = None


class ReproductionRegistry:
    """Name → :class:`Reproduction`; the modules of :data:`MODULES` register on first use."""

    def __init__(self) -> None:
        self._entries: dict[str, Reproduction] = {}
        self._loaded = False

    def register(self, rep: Reproduction) -> Reproduction:
        if rep.name in self._entries:
            raise ValueError(f"reproduction {rep.name!r} is registered twice")
        self._entries[rep.name] = rep
        return rep

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in MODULES:
                importlib.import_module(f"{__name__}.{module}")

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> Reproduction:
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._entries), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown reproduction {name!r}; known: {', '.join(self.names())}{hint}"
            ) from None


#: every reproduction, by name
REPRODUCTIONS = ReproductionRegistry()


def config_path(rep: Reproduction) -> Path:
    """The bundled config file of ``rep``."""
    p = Path(rep.config)
    if p.is_absolute():
        return p
    ref = importlib.resources.files("shrinkgrad.experiments") / "configs" / rep.config
    return Path(str(ref))


@dataclasses.dataclass
class ReproductionResult:
    """What :func:`reproduce` measured and wrote."""

    reproduction: Reproduction
    config: ExperimentConfig
    out: Path
    outcome: Outcome
    claims: list[Claim]
    figures: list[Path]
    elapsed_s: float
    summary_path: Path
    #: the command line that ran it (re-running it resumes an interrupted reproduction)
    command: tuple[str, ...] = ()

    @property
    def progress(self) -> tuple[int, int | None]:
        """(runs finished, runs in the config — None when the executor does not say)."""
        table = self.outcome.table
        done = int(table["run_id"].nunique()) if "run_id" in table.columns else 0
        runs = getattr(self.outcome, "runs", None)
        total = len(runs) if isinstance(runs, pd.DataFrame) else None
        return done, total

    @property
    def resume_command(self) -> str:
        """What to run to finish an interrupted reproduction (its own command line again)."""
        import shlex

        if self.command:
            return shlex.join(self.command)
        profile = self.config.profile
        flag = "--quick" if profile == "quick" else f"--profile {profile}" if profile else ""
        words = ["shrinkgrad reproduce", self.reproduction.name, flag, "--out"]
        return " ".join(w for w in words if w) + " " + shlex.quote(str(self.out))

    @property
    def table(self) -> pd.DataFrame:
        """The claim table (claim, measured, criterion, result)."""
        return claims_table(self.claims)

    @property
    def passed(self) -> bool:
        """Claims were measured and none failed."""
        return bool(self.claims) and all(c.passed is not False for c in self.claims)


def claim_params(rep: Reproduction, config: ExperimentConfig) -> dict[str, Any]:
    """The entry's defaults updated by the config's ``[claims]`` (unknown keys are errors)."""
    params = dict(rep.defaults)
    for k, v in config.claims.items():
        if k not in rep.defaults:
            close = difflib.get_close_matches(k, list(rep.defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                config.source,
                f"claims.{k}",
                f"reproduction {rep.name!r} reads no claim parameter {k!r}; it reads: "
                f"{', '.join(rep.defaults) or 'none'}{hint}",
            )
        params[k] = v
    return params


def reproduce(
    name: str | Reproduction,
    out: str | os.PathLike[str] | None = None,
    *,
    quick: bool = False,
    profile: str | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    jobs: int | None = None,
    fmt: Format | None = None,
    progress: bool = True,
    command: Sequence[str] | None = None,
) -> ReproductionResult:
    """Run reproduction ``name``: its config, its claims, its figures and ``summary.json``.

    ``name`` is a registered name (or a :class:`Reproduction`); ``quick`` selects the config's
    ``quick`` profile (``profile`` names any other, e.g. the test suite's ``tiny``);
    ``overrides`` as in :func:`~shrinkgrad.experiments.load_config`; ``out`` defaults to
    ``runs/<name>`` (``runs/<name>-quick`` with ``quick``). When the sweep is interrupted, or no
    run finished, the claims are not measured and ``claims`` is empty (re-run to resume).
    """
    from ..runner import run_experiment

    rep = name if isinstance(name, Reproduction) else REPRODUCTIONS.get(name)
    prof = profile or ("quick" if quick else None)
    cfg = load_config(config_path(rep), profile=prof, overrides=overrides)
    params = claim_params(rep, cfg)
    suffix = f"-{prof}" if prof else ""
    out_dir = Path(out) if out is not None else Path("runs") / f"{rep.name}{suffix}"
    t0 = time.perf_counter()
    execute = rep.execute or run_experiment
    outcome = execute(cfg, out_dir, jobs=jobs, fmt=fmt, progress=progress, command=command)
    claims: list[Claim] = []
    figures: list[Path] = []
    if not outcome.interrupted and not outcome.table.empty:
        table = outcome.table
        claims = rep.claims(table, params)
        figures = draw(rep, table, params, out_dir / "figures")
    elapsed = time.perf_counter() - t0
    summary = {
        "reproduction": rep.name,
        "title": rep.title,
        "paper": rep.paper,
        "config": str(config_path(rep)),
        "profile": prof,
        "out": str(out_dir),
        "complete": outcome.complete,
        "interrupted": outcome.interrupted,
        "elapsed_s": round(elapsed, 1),
        "claims_passed": sum(c.passed is True for c in claims),
        "claims_failed": sum(c.passed is False for c in claims),
        "claims": [c.as_dict() for c in claims],
        "figures": [str(p) for p in figures],
        "claim_parameters": params,
    }
    summary_path = out_dir / "summary.json"
    write_json(summary_path, summary)
    return ReproductionResult(
        rep,
        cfg,
        out_dir,
        outcome,
        claims,
        figures,
        elapsed,
        summary_path,
        tuple(command) if command is not None else (),
    )


def draw(
    rep: Reproduction, table: pd.DataFrame, params: Mapping[str, Any], directory: Path
) -> list[Path]:
    """The figures of ``rep`` for ``table`` (convergence plots, then the entry's own)."""
    from ...plotting import plot_results

    paths: list[Path] = []
    if table.empty:
        return paths
    for spec in rep.plots:
        _, written = plot_results(
            table,
            spec.x,
            spec.y,
            directory / spec.stem,
            facet=spec.facet,
            logx=spec.logx,
            title=f"{rep.title} ({rep.paper})",
        )
        paths += written
    if rep.figures is not None:
        paths += rep.figures(table, params, directory)
    return paths


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
