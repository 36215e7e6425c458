"""``shrinkgrad train CONFIG.toml``: the runs of a config on several torch.distributed processes.

Example::

    shrinkgrad train sweep.toml --nproc 4 --out runs/sweep-dist
    torchrun --standalone --nproc-per-node 4 -m shrinkgrad.distributed sweep.toml --out DIR

The same TOML configs as ``shrinkgrad run`` (docs/experiments.md); each run's clients are spread
over the processes (docs/distributed.md) and the output directory has the same layout and tables
as ``shrinkgrad run`` writes. Without torchrun, ``--nproc`` local gloo processes on 127.0.0.1 are
started (forked); under torchrun (``RANK``/``WORLD_SIZE`` set) this process is one of the ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from .options import format_option, load_run_config, out_option, profile_option, set_option

__all__ = ["INTERRUPTED", "train_cmd"]

#: what an interrupted ``train`` prints before exiting with 130 (``run``'s message: the ranks
#: checkpoint every ``run.checkpoint_every`` rounds, so a run continues from its last one)
INTERRUPTED = (
    "interrupted: finished runs are saved and running ones resume from their last checkpoint; "
    "run the same command again to resume"
)


@click.command("train")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@out_option("runs/<config name>-distributed")
@click.option(
    "--nproc",
    "-n",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="local processes (ignored under torchrun, which sets the world size)",
)
@format_option()
@profile_option()
@set_option()
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0, max=365 * 24 * 3600.0),  # (inf: an overflow in the group)
    callback=lambda ctx, param, value: _finite_seconds(value),
    default=120.0,
    show_default=True,
    help="seconds a collective may wait for a peer before the run fails",
)
@click.option(
    "--no-progress", is_flag=True, help="no progress lines (shown on a terminal, every 5 s)"
)
def train_cmd(
    config: Path,
    out: Path | None,
    nproc: int,
    fmt: str | None,
    profile: str | None,
    overrides: tuple[str, ...],
    timeout: float,
    no_progress: bool,
) -> None:
    """Run the runs of CONFIG (a TOML file) with their clients spread over processes."""
    cfg, out_dir = load_run_config(config, out, profile, overrides, suffix="-distributed")
    show = not no_progress and sys.stderr.isatty()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _under_torchrun(cfg, out_dir, fmt, timeout, show)
        return
    from ..distributed.launch import WorkerError, spawn
    from ..experiments.display import status_counts
    from ..experiments.distributed_sweep import check_world, plan
    from ..experiments.executors import default_jobs
    from ..experiments.runner import check_output_dir
    from ..storage import DirectoryLock, probe_writable

    problems: dict[str, Any] = {}
    runs, notes, infos = plan(cfg, problems)  # checks everything (and loads the data) first
    check_world(cfg, runs, infos, out_dir, nproc)  # ranks > clients, a resume on other --nproc
    check_output_dir(cfg, out_dir)  # not the results of another experiment (as run does)
    probe_writable(out_dir)
    command = ["shrinkgrad", *sys.argv[1:]]
    for note in notes:
        click.echo(f"note: {note}", err=True)
    cores = default_jobs()
    if nproc > cores:
        click.echo(
            f"note: --nproc {nproc} on {cores} cores: every round's all-reduce waits until the OS "
            f"has scheduled all {nproc} processes (measured: 4 ranks on 2 cores ~15x slower "
            f"per round than the simulator, docs/distributed.md); --nproc {cores} is faster here",
            err=True,
        )
    # (no launch.preload(): it imports torch._dynamo for DDP, which the method runner never uses)
    try:
        with DirectoryLock(out_dir, " ".join(command)):
            try:
                spawn(
                    _rank_main,
                    nproc,
                    (cfg, out_dir, fmt, problems, show, command),
                    timeout=365 * 24 * 3600.0,
                    pg_timeout=timeout,
                )
            except KeyboardInterrupt:  # the ranks are stopped: save what they finished
                _save_interrupted(cfg, out_dir, runs, fmt)
                raise
            except WorkerError as e:
                if all(f.message.startswith("KeyboardInterrupt") for f in e.failures):
                    _save_interrupted(cfg, out_dir, runs, fmt)
                    raise KeyboardInterrupt from None  # the ranks saw the Ctrl-C first
                first = e.failures[0]
                debug = os.environ.get("SHRINKGRAD_DEBUG") and first.traceback
                raise click.ClickException(
                    f"{e}\nfinished runs are saved in {out_dir}; run the same command again to "
                    "resume"
                    + (f"\n\nrank {first.rank}'s traceback:\n{first.traceback}" if debug else "")
                ) from None
    except KeyboardInterrupt:  # Ctrl-C: the ranks are stopped and the lock released
        from . import exit_interrupted

        exit_interrupted(INTERRUPTED)
    import pandas as pd

    counts = status_counts(pd.read_csv(out_dir / "runs.csv"))
    click.echo(f"{counts} on {nproc} processes → {out_dir / 'results'}.{fmt or 'parquet'}")


def _save_interrupted(cfg: Any, out_dir: Path, runs: Any, fmt: Any) -> None:
    """After a Ctrl-C: ``results.*`` and ``runs.csv`` from the finished runs (the others
    ``interrupted`` or ``pending``), and the counts, as ``run`` prints them."""
    import contextlib

    from ..experiments.display import status_counts
    from ..experiments.distributed_sweep import save_results

    with contextlib.suppress(Exception):  # (a full disk, say: the interruption still exits 130)
        _, summary = save_results(cfg, out_dir, runs, fmt)
        click.echo(f"{status_counts(summary)} → {out_dir}", err=True)


def _finite_seconds(value: float) -> float:
    """--timeout's value, refused when it is not a number (nan passes FloatRange)."""
    if value != value:
        raise click.BadParameter("nan is not a number of seconds", param_hint="'--timeout'")
    return value


def _progress_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _rank_main(
    rank: int,
    world: int,
    cfg: Any,
    out_dir: Path,
    fmt: Any,
    problems: dict[str, Any],
    show: bool,
    command: list[str],
) -> None:
    from ..experiments.distributed_sweep import train_config

    def log(line: str) -> None:
        print(line, flush=True)

    progress = _progress_line if show else None
    train_config(
        cfg,
        out_dir,
        fmt=fmt,
        problems=problems,
        log=log,
        progress=progress,
        command=command,
        locked=True,
    )


def _under_torchrun(cfg: Any, out_dir: Path, fmt: Any, timeout: float, show: bool) -> None:
    import torch.distributed as dist

    from ..distributed.launch import init_from_env, worker_setup
    from ..experiments.distributed_sweep import train_config

    worker_setup(int(os.environ.get("SHRINKGRAD_THREADS", "1")))
    rank, world = init_from_env(timeout=timeout)
    try:
        progress = _progress_line if show else None
        train_config(
            cfg,
            out_dir,
            fmt=fmt,
            log=lambda line: click.echo(line),
            progress=progress,
            command=["torchrun", "-m", "shrinkgrad.distributed", *sys.argv[1:]],
        )
        if rank == 0:
            click.echo(f"{world} processes → {out_dir / 'results'}.{fmt or 'parquet'}")
    finally:
        dist.destroy_process_group()
