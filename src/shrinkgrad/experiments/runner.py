"""The sweep runner: every run of a config, resumable, crash-safe, on any executor.

:func:`run_experiment` validates the config (:func:`~shrinkgrad.experiments.grid.check_runs`),
checks by writing that the output directory takes files (:func:`~shrinkgrad.storage.
probe_writable`) and locks it against a second sweep (:class:`~shrinkgrad.storage.DirectoryLock`),
skips runs that already finished there, resumes interrupted ones from their checkpoints and runs
the rest on an executor (:mod:`~shrinkgrad.experiments.executors`: this process, local worker
processes, or a dask cluster). Every file is written atomically; ``results.parquet`` and
``runs.csv`` are rewritten from the finished runs while the sweep goes (at most every
``flush_every`` seconds) and at the end, so a sweep killed at any moment leaves a readable results
file of complete runs, and running the same command again finishes it with the table of an
uninterrupted sweep. On Ctrl-C the workers save their checkpoints and stop. A run that raises is
recorded as ``failed`` with its error (``runs.csv``); an output directory that holds the results
of another experiment is refused (:func:`check_output_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from ..storage import (
    DirectoryLock,
    StorageError,
    atomic_write,
    is_file,
    probe_writable,
    remove_stale_temporaries,
)
from .config import ExperimentConfig, dump_config
from .execute import NO_PROGRESS, RunTask, collect_results, run_state, write_failure
from .executors import Executor, default_jobs, make_executor
from .grid import RunSpec, check_runs, expand
from .results import Format, default_format, write_json, write_table

__all__ = [
    "ExperimentResult",
    "OtherExperimentError",
    "RunFailure",
    "check_output_dir",
    "default_jobs",
    "duplicate_seed_notes",
    "environment",
    "run_experiment",
]

#: event callback: ``emit(kind, run_id, payload)``
Emit = Callable[[str, str, dict[str, Any]], None]
#: statuses of a finished run (``no_progress``: ran all its rounds and ended above its start)
FINISHED = ("completed", "converged", "diverged", "stopped", NO_PROGRESS)


class OtherExperimentError(ValueError):
    """``--out`` holds the results of another experiment (:func:`check_output_dir`)."""


def _experiment_of(name: str, source: str) -> str:
    """What names an experiment: its config's ``name``, else its config file's stem (the
    default output directory ``runs/<name>`` is named the same way)."""
    return name or Path(source).stem


def check_output_dir(config: ExperimentConfig, out: str | os.PathLike[str]) -> None:
    """Refuse an output directory that holds the results of another experiment.

    Writing there would replace its ``results.*``, ``runs.csv`` and ``config.toml`` and leave the
    rest (a reproduction's ``summary.json`` and figures, plots): a directory that contradicts
    itself. The directory's experiment is read from its ``env.json`` (or ``config.toml``). It
    is the same experiment when the configs determine the same runs (the same fingerprint: a
    resume), or when they have the same ``name`` (for a config without one: the same file stem),
    so an edited config (more rounds, another method) still writes into its own directory, and
    its finished runs are reused. Raises :class:`OtherExperimentError` (a ValueError) saying what
    to do.
    """
    d = Path(out)
    env_path, cfg_path = d / "env.json", d / "config.toml"
    old_name: str | None = None
    old_source, old_fp = "", ""
    try:
        if env_path.is_file():
            env = json.loads(env_path.read_text(encoding="utf-8"))
            if isinstance(env, dict):
                old_name = str(env.get("experiment") or "")
                old_source = str(env.get("config") or "")
                old_fp = str(env.get("config_fingerprint") or "")
        elif cfg_path.is_file():
            if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
                import tomllib
            else:  # pragma: no cover - version dependent
                import tomli as tomllib
            doc = tomllib.loads(cfg_path.read_text(encoding="utf-8"))
            old_name, old_source = str(doc.get("name") or ""), str(cfg_path)
    except (OSError, ValueError):
        return  # unreadable: nothing to compare (the sweep reports corrupt run files itself)
    if old_name is None or (old_fp and old_fp == config.fingerprint):
        return
    old = _experiment_of(old_name, old_source)
    new = _experiment_of(config.name, config.source)
    if old == new:
        return
    raise OtherExperimentError(
        f"--out {str(d)!r} holds the results of another experiment ({old!r}, from "
        f"{old_source or cfg_path}); writing {new!r} there would replace its results.*, "
        "runs.csv and config.toml but leave the rest: give another --out, or delete or move "
        f"{str(d)!r} first"
    )


@dataclasses.dataclass
class RunFailure:
    """A run that raised (its directory keeps the checkpoint, so a re-run retries it)."""

    run: RunSpec
    message: str
    traceback: str = ""


@dataclasses.dataclass
class ExperimentResult:
    """What :func:`run_experiment` did.

    ``table``: the results table of every finished run of the config (also in
    ``DIR/results.*``); ``runs``: one row per run (``DIR/runs.csv``); ``ran``: runs executed by
    this call, of which ``resumed`` continued from a checkpoint (``ran - resumed`` started from
    round 0); ``skipped``: runs that had finished before this call; ``failed``: runs that raised
    or whose worker died; ``interrupted``: whether Ctrl-C stopped the sweep (re-run to resume);
    ``notes``: combinations the config asked to skip, and arms whose seeds gave identical runs.
    """

    config: ExperimentConfig
    out: Path
    table: pd.DataFrame
    runs: pd.DataFrame
    ran: int
    skipped: int
    failed: list[RunFailure]
    interrupted: bool
    notes: list[str]
    results_path: Path
    resumed: int = 0
    executor: str = ""

    @property
    def complete(self) -> bool:
        """All runs of the config finished."""
        return not self.failed and not self.interrupted

    @property
    def started(self) -> int:
        """Runs of this call that started from round 0."""
        return self.ran - self.resumed


# --------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------
def run_experiment(
    config: ExperimentConfig,
    out: str | os.PathLike[str],
    *,
    jobs: int | None = None,
    fmt: Format | None = None,
    progress: bool = True,
    command: Sequence[str] | None = None,
    display: Any = None,
    executor: str | Executor | None = None,
    flush_every: float = 10.0,
) -> ExperimentResult:
    """Run every run of ``config`` into the directory ``out`` and return the results.

    ``jobs``: worker processes of the default ``local`` executor (default: the number of cores;
    1 runs in this process) and the default size of a dask ``LocalCluster``; ``executor``: where
    the runs execute (``"local"``, ``"dask"``, ``"dask[address=tcp://host:8786]"``, or an
    :class:`~shrinkgrad.experiments.executors.Executor`); ``fmt``: ``"parquet"`` (default when
    pyarrow is available) or ``"csv"`` for the tables; ``progress``: show a progress bar (on a
    terminal) or one line per finished run (otherwise); ``command``: recorded in env.json
    (default ``sys.argv``); ``flush_every``: seconds between rewrites of ``results.*`` while the
    sweep runs. Finished runs already in ``out`` are skipped; interrupted ones resume from their
    checkpoints.

    Raises, before running anything: :class:`~shrinkgrad.experiments.config.ConfigError` when
    the config cannot run; :class:`OtherExperimentError` when ``out`` holds the results of another
    experiment (:func:`check_output_dir`); :class:`~shrinkgrad.storage.StorageError` when
    ``out`` cannot be
    written (read-only, full, a name too long) or another process is using it
    (:class:`~shrinkgrad.storage.DirectoryBusy`);
    :class:`~shrinkgrad.experiments.results.CorruptFileError` when a finished run's files in
    ``out`` cannot be read. A disk that fills up during the sweep stops it with a StorageError
    (finished runs are kept; running ones keep their last checkpoint).
    """
    from .display import make_display

    out_dir = Path(out)
    if is_file(out_dir):
        raise NotADirectoryError(f"--out {str(out_dir)!r} is a file; give a directory")
    fmt = fmt or default_format()
    runs = expand(config)
    runs, notes, infos = check_runs(config, runs)
    execu = make_executor(executor, jobs)
    check_output_dir(config, out_dir)
    probe_writable(out_dir)
    with DirectoryLock(out_dir, " ".join(command) if command is not None else ""):
        return _sweep(
            config,
            out_dir,
            runs,
            notes,
            infos,
            execu,
            fmt,
            progress,
            command,
            display,
            flush_every,
            make_display,
        )


def _sweep(
    config: ExperimentConfig,
    out_dir: Path,
    runs: list[RunSpec],
    notes: list[str],
    infos: dict[str, Any],
    execu: Executor,
    fmt: Format,
    progress: bool,
    command: Sequence[str] | None,
    display: Any,
    flush_every: float,
    make_display: Callable[..., Any],
) -> ExperimentResult:
    remove_stale_temporaries(out_dir)
    for run in runs:
        remove_stale_temporaries(out_dir / "runs" / run.run_id)
    atomic_write(out_dir / "config.toml", lambda p: p.write_text(dump_config(config), "utf-8"))
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    states = {r.run_id: run_state(out_dir / "runs" / r.run_id) for r in runs}
    todo = [r for r in runs if states[r.run_id] != "finished"]
    cache: dict[str, Any] = {}
    collect_results(out_dir, runs, config.name, cache)  # reads (checks) every finished run now
    env = environment(config, execu.workers(len(todo) or 1), command)
    env["executor"] = execu.describe()
    env["started"] = started
    write_json(out_dir / "env.json", env)

    disp = display or make_display(progress, total=len(runs), done=len(runs) - len(todo))
    by_id = {r.run_id: r for r in runs}
    failed: list[RunFailure] = []
    failures: dict[str, str] = {}  # run id → message of the runs that raised in this call
    ran: set[str] = set()
    resumed: set[str] = set()
    last_flush = [time.monotonic()]

    def flush() -> tuple[pd.DataFrame, pd.DataFrame, Path]:
        table, summary = collect_results(out_dir, runs, config.name, cache, failures)
        path = write_table(table, out_dir / "results", fmt)
        atomic_write(out_dir / "runs.csv", lambda p: summary.to_csv(p, index=False))
        last_flush[0] = time.monotonic()
        return table, summary, path

    def emit(kind: str, run_id: str, payload: dict[str, Any]) -> None:
        run = by_id.get(run_id)
        if run is None:  # pragma: no cover - events only come for our runs
            return
        if kind == "start":
            ran.add(run_id)
            if payload.get("resumed"):
                resumed.add(run_id)
        if kind == "failed":
            ran.add(run_id)  # attempted by this call, even when it failed before its start
            failed.append(RunFailure(run, payload["message"], payload.get("traceback", "")))
            failures[run_id] = payload["message"]
            with contextlib.suppress(OSError, StorageError):  # runs.csv has it in any case
                write_failure(out_dir / "runs" / run_id, run_id, payload["message"])
        disp.event(kind, run, payload)
        if kind == "done" and time.monotonic() - last_flush[0] >= flush_every:
            flush()

    tasks = [
        RunTask(r, str(out_dir / "runs" / r.run_id), infos[r.problem.spec], config.name, fmt)
        for r in todo
    ]
    interrupted = False
    try:
        disp.start()
        if tasks:
            interrupted = execu.run(tasks, emit)
    except StorageError:
        disp.stop()
        with contextlib.suppress(StorageError, ValueError):  # keep what finished, if possible
            flush()
        raise
    finally:
        disp.stop()
    table, summary, results_path = flush()
    notes = notes + duplicate_seed_notes(table, runs)
    env["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env["runs"] = {
        "total": len(runs),
        "finished": int(summary["status"].isin(FINISHED).sum()),
        "already_finished": len(runs) - len(todo),
        "ran": len(ran),
        "resumed": len(resumed),
        "failed": len(failed),
        "interrupted": interrupted,
    }
    write_json(out_dir / "env.json", env)
    return ExperimentResult(
        config=config,
        out=out_dir,
        table=table,
        runs=summary,
        ran=len(ran),
        skipped=len(runs) - len(todo),
        failed=failed,
        interrupted=interrupted,
        notes=notes,
        results_path=results_path,
        resumed=len(resumed),
        executor=execu.describe(),
    )


#: columns that legitimately differ between the seeds of a deterministic arm
_PER_SEED = ("seed", "seed_index", "run_id", "time_s")


def duplicate_seed_notes(table: pd.DataFrame, runs: Sequence[RunSpec]) -> list[str]:
    """One note per arm whose seeds all gave the same run (nothing in it is random).

    A deterministic compressor (Top-k, identity, scaled sign, ...) with a deterministic method
    (full gradients, every client every round) does not use the seed at all: ``run.seeds = 3``
    then runs three copies. Measured, not predicted: the finished tables of an arm's seeds are
    compared (without the seed, run id and time columns).
    """
    groups: dict[tuple[str, str, str, str, str | None], list[RunSpec]] = {}
    for r in runs:
        key = (r.problem.spec, r.arm.method, r.arm.compressor, r.arm.stepsize, r.network)
        groups.setdefault(key, []).append(r)
    by_run = dict(tuple(table.groupby("run_id", sort=False))) if len(table) else {}
    same: dict[str, tuple[str, int]] = {}
    for group in groups.values():
        if len(group) < 2 or any(r.run_id not in by_run for r in group):
            continue
        frames = [
            by_run[r.run_id]
            .drop(columns=[c for c in _PER_SEED if c in table.columns])
            .reset_index(drop=True)
            for r in group
        ]
        if all(f.equals(frames[0]) for f in frames[1:]):
            label = group[0].arm.label
            count = same.get(label, (label, 0))[1]
            same[label] = (label, max(count, len(group)))
    return [
        f"{label}: its {k} seeds gave identical runs (nothing in this arm is random: a "
        "deterministic compressor and method); one seed is enough (run.seeds = 1, or a "
        "[[pairs]] entry for it)"
        for label, k in same.values()
    ]


# --------------------------------------------------------------------------------------------
# env.json
# --------------------------------------------------------------------------------------------
def environment(
    config: ExperimentConfig, jobs: int, command: Sequence[str] | None = None
) -> dict[str, Any]:
    """Versions, host, cores, git commit, seeds and command line of a sweep (``env.json``)."""
    import numpy
    import scipy
    import torch

    from .. import __version__

    return {
        "experiment": config.name,
        "config": config.source,
        "profile": config.profile,
        "config_fingerprint": config.fingerprint,
        "seed": config.run.seed,
        "seed_indices": list(config.run.seeds),
        "seeds": [config.seed_of(i) for i in config.run.seeds],
        "command": " ".join(command if command is not None else sys.argv),
        "jobs": jobs,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "shrinkgrad": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "pandas": pd.__version__,
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    """The commit of the shrinkgrad source tree (``+dirty`` with local changes), if a checkout."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None
