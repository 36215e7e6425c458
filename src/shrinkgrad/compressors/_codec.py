"""Numba kernels of the packed wire formats (CPU): per-coordinate codes in one pass.

``*_encode`` computes the codes of one vector chunk by chunk — with exactly the arithmetic and
the random draws of the compressor's kernel in :mod:`._kernels`, so the codes are those of
``C(x)`` — and packs each chunk with :func:`._wire.pack_bits` straight into the payload;
``*_decode`` unpacks a chunk and writes the dense output values (bit-identical to ``C(x)``).
No d-sized intermediate is created.

Work items are the chunks of one vector: call ``K.run(kernel, x[None, :], ...)``; item w covers
coordinates [w·CHUNK, (w+1)·CHUNK). ``CHUNK · width`` is a multiple of 8, so every chunk of a
block that starts on a byte boundary (``byte0``) starts on one too, and the threads write
disjoint bytes. Keys come as the (4, 1) table of :func:`._random.key_table` (K and K₂).

Codes (what the torch paths of :mod:`.quantize` write with :meth:`._wire.BitWriter.add`):

* QSGD / TernGrad: ``level ≪ 1 | sign bit``; value = sign · scale · level;
* natural compression: ``exponent field ≪ 1 | sign bit`` of the output;
* natural dithering: ``c ≪ 1 | sign bit`` with c = 0 for zero and c ≥ 1 for the level
  2^{c−s}; value = sign · ‖x‖ · level;
* scaled sign: the sign bit; value = sign · scale.

Bernoulli's (index, value) pairs come from its sparse form (``_kernels.bernoulli_pairs``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..rng_numba import fill_words
from ._kernels import CHUNK, OK, _tie_up, natural_chunk, round_level
from ._wire import pack_bits, unpack_bits

__all__ = [
    "dither_decode",
    "dither_encode",
    "natural_decode",
    "natural_encode",
    "round_decode",
    "round_encode",
    "sign_decode",
    "sign_encode",
]

_U1 = np.uint32(1)


# --------------------------------------------------------------------------------------------
# QSGD and TernGrad: unbiased rounding to the levels {0, …, s} (twin of _kernels.round_rows)
# --------------------------------------------------------------------------------------------
@njit(cache=True)
def _round_code_block(  # pragma: no cover - compiled
    xs: np.ndarray, byts: np.ndarray, sc: float, fs: float, codes: np.ndarray, flags: np.ndarray
) -> None:
    for i in range(xs.size):
        lev, flags[i] = round_level(xs, i, byts, sc, fs)
        codes[i] = (np.uint32(lev) << _U1) | np.uint32(np.signbit(xs[i]))


@njit(cache=True, nogil=True)
def round_encode(  # pragma: no cover - compiled
    x: np.ndarray,
    scale: np.ndarray,
    s: int,
    k: np.ndarray,
    width: int,
    out: np.ndarray,
    byte0: int,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Codes ``level ≪ 1 | sign`` of :func:`._kernels.round_rows` (scale ``scale[0]``)."""
    d = x.size
    dt = x.dtype.type
    fs = dt(s)
    sc = scale[0]
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    byts = words.view(np.uint8)
    flags = np.empty(CHUNK, dtype=np.uint8)
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x[j0 : j0 + m]
        status[w] = OK
        if sc == 0:
            for i in range(m):
                codes[i] = np.uint32(np.signbit(xs[i]))
        else:
            fill_words(k[0, 0], k[1, 0], j0 // 4, words[: (m + 3) // 4])
            _round_code_block(xs, byts[:m], sc, fs, codes[:m], flags[:m])
            for i in range(m):
                if flags[i]:
                    xv = xs[i]
                    rr = abs(xv) / sc
                    fl = np.floor(rr)
                    t = float(rr - fl) * 256.0
                    if fl < fs and _tie_up(t, math.floor(t), k[2, 0], k[3, 0], j0 + i):
                        lev = fl + dt(1.0)
                        lev = lev if lev < fs else fs
                        codes[i] = (np.uint32(lev) << _U1) | (codes[i] & _U1)
        pack_bits(codes[:m], width, out, 8 * byte0 + j0 * width)


@njit(cache=True)
def _round_value_block(  # pragma: no cover - compiled
    codes: np.ndarray, sc: float, os: np.ndarray
) -> None:
    dt = os.dtype.type
    one = dt(1.0)
    two = dt(2.0)
    for i in range(os.size):
        c = codes[i]
        os[i] = np.copysign(sc * dt(c >> _U1), one - two * dt(c & _U1))


@njit(cache=True, nogil=True)
def round_decode(  # pragma: no cover - compiled
    src: np.ndarray,
    byte0: int,
    width: int,
    scale: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """out_j = sign_j · scale[0] · level_j from the codes of :func:`round_encode`."""
    d = out.size
    sc = scale[0]
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        unpack_bits(src, 8 * byte0 + j0 * width, width, codes[:m])
        _round_value_block(codes[:m], sc, out[j0 : j0 + m])
        status[w] = OK


# --------------------------------------------------------------------------------------------
# natural compression (twin of _kernels.natural_rows, on the bit patterns)
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def natural_encode(  # pragma: no cover - compiled
    xu: np.ndarray,
    mant: int,
    k: np.ndarray,
    width: int,
    out: np.ndarray,
    byte0: int,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Codes ``exponent field ≪ 1 | sign`` of natural compression (``xu``: bit patterns);
    the status of :func:`._kernels.natural_rows` (non-finite input, overflow)."""
    d = xu.size
    ut = xu.dtype.type
    top = ut(8 * xu.itemsize - 1)
    um = ut(mant)
    emask = (ut(1) << ut(width - 1)) - ut(1)
    one = ut(1)
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    flags = np.empty(CHUNK, dtype=np.uint8)
    ys = np.empty(CHUNK, dtype=xu.dtype)
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        status[w] = natural_chunk(xu[j0 : j0 + m], ys[:m], k, 0, j0, mant, words, flags)
        for i in range(m):
            v = ys[i]
            codes[i] = np.uint32((((v >> um) & emask) << one) | (v >> top))
        pack_bits(codes[:m], width, out, 8 * byte0 + j0 * width)


@njit(cache=True, nogil=True)
def natural_decode(  # pragma: no cover - compiled
    src: np.ndarray,
    byte0: int,
    width: int,
    mant: int,
    outu: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Bit patterns ``sign ≪ (bits − 1) | exponent ≪ mant`` from :func:`natural_encode`."""
    d = outu.size
    ut = outu.dtype.type
    top = ut(8 * outu.itemsize - 1)
    um = ut(mant)
    one = ut(1)
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        unpack_bits(src, 8 * byte0 + j0 * width, width, codes[:m])
        os = outu[j0 : j0 + m]
        for i in range(m):
            c = ut(codes[i])
            os[i] = ((c & one) << top) | ((c >> one) << um)
        status[w] = OK


# --------------------------------------------------------------------------------------------
# natural dithering (twin of _kernels.dither_rows)
# --------------------------------------------------------------------------------------------
@njit(cache=True)
def _dither_code_block(  # pragma: no cover - compiled
    xs: np.ndarray,
    byts: np.ndarray,
    nr: float,
    low: float,
    inv_low: float,
    s: int,
    ub: np.ndarray,
    ubits: np.ndarray,
    mant: np.uint64,
    mmask: np.uint64,
    bias: int,
    codes: np.ndarray,
    flags: np.ndarray,
) -> None:
    """The codes of :func:`._kernels._dither_block` with the 8-bit rule: u ≥ L = 2^{1−s} in
    the binade [2^E, 2^{E+1}) gives c = E + s (+1 when rounding up), u < L gives c = 0 or 1."""
    dt = xs.dtype.type
    one = dt(1.0)
    f256 = dt(256.0)
    ut = ubits.dtype.type
    for i in range(xs.size):
        ub[i] = min(abs(xs[i]) / nr, one)
    for i in range(xs.size):
        u = ub[i]
        small = u < low
        ti_big = np.int32((ubits[i] & mmask) >> (mant - ut(8)))
        ti_small = np.int32(u * inv_low * f256)
        ti = ti_small if small else ti_big
        bi = np.int32(byts[i])
        flags[i] = np.uint8(bi == ti)
        up = np.int32(bi < ti)
        c_big = np.int32(ubits[i] >> mant) - bias + s + up
        c = up if small else c_big
        codes[i] = (np.uint32(c) << _U1) | np.uint32(np.signbit(xs[i]))


@njit(cache=True, nogil=True)
def dither_encode(  # pragma: no cover - compiled
    x: np.ndarray,
    norm: np.ndarray,
    s: int,
    k: np.ndarray,
    scratch_bits: np.ndarray,
    mant: int,
    width: int,
    out: np.ndarray,
    byte0: int,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Codes of natural dithering (norm ``norm[0]``); ``scratch_bits``: an empty unsigned
    array of the dtype's width, passed for its dtype (as in :func:`._kernels.dither_rows`)."""
    d = x.size
    dt = x.dtype.type
    low = dt(2.0 ** (1 - s))
    inv_low = dt(2.0 ** (s - 1))
    ut = scratch_bits.dtype.type
    um = ut(mant)
    mmask = (ut(1) << um) - ut(1)
    bias = (1 << (8 * x.itemsize - 2 - mant)) - 1
    nr = norm[0]
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    byts = words.view(np.uint8)
    flags = np.empty(CHUNK, dtype=np.uint8)
    ubits = np.empty(CHUNK, dtype=scratch_bits.dtype)
    ub = ubits.view(x.dtype)
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x[j0 : j0 + m]
        status[w] = OK
        if nr == 0:
            for i in range(m):
                codes[i] = np.uint32(np.signbit(xs[i]))
            pack_bits(codes[:m], width, out, 8 * byte0 + j0 * width)
            continue
        fill_words(k[0, 0], k[1, 0], j0 // 4, words[: (m + 3) // 4])
        _dither_code_block(
            xs,
            byts[:m],
            nr,
            low,
            inv_low,
            s,
            ub[:m],
            ubits[:m],
            um,
            mmask,
            bias,
            codes[:m],
            flags[:m],
        )
        for i in range(m):
            if flags[i]:
                u = min(abs(xs[i]) / nr, dt(1.0))
                if u < low:
                    t = float(u * inv_low) * 256.0
                    c = 0
                else:
                    _, e = math.frexp(u)
                    a = dt(math.ldexp(1.0, e - 1))
                    t = float(u / a - dt(1.0)) * 256.0
                    c = e - 1 + s
                if _tie_up(t, math.floor(t), k[2, 0], k[3, 0], j0 + i):
                    c += 1
                codes[i] = (np.uint32(c) << _U1) | (codes[i] & _U1)
        pack_bits(codes[:m], width, out, 8 * byte0 + j0 * width)


@njit(cache=True, nogil=True)
def dither_decode(  # pragma: no cover - compiled
    src: np.ndarray,
    byte0: int,
    width: int,
    norm: np.ndarray,
    s: int,
    scratch_bits: np.ndarray,
    mant: int,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """out_j = sign_j · norm[0] · 2^{c_j − s} (0 for c_j = 0) from :func:`dither_encode`."""
    d = out.size
    dt = out.dtype.type
    one = dt(1.0)
    two = dt(2.0)
    nr = norm[0]
    ut = scratch_bits.dtype.type
    um = ut(mant)
    bias = (1 << (8 * out.itemsize - 2 - mant)) - 1
    codes = np.empty(CHUNK, dtype=np.uint32)
    levbits = np.empty(CHUNK, dtype=scratch_bits.dtype)
    lev = levbits.view(out.dtype)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        unpack_bits(src, 8 * byte0 + j0 * width, width, codes[:m])
        for i in range(m):
            c = np.int64(codes[i] >> _U1)
            levbits[i] = (ut(c - s + bias) << um) if c != 0 else ut(0)
        os = out[j0 : j0 + m]
        for i in range(m):
            os[i] = np.copysign(nr * lev[i], one - two * dt(codes[i] & _U1))
        status[w] = OK


# --------------------------------------------------------------------------------------------
# scaled sign
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def sign_encode(  # pragma: no cover - compiled
    x: np.ndarray, out: np.ndarray, byte0: int, w0: int, w1: int, status: np.ndarray
) -> None:
    """One sign bit per coordinate (set for negative numbers and −0.0)."""
    d = x.size
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x[j0 : j0 + m]
        for i in range(m):
            codes[i] = np.uint32(np.signbit(xs[i]))
        pack_bits(codes[:m], 1, out, 8 * byte0 + j0)
        status[w] = OK


@njit(cache=True, nogil=True)
def sign_decode(  # pragma: no cover - compiled
    src: np.ndarray,
    byte0: int,
    scale: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """out_j = ±scale[0] from the sign bits of :func:`sign_encode`."""
    d = out.size
    dt = out.dtype.type
    one = dt(1.0)
    two = dt(2.0)
    sc = scale[0]
    codes = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        unpack_bits(src, 8 * byte0 + j0, 1, codes[:m])
        os = out[j0 : j0 + m]
        for i in range(m):
            os[i] = np.copysign(sc, one - two * dt(codes[i]))
        status[w] = OK
