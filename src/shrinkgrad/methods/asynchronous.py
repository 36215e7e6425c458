"""Asynchronous execution of a method ([K18]): one client's stale message per server update.

On [K18]'s asynchronous parameter server a client computes its message at the model x^v it was
last sent, and the server applies it when it arrives, at a later version t ≥ v. This module is the
one implementation of that execution, used by the real server
(:mod:`shrinkgrad.distributed.ps`) and by the simulator's replay of a recorded run
(``asynchronous[trace=RUN_DIR]``). It is written in terms of the method's own parts
(:class:`~shrinkgrad.methods.base.Method`):

* **client** (:func:`client_init`, :func:`client_update`): the method's ``init_clients`` /
  ``client_step`` for the one client (ids = [i], round = its message counter k, the model x^v as
  the server state's ``x``). What goes on the wire (:class:`Sent`) is the vector the step
  compressed, rounded as the wire rounds it (:class:`WireConfig`: C applied to the vector in the
  wire dtype), or, for a step that compresses nothing, its message values in the wire dtype;
* **server** (:func:`server_values`, :func:`server_start`, :func:`server_advance`): the arriving
  vector becomes reduction values through the method's ``async_receive`` (with the server's
  per-client memory when the method keeps one: IAG's table), lost clients' contributions leave
  through ``async_forget``; the aggregate is the synchronous method's reduction
  Σ_j w_j values_j, and the update is the method's own ``server_post`` then ``server_pre``::

      state_t = server_post(ready_{t−1}, Σ_j w_j values_j, t);  ready_t = server_pre(state_t, t+1)

  and ready_t.x is the model the server sends next (version t).

With one client and no staleness this is the sequential method step for step (the contract
test). :class:`Asynchronous` (registered as ``asynchronous``) runs the execution in the
simulator: from the log of a parameter-server run (``trace=RUN_DIR``: which worker's message,
with which counter, computed at which version, applied at which update; losses and resumptions)
it reproduces the run's iterates, or, without a trace, with a round-robin schedule without
staleness. Its theory step is the method's asynchronous rule (``async_theory``) at the delay
that ``tau_max`` (enforced staleness bound) or ``assume_tau`` (assumed delay) gives.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from ..compressors import Compressor
from ..registry import SpecError, parse_spec
from ..rng import Keys, KeyStream
from .base import (
    METHODS,
    Config,
    Constants,
    GradientOracle,
    Message,
    Method,
    ProblemLike,
    Runtime,
    Traffic,
    make_method,
    methods_for,
    weighted_sum,
)
from .stepsize import StepSize

__all__ = [
    "EVENT_INIT",
    "EVENT_LOST",
    "EVENT_RESUMED",
    "IDENTITY_FILES",
    "TRACE_FILES",
    "AsyncClients",
    "AsyncServer",
    "AsyncState",
    "AsyncTrace",
    "Asynchronous",
    "MinibatchOracle",
    "ModelView",
    "RunProblem",
    "Sent",
    "WireConfig",
    "client_init",
    "client_update",
    "delay_bound",
    "server_advance",
    "server_memory",
    "server_start",
    "server_values",
]

#: the files of a parameter-server run directory that describe its asynchrony
TRACE_FILES = {"summary": "summary.json", "updates": "staleness.csv", "events": "events.csv"}
#: the files of a run directory that identify its problem, when present (:class:`RunProblem`):
#: the results table (its ``problem``, ``dataset`` and ``d`` columns) and the server's snapshot
#: (its fingerprint's ``problem.data``, the data digest; only a run with an output directory)
IDENTITY_FILES = {"table": "table.csv", "snapshot": "checkpoint/snapshot.pt"}
#: events of the log: a worker's initial message arrived / a worker was lost / the run resumed
EVENT_INIT = "init_received"
EVENT_LOST = "worker_lost"
EVENT_RESUMED = "resumed"


# --------------------------------------------------------------------------------------------
# the client side
# --------------------------------------------------------------------------------------------
class ModelView(NamedTuple):
    """The server state a worker sees: the model x it was sent (it receives nothing else)."""

    x: torch.Tensor


class _Call(NamedTuple):
    raw: torch.Tensor  # the compressor's input, in the wire dtype (m, d)
    round: int
    out: torch.Tensor  # C(raw), in the wire dtype


@dataclasses.dataclass(frozen=True, eq=False)
class WireConfig(Config):
    """A :class:`~shrinkgrad.methods.base.Config` whose ``compress`` rounds as the wire does.

    ``compress(x)`` returns C(x in the wire dtype) in the run dtype: exactly what the server
    decodes from the compressor's wire format (``decode(encode(x)) = C(x)``, the compressors'
    contract), so a client's memory (EF21's g_i) follows what the server received. With the
    wire dtype equal to the run dtype it is ``Config.compress`` itself. Every call is recorded
    (:attr:`calls`) so the caller can encode the payload.
    """

    calls: list[_Call] = dataclasses.field(default_factory=list, repr=False)

    @classmethod
    def of(cls, cfg: Config) -> WireConfig:
        """The wire view of ``cfg`` (same constants, compressor, step, seed and key cache)."""
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config) if f.init}
        return cls(**fields)

    def dense(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.wire_dtype).to(self.dtype)

    def compress(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, *, sent_only: bool = False
    ) -> torch.Tensor:
        raw = x.to(self.wire_dtype)
        out = super().compress(raw, ids, round, sent_only=sent_only)
        self.calls.append(_Call(raw, int(round), out))
        return out.to(self.dtype)


class Sent(NamedTuple):
    """What the clients of one step put on the wire (rows: the clients of the step).

    ``kind``: ``compressed`` (the step's compressed vectors; ``raw`` is the compressor's input in
    the wire dtype, encoded with the compressor's key at ``round``), ``dense`` (a step that
    compresses nothing sends its message values; ``raw`` = them in the wire dtype) or ``none``
    (nothing to send, e.g. DCGD's initialisation). ``vector`` (m, d) is what the server decodes,
    in the run dtype; ``traffic`` is the method's bit count.
    """

    kind: Literal["compressed", "dense", "none"]
    vector: torch.Tensor | None
    raw: torch.Tensor | None
    round: int
    traffic: Traffic


def _sent(method: Method[Any, Any], cfg: WireConfig, msg: Message, m: int) -> Sent:
    calls = cfg.calls
    if len(calls) > 1:
        raise ValueError(
            f"{method.name} compressed {len(calls)} times in one step; an asynchronous message "
            "carries one compressed vector per client"
        )
    if calls:
        call = calls[0]
        if call.out.shape[0] != m:
            raise ValueError(
                f"{method.name} compressed the vectors of {call.out.shape[0]} of the step's {m} "
                "clients; on a parameter server every client of a step sends"
            )
        return Sent("compressed", call.out.to(cfg.dtype), call.raw, call.round, msg.traffic)
    if msg.values is None:
        return Sent("none", None, None, 0, msg.traffic)
    raw = msg.values.to(cfg.wire_dtype)
    return Sent("dense", raw.to(cfg.dtype), raw, 0, msg.traffic)


def client_init(
    method: Method[Any, Any],
    cfg: Config,
    x0: torch.Tensor,
    oracle: GradientOracle,
    ids: torch.Tensor,
) -> tuple[Any, Sent]:
    """The clients' part of the initialisation (round 0) and what they send."""
    wire = WireConfig.of(cfg)
    clients, msg = method.init_clients(wire, x0, oracle, ids)
    return clients, _sent(method, wire, msg, ids.numel())


def client_update(
    method: Method[Any, Any],
    cfg: Config,
    x: torch.Tensor,
    clients: Any,
    oracle: GradientOracle,
    counter: int,
) -> tuple[Any, Sent]:
    """The clients' step at the model ``x`` they were sent, as their message ``counter``."""
    wire = WireConfig.of(cfg)
    clients, msg = method.client_step(wire, ModelView(x), clients, oracle, counter)
    return clients, _sent(method, wire, msg, clients.ids.numel())


class MinibatchOracle:
    """``oracle`` whose exact gradients become minibatch estimators of ``batch_size`` samples.

    Row j of ``grads(x, ids)`` averages ``batch_size`` samples of client ``ids[j]`` drawn with
    the key (seed, "minibatch", ids[j], round): the parameter server's ``batch_size`` option
    for methods that read exact gradients (a worker's message k uses round k).
    """

    def __init__(self, oracle: GradientOracle, batch_size: int, seed: int, round: int) -> None:
        self.oracle = oracle
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.round = int(round)

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        keys = KeyStream(self.seed, ids, stream="minibatch").at(self.round)
        b = torch.full((ids.numel(),), self.batch_size, dtype=torch.int64)
        return self.oracle.stoch_grads(x, ids, b, keys)

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        return self.oracle.stoch_grads(x, ids, batch_sizes, keys)


# --------------------------------------------------------------------------------------------
# the server side
# --------------------------------------------------------------------------------------------
class AsyncServer(NamedTuple):
    """The server between updates: the method's state after ``update`` updates (its ``x`` is
    x^update), ``ready`` = ``server_pre(state, update + 1)`` (whose ``x`` the server sends next),
    and its per-client ``memory`` (n, d) when the method keeps one."""

    update: int
    state: Any
    ready: Any
    memory: torch.Tensor | None


def server_memory(method: Method[Any, Any], cfg: Config) -> torch.Tensor | None:
    """The initial per-client memory of the server: zeros (n, d), or None."""
    if not method.async_memory:
        return None
    return torch.zeros(cfg.n, cfg.d, dtype=cfg.dtype, device=cfg.device)


def server_values(
    method: Method[Any, Any],
    cfg: Config,
    memory: torch.Tensor | None,
    ids: torch.Tensor,
    sent: torch.Tensor | None,
    forget: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(ids, reduction values, memory) of one update, rows sorted by client id.

    The rows of the clients ``ids`` that sent ``sent`` (``async_receive``) and of the clients
    ``forget`` lost since the last update (``async_forget``). ``values`` is None when nothing is
    to be reduced.
    """
    parts_ids: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    if sent is not None and ids.numel():
        values, memory = method.async_receive(cfg, memory, ids, sent)
        parts_ids.append(ids)
        parts.append(values)
    if forget is not None and forget.numel():
        gone, memory = method.async_forget(cfg, memory, forget)
        if gone is not None:
            parts_ids.append(forget)
            parts.append(gone)
    if not parts:
        return ids[:0], None, memory
    all_ids = torch.cat(parts_ids)
    order = torch.argsort(all_ids, stable=True)
    return all_ids[order], torch.cat(parts)[order], memory


def _aggregate(cfg: Config, ids: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
    return None if values is None else weighted_sum(values, cfg.weights[ids])


def server_start(
    method: Method[Any, Any],
    cfg: Config,
    x0: torch.Tensor,
    ids: torch.Tensor,
    sent: torch.Tensor | None,
) -> AsyncServer:
    """The server after the initialisation: the clients ``ids`` (sorted) sent ``sent`` (or
    nothing); ``init_server`` of their reduction, then ``server_pre`` of round 1."""
    ids, values, memory = server_values(method, cfg, server_memory(method, cfg), ids, sent)
    state = method.init_server(cfg, x0, _aggregate(cfg, ids, values))
    return AsyncServer(0, state, method.server_pre(cfg, state, 1), memory)


def server_advance(
    method: Method[Any, Any], cfg: Config, ready: Any, aggregate: torch.Tensor | None, r: int
) -> tuple[Any, Any]:
    """Update ``r``: (``server_post(ready, aggregate, r)``, ``server_pre`` of it for r + 1)."""
    if aggregate is None:
        raise ValueError(f"{method.name}: an asynchronous update needs a message to apply")
    state = method.server_post(cfg, ready, aggregate, r)
    return state, method.server_pre(cfg, state, r + 1)


def server_update(
    method: Method[Any, Any],
    cfg: Config,
    server: AsyncServer,
    ids: torch.Tensor,
    sent: torch.Tensor,
    forget: torch.Tensor | None = None,
) -> AsyncServer:
    """One update of the real server: the messages ``sent`` of the clients ``ids`` (one
    client asynchronously; every live client in a synchronous round) and the lost ones."""
    ids, values, memory = server_values(method, cfg, server.memory, ids, sent, forget)
    r = server.update + 1
    state, ready = server_advance(method, cfg, server.ready, _aggregate(cfg, ids, values), r)
    return AsyncServer(r, state, ready, memory)


def delay_bound(
    method: Method[Any, Any], n: int, tau_max: int | None, assume_tau: int | None
) -> int | None:
    """The [K18] delay the theory step assumes: ``assume_tau``, the method's delay under the
    staleness bound ``tau_max`` (``async_delay``), 0 for one client (never stale), else None.

    A method with server memory (``async_memory``: the IAG's table) uses every client's last
    message in every update, and one entry is replaced per update, so its oldest entry is at
    least n − 1 updates old whatever the staleness: under ``tau_max`` its delay is at least
    n − 1 (the parameter server refuses tau_max < W − 1 for it; the simulator's round robin
    used to take 2·tau_max < n − 1 and a step too large for its delays)."""
    if assume_tau is not None:
        return int(assume_tau)
    if tau_max is not None:
        floor = n - 1 if method.async_memory else 0
        return max(method.async_delay(int(tau_max)), floor)
    return 0 if n == 1 else None


# --------------------------------------------------------------------------------------------
# the log of a run
# --------------------------------------------------------------------------------------------
#: what a replay may change from the run (a what-if on the same asynchrony); the problem may not
WHAT_IFS = "the method, compressor, step size, seed and wire dtype"


@dataclasses.dataclass(frozen=True)
class RunProblem:
    """The problem a recorded run was on, as its directory records it (None: not recorded).

    ``spec``: the run's problem spec (``summary.json``'s ``config.problem``, with ``n_clients``
    = the workers, as the server built it); ``name``, ``dataset``, ``d``: the results table's
    columns (``info()`` of the problem the server ran, also when ``run_ps`` was given a
    ``problem=`` object); ``data``: the data digest
    (:meth:`~shrinkgrad.problems.Problem.data_digest`) in the fingerprint of the server's
    snapshot (``checkpoint/snapshot.pt``: only a run given an output directory has one).

    The schedule of a run (who sent which message at which version) is a property of that run
    on that problem: replayed on another problem it executes without error and means nothing.
    :meth:`check` therefore refuses a problem whose identity differs; the what-ifs of a replay
    are :data:`WHAT_IFS`.
    """

    spec: str | None = None
    name: str | None = None
    dataset: str | None = None
    d: int | None = None
    data: str | None = None

    @classmethod
    def load(cls, root: Path, config: dict[str, Any], workers: int) -> RunProblem:
        """What ``root`` records; a missing or unreadable identity file records nothing."""
        import pandas as pd

        name = dataset = data = None
        d = None
        table = root / IDENTITY_FILES["table"]
        if table.is_file():
            try:
                row = pd.read_csv(table, nrows=1, dtype=str, keep_default_na=False)
                if len(row) and {"problem", "dataset", "d"} <= set(row.columns):
                    name, dataset = str(row["problem"].iloc[0]), str(row["dataset"].iloc[0])
                    d = int(row["d"].iloc[0])
            except (OSError, ValueError):
                name = dataset = None
                d = None
        snapshot = root / IDENTITY_FILES["snapshot"]
        if snapshot.is_file():
            try:  # the server's own snapshot of this run (launch.resume_point reads it alike)
                snap = torch.load(snapshot, map_location="cpu", weights_only=False)
                fp = snap.get("fingerprint") if isinstance(snap, dict) else None
                found = fp.get("problem.data") if isinstance(fp, dict) else None
                data = found if isinstance(found, str) else None
            except Exception:  # a torn or foreign file: no record (check() warns)
                data = None
        return cls(_run_spec(config.get("problem"), workers), name, dataset, d, data)

    def check(self, problem: Any, source: str) -> None:
        """Refuse ``problem`` in one line when it is not the run's; warn when its data cannot be
        checked (no digest recorded, or the problem has none). An object without ``info()``
        (the bare :class:`~shrinkgrad.methods.base.Constants`) identifies nothing."""
        if not callable(getattr(problem, "info", None)):
            return
        from ..problems.base import data_digest_of

        info = problem.info()
        build = f", make_problem({self.spec!r})" if self.spec else ""

        def refuse(what: str) -> None:
            raise ValueError(
                f"asynchronous: the run in {source!r} was recorded on {what}; replay it on the "
                f"run's problem{build} (a replay's what-ifs change only {WHAT_IFS})"
            )

        name = str(info.get("problem", getattr(problem, "name", "")))
        dataset = str(info.get("dataset", getattr(problem, "dataset", "")))
        if self.name is not None and name != self.name:
            refuse(f"the problem {self.name}, this one is {name}")
        digest = data_digest_of(problem)
        # the same data under another name or path (a moved file) is the same problem: with
        # equal digests the data sets' names are not compared, the specs' other options are
        same_data = digest is not None and digest == self.data
        if self.dataset is not None and dataset != self.dataset and not same_data:
            refuse(f"the data set {self.dataset!r}, this problem's is {dataset!r}")
        if self.d is not None and int(problem.d) != self.d:
            refuse(f"d={self.d}, this problem has d={int(problem.d)}")
        moved = ("dataset",) if same_data else ()
        ran = _spec_key(self.spec, moved)
        this = _spec_key(getattr(problem, "spec", None), moved)
        if ran is not None and this is not None and ran[0] != this[0]:
            refuse(f"{ran[1]}, this problem is {this[1]} (other options)")
        if self.data is not None and digest is not None and digest != self.data:
            refuse(
                f"other data (data digest {self.data[:12]}…, this problem's {digest[:12]}…: "
                "its data file changed since, or other arrays)"
            )
        if self.data is None or digest is None:
            why = (
                "this problem has no data digest (Problem.data_digest is None)"
                if digest is None
                else f"the run in {source!r} records no data digest (no "
                f"{IDENTITY_FILES['snapshot']}: a run without an output directory, or saved "
                "elsewhere)"
            )
            warnings.warn(
                f"asynchronous: {why}, so the replay cannot check that the problem's data are "
                "the run's (it checked the problem's name, data set, d and spec)",
                UserWarning,
                stacklevel=4,
            )


def _run_spec(problem: Any, workers: int) -> str | None:
    """The spec of the problem a run's server built: ``problem`` with n_clients = workers
    (``PSConfig.problem_spec``)."""
    if not isinstance(problem, str) or not problem:
        return None
    try:
        spec = parse_spec(problem)
    except SpecError:
        return problem
    params = dict(spec.params)
    params.setdefault("n_clients", workers)
    return str(dataclasses.replace(spec, params=tuple(params.items())))


def _spec_key(spec: Any, ignore: tuple[str, ...] = ()) -> tuple[Any, str] | None:
    """(comparison key, text) of a problem spec without its defaults and execution parameters
    (:func:`~shrinkgrad.sim.engine.canonical_problem_spec`) and without ``ignore``, parameters
    in any order; None without a spec."""
    from ..sim.engine import canonical_problem_spec

    canon = canonical_problem_spec(spec)
    if canon is None:
        return None
    try:
        parsed = parse_spec(canon)
    except SpecError:
        return canon, canon
    params = tuple(sorted((k, repr(v)) for k, v in parsed.params if k not in ignore))
    return (parsed.name, params, str(parsed.args), str(parsed.base)), canon


@dataclasses.dataclass(frozen=True)
class AsyncTrace:
    """The asynchrony of a recorded parameter-server run (its ``RUN_DIR``).

    Update ``r`` (1 ≤ r ≤ :attr:`updates`) applied worker ``worker[r−1]``'s message number
    ``counter[r−1]``, computed at version ``version[r−1]``. ``init``: the workers whose initial
    message the server received; ``forgets[r]``: workers lost before update r (their
    contributions leave with it); ``resets``: updates before which the run resumed from a
    snapshot (every worker then restarts from the server's memory at the current model);
    ``problem``: the identity of the run's problem, which a replay must share.
    """

    source: str
    workers: int
    method: str
    tau_max: int | None
    assume_tau: int | None
    batch_size: int | None
    worker: torch.Tensor
    counter: torch.Tensor
    version: torch.Tensor
    init: tuple[int, ...]
    forgets: dict[int, tuple[int, ...]]
    resets: frozenset[int]
    #: the problem the run was on (:class:`RunProblem`), which a replay must be on
    problem: RunProblem = dataclasses.field(default_factory=RunProblem)

    @property
    def updates(self) -> int:
        return int(self.worker.numel())

    @classmethod
    def load(cls, path: str | Path) -> AsyncTrace:
        """Read the trace of the run directory ``path`` (written by ``PSResult.save``)."""
        import pandas as pd

        root = Path(path)
        missing = [name for name in TRACE_FILES.values() if not (root / name).is_file()]
        if missing:
            raise ValueError(
                f"asynchronous: {str(root)!r} is not the directory of a parameter-server run (it "
                f"lacks {', '.join(missing)}); give the --out directory of 'shrinkgrad ps'"
            )
        try:
            summary = json.loads((root / TRACE_FILES["summary"]).read_text(encoding="utf-8"))
            config = summary["config"]
            updates = pd.read_csv(root / TRACE_FILES["updates"])
            events = pd.read_csv(root / TRACE_FILES["events"])
            rows = updates.sort_values("update")
            worker = torch.as_tensor(rows["worker"].to_numpy(np.int64, copy=True))
            counter = torch.as_tensor(rows["counter"].to_numpy(np.int64, copy=True))
            version = torch.as_tensor(rows["version_computed"].to_numpy(np.int64, copy=True))
            number = rows["update"].to_numpy(np.int64)
            workers, method, mode = int(config["workers"]), str(config["method"]), config["mode"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"asynchronous: cannot read the trace in {str(root)!r}: {e}") from None
        if mode != "async":
            raise ValueError(
                f"asynchronous: {str(root)!r} is a synchronous run; its rounds are the method's "
                "own: simulate the method itself"
            )
        if not np.array_equal(number, np.arange(1, number.size + 1)):
            raise ValueError(
                f"asynchronous: the updates of {str(root)!r} are not numbered 1, 2, ...: the "
                "trace is incomplete"
            )
        # an event "at update u" happened between updates u and u + 1 (events in time order):
        # a loss is forgotten with update u + 1, unless the run resumed before it (a resumed
        # run restarts every worker from the server's memory)
        init: list[int] = []
        lost: dict[int, set[int]] = {}
        resets: set[int] = set()
        kinds = events["event"].astype(str).tolist()
        afters = events["update"].astype("int64").tolist()
        who = [None if pd.isna(w) else int(w) for w in events["worker"].tolist()]
        for kind, after, worker_id in zip(kinds, afters, who, strict=True):
            if kind == EVENT_INIT and worker_id is not None:
                init.append(worker_id)
            elif kind == EVENT_LOST and worker_id is not None:
                lost.setdefault(after + 1, set()).add(worker_id)
            elif kind == EVENT_RESUMED:
                resets.add(after + 1)
                lost.pop(after + 1, None)
        forgets = {r: tuple(sorted(ws)) for r, ws in lost.items()}
        return cls(
            source=str(root),
            workers=workers,
            method=method,
            tau_max=_opt_int(config.get("tau_max")),
            assume_tau=_opt_int(config.get("assume_tau")),
            batch_size=_opt_int(config.get("batch_size")),
            worker=worker,
            counter=counter,
            version=version,
            init=tuple(sorted(set(init))),
            forgets=forgets,
            resets=frozenset(resets),
            problem=RunProblem.load(root, config, workers),
        )


def _opt_int(value: Any) -> int | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value)


# --------------------------------------------------------------------------------------------
# the execution in the simulator
# --------------------------------------------------------------------------------------------
class AsyncState(NamedTuple):
    """Server state of :class:`Asynchronous`: x, the method's state and ready state, and for
    every worker the model (n, d) it computes its next message at and that model's version."""

    x: torch.Tensor
    inner: Any
    ready: Any
    models: torch.Tensor
    versions: torch.Tensor


class AsyncClients(NamedTuple):
    """Client state of :class:`Asynchronous`: the method's client state of the group and the
    server's per-client memory (n, d), whose rows of the group's clients the group updates."""

    ids: torch.Tensor
    inner: Any
    memory: torch.Tensor | None


def _take(state: Any, pos: torch.Tensor) -> Any:
    """The rows ``pos`` of a client-state NamedTuple (every field has the client axis first)."""
    return type(state)(*(f[pos] for f in state))


def _put(state: Any, pos: torch.Tensor, part: Any) -> Any:
    return type(state)(*(f.index_copy(0, pos, p) for f, p in zip(state, part, strict=True)))


class Asynchronous(Method[AsyncState, AsyncClients]):
    """An asynchronous execution of ``method``: one client's stale message per update ([K18]).

    Update t: a worker i sends its message number k, computed by the method's client step at
    the model x^v it was sent (v ≤ t − 1); the server maps it to reduction values
    (``async_receive``) and applies the method's ``server_post``/``server_pre``; worker i gets
    x^t. The schedule (who, which k, which v) is

    * ``trace=RUN_DIR``: the log of a parameter-server run (``shrinkgrad ps --out RUN_DIR``),
      which this replays: same compressor, step size, seed and wire dtype give the run's
      iterates (to rounding; exactly with ``wire_dtype=float64``), others a what-if on the same
      asynchrony. ``method`` defaults to the run's; ``tau_max``/``assume_tau`` to the run's
      (they only set the theory step). The problem must be the run's: another number of
      clients, problem, option, data set, d or data digest is refused (:class:`RunProblem`);
      a trace that records no data digest replays with a warning;
    * no trace: round robin without staleness (worker (t − 1) mod n at the current model).

    The theory step is the method's asynchronous rule at the delay bound
    (:func:`delay_bound`): ``tau_max`` (the staleness bound the server enforced) or
    ``assume_tau``. The parameter server binds its methods through this class (the one
    step-size path).
    """

    def __init__(
        self,
        method: Method[Any, Any] | None = None,
        *,
        trace: AsyncTrace | str | Path | None = None,
        tau_max: int | None = None,
        assume_tau: int | None = None,
        arrival: bool = False,
    ) -> None:
        tr = AsyncTrace.load(trace) if isinstance(trace, (str, Path)) else trace
        if arrival and tr is not None:
            raise ValueError("asynchronous: a trace fixes the arrival order; give one or the other")
        if method is None:
            method = make_method(tr.method) if tr is not None else make_method("dcgd")
        reason = method.unsupported("ps")
        if reason is not None:
            raise ValueError(
                f"asynchronous: {reason}; the methods that run asynchronously: "
                f"{', '.join(methods_for('ps'))}"
            )
        for name, v in (("tau_max", tau_max), ("assume_tau", assume_tau)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"asynchronous: {name} must be an integer >= 0, got {v!r}")
        if tau_max is not None and assume_tau is not None:
            raise ValueError("asynchronous: give tau_max or assume_tau, not both")
        if tr is not None and tau_max is None and assume_tau is None:
            tau_max, assume_tau = tr.tau_max, tr.assume_tau
        self.method = method
        self.inner = method.async_form()
        self.trace = tr
        self.tau_max = tau_max
        self.assume_tau = assume_tau
        #: the order is the physical arrival order of a real server (no schedule here)
        self.arrival = arrival
        self.requires = self.inner.requires  # type: ignore[misc]

    def default_spec(self) -> str:
        params = [
            f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
            for k, v in (
                ("trace", None if self.trace is None else self.trace.source),
                ("tau_max", self.tau_max),
                ("assume_tau", self.assume_tau),
            )
            if v is not None
        ]
        return (
            "asynchronous" + (f"[{','.join(params)}]" if params else "") + f"({self.method.name})"
        )

    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime in ("hook", "ps"):
            return f"{self.name} is an asynchronous execution itself: run its method there"
        return super().unsupported(runtime)

    # -- binding: the method's constants, compressors, weights and asynchronous rule ----------
    def for_problem(self, problem: ProblemLike, stepsize: float | str | StepSize) -> Asynchronous:
        if self.trace is not None:  # a replay is of the run's problem (RunProblem.check)
            self._check_workers(problem.n)
            self.trace.problem.check(problem, self.trace.source)
        inner = self.inner.for_problem(problem, stepsize)
        if inner is self.inner:
            return self
        out = copy.copy(self)
        out.inner = inner
        return out

    def check_problem(self, consts: Constants) -> None:
        self.inner.check_problem(consts)
        self._check_workers(consts.n)

    def _check_workers(self, n: int) -> None:
        if self.trace is not None and self.trace.workers != n:
            raise ValueError(
                f"asynchronous: the run in {self.trace.source!r} had {self.trace.workers} "
                f"workers, the problem has n={n} clients; build it with "
                f"n_clients={self.trace.workers} (the run's problem)"
            )

    def _check_compressor(
        self, C: Compressor, d: int, *, as_name: str | None = None
    ) -> tuple[float, float | None]:
        # the inner method's check, named as the inner method: on a parameter server the user
        # asked for it (``--method dcgd``), not for the asynchronous execution around it
        return self.inner._check_compressor(C, d, as_name=as_name)

    def client_weights(self, consts: Constants) -> torch.Tensor:
        return self.inner.client_weights(consts)

    def theory_formula(self) -> str:
        return "the method's asynchronous rule at the delay bound (tau_max or assume_tau)"

    def delay(self, n: int) -> int | None:
        """The delay bound of the theory step for ``n`` clients (:func:`delay_bound`); the
        round-robin schedule (no trace) has no staleness, so its delay is that of the memory
        (n − 1: the oldest entry) or 0."""
        if self.round_robin and self.tau_max is None and self.assume_tau is None:
            return n - 1 if self.inner.async_memory else 0
        return delay_bound(self.inner, n, self.tau_max, self.assume_tau)

    @property
    def round_robin(self) -> bool:
        """The schedule is the round robin without staleness (no trace, no real server)."""
        return self.trace is None and not self.arrival

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        return self.inner.async_theory(cfg, self.delay(cfg.n))

    # -- the schedule ----------------------------------------------------------------------------
    def event(self, cfg: Config, r: int) -> tuple[int, int, int | None]:
        """(worker, counter, version) of update ``r``; version None: the current model."""
        tr = self.trace
        if self.arrival:
            raise ValueError(
                f"{self.name} takes its order from a real parameter server's arrivals; in the "
                "simulator give the log of a run: asynchronous[trace=RUN_DIR]"
            )
        if tr is None:
            return (r - 1) % cfg.n, (r - 1) // cfg.n + 1, None
        if r > tr.updates:
            raise ValueError(
                f"asynchronous: the run in {tr.source!r} has {tr.updates} updates; simulate at "
                f"most rounds={tr.updates}"
            )
        j = r - 1
        return int(tr.worker[j]), int(tr.counter[j]), int(tr.version[j])

    def _oracle(self, cfg: Config, oracle: GradientOracle, r: int) -> GradientOracle:
        b = None if self.trace is None else self.trace.batch_size
        return oracle if b is None else MinibatchOracle(oracle, b, cfg.seed, r)

    def _ids_tensor(self, values: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    # -- the parts -------------------------------------------------------------------------------
    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[AsyncClients, Message]:
        inner, sent = client_init(self.inner, cfg, x0, self._oracle(cfg, oracle, 0), ids)
        memory = server_memory(self.inner, cfg)
        received = torch.ones_like(ids, dtype=torch.bool)
        if self.trace is not None:
            received = torch.isin(ids, self._ids_tensor(self.trace.init, ids.device))
        traffic = Traffic(*(t * received for t in sent.traffic))
        if sent.vector is None:
            return AsyncClients(ids, inner, memory), Message(None, None, traffic)
        sel, values, memory = server_values(
            self.inner, cfg, memory, ids[received], sent.vector[received]
        )
        clients = AsyncClients(ids, inner, memory)
        if values is None:  # nobody here: an empty contribution, so every group reduces
            values = torch.zeros(0, cfg.d, dtype=cfg.dtype, device=cfg.device)
        return clients, Message(values, cfg.weights[sel], traffic)

    def init_server(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> AsyncState:
        state = self.inner.init_server(cfg, x0, aggregate)
        ready = self.inner.server_pre(cfg, state, 1)
        models = ready.x.unsqueeze(0).repeat(cfg.n, 1)
        versions = torch.zeros(cfg.n, dtype=torch.int64, device=cfg.device)
        return AsyncState(state.x, state, ready, models, versions)

    def server_pre(self, cfg: Config, server: AsyncState, r: int) -> AsyncState:
        if self.trace is None or r not in self.trace.resets:
            return server
        # the run resumed from a snapshot after update r − 1: every worker got the current model
        models = server.ready.x.unsqueeze(0).expand_as(server.models).clone()
        return server._replace(models=models, versions=torch.full_like(server.versions, r - 1))

    def client_step(
        self, cfg: Config, server: AsyncState, clients: AsyncClients, oracle: GradientOracle, r: int
    ) -> tuple[AsyncClients, Message]:
        worker, counter, version = self.event(cfg, r)
        ids, inner, memory = clients
        dev = ids.device
        if self.trace is not None and r in self.trace.resets:
            inner = self.inner.async_clients(cfg, memory, ids)
        forget_all = () if self.trace is None else self.trace.forgets.get(r, ())
        forget = self._ids_tensor([w for w in forget_all if bool((ids == w).any())], dev)
        pos = torch.nonzero(ids == worker).reshape(-1)
        zero = cfg.no_traffic(ids.numel())
        if pos.numel() == 0:  # the worker of this update is in another group
            sel, values, memory = server_values(self.inner, cfg, memory, ids[:0], None, forget)
            if values is None:  # an empty contribution, so every group takes part in the reduction
                values = torch.zeros(0, cfg.d, dtype=cfg.dtype, device=dev)
            return AsyncClients(ids, inner, memory), Message(values, cfg.weights[sel], zero)
        if version is None:
            x = server.ready.x
        else:
            if int(server.versions[worker]) != version:
                raise ValueError(
                    f"asynchronous: the trace is inconsistent: update {r} applies worker "
                    f"{worker}'s message computed at version {version}, but the worker was sent "
                    f"version {int(server.versions[worker])}"
                )
            x = server.models[worker]
        part, sent = client_update(
            self.inner, cfg, x, _take(inner, pos), self._oracle(cfg, oracle, counter), counter
        )
        if sent.vector is None:
            raise ValueError(f"{self.inner.name} sent nothing in update {r}")
        inner = _put(inner, pos, part)
        sel, values, memory = server_values(self.inner, cfg, memory, ids[pos], sent.vector, forget)
        traffic = Traffic(
            *(z.index_copy(0, pos, t) for z, t in zip(zero, sent.traffic, strict=True))
        )
        assert values is not None
        return AsyncClients(ids, inner, memory), Message(values, cfg.weights[sel], traffic)

    def server_post(
        self, cfg: Config, server: AsyncState, aggregate: torch.Tensor | None, r: int
    ) -> AsyncState:
        worker = self.event(cfg, r)[0]
        state, ready = server_advance(self.inner, cfg, server.ready, aggregate, r)
        models = server.models.clone()
        models[worker] = ready.x
        versions = server.versions.clone()
        versions[worker] = r
        return AsyncState(state.x, state, ready, models, versions)


@METHODS.register("asynchronous")
def asynchronous(
    *methods: Method[Any, Any],
    trace: str | None = None,
    tau_max: int | None = None,
    assume_tau: int | None = None,
) -> Asynchronous:
    """One client's stale message per update ([K18]); trace=RUN_DIR replays a parameter server."""
    if len(methods) > 1:
        raise ValueError(
            "asynchronous takes one method, e.g. asynchronous[trace='runs/ps'](iag), got "
            f"{len(methods)}"
        )
    return Asynchronous(
        methods[0] if methods else None, trace=trace, tau_max=tau_max, assume_tau=assume_tau
    )
