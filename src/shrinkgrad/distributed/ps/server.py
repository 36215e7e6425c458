"""The server side of the parameter server: arrivals, staleness control, updates, records.

The server (rank 0) holds x, its version t (the number of updates applied) and, for the
compressed IAG, the table of the latest compressed gradient of every worker. It listens to every
worker at once: one receiver thread per worker blocks in a gloo ``irecv(...).wait()`` (no
polling) and puts each arrival, or the worker's loss (connection closed, FAIL message), into one
queue; the main thread takes events in arrival order and, between events, applies the held
messages the :class:`~shrinkgrad.distributed.ps.schedule.StalenessGate` allows.

Updates ([K18]; library scaling, methods.md §1, f = (1/n) Σ f_i, with n the live workers):

* async DCGD: x ← x − γ (1/n) Q_i, the message Q_i = Q(∇f_i(x^{t−τ})) of the arriving worker;
  [K18] writes the sum Σ f_i with smoothness L_sum = n L, and its step γ_sum = γ/n gives the same
  iterates. n updates with γ move x like one DCGD round (an incremental, delayed method);
* async compressed IAG: ĝ_i ← Q_i, s ← s + (1/n)(Q_i − ĝ_i^old), x ← x − γ s with s = (1/n) Σ ĝ_j
  (:class:`~shrinkgrad.methods.IAG`'s server step; [K18]: x ← x − γ_sum Σ ĝ_j);
* sync DCGD: every round waits for all live workers and steps with their average
  (:class:`~shrinkgrad.methods.DCGD`'s server step).

The server steps reuse the methods' ``server_post`` on their own state types. Per update the
server records the staleness τ = t − v (v: the version the message was computed at) and the
[K18] delay of the update: τ for DCGD; for IAG the age of the oldest table entry the step uses,
t − min_j v_j, which is at most 2·tau_max under the gate (an entry is replaced at the latest
tau_max + 1 updates after its worker got a model, and was itself at most tau_max stale).
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

from ...compressors import Compressor
from ...methods.base import Config, Method, ProblemLike
from ...methods.delayed import IAG, IAGServer, delayed_theory
from ...methods.gd import DCGD, XState, dcgd_theory
from ...methods.stepsize import parse_stepsize
from ...rng import KeyStream
from .config import PSConfig
from .schedule import StalenessGate
from .wire import FAIL, MODEL, STOP, model_message, pack_model, read_header, recv, send
from .worker import DTYPES

__all__ = ["Arrival", "Lost", "Plan", "ServerLog", "plan_run", "run_server"]

#: how long a receiver thread waits for its worker's next message before reporting it lost
_RECEIVER_WAIT = datetime.timedelta(days=1)


# --------------------------------------------------------------------------------------------
# the plan: method, configuration and step size, resolved before anything starts
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's method maths: the bound method config (γ, compressor, weights, seed) and τ.

    ``tau_bound`` is the [K18] delay the theory step assumed (``tau_max`` for dcgd, ``2·tau_max``
    for iag, ``assume_tau``, 0 for one worker), or None (a constant step, unbounded).
    """

    method: Method[Any, Any]
    cfg: Config
    tau_bound: int | None

    @property
    def stepsize(self) -> float:
        return self.cfg.stepsize

    @property
    def compressor(self) -> Compressor:
        return self.cfg.compressor


def _tau_bound(config: PSConfig) -> int | None:
    if config.mode == "sync":
        return 0
    if config.tau_max is not None:
        return 2 * config.tau_max if config.method == "iag" else config.tau_max
    if config.assume_tau is not None:
        return config.assume_tau
    return 0 if config.workers == 1 else None


def plan_run(config: PSConfig, problem: ProblemLike) -> Plan:
    """Bind the method to the problem's constants and resolve the step size.

    ``stepsize="theory"``: sync: the DCGD rule ``stepsize_dcgd``; async:
    :func:`~shrinkgrad.methods.delayed.delayed_theory` (min of the DCGD rule and 0.99 × the
    [K18] delay rule, the (?) rule of methods.md §4) at τ = :attr:`Plan.tau_bound`. Raises
    ValueError for incompatible compressors (biased ones) before any process starts.
    """
    method: Method[Any, Any] = IAG(init=config.init) if config.method == "iag" else DCGD()
    bound = method.bind(
        problem,
        config.compressor,
        1.0,
        config.seed,
        dtype=DTYPES[config.dtype],
        wire_dtype=DTYPES[config.wire_dtype],
    )
    spec = parse_stepsize(config.stepsize)
    tau = _tau_bound(config)
    if spec.theory:
        if config.mode == "sync":
            gamma, rule = dcgd_theory(bound.cfg)
        else:
            if tau is None:  # PSConfig refuses this; kept for direct callers
                raise ValueError("stepsize='theory' needs tau_max or assume_tau")
            gamma, rule = delayed_theory(bound.cfg, tau)
        gamma *= spec.multiplier
        if spec.multiplier != 1.0:
            rule += f"*{spec.multiplier:g}"
    else:
        gamma, rule = spec.value, "constant"
        if config.tau_max is None and config.mode == "async" and config.workers > 1:
            tau = None  # nothing bounds the delay of a constant-step unbounded run
    if not math.isfinite(gamma) or gamma <= 0:
        raise ValueError(f"the step size must be finite and > 0, got {gamma}")
    cfg = dataclasses.replace(bound.cfg, stepsize=float(gamma), stepsize_rule=rule)
    return Plan(method, cfg, tau)


# --------------------------------------------------------------------------------------------
# events
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arrival:
    """A worker's message as received: who, its counter k, its model version, the payload."""

    worker: int
    counter: int
    version: int
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
        header = torch.empty(4, dtype=torch.int64)
        try:
            recv(header, rank, _RECEIVER_WAIT)
            kind, counter, version, nbytes = read_header(header)
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
        events.put(Arrival(worker, counter, version, payload, time.perf_counter() - t0))


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

    Bits are counted when a message is applied (a message still held when the run stops, or
    held by a worker that dies, is not counted).
    """

    def __init__(
        self,
        config: PSConfig,
        plan: Plan,
        x0: torch.Tensor,
        interrupt: threading.Event | None = None,
        progress_every: float | None = None,
    ) -> None:
        self.config = config
        self.plan = plan
        self.interrupt = interrupt
        self.progress_every = progress_every
        self.progress_at = 0.0  # self.now() of the last progress line
        self.max_staleness = 0
        self.cfg = plan.cfg
        W = config.workers
        self.n = W
        self.dtype = DTYPES[config.dtype]
        self.x = x0.to(self.dtype).clone()
        self.d = int(self.x.numel())
        self.t = 0
        self.live: set[int] = set(range(W))
        self.gate = StalenessGate(range(W), config.tau_max)
        self.held: dict[int, Arrival] = {}
        self.sent_at: dict[int, float] = {}
        self.keys = KeyStream(config.seed, torch.arange(W), stream="compressor")
        self.buf = model_message(self.d, self.dtype)
        self.events: queue.Queue[Arrival | Lost] = queue.Queue()
        self.up = torch.zeros(W, dtype=torch.float64)
        self.up_paper = torch.zeros(W, dtype=torch.float64)
        self.down = torch.zeros(W, dtype=torch.float64)
        self.model_bits = float(self.d * torch.finfo(self.dtype).bits)
        self.rows: list[dict[str, Any]] = []
        self.log_events: list[dict[str, Any]] = []
        self.snapshots: list[tuple[int, float, torch.Tensor, float, float, float]] = []
        self.status: str | None = None
        self.message = ""
        self.ref_norm: float | None = None
        # compressed IAG: the table of latest messages, their versions, s = (1/n) Σ ĝ_j
        self.iag = config.method == "iag" and config.mode == "async"
        self.table = torch.zeros(W, self.d, dtype=self.dtype)
        self.entry_version = [0] * W
        self.s = torch.zeros(self.d, dtype=self.dtype)
        self.init_missing: set[int] = (
            set(range(W)) if self.iag and config.init == "compressed" else set()
        )
        self.t0 = time.perf_counter()
        self.receivers: list[threading.Thread] = []

    # -- helpers ---------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.t0

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
                float(self.up.mean()),
                float(self.up_paper.mean()),
                float(self.down.mean()),
            )
        )

    def send(self, worker: int, kind: int) -> bool:
        """Send x (MODEL) or STOP to ``worker``; a failed send loses the worker."""
        pack_model(self.buf, kind, self.t, self.x if kind == MODEL else None)
        try:
            send(self.buf, worker + 1, datetime.timedelta(seconds=self.config.timeout))
        except RuntimeError as e:
            self.lose(worker, f"send failed: {_describe(e)}")
            return False
        if kind == MODEL:
            self.down[worker] += self.model_bits
            self.sent_at[worker] = time.perf_counter()
            if worker in self.gate.version:
                self.gate.sent(worker, self.t)
        return True

    def lose(self, worker: int, reason: str) -> None:
        if worker not in self.live:
            return
        self.live.discard(worker)
        self.gate.lost(worker)
        self.held.pop(worker, None)
        self.sent_at.pop(worker, None)
        self.event("worker_lost", worker, reason)
        if not self.live:
            self.stop("workers_lost", "every worker was lost")
        elif self.iag:  # drop its entry: s = (1/n_live) Σ_live ĝ_j
            self.reset_sum()
        if worker in self.init_missing:
            self.init_missing.discard(worker)
            self.maybe_finish_init()

    def reset_sum(self) -> None:
        idx = torch.tensor(sorted(self.live))
        self.s = self.table[idx].sum(0) / len(self.live)

    def maybe_finish_init(self) -> None:
        if self.iag and not self.init_missing and self.live and self.status is None:
            self.reset_sum()
            self.event("init_done", None, "the table holds every live worker's Q(∇f_i(x⁰))")
            self.snapshots = [s for s in self.snapshots if s[0] != 0]
            self.snapshot()

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
            self.stop("interrupted", f"interrupted (Ctrl-C) after {self.t} updates")

    def decode(self, a: Arrival) -> torch.Tensor:
        C = self.cfg.compressor
        keys = None if C.deterministic else self.keys.at(a.counter)[a.worker]
        q = C.decode(a.payload, self.d, self.cfg.wire_dtype, keys).to(self.dtype)
        traffic = self.cfg.compressed_traffic(q.unsqueeze(0), down=False)
        self.up[a.worker] += float(traffic.up[0])
        self.up_paper[a.worker] += float(traffic.up_paper[0])
        return q

    def check_message(self, q: torch.Tensor) -> None:
        norm = float(torch.dot(q, q))
        factor = self.config.divergence_factor
        if not math.isfinite(norm):
            self.stop("diverged", f"update {self.t}: a message has non-finite entries")
        elif self.ref_norm is None:
            self.ref_norm = norm
        elif factor is not None and self.ref_norm > 0 and norm > factor * self.ref_norm:
            self.stop(
                "diverged",
                f"update {self.t}: a message's squared norm {norm:.3g} exceeds "
                f"{factor:g} × the first one's ({self.ref_norm:.3g})",
            )

    def record(self, a: Arrival, delay: int) -> None:
        self.max_staleness = max(self.max_staleness, self.t - 1 - a.version)
        self.rows.append(
            {
                "update": self.t,
                "worker": a.worker,
                "counter": a.counter,
                "version_computed": a.version,
                "staleness": self.t - 1 - a.version,
                "delay": delay,
                "time_s": self.now(),
            }
        )

    def after_update(self) -> None:
        if not bool(torch.isfinite(self.x).all()):
            self.stop("diverged", f"update {self.t}: x has non-finite entries")
            return
        if self.t % self.config.log_every == 0:
            self.snapshot()
        if self.progress_every is not None and self.now() - self.progress_at >= self.progress_every:
            self.show_progress()
        if self.config.kill_server_after is not None and self.t >= self.config.kill_server_after:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die without any cleanup
        if self.t >= self.config.updates:
            self.stop("completed", f"{self.t} updates")
        elif self.config.max_time is not None and self.now() >= self.config.max_time:
            self.stop("time_limit", f"max_time={self.config.max_time:g} s reached")

    # -- async -----------------------------------------------------------------------------------
    def apply(self, a: Arrival) -> None:
        """Apply one message (async): the method's server step, then the bookkeeping."""
        q = self.decode(a)
        self.check_message(q)
        if self.status is not None:
            return
        n_live = len(self.live)
        w = 1.0 / n_live
        r = self.t + 1
        if self.iag:
            aggregate = (q - self.table[a.worker]) * w
            self.table[a.worker] = q
            self.entry_version[a.worker] = a.version
            state = self.plan.method.server_post(self.cfg, IAGServer(self.x, self.s), aggregate, r)
            self.x, self.s = state.x, state.s
            delay = self.t - min(self.entry_version[j] for j in self.live)
        else:
            self.x = self.plan.method.server_post(self.cfg, XState(self.x), q * w, r).x
            delay = self.t - a.version
        self.t = r
        self.record(a, delay)
        self.after_update()

    def init_message(self, a: Arrival) -> None:
        """IAG's initial table message Q(∇f_i(x⁰)) (counter 0): fill the entry, no update."""
        q = self.decode(a)
        self.check_message(q)
        self.table[a.worker] = q
        self.entry_version[a.worker] = a.version
        self.init_missing.discard(a.worker)
        self.send(a.worker, MODEL)
        self.maybe_finish_init()

    def handle(self, ev: Arrival | Lost) -> None:
        if isinstance(ev, Lost):
            self.lose(ev.worker, ev.reason)
            return
        if ev.worker not in self.live:
            return  # a late message of a worker declared lost
        if self.iag and ev.counter == 0 and ev.worker in self.init_missing:
            self.init_message(ev)
            return
        self.held[ev.worker] = ev
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

    def run_async(self) -> None:
        while self.status is None:
            self.poll_interrupt()
            if self.status is not None:
                return
            if not self.init_missing:
                w = self.gate.next(self.t)
                if w is not None:
                    a = self.held.pop(w)
                    self.apply(a)
                    if self.status is None and w in self.live:
                        self.send(w, MODEL)
                    continue
            self.wait_event()

    # -- sync ------------------------------------------------------------------------------------
    def run_sync(self) -> None:
        while self.status is None:
            for w in sorted(self.live):
                self.send(w, MODEL)
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
            got = [self.held.pop(w) for w in sorted(self.held)]
            qs = [self.decode(a) for a in got]
            for q in qs:
                self.check_message(q)
            if self.status is not None:
                return
            aggregate = torch.stack(qs).sum(0) / len(qs)
            r = self.t + 1
            self.x = self.plan.method.server_post(self.cfg, XState(self.x), aggregate, r).x
            self.t = r
            for a in got:
                self.record(a, 0)
            self.after_update()

    # -- the whole run ---------------------------------------------------------------------------
    def run(self) -> ServerLog:
        self.t0 = time.perf_counter()
        for w in range(self.n):
            th = threading.Thread(
                target=_receive, args=(w, self.events, self.t0), name=f"ps-recv-{w}", daemon=True
            )
            th.start()
            self.receivers.append(th)
        self.snapshot()
        if self.config.mode == "async":
            for w in range(self.n):
                self.send(w, MODEL)
            self.run_async()
        else:
            self.run_sync()
        elapsed = self.now()
        if self.status != "diverged":
            self.snapshot()
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
) -> ServerLog:
    """Run the server loop in this process (rank 0 of an initialised process group).

    ``interrupt``: when it is set (by a SIGINT handler), the loop stops after the update in
    progress with status ``interrupted``, stops the workers and returns what it has.
    ``progress_every``: print a progress line on stderr at most every that many seconds."""
    return _Server(config, plan, x0, interrupt, progress_every).run()
