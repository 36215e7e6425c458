"""One bucket, one iteration: the method's client parts, the collective, the server parts.

For every tensor of the bucket the hook runs the method's client part (:mod:`.adapter`) with an
encoder that puts the message straight into the plan's send buffer, starts one collective for
the bucket, and, in the collective's callback, decodes the reduction Σ_i w_i c_i of the ranks'
messages and runs the method's server part, whose direction D it writes into the bucket (DDP
copies it into ``.grad``). Which collective:

* ``dense``: the initialisation and the warm-up iterations: every tensor's message (its initial
  message, or a round with the identity compressor) is written, weighted, into the bucket itself,
  which one all-reduce sums;
* ``allreduce`` (compressors whose results are summable, identity): one all-reduce of the send
  buffer of the weighted results;
* ``values`` (shared-seed sparsifiers): one all-reduce of the weighted k values of every tensor;
* ``allgather`` (everything else): one all-gather of every rank's packed payloads (raw values of
  the uncompressed tensors first; for variable-size messages a header of sizes, padding to the
  largest block, whose size is all-gathered first), decoded in rank order on every rank — so
  all ranks hold bit-identical parameters.

With a loss scaler, a rank whose bucket is not finite (``bad``) sends NaN (summed paths) or the
flag byte at the end of its all-gather block, and every rank returns the bucket as NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...compressors import Compressor
from ...methods.base import Message, State
from ...rng import Keys
from .adapter import Encoder, HookConfig
from .collectives import result
from .plan import Plan, Unit

if TYPE_CHECKING:
    from .state import CompressionState

__all__ = ["exchange"]

Fut = torch.futures.Future[torch.Tensor]


def exchange(state: CompressionState, plan: Plan, buf: torch.Tensor, bad: bool) -> Fut:
    """Run the bucket's iteration (see the module docstring); returns DDP's future."""
    entries = [state.memory.get(u.uid) for u in plan.units]
    if all(e is None for e in entries):
        fut = _initialise(state, plan, buf, bad)
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
        return _dense_round(state, plan, buf, bad, states)
    if plan.mode == "allgather":
        return _gather(state, plan, buf, bad, states)
    return _reduce(state, plan, buf, bad, states)


def _slice(buf: torch.Tensor, u: Unit) -> torch.Tensor:
    return buf[u.offset : u.offset + u.numel]


def _weigh(cfg: HookConfig, rank: int, values: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` ← w_rank · values (the reduction weight of this rank's message)."""
    if cfg.uniform:
        torch.div(values, cfg.n, out=out)
    else:
        torch.mul(values, cfg.w[rank], out=out)


# --------------------------------------------------------------------------------------------
# the initialisation and the warm-up iterations: dense messages in the bucket itself
# --------------------------------------------------------------------------------------------
def _initialise(state: CompressionState, plan: Plan, buf: torch.Tensor, bad: bool) -> Fut | None:
    """The method's initialisation of every tensor of the bucket. Returns the future of its
    dense all-reduce, or None when no tensor's initialisation read its gradient or sent
    anything (DCGD, EF, EF21 with ``init=zero``): round 1 then uses this iteration's gradient."""
    adapter, settings = state.adapter, state.settings
    warm = state.iteration < settings.warmup_steps
    it, rank = state.iteration, state.rank
    if bad:
        return _dense_collective(state, buf, [])
    inits: list[tuple[Unit, HookConfig, Any, Message]] = []
    consumed = set()
    for u in plan.units:
        cfg = state.config(u, buf, warm)
        C = cfg.compressor
        keys = settings.keys(C, u.uid, rank, it)
        clients, msg, read = adapter.init_clients(
            cfg, _slice(buf, u), _fresh_encoder(C, keys), plan.work(0, u.numel)
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
            server, _direction = adapter.init_server(cfg, u.numel, buf, None)
            state.memory.put(u.uid, State(0, server, clients))
        return None
    for u, cfg, _, msg in inits:
        out = _slice(buf, u)
        if msg.values is None:
            out.zero_()
        else:
            _weigh(cfg, rank, msg.values.reshape(-1), out)

    def finish(out: torch.Tensor) -> None:
        for u, cfg, clients, msg in inits:
            res = _slice(out, u)
            agg = None if msg.values is None else res.clone()  # the server may keep it
            server, direction = adapter.init_server(cfg, u.numel, buf, agg)
            res.copy_(direction)
            state.memory.put(u.uid, State(0, server, clients))

    return _dense_collective(state, buf, [finish])


def _dense_round(
    state: CompressionState,
    plan: Plan,
    buf: torch.Tensor,
    bad: bool,
    states: list[State[Any, Any]],
) -> Fut:
    """A warm-up round: the method with the identity compressor, its messages (weighted) in the
    bucket itself, one all-reduce of the bucket."""
    adapter, rank = state.adapter, state.rank
    if bad:
        return _dense_collective(state, buf, [])
    steps: list[tuple[Unit, HookConfig, State[Any, Any], Any]] = []
    for u, st in zip(plan.units, states, strict=True):
        cfg = state.config(u, buf, True)
        x = _slice(buf, u)
        dec = plan.work(1, u.numel)
        clients, msg, _ = adapter.client_step(
            cfg, st, x, _dense_encoder(cfg.compressor, None, dec), plan.work(0, u.numel)
        )
        if msg.values is None:
            x.zero_()
        else:
            _weigh(cfg, rank, msg.values.reshape(-1), x)
        steps.append((u, cfg, st, clients))

    def finish(out: torch.Tensor) -> None:
        for u, cfg, st, clients in steps:
            res = _slice(out, u)
            _server_part(state, cfg, u, st, clients, res, res)

    return _dense_collective(state, buf, [finish])


def _server_part(
    state: CompressionState,
    cfg: HookConfig,
    u: Unit,
    st: State[Any, Any],
    clients: Any,
    aggregate: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The method's server part on the decoded aggregate; its direction D goes into ``out``
    (the tensor's slice of the bucket) unless it is already there, the new state into memory."""
    server, direction = state.adapter.server_step(cfg, st, aggregate)
    if direction.data_ptr() != out.data_ptr():
        out.copy_(direction)
    state.memory.put(u.uid, State(st.round + 1, server, clients))


def _dense_collective(state: CompressionState, buf: torch.Tensor, finish: list[Any]) -> Fut:
    """All-reduce the bucket in place, then run ``finish`` on the sum (a non-finite bucket
    makes every rank's sum non-finite)."""
    fut = state.comm.all_reduce(buf)
    rank = state.rank

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = result(f, "all-reduce (dense)", rank)
        for fn in finish:
            fn(out)
        return out

    return fut.then(done)


# --------------------------------------------------------------------------------------------
# encoders: what cfg.compress does for the tensor being processed
# --------------------------------------------------------------------------------------------
def _fresh_encoder(C: Compressor, keys: Keys | None) -> Encoder:
    """C(p) as a new tensor (the initialisation: its message travels dense)."""

    def encode(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        return C(p, keys)

    return encode


def _dense_encoder(C: Compressor, keys: Keys | None, seg: torch.Tensor) -> Encoder:
    """Summable dense results: C(p) goes into ``seg`` and is returned."""

    def encode(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        return C(p, keys, out=seg.view(p.shape))

    return encode


def _raw_encoder(slot: torch.Tensor, dtype: torch.dtype) -> Encoder:
    """An uncompressed tensor in an all-gather block: its raw values go into ``slot``."""

    def encode(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        v = slot.view(dtype)
        v.copy_(p.reshape(-1))
        return v.view(p.shape)

    return encode


def _values_encoder(
    C: Compressor, keys: Keys | None, seg: torch.Tensor, dec: torch.Tensor
) -> Encoder:
    """Shared-seed sparsifiers: the payload is the k values, encoded straight into ``seg``;
    returns C(p) decoded into ``dec`` (p itself when the method only sends it)."""

    def encode(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        nbytes = seg.numel() * seg.element_size()
        payload = C.encode(p.reshape(-1), keys, out=seg.view(torch.uint8))
        if payload.numel() != nbytes:
            raise RuntimeError(
                f"{C.name} sent {payload.numel()} bytes for {seg.numel()} values: with "
                "shared_seed=true a message must be the values only"
            )
        if sent_only:
            return p
        return C.decode(payload, p.numel(), p.dtype, keys, out=dec).view(p.shape)

    return encode


def _payload_encoder(
    C: Compressor,
    keys: Keys | None,
    box: list[torch.Tensor],
    dest: torch.Tensor | None,
    dec: torch.Tensor,
) -> Encoder:
    """Packed payloads: encoded into ``dest`` (fixed-size messages: their slot of the send
    buffer) or a new tensor, and put into ``box``; returns C(p) decoded into ``dec`` (p itself
    when the method only sends it)."""

    def encode(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        payload = C.encode(p.reshape(-1), keys, out=dest)
        box.append(payload)
        if sent_only:
            return p
        return C.decode(payload, p.numel(), p.dtype, keys, out=dec).view(p.shape)

    return encode


def _unsent(state: CompressionState, u: Unit, msg: Message) -> str:
    return (
        f"{state.adapter.method.name} sent a message for tensor #{u.uid} that is not its "
        f"compressed vector (cfg.compress); with {state.settings.name} the hook can only send "
        "compressed messages (a method that sends raw values needs the identity compressor)"
    )


# --------------------------------------------------------------------------------------------
# summable messages: one all-reduce of the send buffer
# --------------------------------------------------------------------------------------------
def _reduce(
    state: CompressionState,
    plan: Plan,
    buf: torch.Tensor,
    bad: bool,
    states: list[State[Any, Any]],
) -> Fut:
    """One all-reduce of the weighted messages (dense results, or shared-index values)."""
    adapter, settings = state.adapter, state.settings
    rank, it, send = state.rank, state.iteration, plan.send
    esize = buf.element_size()
    values = plan.mode == "values"
    clients_of: dict[int, Any] = {}
    if bad:
        send.fill_(float("nan"))
    for u, st in zip(plan.units, states, strict=True):
        if bad:
            break
        cfg = state.config(u, buf, False)
        C = cfg.compressor
        seg = send[u.soff : u.soff + u.nbytes // esize]
        keys = settings.keys(C, u.uid, rank, it)
        if values and u.compressor is not None:
            encoder = _values_encoder(C, keys, seg, plan.work(1, u.numel))
        else:
            encoder = _dense_encoder(C, keys, seg)
        clients, msg, sent = adapter.client_step(
            cfg, st, _slice(buf, u), encoder, plan.work(0, u.numel)
        )
        if not sent:
            if msg.values is None:
                seg.zero_()
            elif not values or u.compressor is None:
                seg.copy_(msg.values.reshape(-1))
            else:
                raise RuntimeError(_unsent(state, u, msg))
        if cfg.uniform:
            seg.div_(cfg.n)
        else:
            seg.mul_(cfg.w[rank])
        clients_of[u.uid] = clients
    fut = state.comm.all_reduce(send)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = result(f, "all-reduce", rank)
        for u, st in zip(plan.units, states, strict=True):
            seg = total[u.soff : u.soff + u.nbytes // esize]
            out = _slice(buf, u)
            agg = seg
            if values and u.compressor is not None:
                C = u.compressor
                keys = settings.keys(C, u.uid, rank, it)
                agg = C.decode(seg.view(torch.uint8), u.numel, buf.dtype, keys, out=out)
            if bad:  # this rank sent NaN: every rank's result is NaN, the iteration is undone
                out.copy_(agg)
                continue
            cfg = state.config(u, buf, False)
            _server_part(state, cfg, u, st, clients_of[u.uid], agg, out)
        return buf

    return fut.then(finish)


# --------------------------------------------------------------------------------------------
# packed payloads: one all-gather, decoded in rank order
# --------------------------------------------------------------------------------------------
def _gather(
    state: CompressionState,
    plan: Plan,
    buf: torch.Tensor,
    bad: bool,
    states: list[State[Any, Any]],
) -> Fut:
    """Packed payloads: one all-gather of every rank's byte buffer, decoded in rank order.

    Layout of a rank's buffer: the raw values of the uncompressed tensors, then (variable-size
    compressors only) one int32 size per compressed tensor, then the payloads; variable-size
    buffers are zero-padded to the largest one, whose size is all-gathered first. With a scaler
    every buffer ends with one more byte, 1 when the rank's bucket was not finite (``bad``: it
    sends nothing else, and no rank decodes anything).
    """
    adapter, settings = state.adapter, state.settings
    rank, it = state.rank, state.iteration
    flag = state.flag_bytes
    variable = any(u.compressor is not None and u.compressor.variable_size for u in plan.compressed)
    if bad:
        return _gather_overflow(state, plan, buf, variable)
    dense_part = plan.dense_part
    payloads: list[torch.Tensor] = []
    steps: dict[int, tuple[HookConfig, State[Any, Any], Any]] = {}
    by_uid = {u.uid: st for u, st in zip(plan.units, states, strict=True)}
    for u in plan.dense:
        cfg = state.config(u, buf, False)
        st = by_uid[u.uid]
        slot = plan.send[u.soff : u.soff + u.nbytes]
        clients, msg, sent = adapter.client_step(
            cfg, st, _slice(buf, u), _raw_encoder(slot, buf.dtype), plan.work(0, u.numel)
        )
        if not sent:
            raw = slot.view(buf.dtype)
            if msg.values is None:
                raw.zero_()
            else:
                raw.copy_(msg.values.reshape(-1))
        steps[u.uid] = (cfg, st, clients)
    for u in plan.compressed:
        cfg = state.config(u, buf, False)
        C = u.compressor
        assert C is not None
        st = by_uid[u.uid]
        box: list[torch.Tensor] = []
        # fixed-size messages are encoded in place, into their slot of the send buffer
        dest = None if variable else plan.send[u.soff : u.soff + u.nbytes]
        keys = settings.keys(C, u.uid, rank, it)
        encoder = _payload_encoder(C, keys, box, dest, plan.work(1, u.numel))
        clients, msg, sent = adapter.client_step(
            cfg, st, _slice(buf, u), encoder, plan.work(0, u.numel)
        )
        if not sent:
            raise RuntimeError(_unsent(state, u, msg))
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
            grown = torch.zeros(block, dtype=torch.uint8, device=buf.device)
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

    def server(out: torch.Tensor) -> torch.Tensor:
        for u in plan.units:
            cfg, st, clients = steps[u.uid]
            res = _slice(out, u)
            _server_part(state, cfg, u, st, clients, res, res)
        return out

    return _exchange(state, plan, buf, send, block, variable, server)


def _gather_overflow(state: CompressionState, plan: Plan, buf: torch.Tensor, variable: bool) -> Fut:
    """The all-gather of a rank whose bucket is not finite: zeros and the flag byte set."""
    block = state.comm.max_size(1) if variable else plan.send.numel()
    if plan.send.numel() < block:
        plan.send = torch.zeros(block, dtype=torch.uint8, device=buf.device)
    send = plan.send[:block]
    send.zero_()
    send[block - 1] = 1
    return _exchange(state, plan, buf, send, block, variable, None)


def _exchange(
    state: CompressionState,
    plan: Plan,
    buf: torch.Tensor,
    send: torch.Tensor,
    block: int,
    variable: bool,
    server: Any,
) -> Fut:
    """All-gather ``send`` (``block`` bytes per rank), decode the ranks' messages into buf and
    run the server parts (``server(buf)``)."""
    n, rank, it = state.world_size, state.rank, state.iteration
    if plan.recv is None or plan.recv.numel() < n * block:
        plan.recv = torch.empty(n * block, dtype=torch.uint8, device=buf.device)
    recv = plan.recv[: n * block]
    fut = state.comm.all_gather(recv, send)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result(f, "all-gather", rank)  # raises a clear error if the collective failed
        if state.flag_bytes and bool(recv.view(n, block)[:, block - 1].any()):
            return buf.fill_(float("nan"))  # some rank overflowed: nothing to decode
        _combine(state, plan, buf, recv, block, variable, it)
        return buf if server is None else server(buf)

    return fut.then(finish)


def _combine(
    state: CompressionState,
    plan: Plan,
    buf: torch.Tensor,
    recv: torch.Tensor,
    block: int,
    variable: bool,
    it: int,
) -> None:
    """Decode every rank's block of ``recv`` (in rank order): buf ← Σ_j w_j c_j per tensor."""
    n = state.world_size
    dense_part = plan.dense_part
    m = len(plan.compressed)
    configs = {u.uid: state.config(u, buf, False) for u in plan.units}
    for j in range(n):
        base = j * block
        for u in plan.dense:
            cfg = configs[u.uid]
            raw = recv[base + u.soff : base + u.soff + u.nbytes].clone().view(buf.dtype)  # aligned
            out = _slice(buf, u)
            if cfg.uniform and j == 0:
                out.copy_(raw)
            elif cfg.uniform:
                out.add_(raw)
            elif j == 0:
                torch.mul(raw, cfg.w[j], out=out)
            else:
                out.add_(raw, alpha=cfg.w[j])
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
            payload = recv[pos : pos + size]
            keys = state.settings.keys(C, u.uid, j, it)
            pos += size
            out = _slice(buf, u)
            if C.sparse_message:  # O(k): the weighted values added at their indices
                idx, vals = C.decode_sparse(payload, u.numel, buf.dtype, keys)
                vals.mul_(cfg.w[j])
                if j == 0:
                    out.zero_()
                out.index_add_(0, idx, vals)
                continue
            c = C.decode(
                payload, u.numel, buf.dtype, keys, out=out if j == 0 else plan.work(1, u.numel)
            )
            if not cfg.uniform:
                c.mul_(cfg.w[j])
            if j > 0:
                out.add_(c)
    for u in plan.units:
        cfg = configs[u.uid]
        if cfg.uniform and (u.compressor is None or not u.compressor.sparse_message):
            _slice(buf, u).div_(n)
