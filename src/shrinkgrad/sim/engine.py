"""The run engine shared by :func:`~shrinkgrad.sim.simulate` and the distributed runner.

A run is set up once by :func:`setup_run` — argument checks, the problem, the method bound to it,
x⁰, the table's identifying columns and the checkpoint fingerprint — and driven by
:func:`run_rounds`: ``init``, the rounds, a row every ``log_every`` rounds, the divergence and
convergence verdicts, the callback, checkpoints and the :class:`SimResult` (docs/simulator.md).

What differs between the simulator and a rank of a distributed run is a :class:`Runtime`: where
the clients live and how a round reaches them (the gradient oracle and the reduction), how the
metrics and the bit counters are summed over the clients, and how a checkpoint is found.
:class:`LocalRuntime` holds every client in this process; ``shrinkgrad.distributed.runner`` has
one per rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal, Protocol

import numpy as np
import pandas as pd
import torch

from ..compressors import Compressor
from ..methods.base import BoundMethod, Method, NonFiniteError, State, Traffic, make_method
from ..methods.oracle import ProblemOracle
from ..methods.stepsize import StepSize
from ..problems import Problem
from .checkpoint import load_checkpoint, save_checkpoint

__all__ = [
    "COLUMNS",
    "LocalRuntime",
    "Progress",
    "Row",
    "RunSetup",
    "Runtime",
    "SimResult",
    "SimulationInterrupted",
    "Status",
    "run_rounds",
    "setup_run",
]

Status = Literal["completed", "converged", "diverged", "stopped"]

#: the columns of ``SimResult.table``, in order
COLUMNS = (
    "round",
    "grad_norm_sq",
    "loss",
    "bits_up",
    "bits_up_paper",
    "bits_down",
    "time_s",
    "method",
    "compressor",
    "stepsize",
    "stepsize_rule",
    "seed",
    "dataset",
    "problem",
    "n_clients",
    "d",
)
_METRICS = COLUMNS[:7]
#: (round, grad_norm_sq, loss, bits_up, bits_up_paper, bits_down, time_s)
Row = tuple[int, float, float, float, float, float, float]


@dataclasses.dataclass
class SimResult:
    """The outcome of :func:`~shrinkgrad.sim.simulate` (and of a distributed run).

    ``table``: one row per logged round (see :data:`COLUMNS`); ``state``: the method state at the
    last round run; ``status``: ``completed`` (all rounds), ``converged`` (grad_norm_sq ≤ tol),
    ``diverged`` (see ``message``) or ``stopped`` (the callback asked to stop); ``bits_up``,
    ``bits_up_paper``, ``bits_down``: cumulative bits per client, shape (n,).
    """

    table: pd.DataFrame
    state: State[Any, Any]
    status: Status
    message: str
    stepsize: float
    stepsize_rule: str
    bits_up: torch.Tensor
    bits_up_paper: torch.Tensor
    bits_down: torch.Tensor
    config: dict[str, Any]

    @property
    def x(self) -> torch.Tensor:
        """The last iterate."""
        return self.state.x

    @property
    def rounds(self) -> int:
        """The number of rounds run."""
        return self.state.round


class SimulationInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt raised by :func:`~shrinkgrad.sim.simulate` with the partial result.

    When a checkpoint path was given, the last complete round has been saved before it is raised;
    calling :func:`~shrinkgrad.sim.simulate` again with the same arguments resumes from there.
    """

    def __init__(self, result: SimResult) -> None:
        super().__init__(f"simulation interrupted after round {result.rounds}")
        self.result = result


@dataclasses.dataclass(frozen=True)
class Progress:
    """Everything that changes during a run and is saved in a checkpoint.

    Immutable: a round builds a new ``Progress`` and the loop commits it with one assignment, so
    an interruption at any point leaves the last committed round intact. The logged rows live in
    a list shared between successive values; each value sees its first ``n_rows`` entries. The
    bit counters have one entry per client of the problem (zero for clients another process
    runs).
    """

    state: State[Any, Any]
    up: torch.Tensor
    up_paper: torch.Tensor
    down: torch.Tensor
    time_s: float
    #: the metric columns of the logged rows (:data:`Row`); the identifying columns are constant
    #: and added when the table is built
    rows: list[Row]
    n_rows: int
    last_logged: int
    gns0: float
    status: Status | None = None
    message: str = ""

    @classmethod
    def start(cls, state: State[Any, Any], traffic: Traffic, elapsed: float, n: int) -> Progress:
        """The progress after ``init`` (round 0, not logged yet) of a problem with n clients."""
        zeros = torch.zeros(n, dtype=torch.float64, device=state.x.device)
        empty = cls(state, zeros, zeros, zeros, 0.0, [], 0, -1, math.nan)
        return empty.after(state, traffic, elapsed)

    def after(self, state: State[Any, Any], traffic: Traffic, elapsed: float) -> Progress:
        """The progress after a step to ``state`` that moved ``traffic`` in ``elapsed`` s."""
        ids = state.clients.ids
        return dataclasses.replace(
            self,
            state=state,
            up=self.up.index_add(0, ids, traffic.up),
            up_paper=self.up_paper.index_add(0, ids, traffic.up_paper),
            down=self.down.index_add(0, ids, traffic.down),
            time_s=self.time_s + elapsed,
        )

    def table_rows(self) -> list[Row]:
        return self.rows[: self.n_rows]

    def with_row(self, row: Row) -> Progress:
        del self.rows[self.n_rows :]  # rows of an interrupted, uncommitted round
        self.rows.append(row)
        return dataclasses.replace(self, n_rows=self.n_rows + 1, last_logged=int(row[0]))

    def snapshot(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rows"] = self.table_rows()
        return out


class Runtime(Protocol):
    """Where a run's clients live: what :func:`run_rounds` needs besides the :class:`RunSetup`."""

    #: True when this process holds the whole run, so that it can save and report an interrupted
    #: run on its own (a rank of a distributed run cannot: its peers are in the middle of a round)
    standalone: bool

    def init(
        self, bound: BoundMethod[Any, Any], x0: torch.Tensor
    ) -> tuple[State[Any, Any], Traffic]:
        """Round 0 of this process's clients (``bound.init`` with the oracle and reduction)."""
        ...

    def step(
        self, bound: BoundMethod[Any, Any], state: State[Any, Any]
    ) -> tuple[State[Any, Any], Traffic]:
        """One round; raises :class:`~shrinkgrad.methods.NonFiniteError` when it diverged."""
        ...

    def row(self, progress: Progress) -> Row:
        """The logged metrics of ``progress``'s round: ‖∇f‖² and f of the full objective, the
        bit counters averaged over all n clients, and the elapsed time."""
        ...

    def totals(self, progress: Progress) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cumulative (bits up, bits up in the papers' convention, bits down) of all n
        clients, shape (n,) each."""
        ...

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The checkpoint saved at ``path``, or None when there is none."""
        ...


class LocalRuntime:
    """Every client in this process, on one tensor axis: the simulator's runtime."""

    standalone = True

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.oracle = ProblemOracle(problem)

    def init(
        self, bound: BoundMethod[Any, Any], x0: torch.Tensor
    ) -> tuple[State[Any, Any], Traffic]:
        return bound.init(x0, self.oracle)

    def step(
        self, bound: BoundMethod[Any, Any], state: State[Any, Any]
    ) -> tuple[State[Any, Any], Traffic]:
        return bound.step(state, self.oracle)

    def row(self, progress: Progress) -> Row:
        p, x = progress, progress.state.x
        g = self.problem.grad(x)
        gns, loss = float(torch.dot(g, g)), float(self.problem.loss(x))
        up, paper, down = float(p.up.mean()), float(p.up_paper.mean()), float(p.down.mean())
        return (p.state.round, gns, loss, up, paper, down, p.time_s)

    def totals(self, progress: Progress) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return progress.up, progress.up_paper, progress.down

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        return load_checkpoint(path)


# --------------------------------------------------------------------------------------------
# setting a run up
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What is fixed about a run (built by :func:`setup_run`)."""

    problem: Problem
    bound: BoundMethod[Any, Any]
    x0: torch.Tensor
    rounds: int
    log_every: int
    tol: float | None
    divergence_factor: float | None
    checkpoint_every: int
    #: the table's identifying columns (``method`` ... ``d`` of :data:`COLUMNS`)
    meta: dict[str, Any]
    #: what a checkpoint must match to be resumed (``meta``, a hash of x⁰, log_every, dtypes)
    fingerprint: dict[str, Any]


def setup_run(
    problem: Problem | str,
    method: Method[Any, Any] | str,
    compressor: Compressor | str | None,
    stepsize: float | str | StepSize,
    rounds: int,
    seed: int,
    x0: Any,
    *,
    log_every: int,
    tol: float | None,
    dtype: torch.dtype | str | None,
    device: torch.device | str | None,
    wire_dtype: torch.dtype,
    divergence_factor: float | None,
    checkpoint_every: int | None,
) -> RunSetup:
    """Check the arguments of :func:`~shrinkgrad.sim.simulate` and bind the run they describe.

    ``device=None`` keeps the problem's device; ``checkpoint_every=None`` is 1000 rounds.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    if isinstance(log_every, bool) or not isinstance(log_every, (int, np.integer)) or log_every < 1:
        raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
    if tol is not None and not (isinstance(tol, (int, float)) and tol >= 0):
        raise ValueError(f"tol must be a number >= 0 or None, got {tol!r}")
    if divergence_factor is not None and not divergence_factor > 1:
        raise ValueError(f"divergence_factor must be > 1 or None, got {divergence_factor!r}")
    if checkpoint_every is not None and (
        isinstance(checkpoint_every, bool)
        or not isinstance(checkpoint_every, int)
        or checkpoint_every < 1
    ):
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    dev = torch.device(device) if device is not None else None
    prob = _prepare_problem(problem, _dtype(dtype), dev)
    meth = make_method(method)
    bound: BoundMethod[Any, Any] = meth.bind(
        prob,
        compressor,
        stepsize,
        seed,
        dtype=prob.dtype,
        device=prob.device,
        wire_dtype=wire_dtype,
    )
    cfg = bound.cfg
    x_start = _x0(prob, x0, cfg.dtype, cfg.device)
    info = prob.info()
    meta: dict[str, Any] = {
        "method": meth.name,
        "compressor": cfg.compressor.name,
        "stepsize": cfg.stepsize,
        "stepsize_rule": cfg.stepsize_rule,
        "seed": cfg.seed,
        "dataset": str(info.get("dataset", prob.dataset)),
        "problem": str(info.get("problem", prob.name)),
        "n_clients": cfg.n,
        "d": cfg.d,
    }
    x_bytes = x_start.detach().cpu().to(torch.float64).numpy().tobytes()
    fingerprint = dict(
        meta,
        x0_sha1=hashlib.sha1(x_bytes).hexdigest(),
        log_every=int(log_every),
        dtype=str(cfg.dtype),
        wire_dtype=str(cfg.wire_dtype),
    )
    return RunSetup(
        problem=prob,
        bound=bound,
        x0=x_start,
        rounds=int(rounds),
        log_every=int(log_every),
        tol=tol,
        divergence_factor=divergence_factor,
        checkpoint_every=checkpoint_every if checkpoint_every is not None else 1000,
        meta=meta,
        fingerprint=fingerprint,
    )


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    table = {"float32": torch.float32, "float64": torch.float64, "double": torch.float64}
    if value in table:
        return table[value]
    raise ValueError(f"dtype must be 'float32' or 'float64' (or a torch dtype), got {value!r}")


def _prepare_problem(
    problem: Problem | str, dtype: torch.dtype | None, device: torch.device | None
) -> Problem:
    if isinstance(problem, str):
        problem = _problem_by_name(problem, dtype, device)
    if not isinstance(problem, Problem):
        raise TypeError(
            f"problem must be a shrinkgrad Problem or a problem name, got {type(problem).__name__}"
        )
    want_dtype = dtype if dtype is not None else problem.dtype
    want_device = device if device is not None else problem.device
    if problem.dtype == want_dtype and torch.device(problem.device) == torch.device(want_device):
        return problem
    to = getattr(problem, "to", None)
    if callable(to):
        moved = to(dtype=want_dtype, device=want_device)
        assert isinstance(moved, Problem)
        return moved
    raise ValueError(
        f"problem {problem.name!r} holds {problem.dtype} data on {problem.device}; build it with "
        f"dtype={want_dtype} and device={want_device} (it has no .to() to convert)"
    )


def _problem_by_name(spec: str, dtype: torch.dtype | None, device: torch.device | None) -> Problem:
    """Build a problem by name, passing ``dtype``/``device`` to its factory when it takes them."""
    from ..problems import PROBLEMS  # importing the package registers every factory
    from ..registry import parse_spec

    entry = PROBLEMS.entry(parse_spec(spec).name)
    names = {p.name for p in entry.keyword}
    overrides: dict[str, Any] = {}
    if dtype is not None and "dtype" in names:
        overrides["dtype"] = dtype
    if device is not None and "device" in names:
        overrides["device"] = device
    return PROBLEMS.make(spec, **overrides)


def _x0(problem: Problem, x0: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if x0 is None:
        return problem.x0().to(dtype=dtype, device=device)
    try:
        t = torch.as_tensor(np.asarray(x0) if not isinstance(x0, torch.Tensor) else x0)
    except (TypeError, ValueError) as e:
        raise TypeError(f"x0 must be array-like with {problem.d} numbers: {e}") from None
    t = t.to(dtype=dtype, device=device).reshape(-1) if t.numel() == problem.d else t
    if t.shape != (problem.d,):
        raise ValueError(
            f"x0 must have {problem.d} entries (the problem's dimension d), got shape "
            f"{tuple(torch.as_tensor(x0).shape)}"
        )
    if not bool(torch.isfinite(t).all()):
        raise ValueError("x0 has non-finite entries (NaN or inf)")
    return t.clone()


# --------------------------------------------------------------------------------------------
# running it
# --------------------------------------------------------------------------------------------
def run_rounds(
    setup: RunSetup,
    runtime: Runtime,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    progress: bool = False,
    callback: Callable[[int, State[Any, Any]], bool | None] | None = None,
) -> SimResult:
    """Run ``setup`` on ``runtime`` (resuming ``checkpoint`` when it exists) and return its result.

    The semantics of every argument are :func:`~shrinkgrad.sim.simulate`'s (docs/simulator.md):
    the table, the stopping rules, checkpoints every ``setup.checkpoint_every`` rounds and at the
    end, a ``RuntimeWarning`` on divergence. On Ctrl-C a standalone runtime saves the last complete
    round and raises :class:`SimulationInterrupted`; otherwise the KeyboardInterrupt propagates.
    """
    cfg = setup.bound.cfg
    rounds = setup.rounds

    def save(p: Progress) -> None:
        if checkpoint is not None:
            save_checkpoint(checkpoint, {"fingerprint": setup.fingerprint, **p.snapshot()})

    def result(p: Progress) -> SimResult:
        up, up_paper, down = runtime.totals(p)
        return SimResult(
            table=_table(p.table_rows(), setup.meta),
            state=p.state,
            status=p.status or "completed",
            message=p.message,
            stepsize=cfg.stepsize,
            stepsize_rule=cfg.stepsize_rule,
            bits_up=up,
            bits_up_paper=up_paper,
            bits_down=down,
            config=setup.fingerprint,
        )

    # -- start or resume ------------------------------------------------------------------------
    prog = _resume(runtime, checkpoint, setup.fingerprint, cfg.device)
    if prog is None:
        prog = _start(setup, runtime)
        save(prog)
    if prog.status is None and prog.state.round < rounds and prog.n_rows:
        # extending a finished run: its last row was logged only because it was the last round
        last = prog.table_rows()[-1][0]
        if last == prog.state.round and last % setup.log_every != 0:
            prev = prog.table_rows()[-2][0] if prog.n_rows > 1 else -1
            prog = dataclasses.replace(prog, n_rows=prog.n_rows - 1, last_logged=prev)
    if prog.status is not None or prog.state.round >= rounds:
        if prog.state.round > rounds:
            raise ValueError(
                f"the checkpoint {str(checkpoint)!r} is at round {prog.state.round} > rounds="
                f"{rounds}; ask for at least {prog.state.round} rounds or use another path"
            )
        return result(prog)

    # -- the loop -------------------------------------------------------------------------------
    bar = _progress_bar(progress, rounds, prog.state.round, setup.meta)
    tick = max(1, rounds // 100)  # the bar also moves every 1% of the rounds
    try:
        while prog.state.round < rounds and prog.status is None:
            prog = _advance(setup, runtime, prog)
            r = prog.state.round
            if prog.last_logged == r and prog.status is None:
                if callback is not None and callback(r, prog.state):
                    msg = f"stopped by the callback at round {r}"
                    prog = dataclasses.replace(prog, status="stopped", message=msg)
                if bar is not None:
                    bar(r, prog.table_rows()[-1][1])
            elif bar is not None and r % tick == 0:
                bar(r, None)
            if checkpoint is not None and prog.state.round % setup.checkpoint_every == 0:
                save(prog)
    except KeyboardInterrupt:
        if bar is not None:
            bar(None, None)
        if not runtime.standalone:
            raise
        save(prog)
        raise SimulationInterrupted(result(prog)) from None
    if bar is not None:
        bar(None, None)
    if prog.status == "diverged":
        # stacklevel 3: the caller of simulate() / run_distributed()
        warnings.warn(prog.message, RuntimeWarning, stacklevel=3)
    save(prog)
    return result(prog)


def _table(rows: list[Row], meta: dict[str, Any]) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=list(_METRICS))
    table = table.astype({"round": "int64"}).assign(**meta)[list(COLUMNS)]
    return table.astype({"seed": "int64", "n_clients": "int64", "d": "int64"})


def _finite(row: Row) -> bool:
    return math.isfinite(row[1]) and math.isfinite(row[2])


def _start(setup: RunSetup, runtime: Runtime) -> Progress:
    """Initialise the method and log round 0."""
    t0 = time.perf_counter()
    state, traffic = runtime.init(setup.bound, setup.x0)
    prog = Progress.start(state, traffic, time.perf_counter() - t0, setup.bound.cfg.n)
    row = runtime.row(prog)
    gns, loss = row[1], row[2]
    if not _finite(row):
        raise ValueError(
            f"the objective or its gradient is not finite at x0 (grad_norm_sq={gns}, "
            f"loss={loss}); choose another starting point"
        )
    prog = dataclasses.replace(prog, gns0=gns).with_row(row)
    if setup.tol is not None and gns <= setup.tol:
        msg = f"grad_norm_sq {gns:.3g} <= tol={setup.tol:g} at round 0"
        prog = dataclasses.replace(prog, status="converged", message=msg)
    return prog


def _advance(setup: RunSetup, runtime: Runtime, prog: Progress) -> Progress:
    """Run one round: the new progress (state, bits, time and, when due, a row and a verdict)."""
    r = prog.state.round + 1
    t0 = time.perf_counter()
    try:
        new_state, traffic = runtime.step(setup.bound, prog.state)
        finite = bool(torch.isfinite(new_state.x).all())
    except NonFiniteError:
        new_state, traffic, finite = prog.state, None, False
    elapsed = time.perf_counter() - t0
    if not finite or traffic is None:
        return _diverged_nonfinite(setup, runtime, prog, r)
    nxt = prog.after(new_state, traffic, elapsed)
    if r % setup.log_every != 0 and r != setup.rounds:
        return nxt
    row = runtime.row(nxt)
    if not _finite(row):
        out = _diverged_nonfinite(setup, runtime, prog, r)
        extra = f" (grad_norm_sq={row[1]}, loss={row[2]} at round {r})"
        return dataclasses.replace(out, message=out.message + extra)
    nxt = nxt.with_row(row)
    status, message = _verdict(setup, r, row[1], prog.gns0)
    return dataclasses.replace(nxt, status=status, message=message) if status else nxt


def _verdict(setup: RunSetup, r: int, gns: float, gns0: float) -> tuple[Status | None, str]:
    """Divergence or convergence at a logged round (decided with the row, atomically)."""
    factor, tol, cfg = setup.divergence_factor, setup.tol, setup.bound.cfg
    if factor is not None and gns0 > 0 and gns > factor * gns0:
        return "diverged", (
            f"diverged at round {r}: grad_norm_sq grew from {gns0:.3g} to {gns:.3g} (more "
            f"than {factor:g}x); the step size {cfg.stepsize:.4g} ({cfg.stepsize_rule}) is too "
            "large"
        )
    if tol is not None and gns <= tol:
        return "converged", f"grad_norm_sq {gns:.3g} <= tol={tol:g} at round {r}"
    return None, ""


def _diverged_nonfinite(setup: RunSetup, runtime: Runtime, prog: Progress, r: int) -> Progress:
    """Stop at round ``r`` whose values are not finite; log the last finite round if unlogged."""
    if prog.state.round > prog.last_logged:
        row = runtime.row(prog)
        if _finite(row):
            prog = prog.with_row(row)
    cfg = setup.bound.cfg
    message = (
        f"diverged at round {r}: non-finite values (step size {cfg.stepsize:.4g}, "
        f"{cfg.stepsize_rule}, is too large?); the table ends at round {prog.last_logged}"
    )
    return dataclasses.replace(prog, status="diverged", message=message)


def _resume(
    runtime: Runtime,
    path: str | os.PathLike[str] | None,
    fingerprint: dict[str, Any],
    device: torch.device,
) -> Progress | None:
    """The progress saved at ``path`` (checked against ``fingerprint``), or None."""
    data = runtime.load(path) if path is not None else None
    if data is None:
        return None
    saved = data.get("fingerprint", {})
    diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if diff:
        detail = ", ".join(
            f"{k}: saved {saved.get(k)!r} vs now {fingerprint.get(k)!r}" for k in diff
        )
        raise ValueError(
            f"the checkpoint {str(path)!r} belongs to a different run ({detail}); delete it, or "
            "choose another checkpoint path"
        )
    fields = {f.name for f in dataclasses.fields(Progress)}
    missing = sorted(k for k in fields if k not in data and k not in ("status", "message"))
    if missing:
        raise ValueError(
            f"the checkpoint {str(path)!r} was written by another version of shrinkgrad (it "
            f"lacks {', '.join(missing)}); delete it to start the run again"
        )
    prog = Progress(**{k: v for k, v in data.items() if k in fields})
    if device.type != "cpu":
        prog = dataclasses.replace(
            prog,
            state=_to_device(prog.state, device),
            up=prog.up.to(device),
            up_paper=prog.up_paper.to(device),
            down=prog.down.to(device),
        )
    return prog


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, State):
        return State(obj.round, _to_device(obj.server, device), _to_device(obj.clients, device))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(v, device) for v in obj))
    return obj


def _progress_bar(
    enabled: bool, rounds: int, start: int, meta: dict[str, Any]
) -> Callable[[int | None, float | None], None] | None:
    """A rich progress bar on stderr, or None (disabled, or stderr is not a terminal)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from rich import progress as rp
    from rich.console import Console
    from rich.markup import escape

    bar = rp.Progress(
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.TextColumn("{task.completed}/{task.total}"),
        rp.TextColumn("{task.fields[gns]}"),
        rp.TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    label = escape(f"{meta['method']} + {meta['compressor']}")  # names contain [...]
    task = bar.add_task(label, total=rounds, gns="")
    bar.update(task, completed=start)
    bar.start()

    def update(r: int | None, gns: float | None) -> None:
        if r is None:
            bar.stop()
        elif gns is None:
            bar.update(task, completed=r)
        else:
            bar.update(task, completed=r, gns=f"‖∇f‖²={gns:.3g}")

    return update
