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

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch.distributed as dist

from ..distributed.runner import run_distributed
from .config import ExperimentConfig, dump_config
from .execute import collect_results, finish_run, prepare_run, write_run
from .grid import ProblemInfo, RunSpec, build_problem, check_runs, expand
from .results import Format, default_format, find_run_table, write_json, write_table

__all__ = ["PROGRESS_EVERY", "plan", "train_config"]

#: seconds between progress lines within a run
PROGRESS_EVERY = 5.0


def plan(
    config: ExperimentConfig, problems: dict[str, Any] | None = None
) -> tuple[list[RunSpec], list[str], dict[str, ProblemInfo]]:
    """The runs of ``config`` after the same checks as ``shrinkgrad run`` (ConfigError if not).

    Built problems are stored in ``problems`` (spec → problem) for reuse: ranks forked after this
    call inherit them instead of loading the data again.
    """
    cache = problems if problems is not None else {}

    def build(spec: str) -> Any:
        if spec not in cache:
            cache[spec] = build_problem(spec, config.run.dtype)
        return cache[spec]

    return check_runs(config, expand(config), build=build)


def train_config(
    config: ExperimentConfig,
    out: str | Path,
    *,
    fmt: Format | None = None,
    problems: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every: float = PROGRESS_EVERY,
) -> pd.DataFrame | None:
    """Run every run of ``config`` on the ranks of the default process group into ``out``.

    Call on every rank. Returns the results table on rank 0 (None elsewhere). ``problems``
    (spec → built problem) avoids rebuilding problems already built in this process; ``log``
    receives one line per run on rank 0, ``progress`` one line (``run-id label: round r/R``)
    at most every ``progress_every`` seconds within a run, on rank 0.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(out)
    fmt = fmt or default_format()
    cache = problems if problems is not None else {}
    runs, _, infos = plan(config, cache)
    todo_ids: list[Any] = [None]
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.toml").write_text(dump_config(config), encoding="utf-8")
        todo_ids[0] = [
            r.run_id for r in runs if find_run_table(out_dir / "runs" / r.run_id) is None
        ]
    dist.broadcast_object_list(todo_ids, src=0)  # rank 0's file system decides what is left
    todo = set(todo_ids[0])
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
    table, summary_table = collect_results(out_dir, runs, config.name)
    write_table(table, out_dir / "results", fmt)
    summary_table.to_csv(out_dir / "runs.csv", index=False)
    return table


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
    result, wall = prepared.execute(
        run_distributed, checkpoint=run_dir / "checkpoint.pt", callback=tick
    )
    table, summary = finish_run(prepared, result, wall, info, experiment, world_size=world)
    dist.barrier()  # every rank saved its final checkpoint
    if rank == 0:
        write_run(run_dir, table, summary, fmt)
    for p in run_dir.glob(f"checkpoint.pt.rank{rank}-of-*"):
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
