"""One run of a sweep, whichever runtime runs it: ``shrinkgrad run`` (the simulator, in worker
processes) and ``shrinkgrad train`` (torch.distributed ranks) share everything here.

* :func:`prepare_run` builds the run's problem and its absolute stopping tolerance
  (``run.tol_rel`` × ‖∇f(x⁰)‖²); the step-size spec goes to the runtime as written;
  :meth:`PreparedRun.execute` calls :func:`~shrinkgrad.sim.simulate` or
  :func:`~shrinkgrad.distributed.run_distributed` with them;
* :func:`finish_run` turns the result into the run's table (the simulator's columns plus the
  sweep's, :data:`~shrinkgrad.experiments.results.RESULT_COLUMNS`) and its summary
  (``done.json``, one row of ``runs.csv``); :func:`write_run` writes both;
* :func:`collect_results` concatenates the finished runs of a config and summarises every run.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from .grid import ProblemInfo, RunSpec, build_problem
from .results import (
    Format,
    concat_tables,
    find_run_table,
    read_json,
    read_table,
    write_json,
    write_table,
)

if TYPE_CHECKING:
    from ..sim import SimResult

__all__ = ["PreparedRun", "collect_results", "finish_run", "prepare_run", "write_run"]


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A run with its problem built, its step size resolved and its tolerance made absolute."""

    run: RunSpec
    problem: Any
    tol: float | None

    @property
    def stepsize(self) -> str:
        """The step-size spec as written in the config; ``Method.bind`` resolves it (the one
        grammar of :mod:`shrinkgrad.methods.stepsize`) and the run records its rule."""
        return self.run.arm.stepsize

    def arguments(self) -> dict[str, Any]:
        """The arguments of ``simulate`` / ``run_distributed`` for this run, except the
        checkpoint and the callback."""
        import torch

        run, s = self.run, self.run.settings
        return {
            "problem": self.problem,
            "method": run.arm.method,
            "compressor": run.arm.compressor,
            "stepsize": self.stepsize,
            "rounds": s.rounds,
            "seed": run.seed,
            "log_every": s.log_every,
            "tol": self.tol,
            "dtype": s.dtype,
            "wire_dtype": getattr(torch, s.wire_dtype),
            "divergence_factor": s.divergence_factor,
            "checkpoint_every": s.checkpoint_every,
        }

    def execute(self, runner: Callable[..., SimResult], **kwargs: Any) -> tuple[SimResult, float]:
        """``runner(**self.arguments(), **kwargs)`` and its wall time in seconds.

        ``runner`` is ``simulate`` or ``run_distributed``; ``kwargs`` adds the checkpoint and the
        callback. Divergence warnings are silenced: the status and message record it.
        """
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            result = runner(**self.arguments(), **kwargs)
        return result, time.perf_counter() - t0


def prepare_run(run: RunSpec, problem: Any = None) -> PreparedRun:
    """Build ``run``'s problem (unless given) and make its tolerance absolute."""
    s = run.settings
    if problem is None:
        problem = build_problem(run.problem.spec, s.dtype)
    tol = s.tol
    if s.tol_rel is not None:
        g0 = problem.grad(problem.x0())
        tol = s.tol_rel * float(g0 @ g0)
    return PreparedRun(run, problem, tol)


def finish_run(
    prepared: PreparedRun,
    result: SimResult,
    wall_s: float,
    info: ProblemInfo,
    experiment: str,
    **extra: Any,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The run's table and summary; ``extra`` entries are appended to the summary."""
    run = prepared.run
    table = result.table.copy()
    columns = {
        "run_id": run.run_id,
        "experiment": experiment,
        "problem_spec": run.problem.spec,
        "problem_label": run.problem.label,
        "stepsize_spec": run.arm.stepsize,
        "seed_index": run.seed_index,
        "status": result.status,
        **info.columns(),
    }
    for k, v in columns.items():
        table[k] = v
    last = table.iloc[-1]
    summary = {
        "run_id": run.run_id,
        "problem": run.problem.label,
        "method": run.arm.method,
        "compressor": run.arm.compressor,
        "stepsize_spec": run.arm.stepsize,
        "stepsize": result.stepsize,
        "stepsize_rule": result.stepsize_rule,
        "seed_index": run.seed_index,
        "seed": run.seed,
        "status": result.status,
        "message": result.message,
        "rounds": int(result.rounds),
        "grad_norm_sq": float(last["grad_norm_sq"]),
        "loss": float(last["loss"]),
        "bits_up": float(last["bits_up"]),
        "wall_s": wall_s,
        **extra,
    }
    return table, summary


def write_run(run_dir: Path, table: pd.DataFrame, summary: dict[str, Any], fmt: Format) -> None:
    """Write a finished run: ``table.<fmt>``, then ``done.json`` (which marks it finished)."""
    write_table(table, run_dir / "table", fmt)
    write_json(run_dir / "done.json", summary)


def collect_results(
    out_dir: Path, runs: Sequence[RunSpec], experiment: str
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Concatenate the finished runs' tables (config order) and summarise every run.

    The presentation columns (``problem_label``, ``experiment``) are taken from the current
    config, so relabelling a problem does not require re-running it. A run that has not finished
    is ``interrupted`` when it left a checkpoint (the simulator's ``checkpoint.pt`` or the ranks'
    ``checkpoint.pt.rank*``), else ``pending``.
    """
    tables = []
    rows = []
    for r in runs:
        run_dir = out_dir / "runs" / r.run_id
        path = find_run_table(run_dir)
        base = {
            "run_id": r.run_id,
            "problem": r.problem.label,
            "method": r.arm.method,
            "compressor": r.arm.compressor,
            "stepsize_spec": r.arm.stepsize,
            "seed_index": r.seed_index,
            "seed": r.seed,
        }
        if path is None:
            started = (run_dir / "checkpoint.pt").exists() or any(
                run_dir.glob("checkpoint.pt.rank*")
            )
            rows.append({**base, "status": "interrupted" if started else "pending"})
            continue
        t = read_table(path)
        t["problem_label"] = r.problem.label
        t["experiment"] = experiment
        tables.append(t)
        done = read_json(run_dir / "done.json")
        rows.append({**base, **{k: v for k, v in done.items() if k not in base}})
    return concat_tables(tables), pd.DataFrame(rows)
