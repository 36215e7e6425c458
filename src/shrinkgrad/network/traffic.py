"""What each runtime sends: the bytes of every collective and message, from the compressor.

The sizes come from the compressor's honest ``bits`` and its ``collective`` exactly as the
runtimes use them, so the cost model charges what is sent:

* :func:`hook_collectives` — one step of the DDP communication hook
  (:mod:`shrinkgrad.distributed.hooks`), bucket by bucket. Its rules: a tensor with fewer than
  ``min_numel`` entries travels raw; with ``ratio`` a tensor of d entries keeps k = ⌈ratio·d⌉;
  a compressor whose results are summable (``collective == "allreduce"``) is all-reduced as the
  dense bucket; a fixed-size sparsifier with a shared seed all-reduces its k values only;
  anything else is encoded (⌈bits(d)/8⌉ bytes per tensor) and all-gathered with the raw small
  tensors in front; variable-size messages (bernoulli) first all-gather their sizes (one int64)
  and then a block holding one int32 size per tensor and the payloads, padded to the largest
  rank's block; with a loss scaler every all-gathered block ends with one flag byte; a bucket
  with nothing to compress is a plain all-reduce; the warm-up steps all-reduce the dense bucket;
  PowerSGD's shared basis (``power_sgd[shared=true]``, ``collective == "allreduce_factors"``)
  all-reduces the raw small tensors with the P factors (m × r each), then the Q factors
  (n × r), r(m + n) values per tensor of the matrix view ``shapes`` gives.
* :func:`wire_bytes` — the bytes on the wire of the simulator's messages: ⌈bits/8⌉ for a
  message of ``bits`` bits (the wire format pads every message to a whole byte);
* :func:`stage_shares` — how a compressed message of the simulator travels: in one exchange, or
  (PowerSGD's shared basis) in two, P then Q, the shares m/(m + n) and n/(m + n);
* :func:`ps_messages` — one cycle of a parameter-server worker
  (:mod:`shrinkgrad.distributed.ps.wire`): the model down (header + d values), the header and
  the encoded gradient up.

``bytes`` here are what a rank hands to the collective as its own message — what the hook
counts in ``CompressionState.last_step_bytes``; the time of the collective (which moves more
than that through the network) is the network's business (:mod:`.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

    from ..compressors import Compressor
    from ..methods.base import Method, Traffic

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveKind",
    "PSMessages",
    "hook_collectives",
    "ps_messages",
    "round_stages",
    "round_summable",
    "stage_shares",
    "summable",
    "wire_bytes",
]

#: a synchronous collective among all ranks
CollectiveKind = Literal["allreduce", "allgather"]
#: the kinds a :class:`Collective` may have (the network costs each its own way)
COLLECTIVE_KINDS: tuple[str, ...] = ("allreduce", "allgather")


def _is_int(n: object) -> bool:
    """An integer, Python's or numpy's (bools are not)."""
    return not isinstance(n, (bool, np.bool_)) and isinstance(n, (int, np.integer))


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective: its kind, and the bytes each rank hands to it (the all-reduced buffer,
    or its own all-gather block).

    A kind other than :data:`COLLECTIVE_KINDS`, or a byte count that is not a finite number
    ≥ 0, is a one-line ValueError here (a network would otherwise cost it as something else).
    """

    kind: CollectiveKind
    nbytes: int
    what: str = ""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(
                f"Collective kind must be one of {', '.join(COLLECTIVE_KINDS)}, got {self.kind!r}"
            )
        n = self.nbytes
        number = not isinstance(n, (bool, np.bool_)) and isinstance(
            n, (int, float, np.integer, np.floating)
        )
        if not (number and math.isfinite(n) and n >= 0):
            raise ValueError(f"Collective nbytes must be a finite number of bytes >= 0, got {n!r}")


@dataclasses.dataclass(frozen=True)
class PSMessages:
    """Bytes of a parameter-server worker's messages in one cycle: ``down`` (server → worker)
    and ``up`` (worker → server), one entry per point-to-point send."""

    down: tuple[int, ...]
    up: tuple[int, ...]


def _factor_shared(compressor: Compressor) -> bool:
    """PowerSGD's shared basis (``collective == "allreduce_factors"`` with ``shared``): its
    factors are summed stage by stage; per-client PowerSGD's are each client's own."""
    return compressor.collective == "allreduce_factors" and bool(
        getattr(compressor, "shared", False)
    )


def summable(compressor: Compressor) -> bool:
    """Whether ranks can sum their messages with all-reduces (dense results, the k values of a
    shared-seed sparsifier, or PowerSGD's shared-basis factors P then Q:
    :func:`stage_shares`) instead of all-gathering them. Per-client PowerSGD is not: each
    client's factors are its own and do not add up (:func:`.hooks.config.factor_refusal`)."""
    return (
        compressor.collective == "allreduce"
        or bool(getattr(compressor, "shared_seed", False))
        or _factor_shared(compressor)
    )


def stage_shares(compressor: Compressor, d: int) -> tuple[float, ...]:
    """The shares of one compressed message of a d-vector that travel in successive,
    synchronous exchanges: ``(1.0,)`` (one exchange) for every compressor but PowerSGD's shared
    basis, whose message is r(m + n) values sent in two stages, P (m × r) summed, then — once
    every rank has P̂ = orthonormalize(ΣP_i) — Q (n × r) summed:
    ``(m/(m + n), n/(m + n))`` for the m × n view of a d-vector
    (:meth:`shrinkgrad.compressors.lowrank.PowerSGD.factor_collective`, the same two
    all-reduces :func:`hook_collectives` charges the DDP hook)."""
    if not _factor_shared(compressor):
        return (1.0,)
    plan = compressor.factor_collective(int(d))  # type: ignore[attr-defined]
    sizes = [math.prod(stage.shape) for stage in plan.stages]
    total = sum(sizes)
    return tuple(s / total for s in sizes)


def wire_bytes(bits: Any) -> np.ndarray:
    """Bytes on the wire of messages of ``bits`` bits each: ⌈bits/8⌉ (float64, ``bits``'
    shape; a tensor, an array or a list).

    The wire format (:mod:`shrinkgrad.compressors._wire`) writes a message's fields into one bit
    stream padded with zero bits to a whole byte, so a message of b bits is ⌈b/8⌉ bytes — what
    ``encode`` returns, what the DDP hook counts (:func:`hook_collectives`) and what the
    parameter server sends (:func:`ps_messages`). Each entry of a simulated round's
    :class:`~shrinkgrad.methods.Traffic` is one message (a client's, in that round), so the
    network model charges ⌈up_i/8⌉ and ⌈down_i/8⌉ bytes, not up_i/8: top_k[k=1] on d = 123
    is 32 + 7 = 39 bits, 5 bytes on the wire (4.875 before). 0 bits (nothing sent) is 0
    bytes.
    """
    if hasattr(bits, "detach"):  # a torch tensor
        bits = bits.detach().cpu().numpy()
    b = np.asarray(bits, dtype=np.float64)
    return np.ceil(b / 8.0)


def round_summable(traffic: Traffic, compressed: bool) -> bool:
    """Whether one round's messages can be all-reduced: those of a run whose compressed
    messages are (``compressed``: :func:`summable` of its compressor), or a round of
    uncompressed vectors (:class:`~shrinkgrad.methods.DenseTraffic`: EF21's, DIANA's and the
    IAG's full initialisation), whatever the compressor."""
    from ..methods.base import DenseTraffic

    return compressed or isinstance(traffic, DenseTraffic)


def round_stages(traffic: Traffic, stages: tuple[float, ...]) -> tuple[float, ...]:
    """The stages of one round's messages (:func:`stage_shares`): those of the run's compressed
    messages (``stages``), or one for a round of uncompressed vectors
    (:class:`~shrinkgrad.methods.DenseTraffic`, summed in one all-reduce)."""
    from ..methods.base import DenseTraffic

    return (1.0,) if isinstance(traffic, DenseTraffic) else stages


def _buckets(tensors: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """``tensors`` as a list of buckets (a flat list of sizes is one bucket)."""
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence) or not tensors:
        raise ValueError(
            "tensors must be a non-empty list of tensor sizes (numel), e.g. [p.numel() for p in "
            "model.parameters()], or a list of such lists (one per DDP bucket)"
        )
    nested = [isinstance(t, Sequence) for t in tensors]
    if all(nested):
        out = [list(b) for b in tensors]  # type: ignore[arg-type]
    elif not any(nested):
        out = [list(tensors)]  # type: ignore[arg-type]
    else:
        raise ValueError("tensors mixes sizes and lists of sizes; give one form")
    for b in out:
        if not b:
            raise ValueError("a bucket of tensors is empty")
        for i, n in enumerate(b):
            if not _is_int(n) or n < 1:
                raise ValueError(f"a tensor size must be an integer >= 1, got {n!r}")
            b[i] = int(n)  # numpy integers (e.g. from np.prod) are sizes too
    return out


def _float_dtype(dtype: object, default: str, what: str) -> torch.dtype:
    """``dtype`` (None: torch's ``default``) when it is a floating-point torch dtype, else a
    one-line ValueError naming ``what`` (gradients and wire values are floats)."""
    import torch

    dt = getattr(torch, default) if dtype is None else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(
            f"{what} must be a floating-point torch dtype (torch.float32, torch.float16, "
            f"torch.bfloat16, torch.float64), got {dtype!r}"
        )
    return dt


def _float_bits(dtype: torch.dtype) -> int:
    import torch

    return int(torch.finfo(dtype).bits)


def _shapes(
    buckets: list[list[int]], shapes: Sequence[Sequence[Sequence[int]]] | None
) -> list[list[tuple[int, ...]]]:
    """The tensors' shapes bucket by bucket (vectors by default), checked against the sizes."""
    if shapes is None:
        return [[(n,) for n in b] for b in buckets]
    out = [[tuple(int(v) for v in s) for s in b] for b in shapes]
    if [len(b) for b in out] != [len(b) for b in buckets] or any(
        math.prod(s) != n
        for sb, nb in zip(out, buckets, strict=True)
        for s, n in zip(sb, nb, strict=True)
    ):
        raise ValueError(
            "shapes must give one shape per tensor, bucket by bucket, with as many entries as "
            "the tensor sizes say (e.g. shapes=[[tuple(p.shape) for p in bucket_params]])"
        )
    return out


def _view(C: Compressor, shape: tuple[int, ...]) -> Compressor:
    """A low-rank compressor bound to a tensor's matrix view, as the hook binds it."""
    for_shape = getattr(C, "for_shape", None)
    if callable(for_shape) and len(shape) >= 2:
        bound = for_shape(shape)
        assert isinstance(bound, type(C))
        return bound
    return C


def _per_tensor(compressor: str | Compressor, numel: int, ratio: float | None) -> Compressor:
    """The compressor of one tensor: ``compressor`` built, or with ``ratio`` k = ⌈ratio·numel⌉
    set where the hook sets it (:mod:`shrinkgrad.compressors.ratio`)."""
    from ..compressors import COMPRESSORS, make_compressor
    from ..compressors.ratio import ratio_spec, with_k

    if ratio is None:
        return make_compressor(compressor)
    text = compressor if isinstance(compressor, str) else compressor.name
    k = min(numel, max(1, math.ceil(ratio * numel)))
    return COMPRESSORS.make(with_k(ratio_spec(text, ratio), k))


def hook_collectives(
    compressor: str | Compressor,
    tensors: Sequence[int] | Sequence[Sequence[int]],
    *,
    ratio: float | None = None,
    min_numel: int = 1024,
    dtype: torch.dtype | None = None,
    warmup: bool = False,
    scaler: bool = False,
    shapes: Sequence[Sequence[Sequence[int]]] | None = None,
    granularity: str = "tensor",
    state_dtype: str = "float32",
    method: str | Method[Any, Any] | None = None,
    summation: str = "auto",
) -> list[Collective]:
    """The collectives of one step of :func:`~shrinkgrad.distributed.compression_hook`.

    ``tensors``: the gradients' sizes (numel), one bucket, or a list of buckets as DDP forms
    them; ``shapes``: the tensors' shapes, bucket by bucket (a list of lists of shapes), for
    the matrix views of the low-rank compressors (default: every tensor a vector, the flat
    rule); ``compressor``, ``ratio``, ``min_numel`` as given to ``CompressionState``; ``dtype``
    the gradients' (float32 by default); ``warmup`` for a warm-up step (dense all-reduce);
    ``state_dtype`` as given to ``CompressionState`` (a warm-up step of 16-bit gradients
    all-reduces in float32 with the default float32 memory, in the 16-bit dtype with
    ``"gradient"``: docs/distributed.md, bfloat16 and float16 models);
    ``scaler`` when a loss scaler is attached (one flag byte per all-gathered block);
    ``granularity="bucket"`` as given to ``CompressionState``: every bucket one flat vector of
    its total size (vector compressors only, as in the hook); ``method`` (default
    ``dcgd[biased=true]``, the hook's) and ``summation`` as given to ``CompressionState``: where
    the hook all-gathers the summed rounds and adds them in float32
    (:func:`~shrinkgrad.distributed.hooks.config.gathers_sums`: by default 16-bit gradients with
    a float32 memory and a method that accumulates its aggregates, EF21 and DIANA), each
    all-reduce of a compressed step is an all-gather of the same per-rank bytes. The sum of
    the ``nbytes`` equals the hook's ``last_step_bytes`` for fixed-size messages; for
    variable-size ones (bernoulli) the block holds the expected payload (the hook pads to the
    largest rank's actual one).
    """
    dt = _float_dtype(dtype, "float32", "dtype")
    esize = _float_bits(dt) // 8
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0.0 < float(ratio) <= 1.0):
        raise ValueError(f"ratio must be a number in (0, 1] (e.g. 0.01 for 1%), got {ratio!r}")
    template = _per_tensor(compressor, 1, ratio)  # (with a ratio: k = 1, per tensor below)
    from ..distributed.hooks.config import (
        STATE_DTYPES,
        SUMMATIONS,
        factor_refusal,
        gathers_sums,
        granularity_refusal,
        resolve_method,
    )

    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be one of {', '.join(STATE_DTYPES)} (as given to "
            f"CompressionState), got {state_dtype!r}"
        )
    if summation not in SUMMATIONS:
        raise ValueError(
            f"summation must be one of {', '.join(SUMMATIONS)} (as given to CompressionState), "
            f"got {summation!r}"
        )
    half = _float_bits(dt) == 16
    warm_size = 4 if half and state_dtype == "float32" else esize
    import torch

    wdtype = torch.float32 if half and state_dtype == "float32" else dt
    gathered = gathers_sums(summation, dt, wdtype, resolve_method(method, None, 0.0, 1))
    summed: CollectiveKind = "allgather" if gathered else "allreduce"  # the summed rounds
    how = " (all-gathered, added in float32)" if gathered else ""

    refusal = factor_refusal(template)  # the hook refuses it: no traffic to model
    if refusal is not None:
        raise ValueError(refusal)
    refusal = granularity_refusal(template, granularity)
    if refusal is not None:
        raise ValueError(refusal)
    buckets = _buckets(tensors)
    if granularity == "bucket":
        buckets = [[sum(bucket)] for bucket in buckets]
        shapes = None
    views = _shapes(buckets, shapes)
    out: list[Collective] = []
    for b, bucket in enumerate(buckets):
        dense = sum(bucket) * esize
        if warmup:
            out.append(
                Collective(
                    "allreduce", sum(bucket) * warm_size, f"bucket {b}: warm-up (dense all-reduce)"
                )
            )
            continue
        comps = [
            _view(_per_tensor(compressor, n, ratio), shape) if n >= max(min_numel, 1) else None
            for n, shape in zip(bucket, views[b], strict=True)
        ]
        if all(C is None for C in comps):
            out.append(Collective(summed, dense, f"bucket {b}: nothing to compress{how}"))
            continue
        if template.collective == "allreduce":
            out.append(Collective(summed, dense, f"bucket {b}: summable dense results{how}"))
            continue
        raw = sum(n * esize for n, C in zip(bucket, comps, strict=True) if C is None)
        if template.collective == "allreduce_factors":  # PowerSGD's shared basis: P, then Q
            p_bytes = q_bytes = 0
            for n, C in zip(bucket, comps, strict=True):
                if C is not None:
                    plan = C.factor_collective(n, dt)  # type: ignore[attr-defined]
                    p_stage, q_stage = plan.stages
                    p_bytes += math.prod(p_stage.shape) * esize
                    q_bytes += math.prod(q_stage.shape) * esize
            out.append(Collective(summed, raw + p_bytes, f"bucket {b}: raw values and P{how}"))
            out.append(Collective(summed, q_bytes, f"bucket {b}: Q (after P){how}"))
            continue
        if getattr(template, "shared_seed", False):
            values = 0
            for n, C in zip(bucket, comps, strict=True):
                if C is not None:
                    k = C.sparse_k(n)
                    if k is None:
                        raise ValueError(
                            f"{C.name}: shared_seed=true needs a fixed-size sparsifier (rand_k)"
                        )
                    values += k * esize
            out.append(Collective(summed, raw + values, f"bucket {b}: shared-seed values{how}"))
            continue
        payload = 0
        for n, C in zip(bucket, comps, strict=True):
            if C is not None:
                try:
                    payload += math.ceil(C.bits(n, dt) / 8)
                except ValueError as e:
                    raise ValueError(
                        f"cannot compress a tensor of {n} entries with {C.name}: {e}"
                    ) from None
        flag = 1 if scaler else 0
        if template.variable_size:
            m = sum(C is not None for C in comps)
            out.append(Collective("allgather", 8, f"bucket {b}: message sizes"))
            block = raw + 4 * m + payload + flag
            out.append(Collective("allgather", block, f"bucket {b}: padded packed payloads"))
        else:
            block = raw + payload + flag
            out.append(Collective("allgather", block, f"bucket {b}: packed payloads"))
    return out


def ps_messages(
    compressor: str | Compressor,
    d: int,
    *,
    dtype: torch.dtype | None = None,
    wire_dtype: torch.dtype | None = None,
    dense: bool = False,
) -> PSMessages:
    """The messages of one worker cycle of the parameter server (:mod:`...distributed.ps`).

    Down: one message of the 32-byte header and the d model values in the run ``dtype``
    (float64 by default). Up: the reply header (``REPLY_WORDS`` int64 words), then the payload:
    ``C.encode(v)`` of ⌈bits(d, wire_dtype)/8⌉ bytes (wire dtype float32 by default), or the d
    values in the wire dtype for a method's ``dense`` message; an empty payload is not sent.
    """

    from ..compressors import make_compressor
    from ..distributed.ps.wire import HEADER_BYTES, REPLY_WORDS

    if not _is_int(d) or d < 1:
        raise ValueError(f"d must be an integer >= 1, got {d!r}")
    d = int(d)
    dt = _float_dtype(dtype, "float64", "dtype")
    wire = _float_dtype(wire_dtype, "float32", "wire_dtype")
    if dense:
        payload = d * (_float_bits(wire) // 8)
    else:
        payload = math.ceil(make_compressor(compressor).bits(d, wire) / 8)
    down = HEADER_BYTES + d * (_float_bits(dt) // 8)
    header = 8 * REPLY_WORDS
    return PSMessages((down,), (header, payload) if payload else (header,))
