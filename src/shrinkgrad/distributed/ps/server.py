"""The server side of the parameter server: arrivals, staleness control, updates, records.

The server (rank 0) holds the method's server state and its version t (the number of updates
applied). It listens to every worker at once: one receiver thread per worker blocks in a gloo
``irecv(...).wait()`` (no polling) and puts each arrival, or the worker's loss (connection
closed, FAIL message), into one queue; the main thread takes events in arrival order and, between
events, applies the held messages the :class:`~shrinkgrad.distributed.ps.schedule.StalenessGate`
allows.

The arithmetic is the method's, through :mod:`shrinkgrad.methods.asynchronous` (the same code the
simulator's replay of a run uses): the initialisation is ``server_start`` of every worker's
initial message; an asynchronous update is ``server_update`` of one arriving message (its
reduction values from the method's ``async_receive``, the lost workers' contributions leaving
through ``async_forget``, then the method's ``server_post`` and ``server_pre``); a synchronous
round (``mode="sync"``) is the same with every live worker's message. The model sent next is the
``x`` of the method's state after ``server_pre`` (for EF21, x^{t+1} = x^t − γ g^t).

Per update the server records the staleness τ = t − v (v: the version the message was computed
at) and the [K18] delay of the update: τ, or, for a method whose server keeps a per-worker memory
(IAG's table), the age of the oldest entry the step uses, t − min_j v_j, at most 2·tau_max under
the gate. With an output directory it snapshots its state (:mod:`.checkpoint`) so that a killed
server can be resumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import torch

from ..._sums import mean_value
from ...compressors import Compressor, make_compressor
from ...methods.asynchronous import (
    EVENT_INIT,
    EVENT_LOST,
    EVENT_RESUMED,
    Asynchronous,
    AsyncServer,
    delay_bound,
    server_start,
    server_update,
)
from ...methods.base import Config, Method, ProblemLike, Traffic
from ...methods.stepsize import parse_stepsize
from ...problems.base import data_digest_of
from ..runner import check_compressor_spans
from .checkpoint import Checkpoint, fingerprint
from .config import PSConfig
from .schedule import StalenessGate
from .wire import (
    FAIL,
    INIT,
    MODEL,
    REPLY_WORDS,
    RESUME,
    STOP,
    decode_payload,
    model_message,
    pack_model,
    read_reply,
    recv,
    send,
)
from .worker import DTYPES, dump_clients

__all__ = ["Arrival", "Lost", "Plan", "ServerLog", "plan_run", "run_server"]

#: how long a receiver thread waits for its worker's next message before reporting it lost
_RECEIVER_WAIT = datetime.timedelta(days=1)


# --------------------------------------------------------------------------------------------
# the plan: method, configuration and step size, resolved before anything starts
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's method: as configured (``method``), as it runs (``inner``: the asynchronous form,
    or the method itself in sync mode), its bound configuration (γ, compressor, weights, seed)
    and τ, the [K18] delay the theory step assumed (None when nothing bounds it)."""

    method: Method[Any, Any]
    inner: Method[Any, Any]
    cfg: Config
    tau_bound: int | None
    #: the problem's data digest (:meth:`~shrinkgrad.problems.Problem.data_digest`), recorded
    #: in the snapshot's fingerprint so that a resume on other data is refused
    data: str | None = None

    @property
    def stepsize(self) -> float:
        return self.cfg.stepsize

    @property
    def compressor(self) -> Compressor:
        return self.cfg.compressor


def plan_run(config: PSConfig, problem: ProblemLike) -> Plan:
    """Bind the method to the problem's constants and resolve the step size (``Method.bind``).

    Async: :class:`~shrinkgrad.methods.asynchronous.Asynchronous` binds the method with the
    delay bound τ of ``tau_max`` (the method's ``async_delay``: 2·tau_max for iag) or
    ``assume_tau`` (0 for one worker), so ``stepsize="theory"`` is the method's asynchronous
    rule at τ; sync: the method's own rule. Raises ValueError for incompatible compressors and
    impossible step sizes before any process starts.
    """
    method = config.build_method()
    _refuse(config, method)
    options: dict[str, Any] = {
        "dtype": DTYPES[config.dtype],
        "wire_dtype": DTYPES[config.wire_dtype],
    }
    args = (problem, config.compressor_spec, config.stepsize, config.seed)
    data = data_digest_of(problem)
    if config.mode == "sync":
        bound = method.bind(*args, **options)
        return Plan(method, method, bound.cfg, 0, data)
    wrapper = Asynchronous(
        method, tau_max=config.tau_max, assume_tau=config.assume_tau, arrival=True
    )
    bound = wrapper.bind(*args, **options)
    tau = delay_bound(wrapper.inner, problem.n, config.tau_max, config.assume_tau)
    return Plan(method, wrapper.inner, bound.cfg, tau, data)


def _refuse(config: PSConfig, method: Method[Any, Any]) -> None:
    """One-line errors for what a parameter server cannot run as the simulator does."""
    if config.batch_size is not None:
        if method.samples_minibatches:
            raise ValueError(
                f"{method.name} draws its own minibatches, and batch_size={config.batch_size} "
                "would replace its exact initial gradients by minibatch ones while leaving its "
                "later ones as they are; drop batch_size (--batch-size)"
            )
        step = parse_stepsize(config.stepsize)
        if step.theory or step.of is not None:
            raise ValueError(
                f"stepsize='theory' with batch_size={config.batch_size}: {method.name}'s theory "
                "step assumes exact gradients; give a number, or use a method whose rule "
                "accounts for the minibatch noise (ef21_sgd[b=...], without batch_size)"
            )
    check_compressor_spans(make_compressor(config.compressor_spec), config.workers)


# --------------------------------------------------------------------------------------------
# events
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arrival:
    """A worker's message as received (header fields, the payload, the arrival time)."""

    worker: int
    kind: int
    counter: int
    version: int
    payload_kind: int
    key: int
    traffic: Traffic
    payload: torch.Tensor
    time: float


@dataclasses.dataclass(frozen=True)
class Lost:
    """A worker is gone (its connection closed, it failed, or it was silent too long)."""

    worker: int
    reason: str
    time: float


def _describe(e: BaseException) -> str:
    msg = str(e)
    if "Connection closed by peer" in msg:
        return "connection closed (the process died)"
    if "Connection reset by peer" in msg:
        return "connection reset (the process died)"
    first = msg.splitlines()[0] if msg else ""
    return f"{type(e).__name__}: {first[:160]}"


def _receive(worker: int, events: queue.Queue[Arrival | Lost], t0: float) -> None:
    """Receiver thread of one worker: header, payload, enqueue; until the worker is lost."""
    rank = worker + 1
    while True:
        header = torch.empty(REPLY_WORDS, dtype=torch.int64)
        try:
            recv(header, rank, _RECEIVER_WAIT)
            kind, counter, version, nbytes, pkind, key, traffic = read_reply(header)
            payload = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                recv(payload, rank, _RECEIVER_WAIT)
        except Exception as e:  # a closed connection ends the thread
            events.put(Lost(worker, _describe(e), time.perf_counter() - t0))
            return
        if kind == FAIL:
            text = bytes(payload.numpy()).decode(errors="replace")
            events.put(Lost(worker, f"failed: {text}", time.perf_counter() - t0))
            return
        arrival = Arrival(
            worker, kind, counter, version, pkind, key, traffic, payload, time.perf_counter() - t0
        )
        events.put(arrival)


# --------------------------------------------------------------------------------------------
# the record of a run
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ServerLog:
    """What the server loop records; :mod:`.results` turns it into tables.

    ``snapshots``: (update, time_s, x, bits_up, bits_up_paper, bits_down) with the bits as means
    over clients of the cumulative counts; ``updates``: one dict per applied message;
    ``events``: worker losses and other notable moments.
    """

    snapshots: list[tuple[int, float, torch.Tensor, float, float, float]]
    updates: list[dict[str, Any]]
    events: list[dict[str, Any]]
    status: str
    message: str
    t: int
    x: torch.Tensor
    bits_up: torch.Tensor
    bits_up_paper: torch.Tensor
    bits_down: torch.Tensor
    elapsed: float
    live: list[int]


class _Server:
    """The server's state and loops (see the module docstring); one instance per run.

    Bits are the method's count of each message, added when the message is applied (a message
    still held when the run stops, or held by a worker that dies, is not counted).
    """

    def __init__(
        self,
        config: PSConfig,
        plan: Plan,
        x0: torch.Tensor,
        interrupt: threading.Event | None = None,
        progress_every: float | None = None,
        out: str | os.PathLike[str] | None = None,
        resume: dict[str, Any] | None = None,
        note: str = "",
    ) -> None:
        self.config = config
        self.plan = plan
        self.interrupt = interrupt
        self.progress_every = progress_every
        self.progress_at = 0.0  # self.now() of the last progress line
        self.max_staleness = 0
        self.cfg = plan.cfg
        self.inner = plan.inner
        W = config.workers
        self.n = W
        self.dtype = DTYPES[config.dtype]
        self.x0 = x0.to(self.dtype).clone()
        self.x = self.x0
        self.d = int(self.x.numel())
        self.t = 0
        self.srv: AsyncServer | None = None
        self.live: set[int] = set(range(W))
        self.gate = StalenessGate(range(W), config.tau_max)
        self.held: dict[int, Arrival] = {}
        self.sent_at: dict[int, float] = {}
        self.buf = model_message(self.d, self.dtype)
        self.events: queue.Queue[Arrival | Lost] = queue.Queue()
        self.up = torch.zeros(W, dtype=torch.float64)
        self.up_paper = torch.zeros(W, dtype=torch.float64)
        self.down = torch.zeros(W, dtype=torch.float64)
        self.counters = [0] * W  # last applied message counter of every worker
        self.entry_version = [0] * W  # version of every worker's last applied message
        self.applied: set[int] = set()  # the workers of the last update (not sent a model yet)
        self.pending_forget: set[int] = set()
        self.init_wait: set[int] = set()
        self.init_sent: dict[int, torch.Tensor | None] = {}
        self.rows: list[dict[str, Any]] = []
        self.log_events: list[dict[str, Any]] = []
        self.snapshots: list[tuple[int, float, torch.Tensor, float, float, float]] = []
        self.status: str | None = None
        self.message = ""
        self.ref_norm: float | None = None
        self.offset = 0.0  # seconds the run had already lasted before a resume
        self.t0 = time.perf_counter()
        self.receivers: list[threading.Thread] = []
        self.ckpt = Checkpoint(out) if out is not None else None
        self.ckpt_at = (0, 0.0)  # (update, time) of the last snapshot
        self.resume = resume
        self.note = note

    # -- helpers ---------------------------------------------------------------------------------
    def now(self) -> float:
        return self.offset + time.perf_counter() - self.t0

    def event(self, kind: str, worker: int | None, detail: str) -> None:
        self.log_events.append(
            {
                "time_s": self.now(),
                "update": self.t,
                "worker": worker,
                "event": kind,
                "detail": detail,
            }
        )

    def snapshot(self) -> None:
        if self.snapshots and self.snapshots[-1][0] == self.t:
            return
        self.snapshots.append(
            (
                self.t,
                self.now(),
                self.x.clone(),
                mean_value(self.up),  # the simulator's row values (shrinkgrad._sums)
                mean_value(self.up_paper),
                mean_value(self.down),
            )
        )

    def send_to(self, worker: int, kind: int, *, state: torch.Tensor | None = None) -> bool:
        """Send the next model (INIT/MODEL; RESUME with a client state) or STOP to ``worker``;
        a failed send loses the worker."""
        if kind == INIT:
            x: torch.Tensor | None = self.x0
        elif kind == STOP:
            x = None
        else:
            assert self.srv is not None
            x = self.srv.ready.x
        counter = self.counters[worker] + 1 if self.config.mode == "async" else self.t + 1
        nbytes = 0 if state is None else state.numel()
        pack_model(self.buf, kind, self.t, x, counter=counter, nbytes=nbytes)
        wait = datetime.timedelta(seconds=self.config.timeout)
        try:
            send(self.buf, worker + 1, wait)
            if state is not None:
                send(state, worker + 1, wait)
        except RuntimeError as e:
            self.lose(worker, f"send failed: {_describe(e)}")
            return False
        if kind != STOP:
            self.sent_at[worker] = time.perf_counter()
            if kind != INIT and worker in self.gate.version:
                self.gate.sent(worker, self.t)
        return True

    def lose(self, worker: int, reason: str) -> None:
        if worker not in self.live:
            return
        self.live.discard(worker)
        self.gate.lost(worker)
        self.held.pop(worker, None)
        self.sent_at.pop(worker, None)
        self.init_wait.discard(worker)
        self.pending_forget.add(worker)  # its contributions leave with the next update
        self.event(EVENT_LOST, worker, reason)
        if not self.live:
            self.stop("workers_lost", "every worker was lost")

    def stop(self, status: str, message: str) -> None:
        if self.status is None:
            self.status, self.message = status, message

    def show_progress(self) -> None:
        """One line on stderr: updates (of the total), rate, staleness so far, live workers."""
        self.progress_at = now = self.now()
        total = self.config.updates
        stale = self.max_staleness
        print(
            f"ps: {self.t}/{total} updates ({100.0 * self.t / total:.1f} %), "
            f"{self.t / max(now, 1e-9):.0f}/s, max staleness {stale}, "
            f"{len(self.live)}/{self.n} workers, {now:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def poll_interrupt(self) -> None:
        """Stop (status ``interrupted``) once a SIGINT (Ctrl-C) has set ``interrupt``."""
        if self.interrupt is not None and self.interrupt.is_set():
            self.stop("interrupted", f"interrupted (Ctrl-C or SIGTERM) after {self.t} updates")

    def decode(self, a: Arrival) -> torch.Tensor | None:
        """The vector (1, d) the message carries (the method's compressed vector), checked."""
        cfg = self.cfg
        q = decode_payload(
            a.payload_kind,
            a.payload,
            cfg,
            a.worker,
            a.key,
            self.d,
            cfg.wire_dtype,
            self.dtype,
        )
        if q is not None:
            self.check_message(q)
        return q

    def account(self, a: Arrival) -> None:
        """Add the method's bit count of the message to the worker's counters."""
        self.up[a.worker] += float(a.traffic.up[0])
        self.up_paper[a.worker] += float(a.traffic.up_paper[0])
        self.down[a.worker] += float(a.traffic.down[0])

    def check_message(self, q: torch.Tensor) -> None:
        norm = float(torch.dot(q[0], q[0]))
        factor = self.config.divergence_factor
        if not math.isfinite(norm):
            self.stop("diverged", f"update {self.t}: a message has non-finite entries")
        elif self.ref_norm is None or self.ref_norm == 0:
            self.ref_norm = norm
        elif factor is not None and norm > factor * self.ref_norm:
            self.stop(
                "diverged",
                f"update {self.t}: a message's squared norm {norm:.3g} exceeds "
                f"{factor:g} × the first one's ({self.ref_norm:.3g})",
            )

    def record(self, a: Arrival, delay: int) -> None:
        staleness = self.t - 1 - a.version
        self.max_staleness = max(self.max_staleness, staleness)
        self.rows.append(
            {
                "update": self.t,
                "worker": a.worker,
                "counter": a.counter,
                "version_computed": a.version,
                "staleness": staleness,
                "delay": delay,
                "time_s": self.now(),
            }
        )
        if self.ckpt is not None:
            self.ckpt.log(self.t, a.worker, a.counter, a.version)

    def after_update(self) -> None:
        if not bool(torch.isfinite(self.x).all()):
            self.stop("diverged", f"update {self.t}: x has non-finite entries")
            return
        if self.t % self.config.log_every == 0:
            self.snapshot()
        if self.progress_every is not None and self.now() - self.progress_at >= self.progress_every:
            self.show_progress()
        if self.ckpt is not None:
            last_t, last_time = self.ckpt_at
            if (
                self.t - last_t >= self.config.snapshot_every
                or self.now() - last_time >= self.config.snapshot_seconds
            ):
                self.save_checkpoint()
        if self.config.kill_server_after is not None and self.t >= self.config.kill_server_after:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die without any cleanup
        if self.t >= self.config.updates:
            self.stop("completed", f"{self.t} updates")
        elif self.config.max_time is not None and self.now() >= self.config.max_time:
            self.stop("time_limit", f"max_time={self.config.max_time:g} s reached")

    def apply(self, got: list[Arrival]) -> None:
        """One update: the messages ``got`` (one asynchronously, every live worker's in a
        synchronous round) through the method's server step, then the bookkeeping."""
        assert self.srv is not None
        qs = [self.decode(a) for a in got]
        if self.status is not None:
            return
        if any(q is None for q in qs):
            raise RuntimeError(f"{self.inner.name} sent a step message without a vector")
        forget = torch.tensor(sorted(self.pending_forget), dtype=torch.int64)
        self.pending_forget.clear()
        ids = torch.tensor([a.worker for a in got], dtype=torch.int64)
        sent = torch.cat(qs)  # type: ignore[arg-type]
        self.srv = server_update(self.inner, self.cfg, self.srv, ids, sent, forget)
        old = self.t
        self.t, self.x = self.srv.update, self.srv.state.x
        self.applied = {a.worker for a in got}  # their next job is of version self.t
        for a in got:
            self.account(a)
            self.counters[a.worker] = a.counter
            self.entry_version[a.worker] = a.version
        for a in got:
            if self.config.mode == "sync":
                delay = 0
            elif self.inner.async_memory:  # the oldest entry of every live worker's memory
                delay = old - min(self.entry_version[j] for j in self.live)
            else:
                delay = old - a.version
            self.record(a, delay)
        self.after_update()

    def handle(self, ev: Arrival | Lost) -> None:
        if isinstance(ev, Lost):
            self.lose(ev.worker, ev.reason)
            return
        if ev.worker not in self.live:
            return  # a late message of a worker declared lost
        if ev.kind == INIT:
            if ev.worker in self.init_wait:
                self.init_sent[ev.worker] = self.decode(ev)
                self.account(ev)
                self.init_wait.discard(ev.worker)
                self.sent_at.pop(ev.worker, None)
                self.event(EVENT_INIT, ev.worker, f"counter {ev.counter}")
            return
        self.held[ev.worker] = ev
        if self.config.mode == "async":
            self.gate.arrived(ev.worker)

    def check_silence(self) -> float:
        """Lose workers computing for longer than ``timeout``; seconds until the next check."""
        now = time.perf_counter()
        nxt = self.config.timeout
        for w in sorted(self.live):
            if w in self.held or w not in self.sent_at:
                continue
            waited = now - self.sent_at[w]
            if waited > self.config.timeout:
                self.lose(w, f"silent for {waited:.1f} s (timeout={self.config.timeout:g} s)")
            else:
                nxt = min(nxt, self.config.timeout - waited)
        return max(nxt, 0.01)

    def wait_event(self) -> None:
        wait = min(self.check_silence(), 0.5)  # 0.5 s: how soon a Ctrl-C is noticed when idle
        if self.config.max_time is not None:
            wait = min(wait, max(self.config.max_time - self.now(), 0.0) + 0.01)
        try:
            ev = self.events.get(timeout=wait)
        except queue.Empty:
            if self.config.max_time is not None and self.now() >= self.config.max_time:
                self.stop("time_limit", f"max_time={self.config.max_time:g} s reached")
            return
        self.handle(ev)
        while True:  # take everything already there, in arrival order
            try:
                self.handle(self.events.get_nowait())
            except queue.Empty:
                return

    # -- the start: every worker's initial message, or a snapshot ----------------------------
    def begin(self) -> None:
        """Start the run: fresh (initial messages) or from the snapshot; every live worker then
        has a model to compute on."""
        if self.resume is not None:
            self.restore(self.resume)
            return
        self.init_wait = set(self.live)
        for w in sorted(self.live):
            self.send_to(w, INIT)
        while self.status is None and self.init_wait:
            self.poll_interrupt()
            if self.status is None:
                self.wait_event()
        if self.status is not None:
            return
        ids = sorted(w for w in self.init_sent if w in self.live)
        vectors = [self.init_sent[w] for w in ids]
        sent = None if any(v is None for v in vectors) else torch.cat(vectors)  # type: ignore[arg-type]
        self.srv = server_start(
            self.inner, self.cfg, self.x0, torch.tensor(ids, dtype=torch.int64), sent
        )
        self.x = self.srv.state.x
        self.event("init_done", None, f"initial messages of workers {ids}")
        self.snapshot()
        self.save_checkpoint()
        for w in sorted(self.live):
            self.send_to(w, MODEL)

    def restore(self, snap: dict[str, Any]) -> None:
        """Continue from a snapshot: the server's state, records and counters; every worker
        restarts from the client state the method derives from the server's memory."""
        self.srv = snap["server"]
        assert self.srv is not None
        self.t, self.x = self.srv.update, self.srv.state.x
        self.counters = list(snap["counters"])
        self.entry_version = list(snap["entry_version"])
        self.up, self.up_paper, self.down = snap["up"], snap["up_paper"], snap["down"]
        self.ref_norm = snap["ref_norm"]
        self.max_staleness = int(snap["max_staleness"])
        # the logged iterates on the log_every grid only: the previous run's last row (its
        # end, at an update off the grid: a time limit, Ctrl-C, or a completed run extended
        # by --updates) is no row of the uninterrupted run, whose table this one continues
        every = self.config.log_every
        self.snapshots = [s for s in snap["snapshots"] if s[0] % every == 0]
        self.rows = list(snap["rows"])
        self.log_events = list(snap["events"])
        self.offset = float(snap["elapsed"])
        self.t0 = time.perf_counter()
        self.ckpt_at = (self.t, self.now())
        self.event(
            EVENT_RESUMED, None, self.note or f"resumed from the snapshot at update {self.t}"
        )
        jobs = snap.get("job_version", {})  # (absent from snapshots before stop 34)
        for w in sorted(self.live):
            ids = torch.tensor([w], dtype=torch.int64)
            clients = self.inner.async_clients(self.cfg, self.srv.memory, ids)
            sent = self.send_to(w, RESUME, state=dump_clients(clients))
            if sent and w in jobs and self.config.mode == "async" and w in self.gate.version:
                self.gate.restarted(w, jobs[w])  # the deadline of the job it replaces

    def job_versions(self) -> dict[int, int]:
        """Every live worker's job version (the staleness gate's): the model it computes on,
        or self.t for a worker of the last update, whose new model is being sent."""
        return {
            w: (self.t if w in self.applied else v) for w, v in sorted(self.gate.version.items())
        }

    def save_checkpoint(self) -> None:
        if self.ckpt is None or self.srv is None:
            return
        config = dict(self.config.to_dict(), compressor=self.config.compressor_spec)
        self.ckpt.save(
            {
                "fingerprint": fingerprint(config, self.plan.data),
                "server": self.srv,
                "counters": list(self.counters),
                "entry_version": list(self.entry_version),
                "job_version": self.job_versions(),
                "up": self.up.clone(),
                "up_paper": self.up_paper.clone(),
                "down": self.down.clone(),
                "ref_norm": self.ref_norm,
                "max_staleness": self.max_staleness,
                "snapshots": list(self.snapshots),
                "rows": list(self.rows),
                "events": list(self.log_events),
                "elapsed": self.now(),
                "status": self.status,
                "message": self.message,
            }
        )
        self.ckpt_at = (self.t, self.now())

    # -- async -----------------------------------------------------------------------------------
    def run_async(self) -> None:
        while self.status is None:
            self.poll_interrupt()
            if self.status is not None:
                return
            w = self.gate.next(self.t)
            if w is not None:
                self.apply([self.held.pop(w)])
                if self.status is None and w in self.live:
                    self.send_to(w, MODEL)
                continue
            self.wait_event()

    # -- sync ------------------------------------------------------------------------------------
    def run_sync(self) -> None:
        while self.status is None:
            start = time.perf_counter()
            while self.status is None and set(self.live) - set(self.held):
                self.poll_interrupt()
                try:
                    ev = self.events.get(timeout=0.5)
                except queue.Empty:
                    ev = None
                if ev is not None:
                    self.handle(ev)
                if time.perf_counter() - start > self.config.timeout:
                    for w in sorted(set(self.live) - set(self.held)):
                        self.lose(w, f"silent for {self.config.timeout:g} s in a round")
            if self.status is not None:
                return
            self.apply([self.held.pop(w) for w in sorted(self.held)])
            if self.status is None:
                for w in sorted(self.live):
                    self.send_to(w, MODEL)

    # -- the whole run ---------------------------------------------------------------------------
    def run(self) -> ServerLog:
        self.t0 = time.perf_counter()
        for w in range(self.n):
            th = threading.Thread(
                target=_receive, args=(w, self.events, self.t0), name=f"ps-recv-{w}", daemon=True
            )
            th.start()
            self.receivers.append(th)
        if self.ckpt is not None:
            self.ckpt.open_log(fresh=self.resume is None)
        try:
            self.begin()
            if self.status is None:
                self.run_async() if self.config.mode == "async" else self.run_sync()
            elapsed = self.now()
            if self.status != "diverged" and self.srv is not None:
                self.snapshot()
            if self.status is not None:  # a diverged run's too: its status makes a resume
                self.save_checkpoint()  # refuse it (launch.resume_point), not run it again
        finally:
            if self.ckpt is not None:
                self.ckpt.close()
        self.shutdown()
        return ServerLog(
            snapshots=self.snapshots,
            updates=self.rows,
            events=self.log_events,
            status=self.status or "completed",
            message=self.message,
            t=self.t,
            x=self.x,
            bits_up=self.up,
            bits_up_paper=self.up_paper,
            bits_down=self.down,
            elapsed=elapsed,
            live=sorted(self.live),
        )

    def shutdown(self) -> None:
        """STOP every live worker, then wait (bounded) until they have all disconnected."""
        for w in sorted(self.live):
            pack_model(self.buf, STOP, self.t, None)
            with contextlib.suppress(RuntimeError):
                send(self.buf, w + 1, datetime.timedelta(seconds=self.config.timeout))
        deadline = (
            time.perf_counter()
            + self.config.timeout
            + max(self.config.worker_delay(w) for w in range(self.n))
        )
        for th in self.receivers:
            th.join(max(deadline - time.perf_counter(), 0.0))


def run_server(
    config: PSConfig,
    plan: Plan,
    x0: torch.Tensor,
    interrupt: threading.Event | None = None,
    progress_every: float | None = None,
    *,
    out: str | os.PathLike[str] | None = None,
    resume: dict[str, Any] | None = None,
    note: str = "",
) -> ServerLog:
    """Run the server loop in this process (rank 0 of an initialised process group).

    ``interrupt``: when it is set (by a SIGINT handler), the loop stops after the update in
    progress with status ``interrupted``, stops the workers and returns what it has.
    ``progress_every``: print a progress line on stderr at most every that many seconds.
    ``out``: snapshot the run into ``out/checkpoint/`` (:mod:`.checkpoint`); ``resume``: a
    snapshot to continue from (``note`` is the event that says so)."""
    server = _Server(config, plan, x0, interrupt, progress_every, out, resume, note)
    return server.run()
