"""The run engine shared by :func:`~shrinkgrad.sim.simulate` and the distributed runner.

A run is set up once by :func:`setup_run` — argument checks, the problem, the method bound to it,
x⁰, the table's columns and identifying values, the checkpoint fingerprint — and driven by
:func:`run_rounds`: ``init``, the rounds, a row every ``log_every`` rounds, the divergence and
convergence verdicts, the callback, checkpoints and the :class:`SimResult` (docs/simulator.md).
How a run is carried out (rounds, logging, stopping rules, checkpoints, dtypes, ...) is one
:class:`~shrinkgrad.sim.options.RunOptions` value carried by the :class:`RunSetup`.

What differs between the simulator and a rank of a distributed run is a :class:`Runtime`: where
the clients live and how a round reaches them (the gradient oracle and the reduction), how the
metrics and the bit counters are summed over the clients, and how a checkpoint is found.
:class:`LocalRuntime` holds every client in this process; ``shrinkgrad.distributed.runner`` has
one per rank. Before a round whose row will be logged the engine tells the runtime so
(``record=True``): its oracle then keeps ∇f and f of the round's full-batch gradient pass, and
the row costs nothing more when the method evaluated every client at the new iterate
(:mod:`shrinkgrad.methods.oracle`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np
import pandas as pd
import torch

from .._sums import all_finite, row_values
from ..compressors import Compressor
from ..methods.base import BoundMethod, Method, NonFiniteError, State, Traffic, make_method
from ..methods.oracle import ProblemOracle
from ..methods.stepsize import StepSize
from ..network.clock import ModelClock
from ..problems import Problem
from ..problems.base import data_digest_of, digest_arrays
from .checkpoint import load_checkpoint, save_checkpoint
from .options import Divergence, DivergenceReference, RunOptions

__all__ = [
    "COLUMNS",
    "METRIC_COLUMNS",
    "TIME_MODEL_COLUMN",
    "LocalRuntime",
    "Progress",
    "Row",
    "RunSetup",
    "Runtime",
    "SimResult",
    "SimulationInterrupted",
    "Status",
    "check_round_memory",
    "held_out_values",
    "run_identity",
    "run_rounds",
    "setup_run",
    "table_columns",
]

Status = Literal["completed", "converged", "diverged", "stopped"]

#: the columns of ``SimResult.table``, in order, for a problem without held-out metrics
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
#: the metric block of a row: (round, grad_norm_sq, loss, bits_up, bits_up_paper, bits_down,
#: time_s); a problem's held-out columns follow it
METRIC_COLUMNS = COLUMNS[:7]
#: the column of a run given a network (``simulate(network=...)``), right after ``time_s``
TIME_MODEL_COLUMN = "time_model_s"
#: the metrics of one logged row: :data:`METRIC_COLUMNS`, ``time_model_s`` when the run has a
#: network, then the held-out values
Row = tuple[float, ...]


def table_columns(held_out: Sequence[str] = (), *, time_model: bool = False) -> tuple[str, ...]:
    """The table's columns for a problem with the held-out columns ``held_out`` (PLAN interface
    1): the metric block, ``time_model_s`` (a run with a network), the held-out metrics, the
    identifying columns."""
    model = (TIME_MODEL_COLUMN,) if time_model else ()
    return METRIC_COLUMNS + model + tuple(held_out) + COLUMNS[len(METRIC_COLUMNS) :]


def held_out_values(problem: Problem, names: Sequence[str], x: torch.Tensor) -> tuple[float, ...]:
    """``problem.held_out(x)`` as floats in the order of ``names`` (its ``held_out_columns``)."""
    if not names:
        return ()
    values = problem.held_out(x)
    if not isinstance(values, Mapping) or set(values) != set(names):
        got = sorted(values) if isinstance(values, Mapping) else type(values).__name__
        raise TypeError(
            f"{type(problem).__name__}.held_out(x) must return a dict with exactly the keys of "
            f"held_out_columns {list(names)}, got {got}"
        )
    return tuple(float(values[k]) for k in names)


@dataclasses.dataclass
class SimResult:
    """The outcome of :func:`~shrinkgrad.sim.simulate` (and of a distributed run).

    ``table``: one row per logged round (see :func:`table_columns`); ``state``: the method state
    at the last round run; ``status``: ``completed`` (all rounds), ``converged`` (grad_norm_sq ≤
    tol), ``diverged`` (see ``message``) or ``stopped`` (the callback asked to stop);
    ``bits_up``, ``bits_up_paper``, ``bits_down``: cumulative bits per client, shape (n,).
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

    def __repr__(self) -> str:
        """A few lines: status, rounds, the last row's metrics, the step size and its rule."""
        cfg, t = self.config, self.table
        head = (
            f"SimResult({self.status}, {self.rounds} rounds, {len(t)} rows: "
            f"{cfg.get('method', '?')} + {cfg.get('compressor', '?')} on "
            f"{cfg.get('problem', '?')}[{cfg.get('dataset', '')}], n={cfg.get('n_clients', '?')}, "
            f"d={cfg.get('d', '?')}, seed={cfg.get('seed', '?')})"
        )
        lines = [head, f"  stepsize {self.stepsize:.6g} ({self.stepsize_rule})"]
        if len(t):
            last = t.iloc[-1]
            extra = [c for c in t.columns if c not in COLUMNS]
            shown = ["grad_norm_sq", "loss", *extra, "bits_up"]
            values = ", ".join(f"{c}={float(last[c]):.6g}" for c in shown)
            lines.append(f"  round {int(last['round'])}: {values}")
        if self.message:
            lines.append(f"  {self.message}")
        return "\n".join(lines)


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
    #: the modelled wall-clock time so far (runs with a network; :mod:`shrinkgrad.network.clock`)
    time_model_s: float = 0.0
    #: the round whose logged row decided ``status`` (the tolerance, a growth test or the
    #: callback), −1 when no row did (no status yet, or a non-finite stop): a status decided at a
    #: last round off the logging grid is decided again when the run is extended (:func:`_reopen`)
    decided_at: int = -1

    @classmethod
    def start(
        cls,
        state: State[Any, Any],
        traffic: Traffic,
        elapsed: float,
        n: int,
        clock: ModelClock | None = None,
    ) -> Progress:
        """The progress after ``init`` (round 0, not logged yet) of a problem with n clients."""
        zeros = torch.zeros(n, dtype=torch.float64, device=state.x.device)
        empty = cls(state, zeros, zeros, zeros, 0.0, [], 0, -1, math.nan)
        return empty.after(state, traffic, elapsed, clock)

    def after(
        self,
        state: State[Any, Any],
        traffic: Traffic,
        elapsed: float,
        clock: ModelClock | None = None,
    ) -> Progress:
        """The progress after a step to ``state`` that moved ``traffic`` in ``elapsed`` s; with a
        ``clock``, the round's modelled time is added to ``time_model_s``."""
        ids = state.clients.ids
        model = 0.0 if clock is None else clock.seconds(traffic, ids, elapsed)
        if _all_in_order(ids, self.up.numel()):  # the same sums as index_add, one op each
            up, paper = self.up + traffic.up, self.up_paper + traffic.up_paper
            down = self.down + traffic.down
        else:
            up = self.up.index_add(0, ids, traffic.up)
            paper = self.up_paper.index_add(0, ids, traffic.up_paper)
            down = self.down.index_add(0, ids, traffic.down)
        return Progress(
            state,
            up,
            paper,
            down,
            self.time_s + elapsed,
            self.rows,
            self.n_rows,
            self.last_logged,
            self.gns0,
            self.status,
            self.message,
            self.time_model_s + model,
            self.decided_at,
        )

    def table_rows(self) -> list[Row]:
        return self.rows[: self.n_rows]

    def with_row(self, row: Row) -> Progress:
        del self.rows[self.n_rows :]  # rows of an interrupted, uncommitted round
        self.rows.append(row)
        return Progress(  # positionally, as after(): dataclasses.replace costs several times more
            self.state,
            self.up,
            self.up_paper,
            self.down,
            self.time_s,
            self.rows,
            self.n_rows + 1,
            int(row[0]),
            self.gns0,
            self.status,
            self.message,
            self.time_model_s,
            self.decided_at,
        )

    def snapshot(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rows"] = self.table_rows()
        return out


#: the last client-id tensor found to be 0, 1, …, n − 1 (a run's client state carries the same
#: tensor from round to round, so the check is one identity test)
_IN_ORDER: list[torch.Tensor] = []


def _all_in_order(ids: torch.Tensor, n: int) -> bool:
    """Whether ``ids`` is 0, 1, …, n − 1 (every client, in order)."""
    if _IN_ORDER and _IN_ORDER[0] is ids:
        return True
    if ids.numel() != n or not torch.equal(ids, torch.arange(n, device=ids.device)):
        return False
    _IN_ORDER[:] = [ids]
    return True


class Runtime(Protocol):
    """Where a run's clients live: what :func:`run_rounds` needs besides the :class:`RunSetup`.

    ``record`` (``init``, ``step``) says that the round's row will be logged, so that the
    runtime's oracle keeps what the row's metrics need from the round's own gradient pass.
    """

    #: True when this process holds the whole run, so that it can save and report an interrupted
    #: run on its own (a rank of a distributed run cannot: its peers are in the middle of a round)
    standalone: bool

    def init(
        self, bound: BoundMethod[Any, Any], x0: torch.Tensor, *, record: bool
    ) -> tuple[State[Any, Any], Traffic]:
        """Round 0 of this process's clients (``bound.init`` with the oracle and reduction)."""
        ...

    def step(
        self, bound: BoundMethod[Any, Any], state: State[Any, Any], *, record: bool
    ) -> tuple[State[Any, Any], Traffic]:
        """One round; raises :class:`~shrinkgrad.methods.NonFiniteError` when it diverged."""
        ...

    def prepaid_s(self) -> float:
        """Seconds of the last step's gradient work done ahead by a metric evaluation (which
        ``time_s`` excludes), so that the step is charged for it."""
        ...

    def row(self, progress: Progress) -> Row:
        """The logged metrics of ``progress``'s round: ‖∇f‖² and f of the full objective, the
        bit counters averaged over all n clients, the elapsed time and the held-out values."""
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
        self.held_out: tuple[str, ...] = tuple(getattr(problem, "held_out_columns", ()))

    def init(
        self, bound: BoundMethod[Any, Any], x0: torch.Tensor, *, record: bool = False
    ) -> tuple[State[Any, Any], Traffic]:
        self.oracle.record = record
        return bound.init(x0, self.oracle)

    def step(
        self, bound: BoundMethod[Any, Any], state: State[Any, Any], *, record: bool = False
    ) -> tuple[State[Any, Any], Traffic]:
        self.oracle.record = record
        return bound.step(state, self.oracle)

    def prepaid_s(self) -> float:
        return self.oracle.take_prepaid()

    def row(self, progress: Progress) -> Row:
        p, x = progress, progress.state.x
        m = self.oracle.metrics(x)
        if m is not None:
            g, loss = m.grad, m.loss
        else:  # a problem without a fused pass: its own full gradient and loss
            g, loss = self.problem.grad(x), float(self.problem.loss(x))
        # ‖∇f‖² and the mean bits in one compiled call (small torch ops right after the
        # round's pass over the data cost 5-10x their warm time: shrinkgrad._sums)
        gns, up, paper, down = row_values(g, p.up, p.up_paper, p.down)
        held = held_out_values(self.problem, self.held_out, x)
        return (p.state.round, gns, loss, up, paper, down, p.time_s, *held)

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
    options: RunOptions
    #: the table's identifying columns (``method`` ... ``d`` of :data:`COLUMNS`)
    meta: dict[str, Any]
    #: what a checkpoint must match to be resumed (``meta``, the problem's identity of
    #: :func:`problem_identity`, a hash of x⁰, log_every, dtypes, the stopping rules and
    #: weights of :func:`run_identity`, the held-out columns, the network)
    fingerprint: dict[str, Any]
    #: the problem's held-out columns (``held_out_columns``), appended to the metric block
    held_out: tuple[str, ...] = ()
    #: the problem's certified lower bound on inf f and its known minimiser, for the divergence
    #: tests (None when unknown)
    f_lower: float | None = None
    x_star: torch.Tensor | None = None
    #: the modelled clock of a run given a network (``time_model_s``), else None
    clock: ModelClock | None = None

    @property
    def rounds(self) -> int:
        return self.options.rounds

    @property
    def log_every(self) -> int:
        return self.options.log_every

    @property
    def columns(self) -> tuple[str, ...]:
        """The table's columns."""
        return table_columns(self.held_out, time_model=self.clock is not None)

    @property
    def extra_metrics(self) -> tuple[str, ...]:
        """The metric columns after :data:`METRIC_COLUMNS`: ``time_model_s`` (a run with a
        network) and the held-out metrics, in the order of a :data:`Row`."""
        model = (TIME_MODEL_COLUMN,) if self.clock is not None else ()
        return model + self.held_out

    def row(self, runtime: Runtime, progress: Progress) -> Row:
        """The logged row of ``progress``: the runtime's metrics with ``time_model_s``."""
        row = runtime.row(progress)
        if self.clock is None:
            return row
        k = len(METRIC_COLUMNS)
        return (*row[:k], progress.time_model_s, *row[k:])

    def logged(self, r: int) -> bool:
        """Whether round ``r`` gets a row (every ``log_every`` rounds, round 0, the last round)."""
        return r % self.options.log_every == 0 or r == self.options.rounds


#: n × d arrays that every simulated round holds at least: the clients' gradients and their
#: messages (measured peaks on a LIBSVM problem: about 2 of them for gd, 3 for dcgd, 7 for ef21)
ROUND_CLIENT_ARRAYS = 2


def check_round_memory(problem: Any, method: Any) -> None:
    """Refuse in one line, before anything of size n × d is allocated, a problem whose simulated
    rounds cannot fit in the available memory (:func:`setup_run`, and the measured rounds of
    :func:`shrinkgrad.network.estimate.measure_rounds`).

    A round holds at least :data:`ROUND_CLIENT_ARRAYS` arrays of n × d entries in the problem's
    dtype, and x: a lower bound, so a refusal is certain to be right. A LIBSVM file can declare
    a d of 10⁹ in a few bytes, and its loader only checks that one d-vector fits. The check is
    :func:`shrinkgrad.problems.memory.check_memory` (the one of ``shrinkgrad theory`` and the
    dataset loader); problems on an accelerator are not checked (their memory is not the host's).
    """
    from ..problems.memory import check_memory

    device = getattr(problem, "device", "cpu")
    if getattr(device, "type", str(device)) != "cpu":
        return
    n, d = int(problem.n), int(problem.d)
    dtype = getattr(problem, "dtype", None)
    itemsize = int(getattr(dtype, "itemsize", 8))
    kind = str(dtype).removeprefix("torch.") if dtype is not None else "float64"
    name = getattr(method, "name", method)
    check_memory(
        float(itemsize) * d * (ROUND_CLIENT_ARRAYS * n + 1),
        f"simulating {name} on n = {n:,} clients at d = {d:,} (at least "
        f"{ROUND_CLIENT_ARRAYS} n × d {kind} arrays: the clients' gradients and messages)",
        "select or hash the features to fewer dimensions, or use fewer clients",
    )


#: factory parameters that say how a problem is computed, not which problem it is: the run's
#: dtype is a fingerprint entry of its own, and a resume may move to another device, thread
#: count, storage format or evaluation chunk size (docs/simulator.md, "Checkpoints and resume")
EXECUTION_PARAMS = frozenset({"dtype", "device", "threads", "storage", "batch_size"})

#: ``info()`` keys the fingerprint already holds (in ``meta``, or as the run's dtype)
_INFO_IN_META = frozenset({"problem", "dataset", "n_clients", "d", "dtype", "spec"})

#: a canonical spec longer than this (an explicit client assignment, say) is kept as its hash
_SPEC_MAX_CHARS = 240


def problem_identity(problem: Problem, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What identifies ``problem`` in a checkpoint's fingerprint, beyond name, dataset, n and d.

    Two problems with the same name, data set, n, d and x⁰ can still be different problems: another
    client split, held-out fraction, loss or regulariser (stop 35's audit). The fingerprint
    therefore holds

    * ``problem.<key>`` for every scalar entry of ``problem.info()`` (``split``, ``loss``,
      ``lam``, ``n_samples``, ``n_test``, ...) not already in ``meta``;
    * ``problem.spec``: the problem's registry spec without the parameters at their defaults
      and without :data:`EXECUTION_PARAMS`, so ``mlp[dataset=a1a]`` and
      ``mlp[dataset=a1a,split=contiguous,device=cpu]`` are one problem; a spec of more than
      :data:`_SPEC_MAX_CHARS` characters is kept as ``sha1:<hex>``;
    * ``problem.data``: the problem's :meth:`~shrinkgrad.problems.Problem.data_digest`, a hash of
      its data (a linear problem's matrix, targets and client offsets; a model problem's client
      inputs and targets, held-out part, buffers, architecture and the code of its own module
      classes and loss), when it has one (not None). Two problems
      built from user arrays of the same shapes, on the same split and from the same x⁰ differ
      only there. A problem computes it once (about 1 ms per MB of data) and keeps it while
      what it hashed is unchanged: a model problem checks its tensors' version counters and its
      code on every call, a linear problem's data must not change after construction.

    A checkpoint written before an entry existed lacks it, and is refused in one line as one of
    an earlier version (``_resume``).
    """
    info = problem.info() if info is None else info
    out: dict[str, Any] = {}
    for key, value in info.items():
        if key in _INFO_IN_META:
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and math.isnan(value):
            value = "nan"  # NaN != NaN would refuse the problem's own checkpoint
        if value is None or isinstance(value, (str, int, float, bool)):
            out[f"problem.{key}"] = value
    spec = canonical_problem_spec(getattr(problem, "spec", None))
    if spec is not None:
        if len(spec) > _SPEC_MAX_CHARS:
            spec = "sha1:" + hashlib.sha1(spec.encode()).hexdigest()
        out["problem.spec"] = spec
    digest = data_digest_of(problem)
    if digest is not None:
        out["problem.data"] = digest
    return out


#: the divergence rule of a run given none (``divergence_factor`` at its default)
_DEFAULT_DIVERGENCE = Divergence()


def run_identity(bound: BoundMethod[Any, Any], options: RunOptions) -> dict[str, Any]:
    """What identifies a run in its fingerprint beyond ``meta`` (method, compressor, step size,
    seed, problem), the problem's identity, x⁰, ``log_every`` and the dtypes: each entry only
    when it departs from what every run had before it existed, so older checkpoints of runs
    without it still resume.

    * ``tol`` (when given) and ``divergence`` (a rule other than the default
      :class:`~shrinkgrad.sim.options.Divergence`): the stopping rules. A checkpoint holds the
      status they decided (``converged`` at some round), so a run with other rules would return
      that status and table at once, or continue a run that its own rules had stopped;
    * ``compressor.params``: the parameters of a compressor built directly (``TopK(2)``, no
      registry spec), whose name is its class name alone (``TopK`` for every k);
    * ``client_weights``: a SHA-1 of the reduction weights when they are not all equal (EF21-W's
      w_i = L_i / Σ_j L_j, [EFR] Alg. 2): they come from the problem's constants, which a numeric
      step size does not record (``problem.with_constants`` changes them, not the data).
    """
    out: dict[str, Any] = {}
    if options.tol is not None:
        out["tol"] = float(options.tol)
    div = options.divergence
    if div != _DEFAULT_DIVERGENCE:
        out["divergence"] = (
            f"grad_factor={div.grad_factor!r},loss_factor={div.loss_factor!r},"
            f"iterate_factor={div.iterate_factor!r}"
        )
    comp = bound.cfg.compressor
    if not comp.spec:
        out["compressor.params"] = describe_object(comp)
    w = bound.cfg.weights.detach().to("cpu", torch.float64)
    if w.numel() and not bool((w == w[0]).all()):
        out["client_weights"] = hashlib.sha1(w.numpy().tobytes()).hexdigest()
    return out


def describe_object(obj: Any, depth: int = 3) -> str:
    """``obj`` (a compressor built directly) as its class and public attributes, recursively:
    ``TopK(k=2)``, ``Scaled(inner=RandK(k=2,shared_seed=False),...)``. Numbers and strings by
    ``repr``, tensors and arrays by a SHA-1 of their bytes, other objects by their type."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return repr(obj)
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return "array:" + digest_arrays([("value", obj)])
    if isinstance(obj, (tuple, list)):
        return "(" + ",".join(describe_object(v, depth - 1) for v in obj) + ")"
    attrs = getattr(obj, "__dict__", None)
    name = type(obj).__qualname__
    if attrs is None or depth <= 0:
        return name
    inner = ",".join(
        f"{k}={describe_object(v, depth - 1)}"
        for k, v in sorted(attrs.items())
        if not k.startswith("_") and k != "spec"
    )
    return f"{name}({inner})"


def canonical_problem_spec(spec: Any) -> str | None:
    """``spec`` (a problem's registry spec) without :data:`EXECUTION_PARAMS` and without the
    parameters given at their factory's defaults (:func:`problem_identity`); None when there
    is no spec, and the spec unchanged when the registry does not know it."""
    from ..problems import PROBLEMS
    from ..registry import Spec, SpecError, coerce_value, parse_spec

    if not isinstance(spec, str) or not spec:
        return None
    try:
        parsed = parse_spec(spec)
        entry = PROBLEMS.entry(parsed.name)
    except SpecError:
        return spec
    defaults = {p.name: p.default for p in entry.keyword if p.default is not p.empty}
    kept: list[tuple[str, Any]] = []
    for key, raw in parsed.params:
        if key in EXECUTION_PARAMS:
            continue
        if key in defaults:
            try:
                value = coerce_value(raw, entry.hints.get(key), key, PROBLEMS)
                at_default = type(value) is type(defaults[key]) and bool(value == defaults[key])
            except Exception:  # a value the factory accepted but cannot be compared: keep it
                at_default = False
            if at_default:
                continue
        kept.append((key, raw))
    return str(Spec(parsed.name, tuple(kept), parsed.args))


def setup_run(
    problem: Problem | str,
    method: Method[Any, Any] | str,
    compressor: Compressor | str | None,
    stepsize: float | str | StepSize,
    seed: int,
    x0: Any,
    options: RunOptions,
) -> RunSetup:
    """Check the arguments of :func:`~shrinkgrad.sim.simulate` and bind the run they describe.

    ``options.device=None`` keeps the problem's device, ``options.dtype=None`` its dtype.
    """
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be a RunOptions, got {type(options).__name__}")
    prob = _prepare_problem(problem, options.dtype, options.device)
    meth = make_method(method)
    check_round_memory(prob, meth)  # n × d arrays that cannot fit: one line, before binding
    bound: BoundMethod[Any, Any] = meth.bind(
        prob,
        compressor,
        stepsize,
        seed,
        dtype=prob.dtype,
        device=prob.device,
        wire_dtype=options.wire_dtype,
    )
    # both runtimes reduce with methods.base.weighted_sum (the runner's AllReduce adds an
    # all-reduce), which takes sparse message batches; on the CPU only, where its sum is the
    # serial in-order one (CUDA's index_add_ adds in no fixed order: a seed would no longer
    # fix the last bits)
    sparse = bound.cfg.device.type == "cpu"
    bound = BoundMethod(bound.method, dataclasses.replace(bound.cfg, sparse_batches=sparse))
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
    held_out = tuple(str(c) for c in getattr(prob, "held_out_columns", ()))
    clash = sorted(set(held_out) & set(COLUMNS))
    if clash or len(set(held_out)) != len(held_out):
        raise ValueError(
            f"{type(prob).__name__}.held_out_columns {list(held_out)} must be distinct names "
            f"other than the simulator's columns (clash: {clash})"
        )
    x_bytes = x_start.detach().cpu().to(torch.float64).numpy().tobytes()
    fingerprint = dict(
        meta,
        **problem_identity(prob, info),
        x0_sha1=hashlib.sha1(x_bytes).hexdigest(),
        log_every=options.log_every,
        dtype=str(cfg.dtype),
        wire_dtype=str(cfg.wire_dtype),
    )
    fingerprint.update(run_identity(bound, options))
    if held_out:
        fingerprint["held_out_columns"] = list(held_out)
    clock = None
    if options.network is not None:
        try:
            clock = ModelClock.of(options.network, cfg.n, cfg.compressor, cfg.d)
        except ValueError as e:
            raise ValueError(f"network: {e}") from None
        fingerprint["network"] = clock.describe()
    return RunSetup(
        problem=prob,
        bound=bound,
        x0=x_start,
        options=options,
        meta=meta,
        fingerprint=fingerprint,
        held_out=held_out,
        f_lower=lower_bound(prob),
        x_star=known_minimiser(prob, cfg.dtype, cfg.device),
        clock=clock,
    )


def lower_bound(problem: Problem) -> float | None:
    """The certified lower bound f_lower (else f_star) of ``problem``, or None.

    A problem that computes f* on first use (``lazy_solution``) tightens f_lower when that
    happens: its ``f_lower_a_priori`` is used instead, so that the divergence test sees the same
    bound in every run.
    """
    names = (
        ("f_lower_a_priori",) if getattr(problem, "lazy_solution", False) else ("f_lower", "f_star")
    )
    for name in names:
        value = getattr(problem, name, None)
        if value is not None and math.isfinite(float(value)):
            return float(value)
    return None


def known_minimiser(
    problem: Problem, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """x* when the problem knows it without solving anything (``lazy_solution`` problems compute
    it on first use: their loss test covers the iterate's growth), else None."""
    if getattr(problem, "lazy_solution", False):
        return None
    x = getattr(problem, "x_star", None)
    if not isinstance(x, torch.Tensor) or x.shape != (problem.d,):
        return None
    return x.detach().to(dtype=dtype, device=device)


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
    shape = tuple(t.shape)
    if t.numel() != problem.d:
        raise ValueError(
            f"x0 must have {problem.d} entries (the problem's dimension d), got shape {shape}"
        )
    if sum(s != 1 for s in shape) > 1:  # a vector as (d,), (1, d) or (d, 1); not a matrix
        raise ValueError(
            f"x0 must be a vector of the problem's d = {problem.d} entries, got a {shape} "
            "array; if its entries are in the order of x, pass x0.reshape(-1)"
        )
    t = t.to(dtype=dtype, device=device).reshape(-1)
    if not bool(torch.isfinite(t).all()):
        raise ValueError("x0 has non-finite entries (NaN or inf)")
    return t.clone()


# --------------------------------------------------------------------------------------------
# running it
# --------------------------------------------------------------------------------------------
def run_rounds(setup: RunSetup, runtime: Runtime) -> SimResult:
    """Run ``setup`` on ``runtime`` (resuming its checkpoint when it exists); return the result.

    The semantics of every option are :func:`~shrinkgrad.sim.simulate`'s (docs/simulator.md):
    the table, the stopping rules, checkpoints every ``checkpoint_every`` rounds and at the end,
    a ``RuntimeWarning`` on divergence. On Ctrl-C a standalone runtime saves the last complete
    round and raises :class:`SimulationInterrupted`; otherwise the KeyboardInterrupt propagates.
    """
    cfg, opts = setup.bound.cfg, setup.options
    rounds, checkpoint, callback = opts.rounds, opts.checkpoint, opts.callback
    if setup.clock is not None and not runtime.standalone:
        raise ValueError(
            "network= (the modelled time_model_s) is a simulator option: a distributed run "
            "measures its real time; drop network, or simulate the run with shrinkgrad.simulate"
        )

    def save(p: Progress) -> None:
        if checkpoint is not None:
            save_checkpoint(checkpoint, {"fingerprint": setup.fingerprint, **p.snapshot()})

    def result(p: Progress) -> SimResult:
        up, up_paper, down = runtime.totals(p)
        return SimResult(
            table=_table(p.table_rows(), setup),
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
    prog = _reopen(prog, rounds, opts.log_every)
    if prog.state.round > rounds:
        raise ValueError(
            f"the checkpoint {str(checkpoint)!r} is at round {prog.state.round} > rounds="
            f"{rounds}; ask for at least {prog.state.round} rounds or use another path"
        )
    if prog.status is not None or prog.last_logged == prog.state.round == rounds:
        return result(prog)  # a finished run: its result at once
    ref = _reference(setup, prog)

    def ask_callback(p: Progress) -> Progress:
        """``p`` stopped (status ``stopped``) when the callback asks so after its new row."""
        r = p.state.round
        if callback is None or p.status is not None or p.last_logged != r:
            return p
        if not callback(r, p.state):
            return p
        msg = f"stopped by the callback at round {r}"
        return dataclasses.replace(p, status="stopped", message=msg, decided_at=r)

    # -- the loop -------------------------------------------------------------------------------
    bar = _progress_bar(opts.progress, rounds, prog.state.round, setup.meta)
    tick = max(1, rounds // 100)  # the bar also moves every 1% of the rounds
    try:
        if prog.state.round == rounds:  # saved by a longer run at the round now the last one
            prog = ask_callback(_last_row(setup, runtime, prog, ref))
        while prog.state.round < rounds and prog.status is None:
            prog = _advance(setup, runtime, prog, ref)
            r = prog.state.round
            if prog.last_logged == r and prog.status is None:
                prog = ask_callback(prog)
                if bar is not None:
                    bar(r, prog.table_rows()[-1][1])
            elif bar is not None and r % tick == 0:
                bar(r, None)
            if checkpoint is not None and prog.state.round % opts.checkpoint_every == 0:
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


#: the identifying columns that hold integers (the others are floats or strings)
_INT_META = ("seed", "n_clients", "d")


def _table(rows: list[Row], setup: RunSetup) -> pd.DataFrame:
    """The table of ``rows``: ``round`` int64, the metrics float64, the identifying columns
    constant (int64, float64 or str), built column by column from one float64 array (a few
    ms; letting pandas infer and convert a frame of tuples cost ~50 ms, a quarter of a
    millisecond per round of a 200-round run)."""
    metrics = list(METRIC_COLUMNS) + list(setup.extra_metrics)
    values = np.array(rows, dtype=np.float64).reshape(len(rows), len(metrics))
    n = values.shape[0]
    cols: dict[str, Any] = {name: values[:, k].copy() for k, name in enumerate(metrics)}
    cols["round"] = values[:, 0].astype(np.int64)
    for name, v in setup.meta.items():
        if name in _INT_META:
            cols[name] = np.full(n, int(v), dtype=np.int64)
        elif isinstance(v, str):
            cols[name] = pd.array([v] * n, dtype="str")
        else:
            cols[name] = np.full(n, float(v), dtype=np.float64)
    return pd.DataFrame({c: cols[c] for c in setup.columns})


def _finite(row: Row) -> bool:
    return all(math.isfinite(v) for v in row[1:3]) and all(
        math.isfinite(v) for v in row[len(METRIC_COLUMNS) :]
    )


def _describe(row: Row, setup: RunSetup) -> str:
    names = ("grad_norm_sq", "loss", *setup.extra_metrics)
    values = (row[1], row[2], *row[len(METRIC_COLUMNS) :])
    return ", ".join(f"{k}={v}" for k, v in zip(names, values, strict=True))


def _reference(setup: RunSetup, prog: Progress) -> DivergenceReference:
    """The divergence tests' reference: round 0's metrics (the table's first row)."""
    first = prog.table_rows()[0]
    dist0 = None
    if setup.x_star is not None:
        dist0 = float(torch.sum((setup.x0 - setup.x_star) ** 2))
    eps = float(torch.finfo(setup.bound.cfg.dtype).eps)
    return DivergenceReference(prog.gns0, float(first[2]), setup.f_lower, dist0, eps)


def _start(setup: RunSetup, runtime: Runtime) -> Progress:
    """Initialise the method and log round 0."""
    t0 = time.perf_counter()
    state, traffic = runtime.init(setup.bound, setup.x0, record=True)
    prog = Progress.start(state, traffic, time.perf_counter() - t0, setup.bound.cfg.n, setup.clock)
    if not math.isfinite(prog.time_model_s):
        raise ValueError(
            f"the network model's time of round 0 is {prog.time_model_s} s: the network "
            f"{setup.clock.describe() if setup.clock is not None else ''} has values out of any "
            "physical range (its latency, bandwidth or compute); give finite, realistic ones"
        )
    row = setup.row(runtime, prog)
    gns = row[1]
    if not _finite(row):
        raise ValueError(
            f"the objective, its gradient or a held-out metric is not finite at x0 "
            f"({_describe(row, setup)}); choose another starting point"
        )
    prog = dataclasses.replace(prog, gns0=gns).with_row(row)
    tol = setup.options.tol
    if tol is not None and gns <= tol:
        msg = f"grad_norm_sq {gns:.3g} <= tol={tol:g} at round 0"
        prog = dataclasses.replace(prog, status="converged", message=msg, decided_at=0)
    return prog


def _reopen(prog: Progress, rounds: int, log_every: int) -> Progress:
    """``prog`` without its last row when a longer run than the saved one is asked for and that
    row was logged only because its round was the saved run's last (off the logging grid).

    The row goes, and with it the status it decided (``decided_at``: the tolerance, a growth
    test or the callback at that row; a completed run has none): a run made with the larger
    ``rounds`` from the start logs no row there, so it may converge, diverge or stop at a later
    round. A stop on non-finite values (``decided_at`` −1) is kept: it happens at the same round
    in any longer run.
    """
    if prog.state.round >= rounds or not prog.n_rows:
        return prog
    rows = prog.table_rows()
    last = int(rows[-1][0])
    if last != prog.state.round or last % log_every == 0:
        return prog
    if prog.status is not None and prog.decided_at != last:
        return prog
    prev = int(rows[-2][0]) if prog.n_rows > 1 else -1
    return dataclasses.replace(
        prog, n_rows=prog.n_rows - 1, last_logged=prev, status=None, message="", decided_at=-1
    )


def _last_row(
    setup: RunSetup, runtime: Runtime, prog: Progress, ref: DivergenceReference
) -> Progress:
    """``prog`` with the row of its round, logged as the run's last one, and its verdict.

    For a checkpoint that a longer run saved (an interruption, ``checkpoint_every``) at exactly
    the round now asked for: the uninterrupted run logs its last round. When that row is not
    finite the run is ``diverged`` and its table ends at the last logged row (an uninterrupted
    run would also log the round before when it was off the grid: that state is not saved).
    """
    r = prog.state.round
    row = setup.row(runtime, prog)
    if not _finite(row):
        message = (
            f"diverged at round {r}: non-finite values ({_describe(row, setup)}); the table "
            f"ends at round {prog.last_logged}"
        )
        return dataclasses.replace(prog, status="diverged", message=message)
    return _judged(setup, ref, prog.with_row(row), row)


def _judged(setup: RunSetup, ref: DivergenceReference, prog: Progress, row: Row) -> Progress:
    """``prog``, whose last row is ``row`` (finite), with the verdict of that row."""
    r = prog.state.round
    status, message = _verdict(setup, ref, r, row, prog.state.x)
    if not status:
        return prog
    return dataclasses.replace(prog, status=status, message=message, decided_at=r)


def _advance(
    setup: RunSetup, runtime: Runtime, prog: Progress, ref: DivergenceReference
) -> Progress:
    """Run one round: the new progress (state, bits, time and, when due, a row and a verdict)."""
    r = prog.state.round + 1
    logged = setup.logged(r)
    t0 = time.perf_counter()
    try:
        new_state, traffic = runtime.step(setup.bound, prog.state, record=logged)
        finite = all_finite(new_state.x)
    except NonFiniteError:
        new_state, traffic, finite = prog.state, None, False
    elapsed = time.perf_counter() - t0 + runtime.prepaid_s()
    if not finite or traffic is None:
        return _diverged_nonfinite(setup, runtime, prog, r)
    nxt = prog.after(new_state, traffic, elapsed, setup.clock)
    if not logged:
        return nxt
    row = setup.row(runtime, nxt)
    if not _finite(row):
        out = _diverged_nonfinite(setup, runtime, prog, r)
        extra = f" ({_describe(row, setup)} at round {r})"
        return dataclasses.replace(out, message=out.message + extra)
    return _judged(setup, ref, nxt.with_row(row), row)


def _verdict(
    setup: RunSetup, ref: DivergenceReference, r: int, row: Row, x: torch.Tensor
) -> tuple[Status | None, str]:
    """Divergence or convergence at a logged round (decided with the row, atomically)."""
    opts, cfg = setup.options, setup.bound.cfg
    gns, loss = float(row[1]), float(row[2])
    dist_sq = None
    if setup.x_star is not None and opts.divergence.iterate_factor is not None:
        dist_sq = float(torch.sum((x - setup.x_star) ** 2))
    why = opts.divergence.verdict(ref, gns, loss, dist_sq)
    if why is not None:
        return "diverged", (
            f"diverged at round {r}: {why}; the step size {cfg.stepsize:.4g} "
            f"({cfg.stepsize_rule}) is too large"
        )
    if opts.tol is not None and gns <= opts.tol:
        return "converged", f"grad_norm_sq {gns:.3g} <= tol={opts.tol:g} at round {r}"
    return None, ""


def _diverged_nonfinite(setup: RunSetup, runtime: Runtime, prog: Progress, r: int) -> Progress:
    """Stop at round ``r`` whose values are not finite; log the last finite round if unlogged."""
    if prog.state.round > prog.last_logged:
        row = setup.row(runtime, prog)
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
    unrecorded = [k for k in diff if k.startswith("problem.") and k not in saved]
    if diff and len(unrecorded) == len(diff):
        # a checkpoint of an earlier version, whose fingerprint did not identify the problem
        # (problem_identity): it cannot be told apart from one of another split, loss or data
        raise ValueError(
            f"the checkpoint {str(path)!r} belongs to a different run or to an earlier version "
            f"of shrinkgrad: it does not record the problem's "
            f"{', '.join(k.removeprefix('problem.') for k in unrecorded)}, so it may be of "
            "another split, held-out part, loss or data; delete it to start the run again, or "
            "choose another checkpoint path (another --out)"
        )
    if diff:
        detail = ", ".join(
            f"{k}: saved {saved.get(k)!r} vs now {fingerprint.get(k)!r}" for k in diff
        )
        raise ValueError(
            f"the checkpoint {str(path)!r} belongs to a different run ({detail}); delete it, or "
            "choose another checkpoint path (another --out)"
        )
    fields = {f.name for f in dataclasses.fields(Progress)}
    optional = ("status", "message", "time_model_s", "decided_at")
    missing = sorted(k for k in fields if k not in data and k not in optional)
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
