"""One bucket's iteration with PowerSGD's all-reduce of the factors (``power_sgd[shared=true]``).

Vogels, Karimireddy, Jaggi (NeurIPS 2019), Alg. 1, for every compressed tensor M_i (rank i's
vector that the method compresses, viewed as a matrix) and the Q (n × r) all ranks share:

1. hook body: P_i = M_i Q; one all-reduce of the bucket's P's (with the raw values of its
   uncompressed tensors in front), P = Σ_i P_i;
2. the P all-reduce's callback: P̂ = orthonormalize(P) (float32 or finer, identical on every
   rank) and Q_i = M_iᵀ P̂ of every compressed tensor, whose Q_i/n go into the Q all-reduce,
   which starts at once; then the method's client steps, whose compressor calls return rank
   i's message c_i = P̂ Q_iᵀ (their passes over the state overlap Q's transfer);
3. the Q all-reduce's callback (once the client steps are done): Q̄ = Σ_i Q_i/n; the aggregate
   (1/n) Σ_i c_i = P̂ Q̄ᵀ goes to the method's server part, and Q̄ becomes every rank's next Q
   (the state the method carries).

M_i is what the method's client step hands to its compressor (EF21: ∇f_i − g_i; EF: e_i + ∇f_i;
EF21-SGDM: v_i − g_i), and P_i is needed before that step can finish: step 1 runs the client
step as a *probe* (:meth:`.adapter.Adapter.probe`: a pure run that stops at the compressor
call), which forms M_i in the plan's held buffer (``Plan.held``, one bucket-sized vector: the
probe's scratch), kept for Q_i in step 2; step 2 then runs the client step in full, and, the
method being deterministic, it hands the compressor the same M_i, whose factors are already
known. For the methods that only add messages to their state (``sparse_messages``: EF21, EF,
EF21-SGDM) c_i and the aggregate go to the method as their factors
(:class:`~shrinkgrad.methods.rules.LowRankMessage`): g_i ← g_i + P̂ Q_iᵀ and g ← g + P̂ Q̄ᵀ are
one pass each over the state (:meth:`~shrinkgrad.compressors.PowerSGD.add_outputs`, the bits of
forming the product and adding it), no dense C(M_i) is formed. The arithmetic of the stages is
the compressor's (:class:`~shrinkgrad.compressors.PowerSGD`'s ``factor_p``,
``orthonormal_basis``, ``factor_q``, ``factor_outputs``, ``add_outputs``), the same the
simulator's batched shared step composes with sums over the clients, so the hook on n ranks
follows the simulator with n clients.

No callback waits: the Q all-reduce is reserved in the hook body, right after the P one, and
started by the P callback (:meth:`.collectives.Comm.all_reduce` with ``after``), so every rank
starts the same collectives in the same order however many buckets are in flight (torch's
``powerSGD_hook`` waits for Q inside the P callback, which hangs gloo with several buckets).
The Q callback runs once both the Q all-reduce and its bucket's client steps are done (a
future of each, collected), and the client steps of two buckets, whose P callbacks may run at
once on gloo's threads, take turns on the callback adapter (each bucket's start from the
previous one's future: :func:`_after_turn`), never waiting. The
bytes (counted in the hook body): r(m + n) values per compressed tensor in the gradients' dtype.

*Factor overflow.* The factors travel in the gradients' dtype, and they grow with the singular
values of the matrices, not with their entries: Q_i = M_iᵀ P̂ with σ₁(M_i), P_i = M_i Q with
about σ₁(M_i) times the previous σ₁ (Q is not normalised), so a float16 P_i, Q_i or sum
overflows ±65504 while every gradient entry is finite (Vogels et al. 2019 send the factors in
the gradients' dtype too). The inf is let through to the collectives, so that every rank sees it
in the same sum (P, or Q̄): with a loss scaler the bucket is then NaN on every rank, the scaler
skips the step and the hook's memory is put back (the client steps of a P or Q_i that is not
finite do not run, and a non-finite Q̄ never becomes the next Q); without one, every rank raises
the same one-line error (:func:`_overflow_message`), where it used to hand DDP NaN gradients (a
non-finite P) or take the inf into EF21's g_i and the next Q (a non-finite Q_i) and stop one
iteration later with "non-finite entries". The inputs were checked finite before
(:func:`_finite`, and the uncompressed tensors' check), so a non-finite sum there is an overflow.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...compressors import PowerSGD
from ...methods.base import State
from ...methods.rules import LowRankMessage
from . import encoders
from .adapter import Probed
from .collectives import result

if TYPE_CHECKING:
    from .exchange import Step

__all__ = ["exchange_factors"]

Fut = torch.futures.Future[torch.Tensor]


def _layout(step: Step) -> dict[int, tuple[int, int, int, int]]:
    """Where each tensor's values go in the send buffer: (P offset, P length, Q offset, Q
    length), in elements: the P region holds every tensor in bucket order (the raw values of
    the uncompressed ones, P_i (m × r) of the compressed ones), the Q region after it the Q_i
    (n × r) of the compressed ones."""
    out: dict[int, tuple[int, int, int, int]] = {}
    pos = 0
    qlen: dict[int, int] = {}
    for u in step.plan.units:
        C = u.compressor
        if C is None:
            out[u.uid] = (pos, u.numel, 0, 0)
            pos += u.numel
            continue
        assert isinstance(C, PowerSGD)
        m, n = C.matrix_shape(u.numel)
        out[u.uid] = (pos, m * C.r, 0, 0)
        pos += m * C.r
        qlen[u.uid] = n * C.r
    for u in step.plan.units:
        if u.uid in qlen:
            p_off, p_len, _, _ = out[u.uid]
            out[u.uid] = (p_off, p_len, pos, qlen[u.uid])
            pos += qlen[u.uid]
    return out


def _finite(C: PowerSGD, p: torch.Tensor) -> None:
    """A one-line error unless ``p`` is finite: a finite sum proves every entry finite (inf
    and NaN propagate through it), so ``isfinite`` (a pass that writes a mask) runs only when
    the sum is not (possibly a mere overflow)."""
    if not bool(torch.isfinite(p.sum())) and not bool(torch.isfinite(p).all()):
        raise ValueError(
            f"{C.name} got a vector with non-finite entries (a non-finite gradient, or the "
            "method diverged); attach a loss scaler (scaler=) to skip such steps"
        )


def _overflow_message(step: Step, u: Any, factor: str) -> str:
    """The one-line error (with a loss scaler: warning) of a low-rank ``factor`` of the
    compressed tensor ``u`` that is not finite in the wire dtype although the gradients are."""
    C = u.compressor
    assert isinstance(C, PowerSGD)
    dtype = step.plan.send.dtype
    m, n = C.matrix_shape(u.numel)
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float16:
        fix = (
            "train in bfloat16 (float32's range) or keep float32 gradients (e.g. float32 "
            "parameters under torch.autocast)"
        )
    else:
        fix = "rescale the loss"
    if step.state.scaler is None:
        fix += ", or pass a loss scaler (scaler=) to skip such steps"
    else:
        fix += (
            "; the loss scaler skips the step, but a smaller loss scale does not help (the hook "
            "compresses the unscaled gradient), so if this repeats no step is taken"
        )
    return (
        f"{C.name}: the low-rank factor {factor} of {u.label} ({m} x {n}) overflows {name}'s "
        f"range (±{torch.finfo(dtype).max:.6g}) on the wire although every gradient entry is "
        f"finite (PowerSGD's factors grow with the matrix's singular values, not its entries); "
        f"{fix}"
    )


def _first_overflow(total: torch.Tensor, spans: list[tuple[Any, int, int]]) -> Any | None:
    """The first unit whose span (unit, offset, length) of ``total`` is not finite."""
    for u, off, length in spans:
        if not bool(torch.isfinite(total[off : off + length]).all()):
            return u
    return None


def _weigh_raw(
    step: Step, lay: dict[int, tuple[int, int, int, int]], total: torch.Tensor
) -> torch.Tensor:
    """The gathered P region's sum with the uncompressed tensors' raw values weighted (Σ_j
    w_j v_j, recomputed from the rows; the P factors stay the plain sum Σ_j P_j)."""
    from .exchange import _weighted_rows

    region = total.numel()
    for u in step.plan.dense:
        p_off, p_len, _, _ = lay[u.uid]
        seg = total[p_off : p_off + p_len]
        _weighted_rows(step, step.config(u), p_off, p_len, region, seg)
    return total


def _factored(
    C: PowerSGD, p_hat: torch.Tensor, q: torch.Tensor, shape: tuple[int, ...]
) -> LowRankMessage:
    """P̂ Qᵀ as a :class:`LowRankMessage` with C's in-place addition."""

    def add(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, alpha: float) -> None:
        C.add_outputs(x, left, right, alpha)

    return LowRankMessage(p_hat, q, shape, add)


def _held(step: Step) -> torch.Tensor:
    """The plan's bucket-sized buffer of the vectors M_i the client steps compress (kept from
    the probe in the hook body to the P callback, which forms Q_i = M_iᵀ P̂ from it)."""
    plan = step.plan
    if plan.held is None:
        plan.held = torch.empty(plan.numel, dtype=plan.wdtype, device=step.buf.device)
    return plan.held


def _after_turn(
    previous: torch.futures.Future[None] | None,
    work: Callable[[], None],
    *done: torch.futures.Future[None],
) -> None:
    """Run ``work`` now if ``previous`` is done (or None), else from its callback (never
    waiting), then set ``done``, whatever ``work`` raised (it keeps its errors itself)."""

    def run(_: object = None) -> None:
        try:
            work()
        finally:
            for d in done:
                d.set_result(None)

    if previous is None or previous.done():
        run()
    else:
        previous.add_done_callback(run)


def exchange_factors(step: Step, states: list[State[Any, Any]]) -> Fut:
    """Run the bucket's iteration by the factor all-reduce (module docstring)."""
    from .exchange import _dense_values, _server_part, _summed

    state, plan = step.state, step.plan
    adapter, comm, rank, n = state.adapter, state.comm, step.rank, state.world_size
    fusable = bool(adapter.method.sparse_messages)

    def fuse(C: PowerSGD, d: int, dtype: torch.dtype, p_hat: torch.Tensor) -> bool:
        """Whether C's output goes to the method as its factors (:class:`LowRankMessage`):
        for methods that only add messages to their state (``sparse_messages``), matrix
        views without padding, in the factors' dtype."""
        m, ncols = C.matrix_shape(d)
        return fusable and m * ncols == d and dtype == p_hat.dtype

    lay = _layout(step)
    p_total = sum(lay[u.uid][1] for u in plan.units)
    send = plan.send
    P, Q = send[:p_total], send[p_total:]
    by_uid = {u.uid: st for u, st in zip(plan.units, states, strict=True)}
    dense_clients: dict[int, Any] = {}
    #: per compressed tensor: M_i, the vector its client step compresses (a view of the plan's
    #: held buffer), for Q_i = M_iᵀ P̂ in the P callback
    held: dict[int, torch.Tensor] = {}
    #: this rank's P_i that overflowed the wire dtype (from finite inputs): with a loss scaler
    #: a warning (the step is skipped on every rank, whose P sum is not finite)
    local: list[str] = []

    def own_overflow(t: torch.Tensor) -> bool:
        # (a finite sum proves every entry finite: the mask pass only runs when it is not)
        return not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all())

    if step.bad:
        send.fill_(float("nan"))
    for u in plan.units:
        if step.bad:
            break
        cfg, st = step.config(u), by_uid[u.uid]
        p_off, p_len, _, _ = lay[u.uid]
        seg = P[p_off : p_off + p_len]
        C = u.compressor
        if C is None:  # raw values (the method with the identity), summed with the P's
            clients, msg, sent = adapter.client_step(
                cfg,
                st,
                u.slice(step.x),
                encoders.dense_encoder(cfg.compressor, None, seg, plan.work(1, u.numel)),
                plan.work(0, u.numel),
            )
            if not sent:
                raw = _dense_values(msg)
                seg.zero_() if raw is None else seg.copy_(raw)
            if not plan.gathered:  # (gathered: weighted when summed, below)
                seg.div_(cfg.n) if cfg.uniform else seg.mul_(cfg.w[rank])
            dense_clients[u.uid] = clients
            continue
        assert isinstance(C, PowerSGD)
        keep = u.slice(_held(step))

        def probe(
            p: torch.Tensor,
            q: torch.Tensor,
            C: PowerSGD = C,
            seg: Any = seg,
            keep: Any = keep,
            u: Any = u,
        ) -> Any:
            _finite(C, p)
            flat = p.reshape(-1)
            if flat.data_ptr() != keep.data_ptr():  # (EF21 forms it there: its scratch)
                keep.copy_(flat)
            seg.copy_(C.factor_p(keep.view(1, -1), q.reshape(q.shape[-2:]))[0].reshape(-1))
            if own_overflow(seg):  # sent as it is: every rank's P is then not finite
                local.append(_overflow_message(step, u, "P_i = M_i Q"))
            raise Probed

        # the probe's scratch is the tensor's slice of the held buffer, so that the method
        # forms M_i there (EF21: ∇f_i − g_i) and it stays until the P callback
        adapter.probe(cfg, st, u.slice(step.x), probe, keep)
        held[u.uid] = keep

    if local and state.scaler is not None:
        warnings.warn(local[0], UserWarning, stacklevel=2)
    ready: torch.futures.Future[None] = torch.futures.Future()
    if plan.gathered:  # the ranks' 16-bit factors added in float32 (exchange._summed)
        p_fut = _summed(step, P, 0, None).then(lambda f: [_weigh_raw(step, lay, f.value()[0])])
        q_fut = _summed(step, Q, p_total, None, n, after=ready)
    else:
        p_fut = comm.all_reduce(P)
        q_fut = comm.all_reduce(Q, after=ready)  # reserved now, started by the P callback
    #: per compressed tensor: P̂, the new client state, the Q it carries (filled with Q̄)
    pending: dict[int, tuple[torch.Tensor, Any, torch.Tensor]] = {}
    failed: list[BaseException] = []
    poisoned = [step.bad]
    #: done when the P callback has run to its end: the Q all-reduce starts before (and may
    #: finish before) the P callback's client steps, whose results the Q callback uses
    finished: torch.futures.Future[None] = torch.futures.Future()

    cb = state.callback_adapter
    #: the callback adapter's turn: its client steps run after the previous bucket's (the P
    #: callbacks of two buckets may run at once on gloo's threads, and share its port)
    previous, mine = cb.released, torch.futures.Future[None]()
    cb.released = mine

    def _p_overflow(bad: Any) -> str:
        """The error of a P sum that is not finite from finite inputs (the first span)."""
        if bad is not None and bad.compressor is not None:
            return _overflow_message(step, bad, "P = Σ_i M_i Q")
        name = str(send.dtype).removeprefix("torch.")
        label = "a tensor" if bad is None else bad.label
        return (
            f"the all-reduced sum of {label} (sent uncompressed) overflows {name}'s range "
            "although every rank's gradient is finite; rescale the loss, train in bfloat16 or "
            "float32, or pass a loss scaler (scaler=) to skip such steps"
        )

    def after_p(f: torch.futures.Future[list[torch.Tensor]]) -> None:
        """The P callback: P̂ and Q_i = M_iᵀ P̂ of every compressed tensor from the held M_i,
        into Q, which then starts at once (its transfer overlaps the rest); then (once the
        previous bucket's are done: :func:`_after_turn`) the client steps, whose compressor
        calls take those factors, and the server parts of the uncompressed tensors. Never
        waits; an error is kept for the Q callback, and Q is still sent (NaN when the error
        came first), so that no rank waits for this one."""
        total: torch.Tensor | None = None
        factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            what = "all-gather" if plan.gathered else "all-reduce"
            total = result(f, f"{what} (PowerSGD's P)", rank)
            if poisoned[0] or not bool(torch.isfinite(total).all()):
                # some rank's bucket was not finite (with a loss scaler) or a factor overflowed:
                # so is every result. Without a scaler every input was checked finite, so it is
                # an overflow, and every rank (the same sum) says so
                if not poisoned[0] and state.scaler is None:
                    spans = [(u, lay[u.uid][0], lay[u.uid][1]) for u in plan.units]
                    failed.append(ValueError(_p_overflow(_first_overflow(total, spans))))
                poisoned[0] = True
                Q.fill_(float("nan"))
                total = None
            else:
                for u in plan.compressed:
                    C = u.compressor
                    assert isinstance(C, PowerSGD)
                    p_off, p_len, q_off, q_len = lay[u.uid]
                    m, _ = C.matrix_shape(u.numel)
                    p_hat = C.orthonormal_basis(total[p_off : p_off + p_len].view(m, C.r))
                    q_i = C.factor_q(held[u.uid].view(1, -1), p_hat)  # (1, n, r)
                    if q_i.dtype != send.dtype:  # what is sent is what the client adds
                        q_i = q_i.to(send.dtype).to(q_i.dtype)
                    if own_overflow(q_i):  # not into the client states; every rank's Q̄ of
                        # this tensor (only) is not finite: they skip the step, naming it
                        text = _overflow_message(step, u, "Q_i = M_iᵀ P̂")
                        if state.scaler is None:
                            failed.append(ValueError(text))
                        else:
                            warnings.warn(text, UserWarning, stacklevel=1)
                        poisoned[0] = True
                        Q.zero_()
                        send[q_off : q_off + q_len].copy_(q_i.reshape(-1))
                        total = None
                        break
                    q_seg = send[q_off : q_off + q_len].copy_(q_i.reshape(-1))
                    if not plan.gathered:
                        q_seg.div_(n)
                    factors[u.uid] = (p_hat, q_i)
        except BaseException as e:
            failed.append(e)
            Q.fill_(float("nan"))
            total = None
        ready.set_result(None)  # the Q all-reduce starts (in bucket order: comm's reservation)
        _after_turn(previous, lambda: client_steps(total, factors), mine, finished)

    def client_steps(
        total: torch.Tensor | None, factors: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """The P callback's second part: every tensor's client step (the compressed ones' on
        the factors formed above) and the uncompressed tensors' server parts."""
        if total is None:
            return
        try:
            for u in plan.units:
                st = by_uid[u.uid]
                C = u.compressor
                if C is None:
                    p_off, p_len, _, _ = lay[u.uid]
                    res = total[p_off : p_off + p_len]
                    agg = res if res.dtype == plan.wdtype else step.target(u).copy_(res)
                    _server_part(step, step.config(u), u, st, dense_clients[u.uid], agg)
                    continue
                assert isinstance(C, PowerSGD)
                p_hat, q_i = factors[u.uid]
                dec = plan.work(1, u.numel)
                carried: list[torch.Tensor] = []

                def message(
                    p: torch.Tensor,
                    q: torch.Tensor,
                    C: PowerSGD = C,
                    p_hat: torch.Tensor = p_hat,
                    q_i: torch.Tensor = q_i,
                    dec: torch.Tensor = dec,
                    carried: list[torch.Tensor] = carried,
                ) -> tuple[torch.Tensor, torch.Tensor]:
                    # p is the held M_i again (the method is deterministic): its factors are
                    # those sent; C(M_i) = P̂ Q_iᵀ is handed over as its factors (the method
                    # adds it to its state in one pass) or formed in the work vector
                    carried.append(q)
                    if fuse(C, p.shape[-1], p.dtype, p_hat):
                        return _factored(C, p_hat, q_i, tuple(p.shape)), q  # type: ignore[return-value]
                    c = C.factor_outputs(p_hat, q_i, p.shape[-1], p.dtype, out=dec)
                    return c.view(p.shape), q

                cfg = state.callback_config(u, plan)
                clients, _msg, _ = cb.client_step(
                    cfg, st, u.slice(step.x), None, plan.work(0, u.numel), stateful=message
                )
                pending[u.uid] = (p_hat, clients, carried[0])
        except BaseException as e:
            failed.append(e)

    p_fut.add_done_callback(after_p)

    def after_q(both: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
        """The Q callback (once the P callback has finished too): Q̄, every rank's next Q, and
        the aggregate P̂ Q̄ᵀ for the server parts."""
        what = "all-gather" if plan.gathered else "all-reduce"
        total = result(q_fut, f"{what} (PowerSGD's Q)", rank)  # done (or failed) by now
        if failed:
            raise failed[0]
        out = step.output
        # a rank's Q_i overflowed (it sent its inf), or the sum Q̄ did: one check of the whole
        # sum, then the per-tensor search only when it failed
        if not poisoned[0] and not bool(torch.isfinite(total).all()):
            spans = [(u, lay[u.uid][2] - p_total, lay[u.uid][3]) for u in plan.compressed]
            bad = _first_overflow(total, spans)
            if bad is not None:
                if state.scaler is None:
                    raise ValueError(
                        _overflow_message(step, bad, "Q̄ = Σ_i Q_i / n (a rank's Q_i or the sum)")
                    )
                poisoned[0] = True  # nothing of it becomes the next Q or the server's state
        if poisoned[0]:
            return out.fill_(float("nan"))
        for u in plan.compressed:
            C = u.compressor
            assert isinstance(C, PowerSGD)
            _, _, q_off, q_len = lay[u.uid]
            p_hat, clients, carried = pending[u.uid]
            _, ncols = C.matrix_shape(u.numel)
            q_bar = (
                total[q_off - p_total : q_off - p_total + q_len].view(1, ncols, C.r).to(p_hat.dtype)
            )
            carried.copy_(q_bar.view_as(carried))  # every rank's next Q: the mean Q̄
            target = step.target(u)
            agg: torch.Tensor | LowRankMessage
            if fuse(C, u.numel, target.dtype, p_hat):  # the server adds P̂ Q̄ᵀ in one pass
                agg = _factored(C, p_hat, q_bar, (u.numel,))
            else:
                agg = C.factor_outputs(p_hat, q_bar, u.numel, target.dtype, out=target)[0]
            _server_part(step, step.config(u), u, by_uid[u.uid], clients, agg)
        return out

    return torch.futures.collect_all([q_fut, finished]).then(after_q)
