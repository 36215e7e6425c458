"""The sweep runner: every run of a config in parallel worker processes, resumable.

:func:`run_experiment` validates the config (:func:`~shrinkgrad.experiments.grid.check_runs`),
skips runs that already finished in the output directory, and runs the rest — in this process
when ``jobs == 1``, else in ``jobs`` worker processes started with ``forkserver`` (``spawn``
where that is unavailable): forking a parent that already ran multi-threaded torch code can
hang, and each worker pins its thread pools to one thread (:mod:`._preload`). Every run
checkpoints through the simulator (``DIR/runs/<id>/checkpoint.pt``); on Ctrl-C the workers save
their checkpoint and stop, the results table is rebuilt from the finished runs, and running the
same command again resumes exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd

from .config import ExperimentConfig, dump_config
from .execute import collect_results, finish_run, prepare_run, write_run
from .grid import ProblemInfo, RunSpec, build_problem, check_runs, expand
from .results import Format, default_format, find_run_table, write_json, write_table

__all__ = ["ExperimentResult", "RunFailure", "default_jobs", "environment", "run_experiment"]

#: event callback: ``emit(kind, run_id, payload)``
Emit = Callable[[str, str, dict[str, Any]], None]


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
    ``DIR/results.*``); ``runs``: one row per run (``DIR/runs.csv``); ``skipped``: runs that had
    finished before this call; ``failed``: runs that raised; ``interrupted``: whether Ctrl-C
    stopped the sweep (re-run to resume); ``notes``: combinations the config asked to skip.
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

    @property
    def complete(self) -> bool:
        """All runs of the config finished."""
        return not self.failed and not self.interrupted


def default_jobs() -> int:
    """The number of cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------------------------
# one run (worker side)
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=2)
def _problem(spec: str, dtype: str) -> Any:
    return build_problem(spec, dtype)


def execute_run(
    run: RunSpec,
    run_dir: Path,
    info: ProblemInfo,
    experiment: str,
    fmt: Format,
    emit: Emit,
    progress_every: float = 0.25,
) -> dict[str, Any]:
    """Run one simulation into ``run_dir`` (resuming its checkpoint) and return its summary.

    Writes ``run.json`` first, then (through the simulator) ``checkpoint.pt``; when the run
    ends, ``table.<fmt>`` and ``done.json``, and removes the checkpoint. A KeyboardInterrupt
    leaves the checkpoint and propagates.
    """
    from ..sim import simulate

    s = run.settings
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "run.json", {"run_id": run.run_id, "label": run.label, **run.identity()})
    prepared = prepare_run(run, _problem(run.problem.spec, s.dtype))
    emit("start", run.run_id, {"rounds": s.rounds, "label": run.label})
    last = [0.0]

    def callback(r: int, state: Any) -> bool:
        now = time.monotonic()
        if now - last[0] >= progress_every:
            last[0] = now
            emit("progress", run.run_id, {"round": r})
        return False

    result, wall = prepared.execute(
        simulate,
        # a run shorter than a checkpoint interval is simply rerun after an interruption
        checkpoint=run_dir / "checkpoint.pt" if s.rounds > s.checkpoint_every else None,
        callback=callback,
    )
    table, summary = finish_run(prepared, result, wall, info, experiment)
    write_run(run_dir, table, summary, fmt)
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    emit("done", run.run_id, summary)
    return summary


@dataclasses.dataclass(frozen=True)
class _Task:
    run: RunSpec
    run_dir: str
    info: ProblemInfo
    experiment: str
    fmt: Format


def _worker_main(tasks: Any, events: Any) -> None:
    """Loop of a worker process: take a task, run it, report events; stop on None or Ctrl-C."""
    from ._preload import pin_threads  # threads = 1, heavy imports

    pin_threads()  # again: a forkserver started by someone else may not have preloaded us

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # terminate = Ctrl-C: checkpoint

    def emit(kind: str, run_id: str, payload: dict[str, Any]) -> None:
        if kind == "start":
            payload = {**payload, "pid": os.getpid()}
        events.put((kind, run_id, payload))

    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            try:
                execute_run(
                    task.run, Path(task.run_dir), task.info, task.experiment, task.fmt, emit
                )
            except KeyboardInterrupt:
                emit("interrupted", task.run.run_id, {})
                break
            except Exception as e:  # report and go on with the next run
                emit(
                    "failed",
                    task.run.run_id,
                    {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()},
                )
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _context() -> Any:
    methods = mp.get_all_start_methods()
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["shrinkgrad.experiments._preload"])
        return ctx
    return mp.get_context("spawn")  # pragma: no cover - Windows


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
) -> ExperimentResult:
    """Run every run of ``config`` into the directory ``out`` and return the results.

    ``jobs``: worker processes (default: the number of cores; 1 runs in this process);
    ``fmt``: ``"parquet"`` (default when pyarrow is available) or ``"csv"`` for the tables;
    ``progress``: show a progress bar (on a terminal) or one line per finished run (otherwise);
    ``command``: recorded in env.json (default ``sys.argv``). Finished runs already in ``out``
    are skipped; interrupted ones resume from their checkpoints. Raises
    :class:`~shrinkgrad.experiments.config.ConfigError` before running anything when the config
    cannot run.
    """
    from .display import make_display

    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {str(out_dir)!r} is a file; give a directory")
    fmt = fmt or default_format()
    runs = expand(config)
    runs, notes, infos = check_runs(config, runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.toml").write_text(dump_config(config), encoding="utf-8")
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    todo = [r for r in runs if find_run_table(out_dir / "runs" / r.run_id) is None]
    n_jobs = max(1, min(jobs or default_jobs(), len(todo) or 1))
    env = environment(config, n_jobs, command)
    env["started"] = started
    write_json(out_dir / "env.json", env)

    disp = display or make_display(progress, total=len(runs), done=len(runs) - len(todo))
    by_id = {r.run_id: r for r in runs}
    failed: list[RunFailure] = []
    interrupted = False

    def emit(kind: str, run_id: str, payload: dict[str, Any]) -> None:
        run = by_id.get(run_id)
        if run is None:  # pragma: no cover - events only come for our runs
            return
        if kind == "failed":
            failed.append(RunFailure(run, payload["message"], payload.get("traceback", "")))
        disp.event(kind, run, payload)

    tasks = [
        _Task(r, str(out_dir / "runs" / r.run_id), infos[r.problem.spec], config.name, fmt)
        for r in todo
    ]
    try:
        disp.start()
        if tasks and n_jobs == 1:
            interrupted = _run_here(tasks, emit)
        elif tasks:
            interrupted = _run_pool(tasks, n_jobs, emit)
    finally:
        disp.stop()
    table, summary = collect_results(out_dir, runs, config.name)
    results_path = write_table(table, out_dir / "results", fmt)
    summary.to_csv(out_dir / "runs.csv", index=False)
    env["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env["runs"] = {
        "total": len(runs),
        "finished": int(
            summary["status"].isin(["completed", "converged", "diverged", "stopped"]).sum()
        ),
        "failed": len(failed),
        "interrupted": interrupted,
    }
    write_json(out_dir / "env.json", env)
    return ExperimentResult(
        config=config,
        out=out_dir,
        table=table,
        runs=summary,
        ran=len(todo),
        skipped=len(runs) - len(todo),
        failed=failed,
        interrupted=interrupted,
        notes=notes,
        results_path=results_path,
    )


def _run_here(tasks: list[_Task], emit: Emit) -> bool:
    """Run the tasks one after another in this process; True when interrupted."""
    for task in tasks:
        try:
            execute_run(task.run, Path(task.run_dir), task.info, task.experiment, task.fmt, emit)
        except KeyboardInterrupt:
            emit("interrupted", task.run.run_id, {})
            return True
        except Exception as e:
            emit(
                "failed",
                task.run.run_id,
                {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()},
            )
    return False


def _run_pool(tasks: list[_Task], jobs: int, emit: Emit) -> bool:
    """Run the tasks in ``jobs`` worker processes; True when interrupted."""
    ctx = _context()
    task_q = ctx.Queue()
    event_q = ctx.Queue()
    for t in tasks:
        task_q.put(t)
    for _ in range(jobs):
        task_q.put(None)
    pending = {t.run.run_id for t in tasks}
    current: dict[int, str] = {}  # worker pid -> run id it is running
    workers: list[Any] = []

    def start_worker() -> None:
        p = ctx.Process(target=_worker_main, args=(task_q, event_q), daemon=True)
        p.start()
        workers.append(p)

    def handle(event: tuple[str, str, dict[str, Any]]) -> None:
        kind, run_id, payload = event
        if kind == "start":
            current[payload.get("pid", -1)] = run_id
        if kind in ("done", "failed", "interrupted"):
            pending.discard(run_id)
        emit(kind, run_id, payload)

    for _ in range(jobs):
        start_worker()
    interrupted = False
    try:
        while pending:
            try:
                handle(event_q.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            alive = [p for p in workers if p.is_alive()]
            if len(alive) == len(workers):
                continue
            # a worker exited: normally after its sentinel; abnormally (killed) mid-run
            for p in [p for p in workers if not p.is_alive()]:
                workers.remove(p)
                if p.exitcode not in (0, None):
                    _drain(event_q, handle)
                    lost = _lost_runs(pending, current, p.pid)
                    for run_id in lost:
                        handle(
                            (
                                "failed",
                                run_id,
                                {"message": f"the worker process died (exit code {p.exitcode})"},
                            )
                        )
                    if pending:
                        task_q.put(None)
                        start_worker()
            if not workers:
                _drain(event_q, handle)
                break
    except KeyboardInterrupt:
        interrupted = True
        _stop_workers(workers, event_q, handle)
    finally:
        for p in workers:  # after their sentinel, workers exit by themselves
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        task_q.cancel_join_thread()
        event_q.cancel_join_thread()
    return interrupted


def _lost_runs(pending: set[str], current: dict[int, str], pid: int | None) -> list[str]:
    run_id = current.pop(pid if pid is not None else -1, None)
    return [run_id] if run_id is not None and run_id in pending else []


def _drain(event_q: Any, handle: Callable[[tuple[str, str, dict[str, Any]]], None]) -> None:
    while True:
        try:
            handle(event_q.get_nowait())
        except queue.Empty:
            return


def _stop_workers(
    workers: list[Any], event_q: Any, handle: Callable[[tuple[str, str, dict[str, Any]]], None]
) -> None:
    """Ctrl-C: let every worker save its checkpoint (SIGINT), then wait for them briefly."""
    for p in workers:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # raced with its exit
                os.kill(p.pid, signal.SIGINT)
    deadline = time.monotonic() + 30.0
    while any(p.is_alive() for p in workers) and time.monotonic() < deadline:
        try:
            handle(event_q.get(timeout=0.2))
        except queue.Empty:
            pass
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
            break
    _drain(event_q, handle)


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
