"""One run of a sweep, whichever runtime runs it: ``shrinkgrad run`` (the simulator, in worker
processes) and ``shrinkgrad train`` (torch.distributed ranks) share everything here.

* :func:`prepare_run` builds the run's problem and its absolute stopping tolerance
  (``run.tol_rel`` × ‖∇f(x⁰)‖²); the step-size spec goes to the runtime as written;
  :meth:`PreparedRun.execute` calls :func:`~shrinkgrad.sim.simulate` or
  :func:`~shrinkgrad.distributed.run_distributed` with them;
* :func:`finish_run` turns the result into the run's table (the simulator's columns plus the
  sweep's, :data:`~shrinkgrad.experiments.results.RESULT_COLUMNS`) and its summary
  (``done.json``, one row of ``runs.csv``); :func:`write_run` writes both;
* :func:`no_progress` is the sweep's criterion for a run that ran all its rounds without
  getting anywhere (it ended above its starting loss): :func:`finish_run` records such a run as
  ``no_progress`` instead of ``completed`` (docs/experiments.md, "Run statuses");
* :func:`collect_results` concatenates the finished runs of a config and summarises every run
  (a run that raised is ``failed``, from the ``failed.json`` :func:`write_failure` leaves);
  :func:`run_state` says whether a run directory holds a finished run, a checkpoint or nothing
  (and names the file when a finished run's files cannot be read);
* :func:`execute_run` runs one :class:`RunTask` with the simulator into its directory: what every
  executor (in-process, local worker processes, dask) calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

from .grid import ProblemInfo, RunSpec, build_problem
from .results import (
    CorruptFileError,
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

__all__ = [
    "FAILED",
    "NO_PROGRESS",
    "Emit",
    "PreparedRun",
    "RunTask",
    "collect_results",
    "execute_run",
    "finish_run",
    "no_progress",
    "prepare_run",
    "run_state",
    "warm_up",
    "write_failure",
    "write_run",
]

#: the status of a run that ran all its rounds and ended above its starting loss
#: (:func:`no_progress`): not a result, whatever its last ‖∇f‖² shows
NO_PROGRESS = "no_progress"
#: the status of a run that raised (or whose worker died); its directory keeps the checkpoint
FAILED = "failed"

#: event callback of a running run: ``emit(kind, run_id, payload)`` with kind ``start``
#: (``rounds``, ``label``, ``resumed``), ``progress`` (``round``), ``done`` (the summary)
Emit = Callable[[str, str, dict[str, Any]], None]


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
            **({"network": run.network} if run.network is not None else {}),
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


#: the (problem, dtype, method, compressor, step size) of the runs this process has warmed up
_WARMED: set[tuple[str, ...]] = set()


def warm_up(prepared: PreparedRun) -> None:
    """Run ``prepared``'s run for one untimed round with ``simulate``, once per process and
    kind of run, so that one-off costs — numba loading its compiled kernels, torch's first
    calls, about 0.2–0.4 s here — are not in the first timed run's ``time_s``. Before stop 34
    they were: the first run of each worker started 0.4 s late, and a ``--x time`` plot's
    median over seeds rose where only that seed was left. The round's result is discarded
    (keyed randomness: it changes nothing); an error is left for the timed run to report."""
    from ..sim import simulate

    run = prepared.run
    key = (run.problem.spec, run.settings.dtype, run.arm.method, run.arm.compressor,
           run.arm.stepsize)  # fmt: skip
    if key in _WARMED:
        return
    _WARMED.add(key)
    args = dict(prepared.arguments(), rounds=1, log_every=1, tol=None)
    # an error is raised again by the timed run, where it is reported
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        simulate(**args)


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


def no_progress(table: pd.DataFrame, status: str, dtype: str = "float64") -> str | None:
    """Why a run that ran to its end made no progress (one clause), or None.

    The criterion (conservative on purpose, docs/experiments.md): a ``completed`` run whose last
    logged loss is not finite, or is above its loss at round 0 by more than rounding,
    f(x_T) > f(x⁰) + √eps·|f(x⁰)| (eps of the run's ``dtype``, the rounding level the
    simulator's divergence rule also uses). It ended worse than where it started, so it made no
    progress at all, whatever its last ‖∇f‖² shows (a saturated logistic loss has a small
    gradient while it grows). Only the loss is read: the last ‖∇f‖² of a stochastic method
    fluctuates and may end above its start in a run that converged. Runs that stopped for
    another reason (``converged``, ``diverged``, ``stopped``) keep their status.
    """
    if status != "completed" or "loss" not in table.columns or len(table) < 2:
        return None
    f0, fT = float(table["loss"].iloc[0]), float(table["loss"].iloc[-1])
    if not math.isfinite(f0):
        return None
    if not math.isfinite(fT):
        return f"the loss ended non-finite: f(x_T) = {fT}, f(x⁰) = {f0:.4g}"
    eps = 2.0**-23 if dtype == "float32" else 2.0**-52
    if fT > f0 + math.sqrt(eps) * abs(f0):
        return f"the loss ended above its start: f(x_T) = {fT:.4g} > f(x⁰) = {f0:.4g}"
    return None


def _mark_no_progress(
    table: pd.DataFrame, summary: dict[str, Any], dtype: str
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """``table`` and ``summary`` with the status ``no_progress`` when :func:`no_progress` says
    so (unchanged otherwise)."""
    why = no_progress(table, str(summary.get("status", "")), dtype)
    if why is None:
        return table, summary
    table = table.copy()
    table["status"] = NO_PROGRESS
    old = summary.get("message")
    message = f"{why} (no progress; try a smaller step size)"
    if isinstance(old, str) and old:
        message += f" ({old})"
    return table, {**summary, "status": NO_PROGRESS, "message": message}


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
    if run.network is not None:
        columns["network"] = run.network
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
    if run.network is not None:  # an axis of the grid: its runs.csv rows say which network
        summary["network"] = run.network
        summary["time_model_s"] = float(last["time_model_s"])
    return _mark_no_progress(table, summary, run.settings.dtype)


def write_run(run_dir: Path, table: pd.DataFrame, summary: dict[str, Any], fmt: Format) -> None:
    """Write a finished run: ``table.<fmt>``, then ``done.json`` (which marks it finished)."""
    write_table(table, run_dir / "table", fmt)
    write_json(run_dir / "done.json", summary)


#: the simulator's checkpoint of a run (``shrinkgrad train``'s ranks write ``<it>.rank{r}-of-{W}``)
SIM_CHECKPOINT = "checkpoint.pt"


def checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint a run directory holds: the simulator's and the ranks' (``train``)."""
    sim = run_dir / SIM_CHECKPOINT
    return [*([sim] if sim.exists() else []), *run_dir.glob(SIM_CHECKPOINT + ".rank*")]


def drop_checkpoints(run_dir: Path) -> None:
    """Remove every checkpoint of a finished run, the simulator's and the ranks' (a run
    interrupted under one runtime and finished under the other leaves the first one's)."""
    for p in checkpoints(run_dir):
        p.unlink(missing_ok=True)


def write_failure(run_dir: Path, run_id: str, message: str) -> None:
    """Record that the run raised (``failed.json``): :func:`collect_results` then reports it as
    ``failed`` with ``message`` until it runs again (:func:`execute_run` removes the file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "failed.json", {"run_id": run_id, "status": FAILED, "message": message})


def _failure_message(run_dir: Path) -> str | None:
    """The message of the run's ``failed.json``, or None when it has none (or an unreadable
    one: the run is then reported by its checkpoint, as before)."""
    path = run_dir / "failed.json"
    if not path.exists():
        return None
    try:
        data = read_json(path)
    except (CorruptFileError, OSError):
        return None
    return str(data.get("message", "")) if isinstance(data, dict) else None


RunState = Literal["finished", "checkpoint", "new"]


def run_state(run_dir: Path) -> RunState:
    """``finished`` (a readable ``done.json`` and table), ``checkpoint`` (a simulator or ranks'
    checkpoint to resume) or ``new``. A finished run whose files cannot be read raises
    :class:`~shrinkgrad.experiments.results.CorruptFileError` naming the file and the fix."""
    fix = f"delete the directory {run_dir} to run this run again"
    done = run_dir / "done.json"
    if done.exists():
        try:
            summary = read_json(done)
        except CorruptFileError as e:
            raise e.with_fix(fix) from None
        if not isinstance(summary, dict) or summary.get("run_id") != run_dir.name:
            raise CorruptFileError(done, "it is not the summary of this run", fix)
        if find_run_table(run_dir) is None:
            raise CorruptFileError(done, "the run's table.parquet/table.csv is missing", fix)
        return "finished"
    if checkpoints(run_dir):
        return "checkpoint"
    return "new"


def _read_finished(run_dir: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    fix = f"delete the directory {run_dir} to run this run again"
    path = find_run_table(run_dir)
    if path is None:
        raise CorruptFileError(run_dir / "done.json", "the run's table is missing", fix)
    try:
        return read_table(path), read_json(run_dir / "done.json")
    except CorruptFileError as e:
        raise e.with_fix(fix) from None


def collect_results(
    out_dir: Path,
    runs: Sequence[RunSpec],
    experiment: str,
    cache: dict[str, tuple[pd.DataFrame, dict[str, Any]]] | None = None,
    failures: dict[str, str] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Concatenate the finished runs' tables (config order) and summarise every run.

    The presentation columns (``problem_label``, ``experiment``) are taken from the current
    config, so relabelling a problem does not require re-running it. A run that has not finished
    is ``failed`` (with its error as ``message``) when it raised — it is in ``failures`` (run id
    → message) or left a ``failed.json`` (:func:`write_failure`) —, ``interrupted`` when it left
    a checkpoint (the simulator's ``checkpoint.pt`` or the ranks' ``checkpoint.pt.rank*``), else
    ``pending``. A finished ``completed`` run that made no progress (:func:`no_progress`, also
    for directories written before the criterion existed) is ``no_progress``. ``cache`` (run id →
    (table, summary)) keeps the finished runs already read, so a sweep can rewrite its results
    often.
    """
    failures = failures or {}
    cache = {} if cache is None else cache
    tables = []
    rows = []
    for r in runs:
        run_dir = out_dir / "runs" / r.run_id
        base = {
            "run_id": r.run_id,
            "problem": r.problem.label,
            "method": r.arm.method,
            "compressor": r.arm.compressor,
            "stepsize_spec": r.arm.stepsize,
            "seed_index": r.seed_index,
            "seed": r.seed,
        }
        if r.run_id not in cache:
            if find_run_table(run_dir) is None:
                message = failures.get(r.run_id, _failure_message(run_dir))
                if message is not None:
                    rows.append({**base, "status": FAILED, "message": message})
                    continue
                started = bool(checkpoints(run_dir))
                rows.append({**base, "status": "interrupted" if started else "pending"})
                continue
            cache[r.run_id] = _mark_no_progress(*_read_finished(run_dir), r.settings.dtype)
        table, done = cache[r.run_id]
        t = table.copy()
        t["problem_label"] = r.problem.label
        t["experiment"] = experiment
        tables.append(t)
        rows.append({**base, **{k: v for k, v in done.items() if k not in base}})
    return concat_tables(tables), pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# one run with the simulator (what every executor calls)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunTask:
    """One run of a sweep with everything a worker (local or remote) needs to execute it."""

    run: RunSpec
    run_dir: str
    info: ProblemInfo
    experiment: str
    fmt: Format


@lru_cache(maxsize=2)
def _problem(spec: str, dtype: str) -> Any:
    return build_problem(spec, dtype)


def execute_run(
    task: RunTask,
    emit: Emit,
    progress_every: float = 0.25,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run ``task`` with the simulator into its directory (resuming its checkpoint) and return
    its summary.

    Idempotent: a run that already finished there (another worker got to it first, or a worker
    died after writing it) returns its summary without running again. Writes ``run.json``, then
    (through the simulator) ``checkpoint.pt``; when the run ends ``table.<fmt>`` and ``done.json``
    (each atomically), and removes the checkpoint. A KeyboardInterrupt leaves the checkpoint and
    propagates; ``should_stop()`` returning True at a logged round is one (a worker asked to stop
    stops at a safe point, not in the middle of a library call).
    """
    from ..sim import simulate

    run, run_dir = task.run, Path(task.run_dir)
    s = run.settings
    state = run_state(run_dir)
    if state == "finished":
        summary: dict[str, Any] = read_json(run_dir / "done.json")
        emit("done", run.run_id, summary)
        return summary
    (run_dir / "failed.json").unlink(missing_ok=True)  # an earlier attempt's error: retried now
    write_json(run_dir / "run.json", {"run_id": run.run_id, "label": run.label, **run.identity()})
    prepared = prepare_run(run, _problem(run.problem.spec, s.dtype))
    emit(
        "start",
        run.run_id,
        # only the simulator's own checkpoint resumes here (the ranks' of ``shrinkgrad train``
        # hold each process's clients: this run starts from round 0 and drops them when done)
        {"rounds": s.rounds, "label": run.label, "resumed": (run_dir / SIM_CHECKPOINT).exists()},
    )
    last = [0.0]

    def callback(r: int, _state: Any) -> bool:
        if should_stop is not None and should_stop():
            raise KeyboardInterrupt
        now = time.monotonic()
        if now - last[0] >= progress_every:
            last[0] = now
            emit("progress", run.run_id, {"round": r})
        return False

    warm_up(prepared)
    result, wall = prepared.execute(
        simulate,
        # a run shorter than a checkpoint interval is simply rerun after an interruption
        checkpoint=run_dir / SIM_CHECKPOINT if s.rounds > s.checkpoint_every else None,
        callback=callback,
    )
    table, summary = finish_run(prepared, result, wall, task.info, task.experiment)
    write_run(run_dir, table, summary, task.fmt)
    drop_checkpoints(run_dir)
    emit("done", run.run_id, summary)
    return summary
