"""The vectorised simulator: run a method on a problem, log a tidy table, checkpoint, stop cleanly.

:func:`simulate` binds a method (:mod:`shrinkgrad.methods`) to a problem, a compressor, a step size
and a seed, runs ``init`` then ``step`` with every client on one tensor axis, and returns a
:class:`SimResult` whose ``table`` has one row per logged round (round 0 included). See
docs/simulator.md for the columns, checkpoints and divergence handling.
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
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from ..compressors import Compressor
from ..methods.base import BoundMethod, Method, NonFiniteError, State, make_method
from ..methods.oracle import ProblemOracle
from ..methods.stepsize import StepSize
from ..problems import Problem
from .checkpoint import load_checkpoint, save_checkpoint

__all__ = ["COLUMNS", "SimResult", "SimulationInterrupted", "Status", "simulate"]

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
    """The outcome of :func:`simulate`.

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
    """A KeyboardInterrupt raised by :func:`simulate` that carries the partial result.

    When a checkpoint path was given, the last complete round has been saved before it is raised;
    calling :func:`simulate` again with the same arguments resumes from there.
    """

    def __init__(self, result: SimResult) -> None:
        super().__init__(f"simulation interrupted after round {result.rounds}")
        self.result = result


@dataclasses.dataclass(frozen=True)
class _Progress:
    """Everything that changes during a run and is saved in a checkpoint.

    Immutable: a round builds a new ``_Progress`` and the loop commits it with one assignment, so
    an interruption at any point leaves the last committed round intact. The logged rows live in
    a list shared between successive values; each value sees its first ``n_rows`` entries.
    """

    state: State[Any, Any]
    up: torch.Tensor
    up_paper: torch.Tensor
    down: torch.Tensor
    time_s: float
    #: the metric columns of the logged rows (``_METRICS`` order); the identifying columns are
    #: constant and added when the table is built
    rows: list[Row]
    n_rows: int
    last_logged: int
    gns0: float
    status: Status | None = None
    message: str = ""

    def table_rows(self) -> list[Row]:
        return self.rows[: self.n_rows]

    def with_row(self, row: Row) -> _Progress:
        del self.rows[self.n_rows :]  # rows of an interrupted, uncommitted round
        self.rows.append(row)
        return dataclasses.replace(self, n_rows=self.n_rows + 1, last_logged=int(row[0]))

    def snapshot(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rows"] = self.table_rows()
        return out


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


def _fingerprint(
    meta: dict[str, Any], x0: torch.Tensor, log_every: int, dtype: torch.dtype, wire: torch.dtype
) -> dict[str, Any]:
    x_bytes = x0.detach().cpu().to(torch.float64).numpy().tobytes()
    return dict(
        meta,
        x0_sha1=hashlib.sha1(x_bytes).hexdigest(),
        log_every=log_every,
        dtype=str(dtype),
        wire_dtype=str(wire),
    )


def _metrics(problem: Problem, x: torch.Tensor) -> tuple[float, float]:
    g = problem.grad(x)
    return float(torch.dot(g, g)), float(problem.loss(x))


def simulate(
    problem: Problem | str,
    method: Method[Any, Any] | str,
    compressor: Compressor | str | None = None,
    stepsize: float | str | StepSize = "theory",
    rounds: int = 100,
    seed: int = 0,
    x0: Any = None,
    *,
    log_every: int = 1,
    tol: float | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    wire_dtype: torch.dtype = torch.float32,
    divergence_factor: float | None = 1e8,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    progress: bool = False,
    callback: Callable[[int, State[Any, Any]], bool | None] | None = None,
) -> SimResult:
    """Run ``method`` with ``compressor`` on ``problem`` for ``rounds`` rounds.

    Parameters
    ----------
    problem, method, compressor:
        objects or names (``"ef21_pp[p=0.5]"``, ``"top_k[k=1]"``); ``compressor=None`` is the
        identity. Incompatible pairs (EF21 with an unscaled unbiased compressor, DCGD with a
        biased one) raise a ValueError saying what to use instead.
    stepsize:
        a number, ``"theory"`` or ``"theory*m"`` (see :mod:`shrinkgrad.methods.stepsize`).
    rounds, seed:
        number of rounds; seed of every keyed draw (compressor, participation, minibatch, delay,
        order). The same arguments give the same table (up to ``time_s``).
    x0:
        starting point (array-like of d numbers); default ``problem.x0()``.
    log_every:
        log a row every ``log_every`` rounds (round 0 and the last round are always logged).
        Metric evaluation costs a full gradient; it is excluded from ``time_s``.
    tol:
        stop (status ``converged``) at the first logged round with grad_norm_sq ≤ tol.
    dtype, device:
        float64 (default: the problem's) or float32; the device of the problem's tensors.
    wire_dtype:
        the dtype values are sent in for the honest bit count (default float32).
    divergence_factor:
        stop (status ``diverged``) when grad_norm_sq exceeds this factor times its value at
        round 0; non-finite iterates or metrics always stop the run. ``None`` disables the
        factor test. The table never holds NaN or infinite metrics.
    checkpoint, checkpoint_every:
        a file path: resume from it when it exists (same run configuration, checked), and save
        the run there atomically every ``checkpoint_every`` rounds (default 1000), on
        Ctrl-C and at the end. A resumed run gives exactly the table of an uninterrupted one.
    progress:
        show a progress bar on stderr (only when stderr is a terminal).
    callback:
        ``callback(round, state)`` after every logged row; return True to stop (status
        ``stopped``).
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
    rounds, log_every = int(rounds), int(log_every)
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
    oracle = ProblemOracle(prob)
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
    fingerprint = _fingerprint(meta, x_start, log_every, cfg.dtype, cfg.wire_dtype)
    every = checkpoint_every if checkpoint_every is not None else 1000

    def row(r: int, gns: float, loss: float, p: _Progress) -> Row:
        """The metrics of round ``r`` (bits and time from ``p``, at round ``r``)."""
        up, paper, down = float(p.up.mean()), float(p.up_paper.mean()), float(p.down.mean())
        return (r, gns, loss, up, paper, down, p.time_s)

    def save(p: _Progress) -> None:
        if checkpoint is not None:
            save_checkpoint(checkpoint, {"fingerprint": fingerprint, **p.snapshot()})

    def result(p: _Progress) -> SimResult:
        table = pd.DataFrame(p.table_rows(), columns=list(_METRICS))
        table = table.astype({"round": "int64"}).assign(**meta)[list(COLUMNS)]
        table = table.astype({"seed": "int64", "n_clients": "int64", "d": "int64"})
        return SimResult(
            table=table,
            state=p.state,
            status=p.status or "completed",
            message=p.message,
            stepsize=cfg.stepsize,
            stepsize_rule=cfg.stepsize_rule,
            bits_up=p.up,
            bits_up_paper=p.up_paper,
            bits_down=p.down,
            config=fingerprint,
        )

    # -- start or resume ------------------------------------------------------------------------
    prog = _resume(checkpoint, fingerprint, cfg.device) if checkpoint is not None else None
    if prog is None:
        zeros = torch.zeros(cfg.n, dtype=torch.float64, device=cfg.device)
        t0 = time.perf_counter()
        state, traffic = bound.init(x_start, oracle)
        elapsed = time.perf_counter() - t0
        ids = state.clients.ids
        prog = _Progress(
            state,
            zeros.index_add(0, ids, traffic.up),
            zeros.index_add(0, ids, traffic.up_paper),
            zeros.index_add(0, ids, traffic.down),
            elapsed,
            [],
            0,
            -1,
            math.nan,
        )
        gns, loss = _metrics(prob, state.x)
        if not (math.isfinite(gns) and math.isfinite(loss)):
            raise ValueError(
                f"the objective or its gradient is not finite at x0 (grad_norm_sq={gns}, "
                f"loss={loss}); choose another starting point"
            )
        prog = dataclasses.replace(prog, gns0=gns).with_row(row(0, gns, loss, prog))
        if tol is not None and gns <= tol:
            msg = f"grad_norm_sq {gns:.3g} <= tol={tol:g} at round 0"
            prog = dataclasses.replace(prog, status="converged", message=msg)
        save(prog)
    if prog.status is None and prog.state.round < rounds and prog.n_rows:
        # extending a finished run: its last row was logged only because it was the last round
        last = prog.table_rows()[-1][0]
        if last == prog.state.round and last % log_every != 0:
            prev = prog.table_rows()[-2][0] if prog.n_rows > 1 else -1
            prog = dataclasses.replace(prog, n_rows=prog.n_rows - 1, last_logged=prev)
    if prog.status is not None or prog.state.round >= rounds:
        if prog.state.round > rounds:
            raise ValueError(
                f"the checkpoint {str(checkpoint)!r} is at round {prog.state.round} > rounds="
                f"{rounds}; ask for at least {prog.state.round} rounds or use another path"
            )
        return result(prog)

    def verdict(r: int, gns: float, gns0: float) -> tuple[Status | None, str]:
        """Divergence or convergence at a logged round (decided with the row, atomically)."""
        if divergence_factor is not None and gns0 > 0 and gns > divergence_factor * gns0:
            return "diverged", (
                f"diverged at round {r}: grad_norm_sq grew from {gns0:.3g} to {gns:.3g} (more "
                f"than {divergence_factor:g}x); the step size {cfg.stepsize:.4g} "
                f"({cfg.stepsize_rule}) is too large"
            )
        if tol is not None and gns <= tol:
            return "converged", f"grad_norm_sq {gns:.3g} <= tol={tol:g} at round {r}"
        return None, ""

    # -- the loop -------------------------------------------------------------------------------
    bar = _progress_bar(progress, rounds, prog.state.round, meta)
    tick = max(1, rounds // 100)  # the bar also moves every 1% of the rounds
    try:
        while prog.state.round < rounds and prog.status is None:
            prog = _advance(prob, bound, oracle, prog, rounds, log_every, row, verdict)
            r = prog.state.round
            if prog.last_logged == r and prog.status is None:
                if callback is not None and callback(r, prog.state):
                    msg = f"stopped by the callback at round {r}"
                    prog = dataclasses.replace(prog, status="stopped", message=msg)
                if bar is not None:
                    bar(r, prog.table_rows()[-1][1])
            elif bar is not None and r % tick == 0:
                bar(r, None)
            if checkpoint is not None and prog.state.round % every == 0:
                save(prog)
    except KeyboardInterrupt:
        if bar is not None:
            bar(None, None)
        save(prog)
        raise SimulationInterrupted(result(prog)) from None
    if bar is not None:
        bar(None, None)
    if prog.status == "diverged":
        warnings.warn(prog.message, RuntimeWarning, stacklevel=2)
    save(prog)
    return result(prog)


def _advance(
    prob: Problem,
    bound: BoundMethod[Any, Any],
    oracle: ProblemOracle,
    prog: _Progress,
    rounds: int,
    log_every: int,
    row: Callable[[int, float, float, _Progress], Row],
    verdict: Callable[[int, float, float], tuple[Status | None, str]],
) -> _Progress:
    """Run one round: the new progress (state, bits, time and, when due, a row and a verdict)."""
    cfg = bound.cfg
    r = prog.state.round + 1
    t0 = time.perf_counter()
    try:
        new_state, traffic = bound.step(prog.state, oracle)
        finite = bool(torch.isfinite(new_state.x).all())
    except NonFiniteError:
        new_state, traffic, finite = prog.state, None, False
    elapsed = time.perf_counter() - t0
    if not finite or traffic is None:
        return _diverged_nonfinite(prob, prog, r, cfg.stepsize, cfg.stepsize_rule, row)
    ids = new_state.clients.ids
    nxt = dataclasses.replace(
        prog,
        state=new_state,
        up=prog.up.index_add(0, ids, traffic.up),
        up_paper=prog.up_paper.index_add(0, ids, traffic.up_paper),
        down=prog.down.index_add(0, ids, traffic.down),
        time_s=prog.time_s + elapsed,
    )
    if r % log_every != 0 and r != rounds:
        return nxt
    gns, loss = _metrics(prob, new_state.x)
    if not (math.isfinite(gns) and math.isfinite(loss)):
        out = _diverged_nonfinite(prob, prog, r, cfg.stepsize, cfg.stepsize_rule, row)
        extra = f" (grad_norm_sq={gns}, loss={loss} at round {r})"
        return dataclasses.replace(out, message=out.message + extra)
    nxt = nxt.with_row(row(r, gns, loss, nxt))
    status, message = verdict(r, gns, prog.gns0)
    return dataclasses.replace(nxt, status=status, message=message) if status else nxt


def _diverged_nonfinite(
    prob: Problem,
    prog: _Progress,
    r: int,
    gamma: float,
    rule: str,
    row: Callable[[int, float, float, _Progress], Row],
) -> _Progress:
    """Stop at round ``r`` whose values are not finite; log the last finite round if unlogged."""
    last = prog.state.round
    if last > prog.last_logged:
        gns, loss = _metrics(prob, prog.state.x)
        if math.isfinite(gns) and math.isfinite(loss):
            prog = prog.with_row(row(last, gns, loss, prog))
    message = (
        f"diverged at round {r}: non-finite values (step size {gamma:.4g}, {rule}, is too "
        f"large?); the table ends at round {prog.last_logged}"
    )
    return dataclasses.replace(prog, status="diverged", message=message)


def _resume(
    path: str | os.PathLike[str], fingerprint: dict[str, Any], device: torch.device
) -> _Progress | None:
    data = load_checkpoint(path)
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
    fields = {f.name for f in dataclasses.fields(_Progress)}
    prog = _Progress(**{k: v for k, v in data.items() if k in fields})
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
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[gns]}"),
        TimeRemainingColumn(),
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
