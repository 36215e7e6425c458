"""A sweep on torch.distributed ranks: ``shrinkgrad train`` and torchrun.

This is the experiments side of the multi-process runner: imports go one way, experiments →
distributed (:func:`~shrinkgrad.distributed.runner.run_distributed`), never back.

:func:`train_config` is what every rank runs: each run of the config (the grid of
:mod:`shrinkgrad.experiments`, same run ids) goes through :func:`~shrinkgrad.distributed.runner.
run_distributed` on all ranks together, and rank 0 writes the output directory exactly as
``shrinkgrad run`` does — ``DIR/results.<fmt>`` (the simulator's columns plus the sweep's),
``DIR/runs.csv``, ``DIR/config.toml`` and ``DIR/runs/<run-id>/{table.<fmt>,done.json}`` — so
the plotting and reproduction tools read either. Finished runs are skipped when the command is run
again; an interrupted run resumes from its ranks' checkpoints (``runs/<id>/checkpoint.pt.rank*``).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch.distributed as dist

from ..distributed.runner import run_distributed
from ..storage import DirectoryLock, atomic_write, atomic_write_text, probe_writable
from .config import ConfigError, ExperimentConfig, dump_config
from .execute import (
    SIM_CHECKPOINT,
    collect_results,
    finish_run,
    prepare_run,
    warm_up,
    write_run,
)
from .grid import ProblemInfo, RunSpec, build_problem, check_runs, expand
from .results import Format, default_format, find_run_table, write_json, write_table
from .runner import environment

__all__ = ["PROGRESS_EVERY", "check_world", "plan", "train_config"]

#: seconds between progress lines within a run
PROGRESS_EVERY = 5.0


def plan(
    config: ExperimentConfig, problems: dict[str, Any] | None = None
) -> tuple[list[RunSpec], list[str], dict[str, ProblemInfo]]:
    """The runs of ``config`` after the same checks as ``shrinkgrad run`` (ConfigError if not).

    Built problems are stored in ``problems`` (spec → problem) for reuse: ranks forked after this
    call inherit them instead of loading the data again.
    """
    if config.run.network:
        raise ConfigError(
            config.source,
            "run.network",
            "a distributed sweep measures real time; the modelled network (time_model_s) is "
            "for simulated sweeps: run it with `shrinkgrad run`, or drop run.network",
        )
    cache = problems if problems is not None else {}

    def build(spec: str) -> Any:
        if spec not in cache:
            cache[spec] = build_problem(spec, config.run.dtype)
        return cache[spec]

    return check_runs(config, expand(config), build=build)


def check_world(
    config: ExperimentConfig,
    runs: list[RunSpec],
    infos: dict[str, ProblemInfo],
    out: str | Path,
    world: int,
    what: str = "--nproc",
) -> None:
    """Refuse, before any process starts, what cannot run on ``world`` ranks.

    Every rank needs at least one client (n ≥ world for every problem), and an interrupted run
    resumes only on the number of ranks that wrote its checkpoints (``checkpoint.pt.rank*-of-W``:
    each rank holds its own clients' state). Raises a ConfigError / ValueError naming the problem
    or the run directory and what to do.
    """
    from .config import ConfigError

    for spec, info in infos.items():
        if info.n < world:
            case = next(p for p in config.problems if p.spec == spec)
            raise ConfigError(
                config.source,
                case.key,
                f"{what} {world}: {case.label} has n={info.n} clients, and every process needs at "
                f"least one; use {what} <= {info.n} or n_clients >= {world}",
            )
    from ..compressors import make_compressor
    from ..distributed.runner import check_compressor_spans

    for spec in sorted({run.arm.compressor for run in runs if run.arm.compressor}):
        try:
            C = make_compressor(spec)
        except (TypeError, ValueError):  # not a compressor (a method without one): plan() checked
            continue
        try:
            check_compressor_spans(C, world)
        except ValueError as e:
            raise ValueError(f"{what} {world}: {e}") from None
    out_dir = Path(out)
    for run in runs:
        run_dir = out_dir / "runs" / run.run_id
        if find_run_table(run_dir) is not None:
            continue
        worlds = sorted(
            {int(p.name.rsplit("-of-", 1)[1]) for p in run_dir.glob(f"{SIM_CHECKPOINT}.rank*-of-*")}
        )
        other = [w for w in worlds if w != world]
        if other:
            raise ValueError(
                f"{run_dir}: this run was interrupted on {other[0]} processes (its checkpoints "
                f"checkpoint.pt.rank*-of-{other[0]} hold each process's clients); resume it with "
                f"{what} {other[0]}, or delete those files to start it again on {world}"
            )


def train_config(
    config: ExperimentConfig,
    out: str | Path,
    *,
    fmt: Format | None = None,
    problems: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every: float = PROGRESS_EVERY,
    command: list[str] | None = None,
    locked: bool = False,
) -> pd.DataFrame | None:
    """Run every run of ``config`` on the ranks of the default process group into ``out``.

    Call on every rank. Returns the results table on rank 0 (None elsewhere). ``problems``
    (spec → built problem) avoids rebuilding problems already built in this process; ``log``
    receives one line per run on rank 0, ``progress`` one line (``run-id label: round r/R``)
    at most every ``progress_every`` seconds within a run, on rank 0. Rank 0 checks the world
    size (:func:`check_world`) and that ``out`` takes files, locks it (unless ``locked``: the
    launcher holds the lock) and writes ``config.toml`` and ``env.json`` (``command`` recorded).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(out)
    fmt = fmt or default_format()
    cache = problems if problems is not None else {}
    runs, _, infos = plan(config, cache)
    todo_ids: list[Any] = [None]
    lock = DirectoryLock(out_dir) if rank == 0 and locked is False else None
    env: dict[str, Any] = {}
    if rank == 0:
        try:  # every rank must hear about a failure here, or the others wait in the broadcast
            check_world(config, runs, infos, out_dir, world, "the world size")
            probe_writable(out_dir)
            if lock is not None:
                lock.acquire()
            atomic_write_text(out_dir / "config.toml", dump_config(config))
            env = environment(config, world, command)
            env.update(executor=f"torch.distributed ({dist.get_backend()}, {world} ranks)")
            env["world_size"] = world
            env["started"] = _now()
            write_json(out_dir / "env.json", env)
            todo_ids[0] = [
                r.run_id for r in runs if find_run_table(out_dir / "runs" / r.run_id) is None
            ]
        except Exception as e:
            todo_ids[0] = e
    dist.broadcast_object_list(todo_ids, src=0)  # rank 0's file system decides what is left
    if isinstance(todo_ids[0], Exception):
        if lock is not None:
            lock.release()
        raise todo_ids[0]
    try:
        return _train(
            config,
            out_dir,
            runs,
            infos,
            set(todo_ids[0]),
            fmt,
            cache,
            env,
            log,
            progress,
            progress_every,
        )
    finally:
        if lock is not None:
            lock.release()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _train(
    config: ExperimentConfig,
    out_dir: Path,
    runs: list[RunSpec],
    infos: dict[str, ProblemInfo],
    todo: set[str],
    fmt: Format,
    cache: dict[str, Any],
    env: dict[str, Any],
    log: Callable[[str], None] | None,
    progress: Callable[[str], None] | None,
    progress_every: float,
) -> pd.DataFrame | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for run in runs:
        if run.run_id not in todo:
            continue
        tick = _ticker(run, progress, progress_every) if rank == 0 and progress else None
        summary = _one_run(
            run, out_dir, infos[run.problem.spec], config.name, fmt, cache, world, tick
        )
        if rank == 0 and log is not None:
            log(
                f"{run.run_id} {run.label}: {summary['status']} after {summary['rounds']} rounds, "
                f"grad_norm_sq={summary['grad_norm_sq']:.4g}, {summary['wall_s']:.1f} s on "
                f"{world} ranks"
            )
    dist.barrier()
    if rank != 0:
        return None
    table, _ = save_results(config, out_dir, runs, fmt)
    env["finished"] = _now()
    env["runs"] = {"total": len(runs), "already_finished": len(runs) - len(todo), "ran": len(todo)}
    write_json(out_dir / "env.json", env)
    return table


def save_results(
    config: ExperimentConfig, out_dir: Path, runs: list[RunSpec], fmt: Format | None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Write ``results.<fmt>`` (the finished runs' tables) and ``runs.csv`` (every run's
    status: an unfinished run with its ranks' checkpoints is ``interrupted``), as ``run`` does;
    returns both tables. Called by rank 0 at the end, and by the launcher after a Ctrl-C."""
    table, summary_table = collect_results(out_dir, runs, config.name)
    write_table(table, out_dir / "results", fmt or default_format())
    atomic_write(out_dir / "runs.csv", lambda p: summary_table.to_csv(p, index=False))
    return table, summary_table


def _one_run(
    run: RunSpec,
    out_dir: Path,
    info: ProblemInfo,
    experiment: str,
    fmt: Format,
    cache: dict[str, Any],
    world: int,
    tick: Callable[[int, Any], None] | None = None,
) -> dict[str, Any]:
    """One run on every rank (the same columns and files as the simulator's sweep runner);
    ``tick(round, state)`` is called after every round (progress)."""
    rank = dist.get_rank()
    run_dir = out_dir / "runs" / run.run_id
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        ident = {"run_id": run.run_id, "label": run.label, **run.identity(), "world_size": world}
        write_json(run_dir / "run.json", ident)
    dist.barrier()
    prepared = prepare_run(run, cache.get(run.problem.spec))
    cache[run.problem.spec] = prepared.problem
    warm_up(prepared)  # this process's one-off costs out of the timed run (as run's workers)
    result, wall = prepared.execute(
        run_distributed, checkpoint=run_dir / SIM_CHECKPOINT, callback=tick
    )
    table, summary = finish_run(prepared, result, wall, info, experiment, world_size=world)
    dist.barrier()  # every rank saved its final checkpoint
    if rank == 0:
        write_run(run_dir, table, summary, fmt)
        (run_dir / SIM_CHECKPOINT).unlink(missing_ok=True)  # a simulator run's, interrupted
    for p in run_dir.glob(f"{SIM_CHECKPOINT}.rank{rank}-of-*"):
        p.unlink(missing_ok=True)
    return summary


def _ticker(run: RunSpec, show: Callable[[str], None], every: float) -> Callable[[int, Any], None]:
    """A round callback that shows ``run-id label: round r/R`` at most every ``every`` s."""
    last = [time.perf_counter()]
    total = run.settings.rounds

    def tick(r: int, state: Any) -> None:
        now = time.perf_counter()
        if now - last[0] >= every:
            last[0] = now
            show(f"{run.run_id} {run.label}: round {r}/{total}")

    return tick
