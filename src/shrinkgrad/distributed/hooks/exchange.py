"""One bucket, one iteration: the method's client parts, the collective, the server parts.

For every tensor of the bucket the hook runs the method's client part (:mod:`.adapter`) with an
encoder (:mod:`.encoders`) that puts the message straight into the plan's send buffer, starts one
collective for the bucket, and, in the collective's callback, forms the reduction Σ_i w_i c_i of
the ranks' messages and runs the method's server part, whose direction D goes into the tensor DDP
receives (:meth:`.plan.Plan.output`). Which collective:

* ``dense``: the initialisation and the warm-up iterations: every tensor's message (its initial
  message, or a round with the identity compressor) is written, weighted, into the bucket itself,
  which one all-reduce sums;
* ``allreduce`` (compressors whose results are summable, identity): one all-reduce of the send
  buffer of the weighted results;
* ``values`` (shared-seed sparsifiers): one all-reduce of the weighted k values of every tensor;
* ``factors`` (PowerSGD's shared basis): an all-reduce of the P factors, then one of the Q
  factors started from the first one's callback (:mod:`.factors`);
  on these three *summed* paths, a plan that ``gathered`` (16-bit values, a float32 method
  that integrates its aggregates: :meth:`.config.Settings.gathers`) all-gathers the same
  values unweighted instead and adds them in float32 in rank order (:func:`_summed`), so
  that the sum is that of the messages the ranks added to their own states;
* ``allgather`` (everything else): one all-gather of every rank's packed payloads (raw values of
  the uncompressed tensors first; for variable-size messages a header of sizes, padding to the
  largest block, whose size is all-gathered first), decoded in rank order on every rank — so
  all ranks hold bit-identical parameters.

The reduction of sparse messages (:attr:`.plan.Unit.sparse`) is itself sparse: the ranks'
(index, w_j·value) pairs, handed to the method as one SparseMessage (O(n·k), no dense pass);
a sparse direction is written into the output at O(k) (:meth:`.plan.Plan.write_sparse`). A
direction that is a tensor of the method's server state (EF21's g) is moved into the output
once and the state keeps it there (:meth:`.memory.Memory.rebind`), so later iterations copy
nothing.

With a loss scaler, a rank whose bucket is not finite (``bad``) sends NaN (summed paths) or the
flag byte at the end of its all-gather block, and every rank returns the bucket as NaN.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ...methods.base import Message, State
from ...methods.rules import LowRankMessage, Mirror, SparseMessage
from . import encoders
from .adapter import HookConfig
from .collectives import result
from .plan import Plan, Unit

if TYPE_CHECKING:
    from .state import CompressionState

__all__ = ["exchange"]

Fut = torch.futures.Future[torch.Tensor]
Aggregate = torch.Tensor | SparseMessage | LowRankMessage | None


@dataclasses.dataclass
class Step:
    """One bucket's iteration: the state, the plan, the bucket and what the method reads."""

    state: CompressionState
    plan: Plan
    buf: torch.Tensor  # DDP's bucket: this rank's gradients (and the dense collectives' buffer)
    x: torch.Tensor  # the gradients in the method's dtype (the bucket, or the plan's copy)
    bad: bool
    #: the plan's copy ``x`` is filled tensor by tensor (:meth:`gradient`), and not at all for
    #: the tensors whose compressor reads the bucket itself (:attr:`.plan.Plan.reads_half`)
    deferred: bool = False
    #: the iteration this bucket belongs to, fixed when the hook body starts: the collectives'
    #: callbacks may run after the last bucket's body has advanced ``state.iteration``, and
    #: a keyed decode there must use the keys of the round the message was encoded in
    iteration: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.iteration = self.state.iteration

    @property
    def rank(self) -> int:
        return self.state.rank

    def config(self, u: Unit, warm: bool = False) -> HookConfig:
        return self.state.config(u, self.plan, warm)

    def keys(self, u: Unit, C: Any, rank: int | None = None) -> Any:
        return self.state.settings.keys(
            C, u.key, self.rank if rank is None else rank, self.iteration
        )

    @property
    def output(self) -> torch.Tensor:
        return self.plan.output(self.buf)

    def gradient(self, u: Unit, direct: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``u``'s gradient in the method's dtype for its client step, and the bucket's 16-bit
        slice that stands for it unfilled when its encoder reads that itself (``direct``: a
        packed-payload or shared-seed encoder of a compressed tensor) — else None, and the
        copy is filled now (if it was deferred)."""
        x = u.slice(self.x)
        if not self.deferred:
            return x, None
        if direct:
            return x, u.slice(self.buf)
        return self.plan.fill(u, self.buf), None

    def target(self, u: Unit) -> torch.Tensor:
        """Where a dense aggregate of ``u`` is formed, in the method's dtype: the output slice
        (then the direction of DCGD and EF is there already), unless the method keeps its state
        there (EF21's g) or the output has another dtype; else the unit's gradient slice of
        ``x`` (read by the client part already)."""
        plan = self.plan
        o = u.slice(self.output)
        if o.dtype == plan.wdtype and not self.state.memory.holds(u.uid, o):
            return o
        return u.slice(self.x)


def exchange(state: CompressionState, plan: Plan, buf: torch.Tensor, bad: bool) -> Fut:
    """Run the bucket's iteration (see the module docstring); returns DDP's future."""
    entries = [state.memory.get(u.uid) for u in plan.units]
    fresh = all(e is None for e in entries)
    # a compressed round of a method whose first use of the gradient is its compressor call:
    # the bfloat16 bucket is read by the compressors themselves, the copy filled where needed
    deferred = (
        plan.reads_half
        and not (fresh or bad)
        and plan.mode in ("allgather", "values")
        and state.iteration >= state.settings.warmup_steps
        and state.adapter.method.compresses_gradient_first
    )
    step = Step(state, plan, buf, plan.gradients(buf, fill=not deferred), bad, deferred)
    if fresh:
        fut = _initialise(step)
        if fut is not None:
            return fut
        entries = [state.memory.get(u.uid) for u in plan.units]  # initialised without a message
    missing = [u.uid for u, e in zip(plan.units, entries, strict=True) if e is None]
    if missing:
        raise RuntimeError(
            f"the hook state holds some tensors of this bucket but not {missing}: the checkpoint "
            "belongs to another model (or another parameter order)"
        )
    states = [e for e in entries if e is not None]
    if state.iteration < state.settings.warmup_steps:
        return _dense_round(step, states)
    if state.scaler is None and not bad and plan.compressed:
        _check_uncompressed(step)
    if plan.mode == "allgather":
        return _gather(step, states)
    if plan.mode == "factors":
        from .factors import exchange_factors  # (it uses this module's server part)

        return exchange_factors(step, states)
    return _reduce(step, states)


def _check_uncompressed(step: Step) -> None:
    """Without a loss scaler, stop at a non-finite gradient of a tensor sent uncompressed
    (below ``min_numel``), before the method reads it, naming this rank and the tensor — as a
    compressed tensor's compressor and the dense iterations (:func:`_dense_collective`) do.
    Unchecked, its inf or nan went on the wire silently and into EF's e and EF21's g for the
    rest of the run. (These tensors are small; a run without any compressed tensor — ``gd``,
    plain DDP — is not checked, as plain DDP does not check.)"""
    for u in step.plan.dense:
        if not bool(torch.isfinite(u.slice(step.buf)).all()):
            raise ValueError(
                f"rank {step.rank}: the gradient of {u.label} (sent uncompressed) holds inf or "
                "nan; without a loss scaler (scaler=) every rank stops: check the gradients, or "
                "pass scaler= for mixed precision"
            )


def _weigh(cfg: HookConfig, rank: int, values: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` ← w_rank · values (the reduction weight of this rank's message)."""
    if cfg.uniform:
        torch.div(values, cfg.n, out=out)
    else:
        torch.mul(values, cfg.w[rank], out=out)


def _dense_values(msg: Message) -> torch.Tensor | None:
    """A dense message's values (SparseMessages only reach the hook on the compressed paths)."""
    v = msg.values
    if isinstance(v, SparseMessage):
        return v.dense().reshape(-1)
    return None if v is None else v.reshape(-1)


# --------------------------------------------------------------------------------------------
# the server part and the direction
# --------------------------------------------------------------------------------------------
def _server_part(
    step: Step, cfg: HookConfig, u: Unit, st: State[Any, Any], clients: Any, aggregate: Aggregate
) -> None:
    """The method's server part on the aggregate; its direction D goes into the output. When
    the output holds the bfloat16 conversion of a float32 state tensor (the direction D of
    the round before: EF21's g), the server part is offered that slice as the tensor's
    :class:`~shrinkgrad.methods.rules.Mirror` (``HookConfig.mirror``), which an in-place
    sparse addition writes in the same pass; :func:`_deliver` then converts nothing more."""
    adapter = step.state.adapter
    request = step.plan.mirror_request(u, u.slice(step.output))
    mirrors = adapter.port.mirrors
    if request is not None:
        mirrors[id(request[0])] = request
    try:
        server, direction = adapter.server_step(cfg, st, aggregate)
    finally:
        if request is not None:
            mirrors.pop(id(request[0]), None)
    step.state.memory.put(u.uid, State(st.round + 1, server, clients))
    mirror = None if request is None else request[1]
    _deliver(step, u, direction, adapter.direction_changes(cfg, aggregate), mirror)


def _deliver(
    step: Step,
    u: Unit,
    direction: torch.Tensor | SparseMessage | LowRankMessage,
    changed: torch.Tensor | None = None,
    mirror: Mirror | None = None,
) -> None:
    """D into ``u``'s slice of the output: a sparse D at O(k); a dense one copied, unless it is
    there already, or only at the entries ``changed`` (the method's
    ``direction_changes``) when the output holds the conversion of D from the round before
    (:meth:`.plan.Plan.write_changes`; nothing at all when the server part wrote them through
    ``mirror``). A D that is a tensor of the method's server state is
    moved there once (the state keeps the output slice as that tensor; the plan's own output
    only)."""
    plan = step.plan
    o = u.slice(step.output)
    if isinstance(direction, LowRankMessage):  # (EF's and DCGD's D: the aggregate itself)
        direction = direction.dense().reshape(-1)
    if isinstance(direction, SparseMessage):
        plan.write_sparse(u, o, direction.indices, direction.values, direction.distinct)
        return
    if changed is not None and plan.write_changes(u, o, direction, changed, mirror):
        return
    moved = direction.data_ptr() != o.data_ptr()
    plan.write(u, o, direction)
    if moved and plan.out is not None and direction.dtype == o.dtype:
        step.state.memory.rebind(u.uid, direction, o)


# --------------------------------------------------------------------------------------------
# the initialisation and the warm-up iterations: dense messages in the bucket itself
# --------------------------------------------------------------------------------------------
def _initialise(step: Step) -> Fut | None:
    """The method's initialisation of every tensor of the bucket. Returns the future of its
    dense all-reduce, or None when no tensor's initialisation read its gradient or sent
    anything (DCGD, EF, EF21 with ``init=zero``): round 1 then uses this iteration's gradient."""
    state, plan = step.state, step.plan
    adapter, settings = state.adapter, state.settings
    warm = state.iteration < settings.warmup_steps
    if step.bad:
        return _dense_collective(step, None)
    inits: list[tuple[Unit, HookConfig, Any, Message]] = []
    consumed = set()
    for u in plan.units:
        cfg = step.config(u, warm)
        C = cfg.compressor
        clients, msg, read = adapter.init_clients(
            cfg, u.slice(step.x), encoders.fresh_encoder(C, step.keys(u, C)), plan.work(0, u.numel)
        )
        consumed.add(read or msg.values is not None)
        inits.append((u, cfg, clients, msg))
    if len(consumed) > 1:
        raise RuntimeError(
            f"{adapter.method.name}: the tensors of one bucket initialise differently (some read "
            "their gradient, some do not)"
        )
    if consumed == {False}:
        for u, cfg, clients, _ in inits:
            server, _direction = adapter.init_server(cfg, None)
            state.memory.put(u.uid, State(0, server, clients))
        return None
    send = _dense_send(step)
    for u, cfg, _, msg in inits:
        out = u.slice(send)
        values = _dense_values(msg)
        if values is None:
            out.zero_()
        else:
            _weigh(cfg, step.rank, values, out)

    def finish(total: torch.Tensor) -> None:
        for u, cfg, clients, msg in inits:
            # a fresh tensor in the method's dtype: the server may keep it (EF21: g = aggregate)
            agg = None if msg.values is None else u.slice(total).to(plan.wdtype, copy=True)
            server, direction = adapter.init_server(cfg, agg)
            state.memory.put(u.uid, State(0, server, clients))
            _deliver(step, u, direction)

    return _dense_collective(step, finish, send)


def _dense_round(step: Step, states: list[State[Any, Any]]) -> Fut:
    """A warm-up round: the method with the identity compressor, its messages (weighted) in the
    bucket itself, one all-reduce of the bucket."""
    state, plan = step.state, step.plan
    if step.bad:
        return _dense_collective(step, None)
    steps: list[tuple[Unit, HookConfig, State[Any, Any], Any]] = []
    send = _dense_send(step)
    for u, st in zip(plan.units, states, strict=True):
        cfg = step.config(u, True)
        dec = plan.work(1, u.numel)
        clients, msg, _ = state.adapter.client_step(
            cfg,
            st,
            u.slice(step.x),
            encoders.dense_encoder(cfg.compressor, None, dec, dec),
            plan.work(0, u.numel),
        )
        out = u.slice(send)
        values = _dense_values(msg)
        if values is None:
            out.zero_()
        else:
            _weigh(cfg, step.rank, values, out)
        steps.append((u, cfg, st, clients))

    def finish(total: torch.Tensor) -> None:
        for u, cfg, st, clients in steps:
            res = u.slice(total)
            agg = res if res.dtype == plan.wdtype else u.slice(step.x).copy_(res)
            _server_part(step, cfg, u, st, clients, agg)

    return _dense_collective(step, finish, send)


def _dense_send(step: Step) -> torch.Tensor:
    """Where a dense iteration writes its weighted messages: the bucket itself, or — a 16-bit
    bucket whose method runs in float32 (``state_dtype="float32"``) — a fresh float32 vector
    of its size. The clients keep their float32 messages in their memory (EF21: g_i = ∇f_i
    exactly), so the server's aggregate must be the float32 sum of those same messages; a
    16-bit all-reduce rounded every message to 16 bits and the sum at every addition, and
    EF21's g then differed from the mean of the g_i by up to half a 16-bit unit for the rest
    of the run (each later round adds the same message to both sides). These iterations (the
    initialisation and the warm-up) therefore send 4 bytes an entry."""
    plan = step.plan
    if plan.wdtype == step.buf.dtype:
        return step.buf
    return torch.empty(step.buf.numel(), dtype=plan.wdtype, device=step.buf.device)


def _dense_collective(step: Step, finish: Any, send: torch.Tensor | None = None) -> Fut:
    """All-reduce ``send`` (default: the bucket) in place, then run ``finish`` on the sum (a
    non-finite bucket makes every rank's sum non-finite: then the sum itself is returned).

    Without a loss scaler a rank whose bucket is not finite stops here, before the collective,
    naming itself — as a compressed iteration's compressor does — so that the other ranks fail
    in the collective instead of taking the NaN sum into their method state and blaming their
    own gradients one iteration later."""
    rank = step.rank
    if step.state.scaler is None and not bool(torch.isfinite(step.buf).all()):
        raise ValueError(
            f"rank {rank}: this rank's gradients hold inf or nan in a dense iteration of the "
            "hook (its initialisation or warm-up); without a loss scaler (scaler=) every rank "
            "stops: check the gradients, or pass scaler= for mixed precision"
        )
    fut = step.state.comm.all_reduce(step.buf if send is None else send)

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = result(f, "all-reduce (dense)", rank)
        if finish is None:
            return total
        finish(total)
        return step.output

    return fut.then(done)


def _unsent(step: Step, u: Unit) -> str:
    return (
        f"{step.state.adapter.method.name} sent a message for {u.label} that is not its "
        f"compressed vector (cfg.compress); with {step.state.settings.name} the hook can only "
        "send compressed messages (a method that sends raw values needs the identity compressor)"
    )


# --------------------------------------------------------------------------------------------
# summable messages: one all-reduce of the send buffer
# --------------------------------------------------------------------------------------------
def _reduce(step: Step, states: list[State[Any, Any]]) -> Fut:
    """One all-reduce of the weighted messages (dense results, or shared-index values)."""
    state, plan = step.state, step.plan
    rank, send = step.rank, plan.send
    esize = send.element_size()
    values = plan.mode == "values"
    clients_of: dict[int, Any] = {}
    drawn: dict[int, torch.Tensor] = {}  # the shared indices of every values-path tensor
    if step.bad:
        send.fill_(float("nan"))
    for u, st in zip(plan.units, states, strict=True):
        if step.bad:
            break
        cfg = step.config(u)
        C = cfg.compressor
        seg = send[u.soff : u.soff + u.nbytes // esize]
        keys = step.keys(u, C)
        dec = plan.work(1, u.numel)
        direct = values and u.compressor is not None
        if direct:
            encoder = encoders.values_encoder(C, keys, seg, dec, u.sparse, drawn, u.uid)
        else:
            encoder = encoders.dense_encoder(C, keys, seg, dec)
        x, source = step.gradient(u, direct)
        clients, msg, sent = state.adapter.client_step(
            cfg, st, x, encoder, plan.work(0, u.numel), source=source
        )
        if not sent:
            raw = _dense_values(msg)
            if raw is None:
                seg.zero_()
            elif not values or u.compressor is None:
                seg.copy_(raw)
            else:
                raise RuntimeError(_unsent(step, u))
        if plan.gathered:
            pass  # weighted in the method's dtype when summed (_summed)
        elif cfg.uniform:
            seg.div_(cfg.n)
        else:
            seg.mul_(cfg.w[rank])
        clients_of[u.uid] = clients
    if plan.gathered:
        cfg0 = step.config(plan.units[0])  # (the ranks' weights: the same for every tensor)
        if cfg0.uniform:
            fut = _summed(step, send, 0, None, cfg0.n)
        else:
            fut = _summed(step, send, 0, [float(w) for w in cfg0.w[: cfg0.n]])
    else:
        fut = state.comm.all_reduce(send)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = result(f, "all-gather" if plan.gathered else "all-reduce", rank)
        out = step.output
        for u, st in zip(plan.units, states, strict=True):
            seg = total[u.soff : u.soff + u.nbytes // esize]
            if step.bad:  # this rank sent NaN: every rank's result is NaN, the iteration is undone
                u.slice(out).fill_(float("nan"))
                u.mirror = None
                continue
            agg: Aggregate
            if values and u.compressor is not None:
                idx = drawn[u.uid]
                vals = seg if seg.dtype == plan.wdtype else seg.to(plan.wdtype)
                if u.sparse:  # (the ranks' shared index set: distinct indices)
                    agg = SparseMessage(idx, vals, (1, u.numel), distinct=True)
                else:
                    agg = step.target(u).zero_().index_add_(0, idx, vals)
            elif seg.dtype == plan.wdtype:
                agg = seg
            else:
                agg = step.target(u).copy_(seg)
            _server_part(step, step.config(u), u, st, clients_of[u.uid], agg)
        return out

    return fut.then(finish)


def _summed(
    step: Step,
    values: torch.Tensor,
    offset: int,
    weights: list[float] | None,
    divisor: int = 1,
    after: torch.futures.Future[None] | None = None,
) -> torch.futures.Future[list[torch.Tensor]]:
    """The sum of every rank's ``values`` (a part of the plan's send buffer, at element
    ``offset``), exact to the method's dtype: one all-gather of the values as they are (the
    16-bit messages the ranks added to their own states) into the plan's ``recv`` rows, then
    Σ_j w_j v_j (``weights``; None: Σ_j v_j, then divided by ``divisor``) in the method's
    dtype, in rank order — the same bits on every rank — into the plan's ``sums`` at
    ``offset``. A future of that slice, like an all-reduce's; started once
    ``after`` is done (:meth:`.collectives.Comm.all_gather`)."""
    plan, comm = step.plan, step.state.comm
    n, size = comm.world_size, plan.send.numel()
    if plan.recv is None or plan.recv.dtype != plan.send.dtype:
        plan.recv = torch.empty(n * size, dtype=plan.send.dtype, device=plan.send.device)
    if plan.sums is None:
        plan.sums = torch.empty(size, dtype=plan.wdtype, device=plan.send.device)
    m = values.numel()
    flat = plan.recv[n * offset : n * (offset + m)]
    rows = flat.view(n, m)
    total = plan.sums[offset : offset + m]
    gathered = comm.all_gather(flat, values, after=after)

    def add(f: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
        result(f, "all-gather", step.rank)
        return [_add_rows(rows, total, weights, divisor)]

    return gathered.then(add)


def _add_rows(
    rows: torch.Tensor, out: torch.Tensor, weights: list[float] | None, divisor: int = 1
) -> torch.Tensor:
    """``out`` ← Σ_j w_j rows[j] (``weights``; None: Σ_j rows[j] / ``divisor``) in ``out``'s
    dtype, rank by rank."""
    out.copy_(rows[0])  # (widened first: a product in 16 bits would round)
    if weights is not None:
        out.mul_(weights[0])
    for j in range(1, rows.shape[0]):
        out.add_(rows[j], alpha=1.0 if weights is None else weights[j])
    if divisor != 1:
        out.div_(divisor)
    return out


def _weighted_rows(
    step: Step, cfg: HookConfig, offset: int, length: int, region: int, out: torch.Tensor
) -> torch.Tensor:
    """``out`` ← Σ_j w_j v_j of the entries [offset, offset + length) of the values
    all-gathered by :func:`_summed` for a region of ``region`` entries at the send buffer's
    start (PowerSGD's P region, whose factors are summed unweighted)."""
    n = step.state.world_size
    assert step.plan.recv is not None
    rows = step.plan.recv[: n * region].view(n, region)[:, offset : offset + length]
    if cfg.uniform:
        return _add_rows(rows, out, None, cfg.n)
    return _add_rows(rows, out, [float(w) for w in cfg.w[:n]])


# --------------------------------------------------------------------------------------------
# packed payloads: one all-gather, decoded in rank order
# --------------------------------------------------------------------------------------------
def _gather(step: Step, states: list[State[Any, Any]]) -> Fut:
    """Packed payloads: one all-gather of every rank's byte buffer, decoded in rank order.

    Layout of a rank's buffer: the raw values of the uncompressed tensors, then (variable-size
    compressors only) one int32 size per compressed tensor, then the payloads; variable-size
    buffers are zero-padded to the largest one, whose size is all-gathered first. With a scaler
    every buffer ends with one more byte, 1 when the rank's bucket was not finite (``bad``: it
    sends nothing else, and no rank decodes anything).
    """
    state, plan = step.state, step.plan
    adapter = state.adapter
    flag = state.flag_bytes
    variable = any(u.compressor is not None and u.compressor.variable_size for u in plan.compressed)
    if step.bad:
        return _gather_overflow(step, variable)
    dense_part = plan.dense_part
    payloads: list[torch.Tensor] = []
    steps: dict[int, tuple[HookConfig, State[Any, Any], Any]] = {}
    by_uid = {u.uid: st for u, st in zip(plan.units, states, strict=True)}
    for u in plan.dense:
        cfg = step.config(u)
        st = by_uid[u.uid]
        slot = plan.send[u.soff : u.soff + u.nbytes]
        clients, msg, sent = adapter.client_step(
            cfg,
            st,
            step.gradient(u)[0],
            encoders.raw_encoder(slot, plan.dtype, plan.work(1, u.numel)),
            plan.work(0, u.numel),
        )
        if not sent:
            raw = slot.view(plan.dtype)
            values = _dense_values(msg)
            if values is None:
                raw.zero_()
            else:
                raw.copy_(values)
        steps[u.uid] = (cfg, st, clients)
    for u in plan.compressed:
        cfg = step.config(u)
        C = u.compressor
        assert C is not None
        st = by_uid[u.uid]
        box: list[torch.Tensor] = []
        # fixed-size messages are encoded in place, into their slot of the send buffer
        dest = None if variable else plan.send[u.soff : u.soff + u.nbytes]
        encoder = encoders.PayloadEncoder(
            C, step.keys(u, C), box, dest, plan.work(1, u.numel), plan.dtype, u.sparse
        )
        x, source = step.gradient(u, True)
        clients, msg, sent = adapter.client_step(
            cfg, st, x, encoder, plan.work(0, u.numel), source=source
        )
        if not sent:
            raise RuntimeError(_unsent(step, u))
        if not C.variable_size and box[0].numel() != u.nbytes:
            raise RuntimeError(
                f"{C.name} encoded {u.numel} entries into {box[0].numel()} bytes, but its bits "
                f"formula gives {u.nbytes}: its wire format and bits() disagree"
            )
        payloads.append(box[0])
        steps[u.uid] = (cfg, st, clients)
    if variable:
        header = torch.tensor([p.numel() for p in payloads], dtype=torch.int32)
        size = dense_part + header.numel() * 4 + sum(p.numel() for p in payloads)
        block = state.comm.max_size(size + flag)
        if plan.send.numel() < block:
            grown = torch.zeros(block, dtype=torch.uint8, device=step.buf.device)
            grown[:dense_part].copy_(plan.send[:dense_part])
            plan.send = grown
        send = plan.send[:block]
        send[size:].zero_()
        send[dense_part : dense_part + header.numel() * 4].copy_(header.view(torch.uint8))
        pos = dense_part + header.numel() * 4
        for p in payloads:
            send[pos : pos + p.numel()].copy_(p)
            pos += p.numel()
    else:  # the payloads are already in place
        send = plan.send
        block = send.numel()
    if flag:
        send[block - 1] = 0

    def server(aggregates: dict[int, Aggregate]) -> None:
        for u in plan.units:
            cfg, st, clients = steps[u.uid]
            _server_part(step, cfg, u, st, clients, aggregates[u.uid])

    return _exchange(step, send, block, variable, server)


def _gather_overflow(step: Step, variable: bool) -> Fut:
    """The all-gather of a rank whose bucket is not finite: zeros and the flag byte set."""
    plan = step.plan
    block = step.state.comm.max_size(1) if variable else plan.send.numel()
    if plan.send.numel() < block:
        plan.send = torch.zeros(block, dtype=torch.uint8, device=step.buf.device)
    send = plan.send[:block]
    send.zero_()
    send[block - 1] = 1
    return _exchange(step, send, block, variable, None)


def _exchange(step: Step, send: torch.Tensor, block: int, variable: bool, server: Any) -> Fut:
    """All-gather ``send`` (``block`` bytes per rank), form the ranks' reductions and run the
    server parts (``server(aggregates)``)."""
    state, plan = step.state, step.plan
    n, rank = state.world_size, step.rank
    if plan.recv is None or plan.recv.numel() < n * block:
        plan.recv = torch.empty(n * block, dtype=torch.uint8, device=step.buf.device)
    recv = plan.recv[: n * block]
    fut = state.comm.all_gather(recv, send)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result(f, "all-gather", rank)  # raises a clear error if the collective failed
        out = step.output
        if state.flag_bytes and bool(recv.view(n, block)[:, block - 1].any()):
            for u in plan.units:
                u.mirror = None
            return out.fill_(float("nan"))  # some rank overflowed: nothing to decode
        server(_combine(step, recv, block, variable))
        return out

    return fut.then(finish)


def _combine(step: Step, recv: torch.Tensor, block: int, variable: bool) -> dict[int, Aggregate]:
    """Every rank's block of ``recv`` (in rank order) reduced per tensor: Σ_j w_j c_j, dense (in
    the tensor's :meth:`Step.target`) or, for sparse units, the SparseMessage of all ranks'
    (index, w_j·value) pairs."""
    state, plan = step.state, step.plan
    n, wire, wdtype = state.world_size, plan.dtype, plan.wdtype
    dense_part = plan.dense_part
    m = len(plan.compressed)
    configs = {u.uid: step.config(u) for u in plan.units}
    targets = {u.uid: step.target(u) for u in plan.units if not u.sparse}
    # the sparse units' messages, found rank by rank and decoded unit by unit afterwards (all
    # ranks' pairs of a unit in one call: Compressor.decode_sparse_many)
    spans: dict[int, list[tuple[int, int]]] = {u.uid: [] for u in plan.compressed if u.sparse}
    span_keys: dict[int, list[Any]] = {uid: [] for uid in spans}
    for j in range(n):
        base = j * block
        for u in plan.dense:
            cfg = configs[u.uid]
            raw = recv[base + u.soff : base + u.soff + u.nbytes].clone().view(wire)  # aligned
            out = targets[u.uid]
            if cfg.uniform and j == 0:
                out.copy_(raw)
            elif cfg.uniform:
                out.add_(raw.to(wdtype) if wire != wdtype else raw)
            elif j == 0:
                torch.mul(raw.to(wdtype), cfg.w[j], out=out)
            else:
                out.add_(raw.to(wdtype), alpha=cfg.w[j])
        if variable:
            header = recv[base + dense_part : base + dense_part + 4 * m].clone().view(torch.int32)
            sizes = [int(s) for s in header.tolist()]
            pos = base + dense_part + 4 * m
        else:
            sizes = [u.nbytes for u in plan.compressed]
            pos = base + dense_part
        for u, size in zip(plan.compressed, sizes, strict=True):
            C = u.compressor
            assert C is not None
            cfg = configs[u.uid]
            keys = step.keys(u, C, j)
            if u.sparse:  # O(k): the weighted pairs, summed by the method's index_add
                spans[u.uid].append((pos, size))
                span_keys[u.uid].append(keys)
                pos += size
                continue
            payload = recv[pos : pos + size]
            pos += size
            out = targets[u.uid]
            if C.sparse_message:  # O(k): the weighted values added at their indices
                idx, vals = C.decode_sparse(payload, u.numel, wire, keys)
                vals = (vals.to(wdtype) if vals.dtype != wdtype else vals).mul_(cfg.w[j])
                if j == 0:
                    out.zero_()
                out.index_add_(0, idx, vals)
                continue
            c = encoders.decode(
                C, payload, u.numel, wire, keys, out if j == 0 else plan.work(1, u.numel)
            )
            if not cfg.uniform:
                c.mul_(cfg.w[j])
            if j > 0:
                out.add_(c)
    aggregates: dict[int, Aggregate] = {}
    for u in plan.units:
        if u.sparse:
            C = u.compressor
            assert C is not None
            idx, vals = C.decode_sparse_many(
                recv,
                spans[u.uid],
                u.numel,
                wire,
                list(configs[u.uid].w[:n]),
                span_keys[u.uid],
                wdtype,
            )
            aggregates[u.uid] = SparseMessage(idx, vals, (1, u.numel))
            continue
        out = targets[u.uid]
        C = u.compressor
        if configs[u.uid].uniform and (C is None or not C.sparse_message):
            out.div_(n)
        aggregates[u.uid] = out
    return aggregates
