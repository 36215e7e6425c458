"""Encoders: what ``cfg.compress`` does for the tensor being processed, one per path.

An encoder ``encode(p, sent_only)`` puts the message of C(p) on the wire (into its slot of the
plan's send buffer, or a payload tensor) and returns what the method sees as C(p):

* exactly what the other ranks will decode — on a 16-bit wire the values rounded to the
  gradient's dtype — so that the method's memory (EF21's g_i, EF's e_i) stays consistent with
  what was sent;
* in the method's dtype (float32 for 16-bit gradients by default);
* for a unit whose messages are sparse (:attr:`.plan.Unit.sparse`) a
  :class:`~shrinkgrad.methods.rules.SparseMessage`, never a dense compressed tensor;
* ``p`` itself when the method only sends the result (``sent_only``, DCGD).

The packed-payload and shared-seed encoders (:class:`PayloadEncoder`, :func:`values_encoder`)
also take ``p`` in the bucket's 16-bit dtype (the bfloat16 gradient the port hands them in
place of the method's unfilled float32 copy, :meth:`.adapter.Port.open`): the compressor then
reads it itself, and what they return is still in the method's dtype (their ``dec``'s).

Nothing here is a method's arithmetic: C is the compressor's, the rounding is the wire's.
"""

from __future__ import annotations

import torch

from ...compressors import Compressor
from ...methods.rules import SparseMessage
from ...rng import Keys
from .adapter import Encoder
from .config import HALF

__all__ = [
    "PayloadEncoder",
    "decode",
    "dense_encoder",
    "encode",
    "fresh_encoder",
    "raw_encoder",
    "sparse_form",
    "values_encoder",
]


def encode(
    C: Compressor, p: torch.Tensor, keys: Keys | None, out: torch.Tensor | None, wire: torch.dtype
) -> torch.Tensor:
    """C's payload of ``p`` with its values in ``wire`` (the gradients' dtype)."""
    return C.encode(_on_wire(p.reshape(-1), wire), keys, out=out)


def decode(
    C: Compressor,
    payload: torch.Tensor,
    d: int,
    wire: torch.dtype,
    keys: Keys | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The dense message of ``payload`` (values in ``wire``) in ``out``'s dtype, into ``out``."""
    if out.dtype == wire:
        return C.decode(payload, d, wire, keys, out=out)
    return out.copy_(C.decode(payload, d, wire, keys))


def sparse_form(
    C: Compressor, p: torch.Tensor, keys: Keys | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of C(p) without a dense compressed tensor (``C.sparse``)."""
    flat = p.reshape(-1)
    sparse = getattr(C, "sparse", None)
    if callable(sparse):
        idx, vals = sparse(flat, keys)
        return idx.reshape(-1), vals.reshape(-1)
    payload = C.encode(flat, keys)  # compressors without a sparse form: O(k) round trip
    return C.decode_sparse(payload, flat.numel(), flat.dtype, keys)


def _rounded(values: torch.Tensor, wire: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as the receivers see them (rounded to ``wire``), in ``dtype``."""
    if wire == values.dtype:
        return values if values.dtype == dtype else values.to(dtype)
    return values.to(wire).to(dtype)


def fresh_encoder(C: Compressor, keys: Keys | None) -> Encoder:
    """C(p) as a new tensor (the initialisation: its message travels dense)."""

    def enc(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        return C(p, keys)

    return enc


def dense_encoder(
    C: Compressor, keys: Keys | None, seg: torch.Tensor, dec: torch.Tensor
) -> Encoder:
    """Summable dense results: C(p) goes into ``seg`` (the wire's dtype); returns ``seg`` itself
    when the method computes in that dtype, else the rounded values in ``dec``."""

    def enc(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        if seg.dtype == p.dtype:
            return C(p, keys, out=seg.view(p.shape))
        c = C(p, keys, out=dec.view(p.shape))
        seg.copy_(c.reshape(-1))
        return dec.copy_(seg).view(p.shape)

    return enc


def raw_encoder(slot: torch.Tensor, wire: torch.dtype, dec: torch.Tensor) -> Encoder:
    """An uncompressed tensor in an all-gather block: its raw values (in ``wire``) go into the
    byte ``slot``; returns them in the method's dtype."""

    def enc(p: torch.Tensor, sent_only: bool) -> torch.Tensor:
        v = slot.view(wire)
        v.copy_(p.reshape(-1))
        if wire == p.dtype:
            return v.view(p.shape)
        return dec.copy_(v).view(p.shape)

    return enc


def values_encoder(
    C: Compressor,
    keys: Keys | None,
    seg: torch.Tensor,
    dec: torch.Tensor,
    sparse: bool,
    drawn: dict[int, torch.Tensor],
    uid: int,
) -> Encoder:
    """Shared-seed sparsifiers: the payload is the k values (every rank draws the same
    indices), written into ``seg`` in the wire's dtype; the indices are kept in ``drawn`` for the
    receive side. Returns C(p) as a SparseMessage (``sparse``) or dense in ``dec``."""

    def enc(p: torch.Tensor, sent_only: bool) -> torch.Tensor | SparseMessage:
        idx, vals = sparse_form(C, p, keys)
        if idx.numel() != seg.numel():
            raise RuntimeError(
                f"{C.name} kept {idx.numel()} values for {seg.numel()} slots: with "
                "shared_seed=true a message must be the k values only"
            )
        seg.copy_(vals)
        drawn[uid] = idx
        if sent_only:
            return p
        got = _rounded(vals, seg.dtype, dec.dtype)
        if sparse:
            return SparseMessage(idx, got, tuple(p.shape))
        out = dec.zero_()
        out.index_add_(0, idx, got)
        return out.view(p.shape)

    return enc


class PayloadEncoder:
    """Packed payloads: encoded into ``dest`` (fixed-size messages: their slot of the send
    buffer) or a new tensor, and put into ``box``; returns C(p) as the receivers decode it: a
    SparseMessage of its (index, value) pairs (``sparse``: O(k)), or dense in ``dec``.

    On the sparse path the message is encoded from C's sparse form (``C.encode_pairs``), whose
    pairs, rounded to the wire's dtype, are what the receivers decode: the own payload is not
    decoded again. :meth:`difference` gives C(a − b) from C's fused selection
    (``C.sparse_difference``: Top-k never forms a − b) for EF21's update."""

    def __init__(
        self,
        C: Compressor,
        keys: Keys | None,
        box: list[torch.Tensor],
        dest: torch.Tensor | None,
        dec: torch.Tensor,
        wire: torch.dtype,
        sparse: bool,
    ) -> None:
        self.C, self.keys, self.box, self.dest, self.dec = C, keys, box, dest, dec
        self.wire, self.sparse = wire, sparse
        self.pairs = sparse and C.encodes_pairs
        self.dtype = dec.dtype  # the method's

    def __call__(self, p: torch.Tensor, sent_only: bool) -> torch.Tensor | SparseMessage:
        C, keys, wire = self.C, self.keys, self.wire
        d = p.numel()
        if self.pairs:
            idx, vals = sparse_form(C, _on_wire(p.reshape(-1), wire), keys)
            return self._pairs(idx, vals, d, tuple(p.shape), self.dtype, sent_only, p)
        payload = encode(C, p, keys, self.dest, wire)
        self.box.append(payload)
        if sent_only:
            return p
        if self.sparse:
            idx, vals = C.decode_sparse(payload, d, wire, keys)
            return SparseMessage(idx, _rounded(vals, wire, self.dtype), tuple(p.shape))
        return decode(C, payload, d, wire, keys, self.dec).view(p.shape)

    def difference(self, a: torch.Tensor, b: torch.Tensor) -> SparseMessage | None:
        """C(a − b) (a − b rounded to a 16-bit wire's dtype first, as :func:`encode` rounds
        its input), or None where C has no pair encoding (then the method forms a − b). ``b``
        is in the method's dtype; ``a`` too, or the 16-bit gradient (a − b is then that of
        ``a`` widened, exactly: ``C.sparse_difference``)."""
        if not self.pairs:
            return None
        a1, b1 = a.reshape(-1), b.reshape(-1)
        rounding = self.wire if self.wire in HALF and b.dtype != self.wire else None
        idx, vals = self.C.sparse_difference(a1, b1, self.keys, dtype=rounding)
        msg = self._pairs(idx, vals, a1.numel(), tuple(a.shape), b.dtype, False, a)
        assert isinstance(msg, SparseMessage)
        return msg

    def _pairs(
        self,
        idx: torch.Tensor,
        vals: torch.Tensor,
        d: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        sent_only: bool,
        p: torch.Tensor,
    ) -> torch.Tensor | SparseMessage:
        idx, vals = idx.reshape(-1), vals.reshape(-1)
        self.box.append(self.C.encode_pairs(idx, vals, d, out=self.dest))
        if sent_only:
            return p
        return SparseMessage(idx, _rounded(vals, self.wire, dtype), shape)


def _on_wire(flat: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """The compressor's input for a 16-bit wire: ``flat`` rounded to the wire's dtype (float32
    arithmetic inside the compressor, 16-bit values)."""
    return flat.to(wire) if wire in HALF and flat.dtype != wire else flat
