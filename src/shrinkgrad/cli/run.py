"""``shrinkgrad run CONFIG.toml --out DIR``: run a grid of simulations described in a config.

Example::

    shrinkgrad run sweep.toml --out runs/sweep --jobs 2
    shrinkgrad run sweep.toml --out runs/sweep --set run.rounds=5000 --set 'run.seeds=5'
    shrinkgrad run sweep.toml --dry-run          # validate and list the runs, run nothing
    shrinkgrad run sweep.toml --executor dask    # a dask LocalCluster (shrinkgrad[dask])
    shrinkgrad run sweep.toml --executor "dask[address=tcp://host:8786]"   # an existing cluster

Writes DIR/results.parquet (every run's table), DIR/runs.csv (one row per run),
DIR/config.toml (the resolved config) and DIR/env.json; re-running the same command skips the
finished runs and resumes interrupted ones. The config schema: docs/experiments.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from . import interrupted_status
from .options import (
    format_option,
    jobs_option,
    load_run_config,
    out_option,
    profile_option,
    set_option,
)

if TYPE_CHECKING:
    from ..experiments.grid import ProblemInfo, RunSpec
    from ..experiments.runner import ExperimentResult

__all__ = ["run_cmd"]


@click.command("run")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@out_option("runs/<config name>")
@jobs_option()
@format_option()
@profile_option()
@set_option()
@click.option(
    "--executor",
    default="local",
    show_default=True,
    metavar="SPEC",
    help="where the runs execute: local (--jobs processes), dask (a LocalCluster of --jobs "
    "workers) or dask[address=tcp://host:8786] (an existing dask.distributed scheduler)",
)
@click.option("--dry-run", is_flag=True, help="validate the config and list the runs only")
@click.option("--no-progress", is_flag=True, help="no progress bar or per-run lines")
def run_cmd(
    config: Path,
    out: Path | None,
    jobs: int | None,
    fmt: str | None,
    profile: str | None,
    overrides: tuple[str, ...],
    executor: str,
    dry_run: bool,
    no_progress: bool,
) -> None:
    """Run the grid of simulations described in CONFIG (a TOML file)."""
    from ..experiments.executors import make_executor
    from ..experiments.grid import check_runs, expand

    cfg, out_dir = load_run_config(config, out, profile, overrides)
    execu = make_executor(executor, jobs)  # a bad --executor is an error before anything runs
    if dry_run:
        from ..experiments.runner import check_output_dir

        runs, notes, infos = check_runs(cfg, expand(cfg))
        check_output_dir(cfg, out_dir)
        print_plan(runs, notes, infos, out_dir)
        return
    from ..experiments.runner import run_experiment

    result = run_experiment(
        cfg,
        out_dir,
        jobs=jobs,
        executor=execu,
        fmt=fmt,  # type: ignore[arg-type]
        progress=not no_progress,
        command=["shrinkgrad", *sys.argv[1:]],
    )
    report(result)


#: no-progress runs named one by one after a sweep (the rest are counted; runs.csv has all)
SHOW_NO_PROGRESS = 10


def report(result: ExperimentResult) -> None:
    """Print the outcome of a sweep; exit 1 on failed runs and 130 when interrupted.

    Runs that made no progress (status ``no_progress``: they ended above their starting loss)
    are named in ``warning:`` lines; they are results of the sweep (a step size too large is a
    finding), so they do not change the exit status.
    """
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(summary_line(result))
    for f in result.failed:
        click.echo(f"failed: {f.run.label} [{f.run.run_id}]: {f.message}", err=True)
    from ..experiments.execute import NO_PROGRESS

    runs = result.runs
    flagged = runs[runs["status"] == NO_PROGRESS] if "status" in runs.columns else runs[:0]
    for _, row in flagged.head(SHOW_NO_PROGRESS).iterrows():
        label = f"{row['method']} · {row['compressor']} · γ={row['stepsize_spec']} · seed " + (
            f"{row['seed_index']} · {row['problem']}"
        )
        click.echo(f"warning: no progress: {label} [{row['run_id']}]: {row['message']}", err=True)
    if len(flagged) > SHOW_NO_PROGRESS:
        click.echo(
            f"warning: {len(flagged) - SHOW_NO_PROGRESS} more runs made no progress "
            f"(status no_progress in {result.out / 'runs.csv'})",
            err=True,
        )
    if result.interrupted:
        click.echo(
            "interrupted: finished runs are saved and running ones checkpointed; run the same "
            "command again to resume",
            err=True,
        )
        sys.exit(interrupted_status())
    if result.failed:
        sys.exit(1)


def summary_line(result: ExperimentResult) -> str:
    """``12 runs (11 completed, 1 no progress): 6 started, 3 resumed from checkpoints, 3 already
    finished → …`` (the statuses of runs.csv, ``_`` written as a space)."""
    from ..experiments.display import status_counts

    total = len(result.runs)
    parts = [f"{result.started} started"]
    if result.resumed:
        parts.append(f"{result.resumed} resumed from checkpoints")
    parts.append(f"{result.skipped} already finished")
    left = total - result.skipped - result.ran
    if left:
        parts.append(f"{left} not reached")
    return f"{status_counts(result.runs)}: {', '.join(parts)} → {result.results_path}"


def print_plan(
    runs: list[RunSpec], notes: list[str], infos: dict[str, ProblemInfo], out_dir: Path
) -> None:
    """Print the runs a config would do (and which already finished) and its problems."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..experiments.results import find_run_table

    console = Console(width=160)
    for note in notes:
        console.print(f"note: {escape(note)}")
    table = Table(title=escape(f"{len(runs)} runs (output: {out_dir})"))
    networks = any(r.network is not None for r in runs)  # an axis of the grid: a column
    columns = ["run id", "problem", "method", "compressor", "step size"]
    for col in [*columns, *(["network"] if networks else []), "seed", "state"]:
        table.add_column(col)
    for r in runs:
        done = find_run_table(out_dir / "runs" / r.run_id) is not None
        cells = [
            r.run_id,
            r.problem.label,
            r.arm.method,
            r.arm.compressor,
            r.arm.stepsize,
            *([r.network or ""] if networks else []),
            str(r.seed_index),
            "finished" if done else "to run",
        ]
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
    ptable = Table(title="problems")
    for col in ("problem", "n", "d", "L", "L_AM", "L_QM", "L_var"):
        ptable.add_column(col)
    for spec, info in infos.items():
        ptable.add_row(
            escape(spec),
            str(info.n),
            str(info.d),
            f"{info.L:.4g}",
            f"{info.L_AM:.4g}",
            f"{info.L_QM:.4g}",
            f"{info.L_var:.4g}",
        )
    console.print(ptable)
