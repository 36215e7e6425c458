"""Bit-level wire format shared by every compressor's ``encode`` / ``decode``.

A message is a sequence of *fields*: ``count`` unsigned integers of ``width`` bits each, written
least-significant bit first into one contiguous bit stream (no padding between fields), then
padded with zero bits to a whole byte. Floats travel as their IEEE bit patterns (32 bits for
float32, two 32-bit words, low then high, for float64). The payload of a message of ``b`` bits is
therefore exactly ``⌈b/8⌉`` bytes, which the contract tests check against ``bits(d)``.

Two implementations of the same format:

* CPU: numba kernels (:func:`pack_bits`, :func:`unpack_bits`) write the fields straight into
  one preallocated ``uint8`` payload (one pass; 32-bit fields on a byte boundary are a memcpy).
  Compressors with a per-coordinate code (QSGD, TernGrad, natural compression, natural
  dithering, scaled sign) add their big field as a *block* (:meth:`BitWriter.add_block`): a
  kernel of :mod:`._codec` computes the codes chunk by chunk and packs them in the same pass, so
  no d-sized intermediate exists; decoding reads such a block back with :meth:`BitReader.block`.
* any other device: plain torch (one boolean per bit), so the format is the same on CUDA.

The tests compare both with a straightforward reference bit packer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "HALF_DTYPES",
    "WIRE_DTYPES",
    "BitReader",
    "BitWriter",
    "float_width",
    "pack_bits",
    "paper_width",
    "scalar_width",
    "shift_bits",
    "unpack_bits",
]

_MASK32 = 0xFFFFFFFF
_LITTLE = sys.byteorder == "little"
_U8 = np.uint64(8)
_U255 = np.uint64(255)


#: 16-bit floating dtypes: compressed in float32 arithmetic, their values sent in 16 bits
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: every dtype a message can carry its values in
WIRE_DTYPES = (torch.float32, torch.float64, *HALF_DTYPES)


def float_width(dtype: torch.dtype) -> int:
    """Bits of one *value* of ``dtype`` on the wire (16 for bfloat16 and float16)."""
    return torch.finfo(dtype).bits


def scalar_width(dtype: torch.dtype) -> int:
    """Bits of one per-message *scalar* (a norm, a scale) of a message for ``dtype`` inputs.

    16-bit inputs are compressed in float32 arithmetic (norms and thresholds in float32), so a
    scalar travels as float32: 32 bits; otherwise the dtype's width (32 or 64)."""
    return max(32, torch.finfo(dtype).bits)


def paper_width(dtype: torch.dtype) -> int:
    """Bits per sent float in the papers' convention: 32, or 16 when the wire carries 16-bit
    values (a float64 simulation still counts 32, as the papers' float32 codes do)."""
    return 16 if dtype in HALF_DTYPES else 32


# --------------------------------------------------------------------------------------------
# whole little-endian words at any byte of a payload
# --------------------------------------------------------------------------------------------
def _word_access(bits: int, store: bool) -> Any:
    """An intrinsic that loads (``f(buf, q)``) or stores (``f(buf, q, v)``) the ``bits``-bit
    little-endian word at byte ``q`` of a contiguous ``uint8`` array: one unaligned load or
    store (byte-swapped on a big-endian host), where a loop of single bytes, shifted and
    or-ed, is what numba compiles otherwise (LLVM does not merge them: 15× slower for a
    message's float32 values). No bounds check: the caller's, as for the byte loops they
    replace."""
    nptype: Any = {16: types.uint16, 32: types.uint32, 64: types.uint64}[bits]

    def typer(typingctx: Any, buf: Any, q: Any, *v: Any) -> Any:
        if not (
            isinstance(buf, types.Array)
            and buf.dtype == types.uint8
            and buf.ndim == 1
            and buf.layout == "C"
            and isinstance(q, types.Integer)
            and len(v) == int(store)
        ):
            return None
        sig = types.void(buf, q, nptype) if store else nptype(buf, q)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            pos = context.cast(builder, args[1], signature.args[1], types.intp)
            ptr = builder.bitcast(builder.gep(arr.data, [pos]), ir.IntType(bits).as_pointer())
            if store:
                word = context.cast(builder, args[2], signature.args[2], nptype)
                builder.store(word if _LITTLE else builder.bswap(word), ptr, align=1)
                return context.get_dummy_value()
            word = builder.load(ptr, align=1)
            return word if _LITTLE else builder.bswap(word)

        return sig, codegen

    if store:

        def put(typingctx: Any, buf: Any, q: Any, v: Any) -> Any:
            return typer(typingctx, buf, q, v)

        return intrinsic(put)

    def get(typingctx: Any, buf: Any, q: Any) -> Any:
        return typer(typingctx, buf, q)

    return intrinsic(get)


_u16_at = _word_access(16, False)
_u32_at = _word_access(32, False)
_u64_at = _word_access(64, False)
_put_u32 = _word_access(32, True)
_put_u64 = _word_access(64, True)
_LOW32 = np.uint64(_MASK32)
_U32 = np.uint64(32)


# --------------------------------------------------------------------------------------------
# CPU kernels
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def pack_bits(  # pragma: no cover - compiled
    codes: np.ndarray, width: int, out: np.ndarray, bitpos: int
) -> None:
    """Write ``codes`` (``uint32``, each < 2^width, 1 ≤ width ≤ 32) as ``width``-bit fields
    into the ``uint8`` array ``out`` from bit ``bitpos`` on, least-significant bit first.

    The bits of the first byte below ``bitpos`` are kept (an earlier field), the bits after the
    last field in its byte are zeroed, every byte in between is overwritten. On a byte boundary
    fields of ≤ 16 bits go 8 at a time: 8 codes fill exactly ``width`` bytes, assembled in two
    64-bit words."""
    n = codes.size
    if n == 0:
        return
    o = bitpos >> 3
    nb = bitpos & 7
    mask = np.uint64((1 << width) - 1)
    i = 0
    if nb == 0 and width <= 16:
        for q in range(n // 8):
            lo = np.uint64(0)
            hi = np.uint64(0)
            for t in range(8):
                c = np.uint64(codes[8 * q + t]) & mask
                sh = t * width
                if sh < 64:
                    lo |= c << np.uint64(sh)
                    if sh + width > 64:
                        hi |= c >> np.uint64(64 - sh)
                else:
                    hi |= c << np.uint64(sh - 64)
            if width >= 8:  # the group's first 8 bytes as one word
                _put_u64(out, o, lo)
            else:
                for b in range(width):
                    out[o + b] = np.uint8((lo >> np.uint64(8 * b)) & _U255)
            if width == 16:
                _put_u64(out, o + 8, hi)
            else:
                for b in range(8, width):
                    out[o + b] = np.uint8((hi >> np.uint64(8 * (b - 8))) & _U255)
            o += width
        i = (n // 8) * 8
    # the pending bits in a 64-bit accumulator (fewer than 32 before each field, so a field
    # of ≤ 32 bits fits), written out as a whole 32-bit word whenever one is complete
    acc = np.uint64(out[o]) & np.uint64((1 << nb) - 1)
    for j in range(i, n):
        acc |= (np.uint64(codes[j]) & mask) << np.uint64(nb)
        nb += width
        if nb >= 32:
            _put_u32(out, o, np.uint32(acc & _LOW32))
            o += 4
            acc >>= _U32
            nb -= 32
    while nb >= 8:
        out[o] = np.uint8(acc & _U255)
        o += 1
        acc >>= _U8
        nb -= 8
    if nb > 0:
        out[o] = np.uint8(acc & _U255)


@njit(cache=True)
def _unpack_within4(  # pragma: no cover - compiled
    payload: np.ndarray, o: int, nb: int, width: int, codes: np.ndarray
) -> None:
    """Fields of ``width`` ≤ 25 bits from bit ``nb`` of byte ``o`` on, each read from the four
    bytes starting at its first byte (all of which exist)."""
    mask = np.uint32((1 << width) - 1)
    for j in range(codes.size):
        bit = nb + j * width
        codes[j] = (_u32_at(payload, o + (bit >> 3)) >> np.uint32(bit & 7)) & mask


@njit(cache=True)
def _unpack_within8(  # pragma: no cover - compiled
    payload: np.ndarray, o: int, nb: int, width: int, codes: np.ndarray
) -> None:
    """Fields of ``width`` ≤ 32 bits from bit ``nb`` of byte ``o`` on, each read from the eight
    bytes starting at its first byte (all of which exist)."""
    mask = np.uint64((1 << width) - 1)
    for j in range(codes.size):
        bit = nb + j * width
        codes[j] = np.uint32((_u64_at(payload, o + (bit >> 3)) >> np.uint64(bit & 7)) & mask)


@njit(cache=True, nogil=True)
def unpack_bits(  # pragma: no cover - compiled
    payload: np.ndarray, bitpos: int, width: int, codes: np.ndarray
) -> None:
    """Read ``codes.size`` fields of ``width`` bits from bit ``bitpos`` of ``payload`` into the
    ``uint32`` array ``codes`` (the inverse of :func:`pack_bits`; reads no byte beyond the last
    field)."""
    n = codes.size
    if n == 0:
        return
    o = bitpos >> 3
    nb = bitpos & 7
    mask = np.uint64((1 << width) - 1)
    i = 0
    if nb == 0 and width <= 16:
        for q in range(n // 8):
            lo = np.uint64(0)
            hi = np.uint64(0)
            if width >= 8:  # the group's first 8 bytes as one word
                lo = _u64_at(payload, o)
            else:
                for b in range(width):
                    lo |= np.uint64(payload[o + b]) << np.uint64(8 * b)
            if width == 16:
                hi = _u64_at(payload, o + 8)
            else:
                for b in range(8, width):
                    hi |= np.uint64(payload[o + b]) << np.uint64(8 * (b - 8))
            for t in range(8):
                sh = t * width
                if sh < 64:
                    c = lo >> np.uint64(sh)
                    if sh + width > 64:
                        c |= hi << np.uint64(64 - sh)
                else:
                    c = hi >> np.uint64(sh - 64)
                codes[8 * q + t] = np.uint32(c & mask)
            o += width
        i = (n // 8) * 8
        if i == n:
            return
    else:
        # every field lies within the 4 (width ≤ 25) or 8 bytes from its first one: one
        # independent word load each, no carried accumulator (the fields whose bytes all
        # exist; the rest below)
        span = 4 if width <= 25 else 8
        i = max(0, min(n, ((payload.size - span - o) * 8 - nb) // width + 1))
        if span == 4:
            _unpack_within4(payload, o, nb, width, codes[:i])
        else:
            _unpack_within8(payload, o, nb, width, codes[:i])
        if i == n:
            return
        bit = nb + i * width
        o += bit >> 3
        nb = bit & 7
    acc = np.uint64(payload[o]) >> np.uint64(nb)
    avail = 8 - nb
    o += 1
    for j in range(i, n):
        while avail < width:
            acc |= np.uint64(payload[o]) << np.uint64(avail)
            o += 1
            avail += 8
        codes[j] = np.uint32(acc & mask)
        acc >>= np.uint64(width)
        avail -= width


@njit(cache=True, nogil=True)
def shift_bits(  # pragma: no cover - compiled
    src: np.ndarray, nbits: int, out: np.ndarray, bitpos: int
) -> None:
    """Copy the first ``nbits`` bits of the byte array ``src`` to bit ``bitpos`` of ``out``
    (same rules as :func:`pack_bits`: earlier bits of the first byte kept, padding zeroed)."""
    if nbits == 0:
        return
    o = bitpos >> 3
    s = bitpos & 7
    nbytes = (nbits + 7) >> 3
    last = nbits & 7
    if s == 0:
        for b in range(nbytes):
            out[o + b] = src[b]
    else:
        carry = np.uint32(out[o]) & np.uint32((1 << s) - 1)
        for b in range(nbytes):
            v = np.uint32(src[b])
            if b == nbytes - 1 and last:
                v &= np.uint32((1 << last) - 1)
            out[o + b] = np.uint8((carry | (v << np.uint32(s))) & np.uint32(255))
            carry = v >> np.uint32(8 - s)
        if (s + (last if last else 8)) > 8:
            out[o + nbytes] = np.uint8(carry)
        return
    if last:
        out[o + nbytes - 1] = np.uint8(np.uint32(out[o + nbytes - 1]) & np.uint32((1 << last) - 1))


@njit(cache=True, nogil=True)
def pack_pairs(  # pragma: no cover - compiled
    idx: np.ndarray, words: np.ndarray, width: int, vwidth: int, out: np.ndarray
) -> None:
    """One sparse message's payload into ``out`` (its ⌈k·(width + vwidth)/8⌉ bytes): the k
    indices ``idx`` (int64, each < 2^width) as ``width``-bit fields, then the k value patterns
    ``words`` (uint16 for 16-bit values, uint32 for float32; ``vwidth`` bits each) — the bytes
    :class:`BitWriter` gives to ``add(idx, width)`` followed by ``add_float(values)``, without
    its field list (the DDP hook encodes every tensor of a bucket each step)."""
    k = idx.size
    if width > 0:
        codes = np.empty(k, dtype=np.uint32)
        for t in range(k):
            codes[t] = np.uint32(idx[t] & 0xFFFFFFFF)
        pack_bits(codes, width, out, 0)
    vbit = k * width
    if vwidth == 32 and vbit & 7 == 0:  # whole words on a byte boundary
        b = vbit >> 3
        for t in range(k):
            _put_u32(out, b + 4 * t, np.uint32(words[t]))
    else:
        pack_bits(words, vwidth, out, vbit)


@njit(cache=True, nogil=True)
def unpack_pairs(  # pragma: no cover - compiled
    buf: np.ndarray,
    starts: np.ndarray,
    k: int,
    width: int,
    half: bool,
    w: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
) -> None:
    """The (index, value) pairs of several fixed-size sparse messages lying in one byte
    buffer, weighted and concatenated: message j starts at byte ``starts[j]`` and holds ``k``
    indices of ``width`` bits, then ``k`` values (bfloat16 patterns with ``half``, else float32
    ones), the layout a :class:`BitWriter` gives to ``add(indices, width)`` followed by
    ``add_float(values)``. idx[j·k + t] = its t-th index, vals[j·k + t] = w[j] · its t-th value
    in float32 (one rounded product; a bfloat16 value widened exactly first): the results of
    :meth:`BitReader.read` and :meth:`BitReader.read_values` message by message, converted to
    float32 and multiplied by the float32 weight, in one call instead of n."""
    codes = np.empty(k, dtype=np.uint32)
    for j in range(starts.size):
        s = starts[j]
        o = j * k
        if width > 0:
            unpack_bits(buf, s * 8, width, codes)
            for t in range(k):
                idx[o + t] = np.int64(codes[t])
        else:
            for t in range(k):
                idx[o + t] = 0
        vbit = s * 8 + k * width
        if half:
            if vbit & 7 == 0:
                b = vbit >> 3
                for t in range(k):
                    codes[t] = np.uint32(_u16_at(buf, b + 2 * t))
            else:
                unpack_bits(buf, vbit, 16, codes)
            for t in range(k):
                codes[t] = codes[t] << np.uint32(16)  # bfloat16 → float32: exact
        elif vbit & 7 == 0:
            b = vbit >> 3
            for t in range(k):
                codes[t] = _u32_at(buf, b + 4 * t)
        else:
            unpack_bits(buf, vbit, 32, codes)
        f = codes.view(np.float32)
        wj = np.float32(w[j])
        for t in range(k):
            vals[o + t] = f[t] * wj


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _u32(values: torch.Tensor) -> np.ndarray:
    """Non-negative integers (< 2³²) of a CPU tensor as a contiguous ``uint32`` array."""
    v = values.detach().reshape(-1)
    if v.dtype == torch.int32 or v.dtype == torch.uint32:
        return np.ascontiguousarray(v.numpy()).view(np.uint32)
    return v.to(torch.int64).numpy().astype(np.uint32)


def _float_words_np(v: torch.Tensor) -> np.ndarray:
    """IEEE bit patterns of a CPU float tensor as ``uint32`` words (float64: low, high)."""
    v = v.detach().reshape(-1).contiguous()
    if v.dtype == torch.float32:
        return v.view(torch.int32).numpy().view(np.uint32)
    if v.dtype in HALF_DTYPES:
        return v.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    if v.dtype == torch.float64:
        w = v.view(torch.int64).numpy()
        if _LITTLE:
            return w.view(np.uint32)
        words = np.empty(2 * w.size, dtype=np.uint32)
        words[0::2] = w & _MASK32
        words[1::2] = (w >> 32) & _MASK32
        return words
    raise TypeError(f"the wire format carries float32, float64 or 16-bit values, got {v.dtype}")


def _float_words(v: torch.Tensor) -> list[torch.Tensor]:
    """IEEE bit patterns of a float tensor as 32-bit words (int64 in [0, 2³²)); 16-bit values
    as one 16-bit word each."""
    v = v.reshape(-1).contiguous()
    if v.dtype == torch.float32:
        return [v.view(torch.int32).to(torch.int64) & _MASK32]
    if v.dtype in HALF_DTYPES:
        return [v.view(torch.int16).to(torch.int64) & 0xFFFF]
    if v.dtype == torch.float64:
        w = v.view(torch.int64)
        return [w & _MASK32, (w >> 32) & _MASK32]
    raise TypeError(f"the wire format carries float32, float64 or 16-bit values, got {v.dtype}")


def _check_width(width: int) -> None:
    if width < 0 or width > 32:
        raise ValueError(f"field width must be in [0, 32], got {width}")


#: a block writer: ``write(payload, byte)`` fills the block's bytes from ``payload[byte]`` on
BlockWrite = Callable[[np.ndarray, int], object]


def _fast(device: torch.device, fast: bool | None) -> bool:
    if fast is None:
        return device.type == "cpu"
    if fast and device.type != "cpu":
        raise ValueError(f"the numba bit packer works on CPU tensors, not on {device}")
    return fast


class BitWriter:
    """Collects fields; :meth:`to_bytes` packs them into one ``uint8`` payload.

    ``fast`` (default: on CPU) selects the numba packer; ``fast=False`` the torch one (the
    reference path, any device). :attr:`fast` tells ``_encode_fields`` whether blocks can be
    added. ``value_dtype`` is the dtype the message's *values* travel in (:meth:`add_values`):
    a 16-bit dtype for 16-bit inputs, whose compression runs in float32 (``None``: the values'
    own dtype).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        fast: bool | None = None,
        value_dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.fast = _fast(self.device, fast)
        self.value_dtype = value_dtype
        # (kind, data, width or nbits): "ints" (uint32 array on CPU, int64 tensor elsewhere)
        # or "block" (a BlockWrite, CPU only)
        self._fields: list[tuple[str, object, int]] = []
        self.nbits = 0

    def add(self, values: torch.Tensor, width: int) -> None:
        """Append ``values`` (non-negative integers < 2^width) as ``width``-bit fields."""
        _check_width(width)
        if width == 0 or values.numel() == 0:
            return
        data: object
        if self.fast:
            data = _u32(values.cpu())
        else:
            data = values.reshape(-1).to(device=self.device, dtype=torch.int64)
        self._fields.append(("ints", data, width))
        self.nbits += values.numel() * width

    def add_float(self, values: torch.Tensor) -> None:
        """Append floats as their IEEE bit patterns (16, 32 or 64 bits each)."""
        width = 16 if values.dtype in HALF_DTYPES else 32
        if self.fast:
            words = _float_words_np(values.cpu())
            if words.size:
                self._fields.append(("ints", words, width))
                self.nbits += width * words.size
            return
        parts = _float_words(values.to(self.device))
        if len(parts) == 1:
            self.add(parts[0], width)
        else:  # float64: low word then high word, value by value
            self.add(torch.stack(parts, dim=-1).reshape(-1), 32)

    def add_values(self, values: torch.Tensor) -> None:
        """Append the message's values in :attr:`value_dtype` (rounded to it from the float32
        arithmetic of a 16-bit input); a ValueError when one leaves that dtype's range."""
        vd = self.value_dtype
        if vd is not None and vd != values.dtype:
            values = values.to(vd)
            if not bool(torch.isfinite(values).all()):
                raise value_range_error(vd)
        self.add_float(values)

    def add_block(self, nbits: int, write: BlockWrite) -> None:
        """Append a field of ``nbits`` bits that ``write(payload, byte)`` packs itself (CPU).

        ``payload`` is a ``uint8`` numpy array and the block starts on the byte boundary
        ``payload[byte]`` (when the stream is not byte-aligned there, the block is written into
        a scratch array and shifted into place); ``write`` must fill all ⌈nbits/8⌉ bytes, with
        zero bits after the last field.
        """
        if not self.fast:
            raise RuntimeError("packed blocks are written by CPU kernels; use add() elsewhere")
        if nbits:
            self._fields.append(("block", write, nbits))
            self.nbits += nbits

    def to_bytes(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload: a new ``uint8`` tensor, or the leading ⌈nbits/8⌉ bytes of ``out`` (a
        contiguous ``uint8`` vector on the writer's device)."""
        nbytes = (self.nbits + 7) // 8
        if out is not None and out.numel() < nbytes:
            raise ValueError(f"out has {out.numel()} bytes, the message needs {nbytes}")
        if not self.fast:
            res = self._to_bytes_torch(nbytes)
            return res if out is None else out[:nbytes].copy_(res)
        payload = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
        p = payload.numpy()
        pos = 0
        for kind, data, size in self._fields:
            if kind == "ints":
                assert isinstance(data, np.ndarray)
                if size == 32 and pos % 8 == 0:  # whole words on a byte boundary: a memcpy
                    p[pos // 8 : pos // 8 + 4 * data.size] = data.view(np.uint8)
                else:
                    pack_bits(data, size, p, pos)
                pos += data.size * size
                continue
            write: BlockWrite = data  # type: ignore[assignment]
            if pos % 8 == 0:
                write(p, pos // 8)
            else:  # an unaligned block: write it aligned, then shift it into place
                tmp = np.empty((size + 7) // 8, dtype=np.uint8)
                write(tmp, 0)
                shift_bits(tmp, size, p, pos)
            pos += size
        return payload

    def _to_bytes_torch(self, nbytes: int) -> torch.Tensor:
        bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=self.device)
        pos = 0
        for _, v, width in self._fields:
            assert isinstance(v, torch.Tensor)
            n = v.numel()
            block = bits[pos : pos + n * width].view(n, width)
            for b in range(width):
                block[:, b] = ((v >> b) & 1).to(torch.uint8)
            pos += n * width
        grid = bits.view(nbytes, 8)
        out = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        for b in range(8):
            out |= grid[:, b] << b
        return out


class BitReader:
    """Reads back the fields a :class:`BitWriter` wrote, in the same order (``fast`` and
    ``value_dtype`` as for :class:`BitWriter`)."""

    def __init__(
        self,
        payload: torch.Tensor,
        fast: bool | None = None,
        value_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise TypeError("a payload is a uint8 tensor as returned by encode()")
        self._payload = payload.reshape(-1)
        self.fast = _fast(payload.device, fast)
        self.value_dtype = value_dtype
        self._np = self._payload.contiguous().numpy() if self.fast else None
        self._bits: torch.Tensor | None = None  # one uint8 per bit (other devices)
        self.nbits = 8 * self._payload.numel()
        self.pos = 0

    def read_values(
        self, count: int, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The next ``count`` values of the message: sent in :attr:`value_dtype` (when set),
        returned in ``dtype`` (the arithmetic dtype of the decoder; exact for 16-bit values)."""
        vd = self.value_dtype
        if vd is None or vd == dtype:
            return self.read_float(count, dtype, out)
        res = self.read_float(count, vd).to(dtype)
        return res if out is None else out.copy_(res)

    @property
    def device(self) -> torch.device:
        return self._payload.device

    def _advance(self, nbits: int) -> int:
        """Move past ``nbits`` bits; returns the start position."""
        end = self.pos + nbits
        if end > self.nbits:
            raise ValueError(
                f"payload too short: needs at least {(end + 7) // 8} bytes, has "
                f"{self.nbits // 8}; was it encoded with the same compressor and d?"
            )
        start, self.pos = self.pos, end
        return start

    def _words(self, count: int, width: int) -> np.ndarray:
        """The next ``count`` fields as a ``uint32`` array (CPU)."""
        assert self._np is not None
        start = self._advance(count * width)
        words = np.empty(count, dtype=np.uint32)
        unpack_bits(self._np, start, width, words)
        return words

    def read(self, count: int, width: int) -> torch.Tensor:
        """The next ``count`` fields of ``width`` bits as ``int64``."""
        _check_width(width)
        if width == 0 or count == 0:
            return torch.zeros(count, dtype=torch.int64, device=self.device)
        if self.fast:
            return torch.from_numpy(self._words(count, width).astype(np.int64))
        start = self._advance(count * width)
        block = self._torch_bits()[start : start + count * width].view(count, width)
        out = torch.zeros(count, dtype=torch.int64, device=self.device)
        for b in range(width):
            out |= block[:, b].to(torch.int64) << b
        return out

    def read_float(
        self, count: int, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The next ``count`` floats of ``dtype`` (written into ``out``, a contiguous CPU
        tensor of that size and dtype, when given)."""
        if dtype not in WIRE_DTYPES:
            raise TypeError(
                f"the wire format carries float32, float64 or 16-bit values, got {dtype}"
            )
        if dtype in HALF_DTYPES:
            if self.fast:  # the 16-bit fields' patterns themselves (a memcpy when aligned)
                assert self._np is not None
                start = self._advance(16 * count)
                if start % 8 == 0:
                    raw = self._np[start // 8 : start // 8 + 2 * count].copy()
                    pat = raw.view(np.uint16)
                else:
                    words = np.empty(count, dtype=np.uint32)
                    unpack_bits(self._np, start, 16, words)
                    pat = words.astype(np.uint16)
                res = torch.from_numpy(pat.view(np.int16)).view(dtype)
                return res if out is None else out.copy_(res)
            w16 = self.read(count, 16)
            w16 = torch.where(w16 >= 1 << 15, w16 - (1 << 16), w16)
            res = w16.to(torch.int16).view(dtype)
            return res if out is None else out.copy_(res)
        words_per = 1 if dtype == torch.float32 else 2
        if not self.fast:
            w = self.read(words_per * count, 32)
            if dtype == torch.float32:
                w = torch.where(w >= 1 << 31, w - (1 << 32), w)
                res = w.to(torch.int32).view(torch.float32)
            else:
                w = w.view(count, 2)
                hi = torch.where(w[:, 1] >= 1 << 31, w[:, 1] - (1 << 32), w[:, 1])
                res = (hi * (1 << 32) + w[:, 0]).view(torch.float64)
            return res if out is None else out.copy_(res)
        assert self._np is not None
        if out is None or not out.is_contiguous() or out.device.type != "cpu":
            res = torch.empty(count, dtype=dtype)
        else:
            res = out.reshape(-1)
        target = res.numpy().view(np.uint32)
        if _LITTLE or dtype == torch.float32:
            start = self._advance(32 * words_per * count)
            if start % 8 == 0:  # a memcpy
                target.view(np.uint8)[:] = self._np[start // 8 : start // 8 + 4 * target.size]
            else:
                unpack_bits(self._np, start, 32, target)
        else:
            pairs = self._words(2 * count, 32).astype(np.uint64)
            res.numpy().view(np.uint64)[:] = pairs[0::2] | (pairs[1::2] << np.uint64(32))
        if out is not None and res.data_ptr() != out.data_ptr():
            out.copy_(res)
            return out
        return res

    def block(self, nbits: int) -> tuple[np.ndarray, int]:
        """(bytes, first byte) of the next ``nbits`` bits, starting on a byte boundary (CPU):
        the payload itself when the stream is aligned there, else a shifted copy."""
        assert self._np is not None, "packed blocks are read on CPU"
        start = self._advance(nbits)
        if start % 8 == 0:
            return self._np, start // 8
        tmp = np.empty((nbits + 7) // 8, dtype=np.uint8)
        _extract(self._np, start, nbits, tmp)
        return tmp, 0

    def _torch_bits(self) -> torch.Tensor:
        if self._bits is None:
            shifts = torch.arange(8, device=self.device, dtype=torch.uint8)
            self._bits = ((self._payload[:, None] >> shifts) & 1).reshape(-1)
        return self._bits


def value_range_error(dtype: torch.dtype) -> ValueError:
    """A compressed value beyond the range of the (16-bit) dtype its message carries."""
    return ValueError(
        f"a compressed value exceeds the {dtype} range ({torch.finfo(dtype).max:.4g}); rescale "
        "the input (e.g. a smaller loss scale) or compress bfloat16/float32 tensors"
    )


@njit(cache=True, nogil=True)
def _extract(  # pragma: no cover - compiled
    payload: np.ndarray, bitpos: int, nbits: int, out: np.ndarray
) -> None:
    """out = the ``nbits`` bits of ``payload`` from ``bitpos`` on, realigned to bit 0."""
    o = bitpos >> 3
    s = np.uint32(bitpos & 7)
    nbytes = (nbits + 7) >> 3
    end = (bitpos + nbits + 7) >> 3  # bytes of payload that hold the bits
    for b in range(nbytes):
        lo = np.uint32(payload[o + b]) >> s
        hi = np.uint32(payload[o + b + 1]) if o + b + 1 < end else np.uint32(0)
        out[b] = np.uint8((lo | (hi << (np.uint32(8) - s))) & np.uint32(255))
