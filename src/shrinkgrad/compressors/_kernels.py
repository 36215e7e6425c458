"""Numba CPU kernels: the fast paths of the compressors.

Every kernel has a torch twin in the compressor's module that defines the operator; tests check
that both give bit-identical outputs for the same keys (given the same row norms: the float64
sums of squares differ in summation order between the two paths).

Structure. Rows are cut into chunks of :data:`CHUNK` coordinates; a work item is one (row,
chunk), and :func:`run` spreads the items over a thread pool (the kernels release the GIL).
Each item's output depends only on its own coordinates and the row's key, so the result is the
same for any number of threads. Kernels report problems through a status array instead of
raising (numba cannot format the messages): :data:`OK`, :data:`NON_FINITE` (inf/nan in the
input) or :data:`OVERFLOW` (the result does not fit the dtype). The hot loops live in small
separate functions (``_*_block``) that LLVM vectorizes.

Random bits (the rule of :func:`shrinkgrad.compressors._random.draw_up`): coordinate ``j`` of
a row with key ``K`` uses byte ``j mod 4`` of ``bits32(K, ⌊j/4⌋)``; only when that byte ties
with the first 8 bits of the rounding probability (probability 1/256) are the words
``bits32(K₂, 2j)`` and, on a second tie (2⁻³²), ``bits32(K₂, 2j+1)`` drawn, with
``K₂ = K.fold("extra")``. The probability of rounding up is thus the exact one up to 2⁻⁷², far
below the dtype's resolution, at the cost of one hash per four coordinates. A chunk's words are
hashed in one vectorized loop, a branch-free loop rounds with the 8-bit rule and flags ties,
and a scan of the flags resolves the ties.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic, overload

from .._numba_twin import twin
from ..rng_numba import bits32, fill_words, mix32, mix32_u32

__all__ = [
    "CHUNK",
    "NON_FINITE",
    "OK",
    "OVERFLOW",
    "bernoulli_pairs",
    "bernoulli_rows",
    "bucket_by_chunk",
    "check_rows",
    "copy_rows",
    "dither_rows",
    "lazy_rows",
    "natural_rows",
    "randk_block",
    "randk_indices",
    "round_rows",
    "row_stats",
    "sparse_gather",
    "sparse_rows",
    "top1_rows",
    "topk_candidates",
    "topk_candidates_diff",
    "topk_plan",
    "topk_rows",
    "topk_select",
    "topk_thresholds",
    "topk_thresholds_diff",
    "topk_write",
]

OK = 0
NON_FINITE = 1
OVERFLOW = 2

_TWO32 = 4294967296.0


# --------------------------------------------------------------------------------------------
# row statistics: sum of squares or of |x| (float64, deterministic chunked order), finiteness
# --------------------------------------------------------------------------------------------
#: chunk length of the parallel loops (a multiple of 4, so a chunk starts on a fresh word)
CHUNK_BITS = 14
CHUNK = 1 << CHUNK_BITS


@njit(cache=True)
def _sumsq_block(xs: np.ndarray) -> float:  # pragma: no cover - compiled
    """Σ x² of a block in float64, with four accumulators (a fixed order)."""
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    n4 = xs.size - xs.size % 4
    for j in range(0, n4, 4):
        v0 = np.float64(xs[j])
        v1 = np.float64(xs[j + 1])
        v2 = np.float64(xs[j + 2])
        v3 = np.float64(xs[j + 3])
        a0 += v0 * v0
        a1 += v1 * v1
        a2 += v2 * v2
        a3 += v3 * v3
    for j in range(n4, xs.size):
        v0 = np.float64(xs[j])
        a0 += v0 * v0
    return (a0 + a1) + (a2 + a3)


@intrinsic
def _sumsq_block4(typingctx: Any, x0: Any, x1: Any, x2: Any, x3: Any) -> Any:  # pragma: no cover
    """:func:`_sumsq_block` of four blocks of one length (a multiple of 4) in one loop, bit for
    bit: lane l of a 4-wide float64 vector per block adds the squares of its entries ≡ l
    (mod 4) in order, exactly like the scalar accumulators a0…a3, then (a0 + a1) + (a2 + a3).

    Written in LLVM IR because numba does not SLP-vectorize: the scalar loop waits on its four
    addition chains and converts one entry at a time (1.1 cycles per entry; the norm pass of
    QSGD compute-bound at 3.3 ms for d = 10⁷ on two threads); four blocks of 4-lane chains
    take 0.23 cycles per entry and read four streams at once."""
    if not (
        isinstance(x0, types.Array)
        and x0.ndim == 1
        and x0.dtype in (types.float32, types.float64)
        and x1 == x0
        and x2 == x0
        and x3 == x0
    ):
        return None
    sig = types.UniTuple(types.float64, 4)(x0, x1, x2, x3)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aty = signature.args[0]
        v4d = ir.VectorType(ir.DoubleType(), 4)
        v4e = ir.VectorType(context.get_value_type(aty.dtype), 4)
        arrs = [context.make_array(aty)(context, builder, a) for a in args]
        n = builder.extract_value(arrs[0].shape, 0)
        zero = ir.Constant(v4d, [0.0] * 4)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        step = ir.Constant(n.type, 4)
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), n, step) as (j, _):
            for arr, acc in zip(arrs, accs, strict=True):
                ptr = builder.bitcast(builder.gep(arr.data, [j]), v4e.as_pointer())
                v = builder.load(ptr, align=aty.dtype.bitwidth // 8)
                if aty.dtype == types.float32:
                    v = builder.fpext(v, v4d)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
        sums = []
        for acc in accs:
            vec = builder.load(acc)
            a = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            sums.append(builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3])))
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


@njit(cache=True)
def _sumabs_block(xs: np.ndarray) -> float:  # pragma: no cover - compiled
    """Σ |x| of a block in float64, with four accumulators (a fixed order)."""
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    n4 = xs.size - xs.size % 4
    for j in range(0, n4, 4):
        a0 += abs(np.float64(xs[j]))
        a1 += abs(np.float64(xs[j + 1]))
        a2 += abs(np.float64(xs[j + 2]))
        a3 += abs(np.float64(xs[j + 3]))
    for j in range(n4, xs.size):
        a0 += abs(np.float64(xs[j]))
    return (a0 + a1) + (a2 + a3)


@njit(cache=True)
def _absmax_block(xs: np.ndarray) -> float:  # pragma: no cover - compiled
    """max |x| of a block (float64), nan when the block holds inf or nan."""
    m0 = 0.0
    m1 = 0.0
    bad = np.uint8(0)
    n2 = xs.size - xs.size % 2
    for j in range(0, n2, 2):
        v0 = np.float64(xs[j])
        v1 = np.float64(xs[j + 1])
        bad |= np.uint8((v0 - v0) != 0) | np.uint8((v1 - v1) != 0)
        a0 = abs(v0)
        a1 = abs(v1)
        m0 = a0 if a0 > m0 else m0
        m1 = a1 if a1 > m1 else m1
    for j in range(n2, xs.size):
        v0 = np.float64(xs[j])
        bad |= np.uint8((v0 - v0) != 0)
        a0 = abs(v0)
        m0 = a0 if a0 > m0 else m0
    return np.nan if bad else max(m0, m1)


@njit(cache=True, nogil=True)
def row_stats(  # pragma: no cover - compiled
    x2: np.ndarray, what: int, part: np.ndarray, w0: int, w1: int, status: np.ndarray
) -> None:
    """Partial statistics per work item (row r, chunk c) in float64: ``what`` = 0: Σ x_j²,
    1: max |x_j|, 2: Σ |x_j|. ``part[r, c]``; the caller combines them in chunk order, so the
    result does not depend on the number of threads (inf/nan propagate)."""
    d = x2.shape[1]
    nch = part.shape[1]
    full = d // CHUNK  # chunks of CHUNK entries in each row
    js = np.empty(4, dtype=np.int64)
    rs = np.empty(4, dtype=np.int64)
    w = w0
    while w < w1:
        r = w // nch
        c = w % nch
        j0 = c * CHUNK
        xs = x2[r, j0 : min(d, j0 + CHUNK)]
        if what == 0 and w + 4 <= w1 and c < full:
            # four full chunks at once (they may span rows): Σ x² of each, as _sumsq_block
            q = 0
            for v in range(w, w + 4):
                if v % nch < full:
                    rs[q] = v // nch
                    js[q] = (v % nch) * CHUNK
                    q += 1
            if q == 4:
                p0, p1, p2, p3 = _sumsq_block4(  # type: ignore[var-annotated,call-arg]
                    x2[rs[0], js[0] : js[0] + CHUNK],
                    x2[rs[1], js[1] : js[1] + CHUNK],
                    x2[rs[2], js[2] : js[2] + CHUNK],
                    x2[rs[3], js[3] : js[3] + CHUNK],
                )
                part[rs[0], js[0] // CHUNK] = p0
                part[rs[1], js[1] // CHUNK] = p1
                part[rs[2], js[2] // CHUNK] = p2
                part[rs[3], js[3] // CHUNK] = p3
                status[w : w + 4] = OK
                w += 4
                continue
        if what == 0:
            part[r, c] = _sumsq_block(xs)
        elif what == 1:
            part[r, c] = _absmax_block(xs)
        else:
            part[r, c] = _sumabs_block(xs)
        status[w] = OK
        w += 1


# --------------------------------------------------------------------------------------------
# stochastic rounding decisions
# --------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _tie_up(t: float, tb: float, e0: np.uint64, e1: np.uint64, j: int) -> bool:  # pragma: no cover
    """The rare branch of the draw: the byte equalled ⌊256 f⌋ = tb (t = 256 f)."""
    t2 = (t - tb) * _TWO32
    w1 = float(np.int64(bits32(e0, e1, np.uint64(2 * j))))
    tb2 = math.floor(t2)
    if w1 < tb2:
        return True
    if w1 > tb2:
        return False
    w2 = float(np.int64(bits32(e0, e1, np.uint64(2 * j + 1))))
    return w2 < (t2 - tb2) * _TWO32


@njit(cache=True)
def _words_block(  # pragma: no cover - compiled
    lo: np.uint64, hi: np.uint64, g0: int, out: np.ndarray
) -> None:
    """:func:`fill_words` as a function of its own (inlined into a driver's loop it was not
    vectorized as well: round_rows took 2.2 cycles per entry instead of 1.7 on one chunk)."""
    fill_words(lo, hi, g0, out)


# The hot loops live in separate (not inlined) functions: inside the parallel drivers numba
# does not vectorize them (measured 2-5x slower), as standalone functions LLVM does.
@njit(cache=True, inline="always")
def round_level(  # pragma: no cover - compiled
    xs: np.ndarray, i: int, byts: np.ndarray, sc: float, fs: float
) -> tuple[float, np.uint8]:
    """The unbiased rounding of |x_i|/sc to a level in {0, …, fs} with the 8-bit draw
    ``byts[i]``: ⌊r⌋ + 1 with probability ≈ frac(r) (256 steps), and the flag of a tie (draw =
    the fraction's 8 bits), which :func:`_tie_up` resolves with more random bits. Shared by the
    dense kernel and the wire encoder (``_codec``), so both draw the same levels; inlined into
    their loops, which LLVM then vectorizes as before."""
    dt = xs.dtype.type
    rr = abs(xs[i]) / sc
    fl = np.floor(rr)
    ti = np.int32((rr - fl) * dt(256.0))
    bi = np.int32(byts[i])
    lev = fl + dt(bi < ti)
    return (lev if lev < fs else fs), np.uint8(bi == ti)


@njit(cache=True)
def _round_block(  # pragma: no cover - compiled
    xs: np.ndarray, byts: np.ndarray, sc: float, fs: float, os: np.ndarray, flags: np.ndarray
) -> None:
    for i in range(xs.size):
        lev, flags[i] = round_level(xs, i, byts, sc, fs)
        os[i] = np.copysign(sc * lev, xs[i])


@njit(cache=True)
def _natural_block(  # pragma: no cover - compiled
    xs: np.ndarray,
    byts: np.ndarray,
    sign: np.uint64,
    um: np.uint64,
    u8: np.uint64,
    mmask: np.uint64,
    emax: np.uint64,
    os: np.ndarray,
    flags: np.ndarray,
) -> None:
    ut = xs.dtype.type
    one = ut(1)
    for i in range(xs.size):
        v = xs[i]
        sg = v & sign
        mag = v ^ sg
        e = mag >> um
        m = mag & mmask
        ti = m >> u8
        bi = ut(byts[i])
        flags[i] = (
            np.uint8(bi == ti)
            | (np.uint8(e == emax) << np.uint8(1))
            | (np.uint8((e == emax - one) & (m != 0)) << np.uint8(2))
        )
        os[i] = sg | ((e + ut(bi < ti)) << um)


@njit(cache=True)
def _bernoulli_block(  # pragma: no cover - compiled
    xs: np.ndarray, byts: np.ndarray, sc: float, ti: np.int32, os: np.ndarray, flags: np.ndarray
) -> None:
    zero = xs.dtype.type(0.0)
    for i in range(xs.size):
        v = xs[i] * sc + zero  # a kept −0.0 becomes +0.0: the message omits kept zeros
        bi = np.int32(byts[i])
        flags[i] = np.uint8(bi == ti) | (np.uint8((v - v) != 0) << np.uint8(1))
        os[i] = v if bi < ti else zero


@njit(cache=True, nogil=True)
def round_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    scale: np.ndarray,
    s: int,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Unbiased rounding of |x_j|/scale to the grid {0, 1, …, s}: QSGD and TernGrad.

    out_j = copysign(scale · ℓ_j, x_j) with ℓ_j = ⌊r⌋ + [U < r − ⌊r⌋], r = |x_j|/scale clamped
    to s; a zero scale gives a zero row. The input was checked finite by :func:`row_stats`.

    Layout for speed (per chunk): the random words are hashed in one vectorizable loop; one
    branch-free loop rounds with the 8-bit rule and flags ties; a scan of the flags resolves
    the ties (probability 1/256 each) with more random bits.
    """
    d = x2.shape[1]
    dt = x2.dtype.type
    fs = dt(s)
    zero = dt(0.0)
    nch = (d + CHUNK - 1) // CHUNK
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    byts = words.view(np.uint8)
    flags = np.zeros(CHUNK + 8, dtype=np.uint8)
    f64 = flags.view(np.uint64)
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x2[r, j0 : j0 + m]
        os = out[r, j0 : j0 + m]
        sc = scale[r]
        status[w] = OK
        if sc == 0:
            for i in range(m):
                os[i] = np.copysign(zero, xs[i])
            continue
        _words_block(lo[r], hi[r], j0 // 4, words[: (m + 3) // 4])
        _round_block(xs, byts[:m], sc, fs, os, flags[:m])
        flags[m : (m + 7) & ~7] = 0
        for q in range((m + 7) >> 3):
            if f64[q] == 0:  # 8 flags at a time: a tie has probability 1/256
                continue
            for i in range(q << 3, (q << 3) + 8):
                if flags[i]:
                    xv = xs[i]
                    rr = abs(xv) / sc
                    fl = np.floor(rr)
                    t = float(rr - fl) * 256.0
                    if fl < fs and _tie_up(t, math.floor(t), lo2[r], hi2[r], j0 + i):
                        lev = fl + dt(1.0)
                        os[i] = np.copysign(sc * (lev if lev < fs else fs), xv)


@njit(cache=True)
def _dither_block(  # pragma: no cover - compiled
    xs: np.ndarray,
    byts: np.ndarray,
    nr: float,
    low: float,
    inv_low: float,
    ub: np.ndarray,
    ubits: np.ndarray,
    mant: np.uint64,
    mmask: np.uint64,
    os: np.ndarray,
    flags: np.ndarray,
) -> None:
    """Natural dithering of one chunk with the 8-bit rule (``ub``/``ubits``: one scratch array
    seen as floats and as its bit patterns)."""
    dt = xs.dtype.type
    one = dt(1.0)
    zero = dt(0.0)
    f256 = dt(256.0)
    ut = ubits.dtype.type
    for i in range(xs.size):
        ub[i] = min(abs(xs[i]) / nr, one)
    for i in range(xs.size):
        u = ub[i]
        small = u < low
        a = ubits[i] & ~mmask  # u with the mantissa cleared: 2^⌊log₂ u⌋
        ti_big = np.int32((ubits[i] & mmask) >> (mant - ut(8)))
        ti_small = np.int32(u * inv_low * f256)
        ti = ti_small if small else ti_big
        bi = np.int32(byts[i])
        flags[i] = np.uint8(bi == ti)
        ubits[i] = a + (ut(bi < ti) << mant)  # 2a when rounding up (the exponent field + 1)
        lev_small = low if bi < ti else zero
        lev = lev_small if small else ub[i]
        os[i] = np.copysign(nr * lev, xs[i])


@njit(cache=True, nogil=True)
def dither_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    norm: np.ndarray,
    s: int,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    out: np.ndarray,
    scratch_bits: np.ndarray,
    mant: int,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Natural dithering: unbiased rounding of u = |x_j|/‖x‖ to {0, 2^{1−s}, …, 1/2, 1}.

    u ≥ 2^{1−s} = L lies in a binade [a, 2a] (a = u with the mantissa cleared) and rounds up
    with probability u/a − 1 = mantissa/2^mant; u < L rounds to L with probability u/L.
    ``scratch_bits``: an empty unsigned array of
    the dtype's width, passed only for its dtype (the kernel allocates its own scratch)."""
    d = x2.shape[1]
    dt = x2.dtype.type
    zero = dt(0.0)
    low = dt(2.0 ** (1 - s))
    inv_low = dt(2.0 ** (s - 1))
    ut = scratch_bits.dtype.type
    um = ut(mant)
    mmask = (ut(1) << um) - ut(1)
    nch = (d + CHUNK - 1) // CHUNK
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    byts = words.view(np.uint8)
    flags = np.empty(CHUNK, dtype=np.uint8)
    ubits = np.empty(CHUNK, dtype=scratch_bits.dtype)
    ub = ubits.view(x2.dtype)
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x2[r, j0 : j0 + m]
        os = out[r, j0 : j0 + m]
        nr = norm[r]
        status[w] = OK
        if nr == 0:
            for i in range(m):
                os[i] = np.copysign(zero, xs[i])
            continue
        fill_words(lo[r], hi[r], j0 // 4, words[: (m + 3) // 4])
        _dither_block(xs, byts[:m], nr, low, inv_low, ub[:m], ubits[:m], um, mmask, os, flags)
        for i in range(m):
            if flags[i]:
                u = min(abs(xs[i]) / nr, dt(1.0))
                if u < low:
                    t = float(u * inv_low) * 256.0
                    a = zero
                    b = low
                else:
                    _, e = math.frexp(u)
                    a = dt(math.ldexp(1.0, e - 1))
                    b = a + a
                    t = float(u / a - dt(1.0)) * 256.0
                up = _tie_up(t, math.floor(t), lo2[r], hi2[r], j0 + i)
                os[i] = np.copysign(nr * (b if up else a), xs[i])


@njit(cache=True)
def natural_chunk(  # pragma: no cover - compiled
    xs: np.ndarray,
    os: np.ndarray,
    k: np.ndarray,
    r: int,
    j0: int,
    mant: int,
    words: np.ndarray,
    flags: np.ndarray,
) -> int:
    """Natural compression of one chunk ``xs`` (bit patterns, coordinates j0, j0 + 1, … of
    row r) into ``os``; ``k`` holds the row keys (lo, hi, lo₂, hi₂) as rows of a (4, n) array;
    ``words``/``flags`` are scratch. Returns the chunk's status (see :func:`natural_rows`)."""
    ut = xs.dtype.type
    nbits = 8 * xs.itemsize
    sign = ut(1) << ut(nbits - 1)
    um = ut(mant)
    u8 = ut(mant - 8)
    mmask = (ut(1) << um) - ut(1)
    emax = (ut(1) << ut(nbits - 1 - mant)) - ut(1)
    one = ut(1)
    inv = 2.0**-mant
    m_ = xs.size
    byts = words.view(np.uint8)
    fill_words(k[0, r], k[1, r], j0 // 4, words[: (m_ + 3) // 4])
    _natural_block(xs, byts[:m_], sign, um, u8, mmask, emax, os, flags[:m_])
    st = OK
    for i in range(m_):
        f = flags[i]
        if f:
            if f & 2:
                st = NON_FINITE
            elif f & 4 and st == OK:
                st = OVERFLOW
            if f & 1:
                v = xs[i]
                sg = v & sign
                mag = v ^ sg
                t = float(mag & mmask) * inv * 256.0
                if _tie_up(t, math.floor(t), k[2, r], k[3, r], j0 + i):
                    os[i] = sg | (((mag >> um) + one) << um)
    return st


@njit(cache=True, nogil=True)
def natural_rows(  # pragma: no cover - compiled
    xu: np.ndarray,
    mant: int,
    k: np.ndarray,
    outu: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Natural compression on the IEEE bit patterns (unsigned views of x and out).

    |x_j| = (1 + m/2^mant)·2^e rounds to 2^{e+1} with probability m/2^mant, else to 2^e
    (zero exponent field: subnormals round to 0 or the smallest normal, with probability
    m/2^mant = |x_j|/2^{e_min}); the sign bit is kept. An all-ones exponent (inf/nan) gives
    NON_FINITE, a value above the largest power of two gives OVERFLOW. Same layout as
    :func:`round_rows`; the first 8 bits of the probability are simply m ≫ (mant − 8).
    ``k``: the row keys (lo, hi, lo₂, hi₂) as a (4, rows) ``uint64`` array.
    """
    d = xu.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    flags = np.empty(CHUNK, dtype=np.uint8)
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        m_ = min(d, j0 + CHUNK) - j0
        xs = xu[r, j0 : j0 + m_]
        status[w] = natural_chunk(xs, outu[r, j0 : j0 + m_], k, r, j0, mant, words, flags)


# --------------------------------------------------------------------------------------------
# Top-k: sampled threshold, one candidate pass, exact selection with lowest-index tie-break
# --------------------------------------------------------------------------------------------
@njit(cache=True)
def _kth_smallest(a: np.ndarray, k: int) -> float:  # pragma: no cover - compiled
    """The k-th smallest entry (0-based) of ``a``, which is reordered in place: Wirth/Hoare
    quickselect with a median-of-three pivot (a small kernel that compiles in a fraction of the
    time of ``np.partition``)."""
    lo = 0
    hi = a.size - 1
    while hi > lo:
        mid = (lo + hi) >> 1
        x, y, z = a[lo], a[mid], a[hi]
        pivot = max(min(x, y), min(max(x, y), z))
        i = lo
        j = hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return a[k]  # type: ignore[no-any-return]
    return a[k]  # type: ignore[no-any-return]


@njit(cache=True)
def _select_exact(
    row: np.ndarray, cand: np.ndarray, k: int, idx: np.ndarray
) -> None:  # pragma: no cover
    """The k largest |row[c]| among the candidates (ascending), ties to the lower index."""
    c = cand.size
    if k == c:
        for i in range(c):
            idx[i] = cand[i]
        return
    vals = np.empty(c, dtype=row.dtype)
    for i in range(c):
        vals[i] = abs(row[cand[i]])
    kth = _kth_smallest(vals.copy(), c - k)
    need = k
    for i in range(c):
        if vals[i] > kth:
            need -= 1
    o = 0
    for i in range(c):
        v = vals[i]
        if v > kth:
            idx[o] = cand[i]
            o += 1
        elif v == kth and need > 0:
            idx[o] = cand[i]
            o += 1
            need -= 1


#: golden-ratio step of the sample positions (see :func:`_sample_abs`)
_PHI = 0.6180339887498949


@njit(cache=True, inline="always")
def _sample_abs(row: np.ndarray, sample: np.ndarray) -> None:  # pragma: no cover - compiled
    """|row| at ``sample.size`` positions j_i = ⌊frac(i·φ)·d⌋ (a Weyl sequence): spread over
    the row like an evenly strided sample, but without aliasing with the row length of a
    flattened matrix (a stride of d/4096 hits the same few columns of a 2048-column weight
    gradient, whose magnitudes depend on the column: the threshold then misled, and the exact
    fallback over all d entries ran)."""
    d = row.size
    for i in range(sample.size):
        t = i * _PHI
        sample[i] = abs(row[min(d - 1, int((t - math.floor(t)) * d))])


@njit(cache=True)
def _topk_row(row: np.ndarray, k: int, idx: np.ndarray) -> bool:  # pragma: no cover - compiled
    d = row.size
    if d >= 1 << 16 and k * 16 <= d:
        m = 4096
        sample = np.empty(m, dtype=row.dtype)
        _sample_abs(row, sample)
        mu = m * k / d
        rank = int(mu + 4.0 * math.sqrt(mu) + 4.0)
        if rank < m:
            tau = _kth_smallest(sample, m - rank)
            cap = int(3.0 * rank * d / m) + 1024
            cidx = np.empty(cap, dtype=np.int64)
            c = 0
            bad = False
            for j in range(d):
                v = row[j]
                a = abs(v)
                bad |= (v - v) != 0
                if a >= tau:
                    if c < cap:
                        cidx[c] = j
                    c += 1
            if bad:
                return False
            if k <= c <= cap:
                _select_exact(row, cidx[:c], k, idx)
                return True
    bad2 = False
    for j in range(d):
        v = row[j]
        bad2 |= (v - v) != 0
    if bad2:
        return False
    _select_exact(row, np.arange(d), k, idx)
    return True


#: size of the strided sample that sets the Top-k threshold
TOPK_SAMPLE = 4096


def topk_plan(d: int, k: int) -> tuple[int, int] | None:
    """(sample rank, per-chunk candidate slots) of the sampled Top-k path, or None when the
    direct selection is used (short rows, or k above d/16). The rank is the expected number of
    sampled entries above the k-th largest plus 4 standard deviations and 4, so that the
    threshold keeps at least k candidates except for adversarial layouts (then: fallback)."""
    if d < 1 << 16 or k * 16 > d:
        return None
    mu = TOPK_SAMPLE * k / d
    rank = int(mu + 4.0 * math.sqrt(mu) + 4.0)
    if rank >= TOPK_SAMPLE:
        return None
    return rank, min(CHUNK, int(3.0 * rank * CHUNK / TOPK_SAMPLE) + 64)


@njit(cache=True)
def topk_thresholds(x2: np.ndarray, rank: int, tau: np.ndarray) -> None:  # pragma: no cover
    """tau[r]: the rank-th largest |x_j| of a sample of row r (:func:`_sample_abs`)."""
    n = x2.shape[0]
    m = TOPK_SAMPLE
    sample = np.empty(m, dtype=x2.dtype)
    for r in range(n):
        _sample_abs(x2[r], sample)
        tau[r] = _kth_smallest(sample, m - rank)


@njit(cache=True, inline="always")
def _abs_mask(xu: np.ndarray) -> tuple[np.uint64, np.uint64]:  # pragma: no cover - compiled
    """(all bits but the sign, the exponent field) of the float type whose bit patterns ``xu``
    (unsigned integers of the same width; 16 bits: bfloat16) holds. For finite floats,
    magnitudes compare like their patterns with the sign cleared; inf and nan are the patterns
    ≥ the exponent field."""
    ut = xu.dtype.type
    nbits = 8 * xu.itemsize
    mant = 23 if nbits == 32 else (52 if nbits == 64 else 7)  # 16 bits: bfloat16
    mask = ut(~(ut(1) << ut(nbits - 1)))  # ut(): numba widens uint32 shifts to 64 bits
    return mask, ut(mask ^ ut((ut(1) << ut(mant)) - ut(1)))


#: 64-bit words of a chunk's candidate bitmask (one bit per entry)
_WORDS = (CHUNK + 63) >> 6


@njit(cache=True)
def _mask_block(xu: np.ndarray, tb: Any, bits: np.ndarray) -> None:  # pragma: no cover
    """Bit i of ``bits`` (word i // 64, bit i % 64) = |x_i| ≥ τ on the bit patterns ``xu``
    (τ's pattern ``tb``): a vectorizable loop of 64 comparisons per word. A bitmask, not one
    byte per entry, so that the scan that follows (:func:`_set_bits`) visits one word per 64
    entries."""
    mask, _ = _abs_mask(xu)
    m = xu.size
    full = m >> 6
    for w in range(full):
        acc = np.uint64(0)
        for j in range(64):
            acc |= np.uint64((xu[(w << 6) + j] & mask) >= tb) << np.uint64(j)
        bits[w] = acc
    if m & 63:
        acc = np.uint64(0)
        for i in range(full << 6, m):
            acc |= np.uint64((xu[i] & mask) >= tb) << np.uint64(i & 63)
        bits[full] = acc


@njit(cache=True, inline="always")
def _set_bits(bits: np.ndarray, m: int, pos: np.ndarray) -> int:  # pragma: no cover
    """The positions of the set bits of the bitmask of m entries ``bits``, ascending, into
    ``pos`` (at least m + 2 entries); returns their number. The first two of every word are
    written unconditionally and counted only where set (trailing-zero counts, with the top
    bit forced so that an empty word is defined), so the usual word of a Top-k threshold
    (at most two set bits) costs no mispredicted branch; a loop takes the rest."""
    top = np.uint64(1) << np.uint64(63)
    one = np.uint64(1)
    cnt = 0
    for w in range((m + 63) >> 6):
        word = bits[w]
        base = w << 6
        pos[cnt] = base + np.int64(trailing_zeros(word | top))  # type: ignore[call-arg]
        cnt += word != 0
        word &= word - one
        pos[cnt] = base + np.int64(trailing_zeros(word | top))
        cnt += word != 0
        word &= word - one
        while word:
            pos[cnt] = base + np.int64(trailing_zeros(word))
            cnt += 1
            word &= word - one
    return cnt


@njit(cache=True, inline="always")
def _candidates_chunk(  # pragma: no cover - compiled
    xs: np.ndarray,
    tbr: Any,
    bits: np.ndarray,
    pos: np.ndarray,
    so: np.ndarray,
    sr: np.ndarray,
) -> tuple[int, bool]:
    """The entries of the chunk ``xs`` (bit patterns) with |x_j| ≥ τ (pattern ``tbr``) into
    the slots ``so`` (offsets) / ``sr`` (patterns), counting beyond them; (count, whether one
    is inf or nan). A vectorized loop makes the chunk's bitmask (:func:`_mask_block`), a
    branch-light scan lists its set bits (:func:`_set_bits`, into the scratch ``pos``)."""
    _, emask = _abs_mask(xs)
    m = xs.size
    _mask_block(xs, tbr, bits)
    cnt = _set_bits(bits, m, pos)
    kept = min(cnt, so.size)
    bad = False
    for t in range(cnt):
        i = pos[t]
        v = xs[i]
        bad |= (v & emask) == emask
        if t < kept:
            so[t] = i
            sr[t] = v
    return cnt, bad


@njit(cache=True, nogil=True)
def topk_candidates(  # pragma: no cover - compiled
    xu: np.ndarray,
    tb: np.ndarray,
    slots: int,
    cand: np.ndarray,
    craw: np.ndarray,
    counts: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Work item (row r, chunk c) of the bit patterns ``xu``: the entries with |x_j| ≥ τ_r
    (pattern without sign ≥ tb[r]) into the chunk's slots — the offset in the chunk
    (``cand``, uint16) and the pattern (``craw``) — counting beyond the slots; NON_FINITE when
    one is inf or nan (tb[r] is at most the pattern of inf, so they are all candidates and
    only the candidates need checking). One read of x (:func:`_candidates_chunk`)."""
    d = xu.shape[1]
    nch = counts.shape[1]
    bits = np.empty(_WORDS, dtype=np.uint64)
    pos = np.empty(CHUNK + 2, dtype=np.int64)
    for w in range(w0, w1):
        r = w // nch
        c = w % nch
        j0 = c * CHUNK
        m = min(d, j0 + CHUNK) - j0
        cnt, bad = _candidates_chunk(
            xu[r, j0 : j0 + m],
            tb[r],
            bits,
            pos,
            cand[r, c * slots : (c + 1) * slots],
            craw[r, c * slots : (c + 1) * slots],
        )
        counts[r, c] = cnt
        status[w] = NON_FINITE if bad else OK


# --------------------------------------------------------------------------------------------
# Top-k of a difference a − b (EF21's C(∇f_i − g_i)) without forming it: every chunk of the
# difference is computed into a cache-resident scratch and selected from there
# --------------------------------------------------------------------------------------------
#: rounding of the difference before the selection: none, or to bfloat16 (round to nearest
#: even on the float32 patterns, exactly torch's ``.to(torch.bfloat16)``)
ROUND_NONE = 0
ROUND_BF16 = 1


@intrinsic
def _widen_bf16(typingctx: Any, u: Any) -> Any:  # pragma: no cover - compiled
    """The float32 that the bfloat16 of pattern ``u`` (uint16) is: u shifted up by 16 bits and
    read as a float32 (zero-extend, shift, bitcast; exact, NaN payloads included)."""
    if u != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(types.uint16), codegen


def load(a: np.ndarray, i: int) -> Any:
    """Entry ``i`` of ``a`` as a float: a float array's own entry, or for ``uint16`` (the bit
    patterns of a bfloat16 tensor, ``t.view(torch.int16).numpy().view(np.uint16)``) the
    float32 it widens to exactly — its 16 bits shifted up by 16, as torch's
    ``.to(torch.float32)`` does. The kernels of a − b below read their minuend through this,
    so a bfloat16 gradient is selected from without a float32 copy of it."""
    if a.dtype == np.uint16:
        return np.array([np.uint32(a[i]) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]
    return a[i]


@overload(load, inline="always")
def _load_overload(a: Any, i: Any) -> Any:  # pragma: no cover - compiled
    if isinstance(a, types.Array) and a.dtype == types.uint16:

        def widen(a: Any, i: Any) -> Any:
            return _widen_bf16(a[i])  # type: ignore[call-arg]

        return widen

    def own(a: Any, i: Any) -> Any:
        return a[i]

    return own


@njit(cache=True)
def _round_bf16_block(u: np.ndarray) -> None:  # pragma: no cover - compiled
    """float32 patterns ``u`` rounded in place to the nearest bfloat16 (ties to even), NaN to
    bfloat16's quiet NaN 0x7FC0 — the conversion of c10::BFloat16, back in float32 patterns."""
    for i in range(u.size):
        v = u[i]
        r = (v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        nan = (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        u[i] = np.uint32(0x7FC00000) if nan else r


@njit(cache=True)
def _sub_block(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """out = a − b (IEEE, element by element: torch.sub's values; ``a`` may be bfloat16
    patterns, widened by :func:`load`)."""
    for i in range(out.size):
        out[i] = load(a, i) - b[i]


@njit(cache=True, inline="always")
def _diff_chunk(  # pragma: no cover - compiled
    a: np.ndarray, b: np.ndarray, scratch: np.ndarray, su: np.ndarray, rnd: int
) -> np.ndarray:
    """The bit patterns of a − b (rounded to bfloat16 for ``rnd`` = ROUND_BF16, float32
    only) in ``scratch`` (a float vector of at least a.size entries; ``su``: its view as
    unsigned patterns); returns the patterns."""
    m = a.size
    _sub_block(a, b, scratch[:m])
    u = su[:m]
    if rnd == ROUND_BF16:
        _round_bf16_block(u)
    return u


@njit(cache=True)
def _mask_diff_block(  # pragma: no cover - compiled
    a: np.ndarray, b: np.ndarray, tau: Any, bits: np.ndarray
) -> None:
    """The bitmask of not (|a_i − b_i| < τ): |a_i − b_i| ≥ τ, or a − b is NaN — the test of
    :func:`_mask_block` on the difference, which is never stored (τ: the float of the
    threshold pattern)."""
    m = a.size
    full = m >> 6
    for w in range(full):
        acc = np.uint64(0)
        for j in range(64):
            i = (w << 6) + j
            acc |= np.uint64(not (abs(load(a, i) - b[i]) < tau)) << np.uint64(j)
        bits[w] = acc
    if m & 63:
        acc = np.uint64(0)
        for i in range(full << 6, m):
            acc |= np.uint64(not (abs(load(a, i) - b[i]) < tau)) << np.uint64(i & 63)
        bits[full] = acc


@njit(cache=True, inline="always")
def _candidates_diff_chunk(  # pragma: no cover - compiled
    a: np.ndarray,
    b: np.ndarray,
    tau: Any,
    bits: np.ndarray,
    pos: np.ndarray,
    so: np.ndarray,
    sr: np.ndarray,
    scratch: np.ndarray,
    su: np.ndarray,
    rnd: int,
) -> tuple[int, bool]:
    """:func:`_candidates_chunk` of a − b in one read of a and b: the bitmask comes from the
    difference in registers (``tau``: a float threshold on |a − b|, for ROUND_BF16 the
    smallest magnitude that rounds to the bfloat16 threshold or above), and only the
    candidates' differences are computed again, into ``scratch`` (``su``: its pattern view),
    and rounded there as one block."""
    _, emask = _abs_mask(su)
    _mask_diff_block(a, b, tau, bits)
    cnt = _set_bits(bits, a.size, pos)
    for t in range(cnt):
        i = pos[t]
        scratch[t] = load(a, i) - b[i]
    us = su[:cnt]
    if rnd == ROUND_BF16:
        _round_bf16_block(us)
    bad = False
    for t in range(cnt):
        bad |= (us[t] & emask) == emask
    kept = min(cnt, so.size)
    for t in range(kept):
        so[t] = pos[t]
        sr[t] = us[t]
    return cnt, bad


@njit(cache=True)
def topk_thresholds_diff(  # pragma: no cover - compiled
    a2: np.ndarray, b2: np.ndarray, rnd: int, rank: int, tau: np.ndarray, tb: np.ndarray
) -> None:
    """:func:`topk_thresholds` of the rows of a − b (rounded as ``rnd`` says), from the same
    sample positions (``tb``: any array of the patterns' unsigned type)."""
    n, d = a2.shape
    m = TOPK_SAMPLE
    sa = np.empty(m, dtype=a2.dtype)
    sb = np.empty(m, dtype=b2.dtype)
    sample = np.empty(m, dtype=b2.dtype)
    su = sample.view(tb.dtype)
    for r in range(n):
        for i in range(m):
            t = i * _PHI
            j = min(d - 1, int((t - math.floor(t)) * d))
            sa[i] = a2[r, j]
            sb[i] = b2[r, j]
        _diff_chunk(sa, sb, sample, su, rnd)
        for i in range(m):
            sample[i] = abs(sample[i])
        tau[r] = _kth_smallest(sample, m - rank)


@njit(cache=True, nogil=True)
def topk_candidates_diff(  # pragma: no cover - compiled
    a2: np.ndarray,
    b2: np.ndarray,
    rnd: int,
    tb: np.ndarray,
    slots: int,
    cand: np.ndarray,
    craw: np.ndarray,
    counts: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """:func:`topk_candidates` of the rows of a − b (rounded as ``rnd`` says): each chunk of
    the difference is computed into a scratch that stays in cache, so the pass reads a and b
    once and writes nothing of size d."""
    d = a2.shape[1]
    nch = counts.shape[1]
    bits = np.empty(_WORDS, dtype=np.uint64)
    pos = np.empty(CHUNK + 2, dtype=np.int64)
    scratch = np.empty(CHUNK, dtype=b2.dtype)
    su = scratch.view(tb.dtype)
    taus = np.empty(tb.size, dtype=b2.dtype)
    tu = taus.view(tb.dtype)
    tu[:] = tb  # the thresholds as floats (patterns of non-negative floats)
    if rnd == ROUND_BF16:
        # |⌊v⌉₁₆| ≥ T (T a bfloat16 pattern: low 16 bits zero) ⟺ |v| ≥ the midpoint below T,
        # included when T's last bfloat16 bit is even (ties to even), else the next float;
        # a threshold that is no bfloat16 (the clipped 0) takes the two-pass path (τ = 0)
        for r in range(tb.size):
            t = tb[r]
            if (t & 0xFFFF) != 0:
                taus[r] = 0.0
            else:
                tu[r] = t - 0x8000 + ((t >> 16) & 1)
    for w in range(w0, w1):
        r = w // nch
        c = w % nch
        j0 = c * CHUNK
        m = min(d, j0 + CHUNK) - j0
        so = cand[r, c * slots : (c + 1) * slots]
        sr = craw[r, c * slots : (c + 1) * slots]
        if rnd == ROUND_NONE or taus[r] > 0:
            a = a2[r, j0 : j0 + m]
            b = b2[r, j0 : j0 + m]
            cnt, bad = _candidates_diff_chunk(a, b, taus[r], bits, pos, so, sr, scratch, su, rnd)
        else:
            xs = _diff_chunk(a2[r, j0 : j0 + m], b2[r, j0 : j0 + m], scratch, su, rnd)
            cnt, bad = _candidates_chunk(xs, tb[r], bits, pos, so, sr)
        counts[r, c] = cnt
        status[w] = NON_FINITE if bad else OK


#: the k-th largest magnitude among the candidates is found in a histogram of the top 16 bits
#: of their patterns (sign cleared), then by quickselect within its bucket
_TOPK_BUCKET_BITS = 16


@njit(cache=True)
def topk_select(  # pragma: no cover - compiled
    x2: np.ndarray,
    xu: np.ndarray,
    k: int,
    tb: np.ndarray,
    slots: int,
    cand: np.ndarray,
    craw: np.ndarray,
    counts: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    starts: np.ndarray,
    b2: np.ndarray,
    rnd: int,
) -> int:
    """Exact Top-k of every row among its candidates (:func:`topk_candidates`): ``idx[r]``
    (ascending) and the kept patterns ``vals[r]``; ``starts[r, c]`` is the first of them in
    chunk c. ``x2``/``xu``: the rows as floats and as bit patterns. With a non-empty ``b2``
    the rows are those of x2 − b2 (rounded as ``rnd`` says; :func:`topk_candidates_diff`),
    recomputed chunk by chunk where the rows are read again.

    The k-th largest magnitude κ: a histogram of the candidates' patterns by their top 16 bits
    (sign cleared) gives its bucket, a quickselect within that bucket its value. Then one scan
    in index order keeps the entries > κ and the first k − #(> κ) entries = κ (ties to the
    lower index). A chunk with more candidates than its slots (the large entries of a weight
    gradient come in whole rows of the matrix, so they cluster) is scanned again for them;
    only a row that kept fewer than k candidates (a misleading sample) is redone by
    :func:`_topk_row`."""
    n, nch = counts.shape
    d = xu.shape[1]
    ut = xu.dtype.type
    mask, _ = _abs_mask(xu)
    shift = ut(8 * xu.itemsize - 1 - _TOPK_BUCKET_BITS)
    hist = np.empty(1 << _TOPK_BUCKET_BITS, dtype=np.int64)
    est = np.empty(nch, dtype=np.int64)
    diff = b2.shape[0] > 0
    scratch = np.empty(CHUNK if diff else 0, dtype=b2.dtype)  # (b2: x2's dtype, or floats)
    su = scratch.view(xu.dtype)
    for r in range(n):
        row = xu[r]
        total = 0
        ext_n = 0
        for c in range(nch):
            total += counts[r, c]
            if counts[r, c] > slots:
                ext_n += counts[r, c]
        if total < k:
            if diff:  # the whole difference, once (a misleading sample: rare)
                xr = np.empty(d, dtype=b2.dtype)
                for c in range(nch):
                    j0 = c * CHUNK
                    j1 = min(d, j0 + CHUNK)
                    _diff_chunk(x2[r, j0:j1], b2[r, j0:j1], scratch, su, rnd)
                    xr[j0:j1] = scratch[: j1 - j0]
                row = xr.view(xu.dtype)
                found = _topk_row(xr, k, idx[r])
            else:
                found = _topk_row(x2[r], k, idx[r])
            if not found:
                return NON_FINITE
            c = 0
            starts[r, 0] = 0
            for t in range(k):
                j = idx[r, t]
                vals[r, t] = row[j]
                while j >= (c + 1) * CHUNK:
                    c += 1
                    starts[r, c] = t
            for c2 in range(c + 1, nch + 1):
                starts[r, c2] = k
            continue
        # the candidates of overflowing chunks, scanned again into a buffer of their own
        eo = np.empty(ext_n, dtype=np.uint16)
        er = np.empty(ext_n, dtype=xu.dtype)
        p = 0
        for c in range(nch):
            est[c] = p
            if counts[r, c] > slots:
                j0 = c * CHUNK
                j1 = min(d, j0 + CHUNK)
                if diff:
                    rc = _diff_chunk(x2[r, j0:j1], b2[r, j0:j1], scratch, su, rnd)
                else:
                    rc = row[j0:j1]
                for i in range(j1 - j0):
                    v = rc[i]
                    if (v & mask) >= tb[r]:
                        eo[p] = i
                        er[p] = v
                        p += 1
        hist[:] = 0
        for c in range(nch):
            cnt = counts[r, c]
            raws = (
                craw[r, c * slots : c * slots + cnt] if cnt <= slots else er[est[c] : est[c] + cnt]
            )
            for t in range(cnt):
                hist[(raws[t] & mask) >> shift] += 1
        b = hist.size - 1
        above = 0
        while above + hist[b] < k:
            above += hist[b]
            b -= 1
        bv = np.empty(hist[b], dtype=xu.dtype)
        p = 0
        for c in range(nch):
            cnt = counts[r, c]
            raws = (
                craw[r, c * slots : c * slots + cnt] if cnt <= slots else er[est[c] : est[c] + cnt]
            )
            for t in range(cnt):
                a = raws[t] & mask
                if (a >> shift) == b:
                    bv[p] = a
                    p += 1
        kth = _kth_smallest(bv, bv.size - (k - above))
        need = k - above
        for t in range(bv.size):
            need -= bv[t] > kth
        o = 0
        for c in range(nch):
            starts[r, c] = o
            cnt = counts[r, c]
            if cnt <= slots:
                offs = cand[r, c * slots : c * slots + cnt]
                raws = craw[r, c * slots : c * slots + cnt]
            else:
                offs = eo[est[c] : est[c] + cnt]
                raws = er[est[c] : est[c] + cnt]
            j0 = c * CHUNK
            for t in range(cnt):  # branch-free: the slot o is written, then kept or not
                a = raws[t] & mask
                eq = a == kth
                keep = (a > kth) | (eq & (need > 0))
                need -= keep & eq
                if o < k:  # (false only after the k-th kept entry)
                    idx[r, o] = j0 + np.int64(offs[t])
                    vals[r, o] = raws[t]
                o += keep
        starts[r, nch] = o
    return OK


@njit(cache=True)
def _zero_block(os: np.ndarray) -> None:  # pragma: no cover - compiled
    """os = 0, written as four interleaved streams (one core keeps more memory requests in
    flight that way: a single-stream pass over 40 MB from DRAM took 3.9 ms on one thread,
    four streams 3.0 ms)."""
    z = os.dtype.type(0)
    q = os.size // 4
    for i in range(q):
        os[i] = z
        os[q + i] = z
        os[2 * q + i] = z
        os[3 * q + i] = z
    for i in range(4 * q, os.size):
        os[i] = z


@njit(cache=True, nogil=True)
def topk_write(  # pragma: no cover - compiled
    outu: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    starts: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Work item (row r, chunk c) of the dense output (bit patterns): zero the chunk and write
    its kept entries (:func:`topk_select`) while it is in cache."""
    d = outu.shape[1]
    nch = starts.shape[1] - 1
    for w in range(w0, w1):
        r = w // nch
        c = w % nch
        j0 = c * CHUNK
        _zero_block(outu[r, j0 : min(d, j0 + CHUNK)])
        o = outu[r]
        for t in range(starts[r, c], starts[r, c + 1]):
            o[idx[r, t]] = vals[r, t]
        status[w] = OK


#: up to this k, short rows find the k-th largest magnitude by insertion into a sorted buffer
TOPK_INSERT_K = 16


@njit(cache=True)
def _top1_row(xu: np.ndarray) -> int:  # pragma: no cover - compiled
    """Index of the first largest |x_j| of a row given as bit patterns ``xu``, or −1 when the
    row holds inf or nan. Two vectorizable passes instead of one branchy argmax: the largest
    pattern with the sign cleared (magnitudes of finite floats order like it; inf and nan are
    the patterns ≥ the exponent field), then the first entry that has it (−0 and +0 share the
    pattern 0, so an all-zero row gives index 0)."""
    mask, emask = _abs_mask(xu)
    m = xu.dtype.type(0)
    for i in range(xu.size):
        a = xu[i] & mask
        m = a if a > m else m
    if m >= emask:
        return -1
    for i in range(xu.size):
        if (xu[i] & mask) == m:
            return i
    return 0


@njit(cache=True)
def _zero_row(o: np.ndarray) -> None:  # pragma: no cover - compiled
    """o = 0 for a short row (a standalone loop that LLVM vectorizes; inlined into a driver it
    was not). :func:`_zero_block`'s four streams pay off on long chunks only: on the rows of a
    (1000, 123) batch they made :func:`top1_rows` 1.8× slower."""
    z = o.dtype.type(0)
    for i in range(o.size):
        o[i] = z


@njit(cache=True, nogil=True)
def top1_rows(  # pragma: no cover - compiled
    xu: np.ndarray, idx: np.ndarray, outu: np.ndarray
) -> int:
    """Top-1 of every row of the bit patterns ``xu`` (:func:`_top1_row`) into ``idx[:, 0]``;
    when ``outu`` has the rows of ``xu`` also the dense result (its patterns: zeros and the kept
    entry). NON_FINITE on inf/nan. The simulator's EF21 + top_k[k=1] path: (1000, 123)
    float64 in 0.1 ms instead of 0.25 ms with one branchy argmax pass per row."""
    n = xu.shape[0]
    dense = outu.shape[0] == n
    for r in range(n):
        j = _top1_row(xu[r])
        if j < 0:
            return NON_FINITE
        idx[r, 0] = j
        if dense:
            _zero_row(outu[r])
            outu[r, j] = xu[r, j]
    return OK


#: rows per block of :func:`shifted_top1_rows` (one ``prange`` iteration and its scratch row)
SHIFTED_BLOCK = 128


def _shifted_top1_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    h2: np.ndarray,
    buf: np.ndarray,
    bu: np.ndarray,
    c2: np.ndarray,
    g2: np.ndarray,
    flat: np.ndarray,
    vals: np.ndarray,
) -> int:
    """The shifted Top-1 of every row in one pass (``TopK.shifted``): c = Top-1(x − h) into
    ``c2`` and h + c into ``g2``, with the values of ``torch.sub``, :func:`top1_rows` and
    ``torch.add`` bit for bit (each is an exact IEEE operation per entry). NON_FINITE when a
    row of x − h holds inf or nan. On the simulator's (1000, 123) float64 batches one pass over
    x, h and the outputs replaces three, and two fresh (n, d) temporaries. Blocks of
    :data:`SHIFTED_BLOCK` rows, each with its scratch row ``buf[b]`` of x − h (``buf`` of shape
    (blocks, d), ``bu`` its bit patterns, the same memory); every row's result depends on that
    row only, so the threaded twin (``shifted_top1_rows_threads``, ``prange`` over the blocks)
    gives the same bits.

    The sparse form (``TopK.shifted_sparse``): when ``flat`` has one entry per row, row r's
    kept entry goes there as its flat position r·d + j in the (n, d) batch, with its value in
    ``vals[r]``; an empty ``c2`` (no rows) then skips the dense c, and g = h except
    g[r, j] = h[r, j] + c[r, j] (``rules.add_message`` of a SparseMessage: h_j itself, not
    h_j + 0, elsewhere)."""
    n, d = x2.shape
    dense = c2.shape[0] == n
    sparse = flat.shape[0] == n
    blocks = (n + SHIFTED_BLOCK - 1) // SHIFTED_BLOCK
    status = np.zeros(blocks, dtype=np.int64)
    for b in prange(blocks):
        sb = buf[b]
        su = bu[b]
        for r in range(b * SHIFTED_BLOCK, min(n, (b + 1) * SHIFTED_BLOCK)):
            xr = x2[r]
            hr = h2[r]
            for q in range(d):
                sb[q] = xr[q] - hr[q]
            j = _top1_row(su)
            if j < 0:
                status[b] = NON_FINITE
                break
            if sparse:
                flat[r] = r * d + j
                vals[r] = sb[j]
            gr = g2[r]
            if dense:
                cr = c2[r]
                _zero_row(cr)
                cr[j] = sb[j]
                for q in range(d):
                    gr[q] = hr[q] + cr[q]
            else:
                for q in range(d):
                    gr[q] = hr[q]
                gr[j] = hr[j] + sb[j]
    for b in range(blocks):
        if status[b] != OK:
            return NON_FINITE
    return OK


#: serial, and over numba threads (the same code, a cache of its own: ``_numba_twin``)
shifted_top1_rows = njit(cache=True, nogil=True)(_shifted_top1_rows)
shifted_top1_rows_threads = njit(cache=True, nogil=True, parallel=True)(twin(_shifted_top1_rows))


@njit(cache=True, inline="always")
def _write_kept(orow: np.ndarray, row: np.ndarray, kept: np.ndarray) -> None:  # pragma: no cover
    """The dense result of one row: zeros, and row[j] at the kept indices j."""
    for i in range(orow.size):
        orow[i] = 0
    for t in range(kept.size):
        orow[kept[t]] = row[kept[t]]


@njit(cache=True, nogil=True)
def topk_rows(  # pragma: no cover - compiled
    x2: np.ndarray, k: int, idx: np.ndarray, out: np.ndarray
) -> int:
    """Indices (ascending) of the k largest |x_j| of every row, ties to the lower index, by
    one selection per row (the path for short rows, e.g. the simulator's (1000, 123) batches,
    and for k > d/16); NON_FINITE on inf/nan. When ``out`` has the rows of ``x2`` it also
    receives the dense result (zeros and the kept entries); pass an empty array to skip it.

    (k = 1 has its own kernel, :func:`top1_rows`.) The k-th largest magnitude τ is
    found — for k ≤ :data:`TOPK_INSERT_K` in the finiteness pass, by insertion into a sorted
    buffer of the k largest so far (few entries get past its last one), else by quickselect on
    a copy — and one pass collects the entries ≥ τ: the kept ones are those > τ and the first
    entries = τ."""
    n, d = x2.shape
    a = np.empty(d, dtype=x2.dtype)
    top = np.empty(k, dtype=x2.dtype)
    cand = np.empty(d, dtype=np.int64)
    dense = out.shape[0] == n
    for r in range(n):
        row = x2[r]
        bad = np.uint8(0)
        if k <= TOPK_INSERT_K:
            top[:] = -1.0
            for i in range(d):
                v = row[i]
                bad |= np.uint8((v - v) != 0)
                av = abs(v)
                if av > top[k - 1]:
                    p = k - 1
                    while p > 0 and top[p - 1] < av:
                        top[p] = top[p - 1]
                        p -= 1
                    top[p] = av
            kth = top[k - 1]
        else:
            for i in range(d):
                v = row[i]
                bad |= np.uint8((v - v) != 0)
                a[i] = abs(v)
            kth = _kth_smallest(a, d - k) if not bad else a[0]
        if bad:
            return NON_FINITE
        c = 0
        above = 0
        for i in range(d):
            av = abs(row[i])
            if av >= kth:
                cand[c] = i
                c += 1
                above += av > kth
        need = k - above
        o = 0
        for t in range(c):
            i = cand[t]
            if abs(row[i]) > kth:
                idx[r, o] = i
                o += 1
            elif need > 0:
                idx[r, o] = i
                o += 1
                need -= 1
        if dense:
            _write_kept(out[r], row, idx[r])
    return OK


#: rows of at least this many float32 entries (and no sampling plan) take
#: :func:`topk_rows_hist` instead of :func:`topk_rows`' quickselect over a copy
TOPK_HIST_MIN = 4096
#: the histogram of :func:`topk_rows_hist`: the top bits of the magnitudes' patterns (the 8
#: exponent bits and 4 of the mantissa; 4096 counters, an L1-resident table)
TOPK_HIST_BITS = 12


@njit(cache=True, nogil=True)
def topk_rows_hist(  # pragma: no cover - compiled
    xu: np.ndarray, k: int, idx: np.ndarray, outu: np.ndarray
) -> int:
    """:func:`topk_rows` for float32 rows given by their bit patterns ``xu`` (uint32), with the
    same result: the indices (ascending) of the k largest |x_j| of every row, ties to the lower
    index, the dense result into ``outu`` when it has the rows of ``xu`` (patterns), NON_FINITE
    on inf/nan. For finite floats the magnitudes order like their patterns with the sign
    cleared (−0 and +0 both 0: equal, as ``abs`` makes them), so the selection runs on
    integers: a histogram of the top :data:`TOPK_HIST_BITS` bits of every magnitude (one pass,
    which also checks finiteness) gives the bucket of the k-th largest, a quickselect among that
    bucket's entries its exact value κ, and one pass in index order keeps the entries > κ and
    the first k − #(> κ) entries = κ. Three reads of a row that stays in cache, instead of the
    copy and the quickselect of the whole row (the rows of 4 k–64 k entries of a DDP hook's
    weight matrices: ≈ 5× faster)."""
    n, d = xu.shape
    dense = outu.shape[0] == n
    nb = 1 << TOPK_HIST_BITS
    shift = np.uint32(31 - TOPK_HIST_BITS)
    mask = np.uint32(0x7FFFFFFF)
    expo = np.uint32(0x7F800000)
    hist = np.empty(nb, dtype=np.int64)
    buck = np.empty(d, dtype=np.uint32)
    for r in range(n):
        row = xu[r]
        hist[:] = 0
        worst = np.uint32(0)
        for i in range(d):
            m = row[i] & mask
            worst = max(worst, m)
            hist[m >> shift] += 1
        if worst >= expo:
            return NON_FINITE
        above = 0  # entries in the buckets above b
        b = nb - 1
        while above + hist[b] < k:
            above += hist[b]
            b -= 1
        c = 0
        ub = np.uint32(b)
        for i in range(d):
            m = row[i] & mask
            if (m >> shift) == ub:
                buck[c] = m
                c += 1
        need = k - above  # 1 ≤ need ≤ c: taken from bucket b
        kappa = _kth_smallest(buck[:c], c - need)
        gt = above
        for t in range(c):
            gt += buck[t] > kappa
        eq = k - gt  # the entries = κ to keep, the first ones
        o = 0
        for i in range(d):
            m = row[i] & mask
            if m > kappa:
                idx[r, o] = i
                o += 1
            elif m == kappa and eq > 0:
                idx[r, o] = i
                o += 1
                eq -= 1
            if o == k:
                break
        if dense:
            _write_kept(outu[r], row, idx[r])
    return OK


# --------------------------------------------------------------------------------------------
# rand-k indices: a keyed Feistel permutation with cycle walking, then a uniform rotation
# --------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _feistel(  # pragma: no cover - compiled
    v: np.uint64,
    m: np.uint64,
    mask_lo: np.uint64,
    hmask: np.uint64,
    nb: np.uint64,
    r0: np.uint64,
    r1: np.uint64,
    r2: np.uint64,
    r3: np.uint64,
) -> np.uint64:
    """A 4-round Feistel permutation of Z_nb × Z_{2^m} (``sparse.randk_domain``): the left half
    adds a round value modulo nb, the right half XORs one (each round a bijection)."""
    left = v >> m
    right = v & mask_lo
    f = mix32(right ^ r0) & hmask
    f = f - nb if f >= nb else f
    left += f
    left = left - nb if left >= nb else left
    right ^= mix32(left ^ r1) & mask_lo
    f = mix32(right ^ r2) & hmask
    f = f - nb if f >= nb else f
    left += f
    left = left - nb if left >= nb else left
    right ^= mix32(left ^ r3) & mask_lo
    return (left << m) | right


@njit(cache=True, inline="always")
def _rotation(  # pragma: no cover - compiled
    k0: np.uint64, k1: np.uint64, ud: np.uint64, rot_tries: int
) -> np.uint64:
    """ρ of the row key (k0, k1): the first of its words 4, 5, … below the largest multiple of
    d under 2³² (rejection sampling), mod d; the last word tried if all are rejected."""
    limit = np.uint64(4294967296) - (np.uint64(4294967296) % ud)
    rot = np.uint64(0)
    for t in range(rot_tries):
        word = bits32(k0, k1, np.uint64(4 + t))
        rot = word % ud
        if word < limit:
            break
    return rot


@njit(cache=True)
def randk_indices(  # pragma: no cover - compiled
    lo: np.ndarray,
    hi: np.ndarray,
    d: int,
    k: int,
    rot_tries: int,
    idx: np.ndarray,
    dom: tuple[int, int, int, int],
) -> None:
    """idx[r, i] = (π_r(i) + ρ_r) mod d for i < k (twin of ``sparse.randk_indices_torch``);
    ``dom`` = (m, mask_lo, hmask, nb) = ``sparse.randk_domain(d)``."""
    um = np.uint64(dom[0])
    ulo = np.uint64(dom[1])
    uh = np.uint64(dom[2])
    unb = np.uint64(dom[3])
    ud = np.uint64(d)
    for r in range(lo.shape[0]):
        k0 = lo[r]
        k1 = hi[r]
        r0 = bits32(k0, k1, np.uint64(0))
        r1 = bits32(k0, k1, np.uint64(1))
        r2 = bits32(k0, k1, np.uint64(2))
        r3 = bits32(k0, k1, np.uint64(3))
        rot = _rotation(k0, k1, ud, rot_tries)
        row = idx[r]
        for i in range(k):
            y = _feistel(np.uint64(i), um, ulo, uh, unb, r0, r1, r2, r3)
            while y >= ud:
                y = _feistel(y, um, ulo, uh, unb, r0, r1, r2, r3)
            row[i] = np.int64((y + rot) % ud)


@njit(cache=True, inline="always")
def _feistel32(  # pragma: no cover - compiled
    v: np.uint32,
    m: np.uint32,
    mask_lo: np.uint32,
    hmask: np.uint32,
    nb: np.uint32,
    r0: np.uint32,
    r1: np.uint32,
    r2: np.uint32,
    r3: np.uint32,
) -> np.uint32:
    """:func:`_feistel` in wrapping ``uint32`` arithmetic (the same values for d ≤ 2³²: the
    domain nb·2^m ≤ 2³² and every intermediate fits in 32 bits), which LLVM vectorizes (the
    conditional subtractions become selects)."""
    left = v >> m
    right = v & mask_lo
    f = mix32_u32(right ^ r0) & hmask
    f = np.uint32(f - nb) if f >= nb else f
    left = np.uint32(left + f)
    left = np.uint32(left - nb) if left >= nb else left
    right ^= mix32_u32(left ^ r1) & mask_lo
    f = mix32_u32(right ^ r2) & hmask
    f = np.uint32(f - nb) if f >= nb else f
    left = np.uint32(left + f)
    left = np.uint32(left - nb) if left >= nb else left
    right ^= mix32_u32(left ^ r3) & mask_lo
    return (left << m) | right


@njit(cache=True)
def _feistel_fill(  # pragma: no cover - compiled
    i0: int,
    y: np.ndarray,
    m: np.uint32,
    mask_lo: np.uint32,
    hmask: np.uint32,
    nb: np.uint32,
    r0: np.uint32,
    r1: np.uint32,
    r2: np.uint32,
    r3: np.uint32,
) -> None:
    """y[t] = π(i0 + t) before cycle walking (a vectorizable loop)."""
    for t in range(y.size):
        y[t] = _feistel32(np.uint32(i0 + t), m, mask_lo, hmask, nb, r0, r1, r2, r3)


@njit(cache=True)
def _feistel_again(  # pragma: no cover - compiled
    v: np.ndarray,
    m: np.uint32,
    mask_lo: np.uint32,
    hmask: np.uint32,
    nb: np.uint32,
    r0: np.uint32,
    r1: np.uint32,
    r2: np.uint32,
    r3: np.uint32,
) -> None:
    """v[s] = π(v[s]): one cycle-walking step of a list of values (a vectorizable loop)."""
    for s in range(v.size):
        v[s] = _feistel32(v[s], m, mask_lo, hmask, nb, r0, r1, r2, r3)


@njit(cache=True, nogil=True)
def randk_block(  # pragma: no cover - compiled
    lo: np.ndarray,
    hi: np.ndarray,
    d: int,
    rot_tries: int,
    idx: np.ndarray,
    dom: tuple[int, int, int, int],
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """:func:`randk_indices` for d ≤ 2³², as work items (row r, block of CHUNK indices) for
    :func:`run`: the Feistel permutation of a whole block in one vectorized loop, then the
    cycle walk of the values still ≥ d (< 2^m / (nb·2^m) = 1/nb ≈ 1/√d of them) in vectorized
    rounds over a shrinking list. The same indices as :func:`randk_indices`."""
    k = idx.shape[1]
    nch = (k + CHUNK - 1) // CHUNK
    um = np.uint32(dom[0])
    ulo = np.uint32(dom[1])
    uh = np.uint32(dom[2])
    unb = np.uint32(dom[3])
    ud = np.uint64(d)
    y = np.empty(CHUNK, dtype=np.uint32)
    pending = np.empty(CHUNK, dtype=np.int64)
    values = np.empty(CHUNK, dtype=np.uint32)
    for w in range(w0, w1):
        r = w // nch
        i0 = (w % nch) * CHUNK
        cnt = min(k, i0 + CHUNK) - i0
        k0 = lo[r]
        k1 = hi[r]
        r0 = np.uint32(bits32(k0, k1, np.uint64(0)))
        r1 = np.uint32(bits32(k0, k1, np.uint64(1)))
        r2 = np.uint32(bits32(k0, k1, np.uint64(2)))
        r3 = np.uint32(bits32(k0, k1, np.uint64(3)))
        rot = _rotation(k0, k1, ud, rot_tries)
        _feistel_fill(i0, y[:cnt], um, ulo, uh, unb, r0, r1, r2, r3)
        npend = 0
        for t in range(cnt):
            if np.uint64(y[t]) >= ud:
                pending[npend] = t
                values[npend] = y[t]
                npend += 1
        while npend > 0:  # cycle walking: the values still >= d, one step per round
            _feistel_again(values[:npend], um, ulo, uh, unb, r0, r1, r2, r3)
            q = 0
            for s in range(npend):
                v = values[s]
                if np.uint64(v) >= ud:
                    pending[q] = pending[s]
                    values[q] = v
                    q += 1
                else:
                    y[pending[s]] = v
            npend = q
        row = idx[r]
        for t in range(cnt):
            u = np.uint64(y[t]) + rot
            row[i0 + t] = np.int64(u - ud if u >= ud else u)
        status[w] = OK


@njit(cache=True)
def bucket_by_chunk(  # pragma: no cover - compiled
    idx: np.ndarray, order: np.ndarray, starts: np.ndarray, positions: bool = False
) -> None:
    """Counting sort of every row's indices by chunk (j ≫ log₂ CHUNK), keeping their order
    within a chunk: chunk c of row r holds ``order[r, starts[r, c]:starts[r, c + 1]]`` — the
    indices j themselves, or with ``positions`` their positions i in ``idx[r]`` and their
    offsets in the chunk, packed as i·CHUNK + (j mod CHUNK) (so that a kernel reads the
    chunk's values in one sequential sweep of ``order`` and fills them in the generation
    order, without a random read of ``idx``: 0.85× for the bucketing and gather of rand-k 1 %
    of 4 M entries)."""
    n, k = idx.shape
    nch = starts.shape[1] - 1
    pos = np.empty(nch, dtype=np.int64)
    shift = np.int64(CHUNK_BITS)
    low = np.int64(CHUNK - 1)
    for r in range(n):
        s = starts[r]
        s[:] = 0
        for i in range(k):
            s[(idx[r, i] >> shift) + 1] += 1
        for c in range(nch):
            s[c + 1] += s[c]
            pos[c] = s[c]
        for i in range(k):
            j = idx[r, i]
            c = j >> shift
            order[r, pos[c]] = (np.int64(i) << shift) | (j & low) if positions else j
            pos[c] += 1


@njit(cache=True, nogil=True)
def sparse_gather(  # pragma: no cover - compiled
    x2: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    scale: np.ndarray,
    vals: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """The sparse form of rand-k without a dense output: chunk by chunk, one vectorizable pass
    checks x finite (NON_FINITE), then the chunk's kept values (:func:`bucket_by_chunk` with
    ``positions``: i·CHUNK + the offset of j = idx[r, i] in the chunk) are read while the chunk
    is in cache, vals[r, i] = x[r, j] · scale[0] (OVERFLOW if a product leaves the dtype's
    range). ``x2`` may be bfloat16 patterns (:func:`load`; then ``scale`` and ``vals`` are
    float32: the products of the widened values)."""
    d = x2.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    sc = scale[0]
    shift = np.int64(CHUNK_BITS)
    low = np.int64(CHUNK - 1)
    for w in range(w0, w1):
        r = w // nch
        c = w % nch
        j0 = c * CHUNK
        st = NON_FINITE if _check_block(x2[r, j0 : min(d, j0 + CHUNK)]) else OK
        row = x2[r]
        for t in range(starts[r, c], starts[r, c + 1]):
            o = order[r, t]
            i = o >> shift
            v = load(row, j0 + (o & low)) * sc
            if not (abs(v) < np.inf) and st == OK:
                st = OVERFLOW
            vals[r, i] = v
        status[w] = st


@njit(cache=True, nogil=True)
def sparse_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    scale: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """out = 0 except out[r, j] = x[r, j] · scale[0] for the kept j, chunk by chunk: one pass
    zeroes the chunk and checks its x finite (NON_FINITE), then the chunk's kept entries
    (:func:`bucket_by_chunk`) are written while both are in cache (OVERFLOW if a product
    leaves the dtype's range)."""
    d = x2.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    sc = scale[0]
    for w in range(w0, w1):
        r = w // nch
        c = w % nch
        j0 = c * CHUNK
        j1 = min(d, j0 + CHUNK)
        st = NON_FINITE if _zero_check_block(x2[r, j0:j1], out[r, j0:j1]) else OK
        row = x2[r]
        o = out[r]
        for t in range(starts[r, c], starts[r, c + 1]):
            j = order[r, t]
            v = row[j] * sc
            if not (abs(v) < np.inf) and st == OK:
                st = OVERFLOW
            o[j] = v
        status[w] = st


def _patterns(xs: np.ndarray) -> np.ndarray:
    """The bit patterns of a float32/float64 array as unsigned integers of its width (a view);
    any other array (bfloat16 patterns, uint16) as it is."""
    if xs.dtype == np.float32:
        return xs.view(np.uint32)
    if xs.dtype == np.float64:
        return xs.view(np.uint64)
    return xs


@overload(_patterns, inline="always")
def _patterns_overload(xs: Any) -> Any:  # pragma: no cover - compiled
    if isinstance(xs, types.Array) and xs.dtype in (types.float32, types.float64):
        utype = np.uint32 if xs.dtype == types.float32 else np.uint64

        def view(xs: Any) -> Any:
            return xs.view(utype)

        return view

    def own(xs: Any) -> Any:
        return xs

    return own


@njit(cache=True)
def _zero_check_block(xs: np.ndarray, os: np.ndarray) -> bool:  # pragma: no cover - compiled
    """os = 0 and whether xs holds inf or nan, in one vectorizable pass (the check of
    :func:`_check_block`)."""
    xu = _patterns(xs)
    mask, emask = _abs_mask(xu)
    m = xu.dtype.type(0)
    zero = os.dtype.type(0.0)
    for i in range(xu.size):
        m = max(m, xu[i] & mask)
        os[i] = zero
    return bool(m >= emask)


@njit(cache=True)
def _check_block(xs: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Whether xs (contiguous float32/float64, or bfloat16 patterns as uint16) holds inf or
    nan: the largest magnitude pattern (sign bit cleared) is at least the exponent field. An
    unsigned max reduction, which LLVM vectorizes (integer max is associative; the float
    comparisons of an ordered loop are not reordered), reads xs at a cold sum's speed: 4 M
    float32 cache-cold, 0.45 ms against 0.77 ms for four interleaved streams of ``v − v ≠ 0``."""
    xu = _patterns(xs)
    mask, emask = _abs_mask(xu)
    m = xu.dtype.type(0)
    for i in range(xu.size):
        m = max(m, xu[i] & mask)
    return bool(m >= emask)


@njit(cache=True, nogil=True)
def check_rows(  # pragma: no cover - compiled
    x2: np.ndarray, w0: int, w1: int, status: np.ndarray
) -> None:
    """NON_FINITE for a chunk holding inf or nan: the finiteness check of the contract, alone
    (the sparse forms read x once, for this, and write O(k))."""
    d = x2.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        status[w] = NON_FINITE if _check_block(x2[r, j0 : min(d, j0 + CHUNK)]) else OK


@njit(cache=True)
def _scale_check_block(  # pragma: no cover - compiled
    xs: np.ndarray, sc: float, os: np.ndarray
) -> int:
    """os = xs · sc + 0 (signed zeros become +0), the status of the chunk."""
    zero = os.dtype.type(0.0)
    bad = np.uint8(0)
    over = np.uint8(0)
    for i in range(xs.size):
        xv = xs[i]
        v = xv * sc + zero
        bad |= np.uint8((xv - xv) != 0)
        over |= np.uint8((v - v) != 0)
        os[i] = v
    if bad:
        return NON_FINITE
    return OVERFLOW if over else OK


@njit(cache=True, nogil=True)
def lazy_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    fire: np.ndarray,
    scale: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Lazy Bernoulli: out = x · scale[0] (+0 for signed zeros) on the rows that fire, 0 on the
    others, checking every x finite in the same pass."""
    d = x2.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    sc = scale[0]
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        j1 = min(d, j0 + CHUNK)
        if fire[r]:
            status[w] = _scale_check_block(x2[r, j0:j1], sc, out[r, j0:j1])
        else:
            status[w] = NON_FINITE if _zero_check_block(x2[r, j0:j1], out[r, j0:j1]) else OK


@njit(cache=True)
def _copy_check_block(xu: np.ndarray, ou: np.ndarray) -> bool:  # pragma: no cover - compiled
    """ou = xu (bit patterns) and whether xu holds inf or nan, in one vectorizable pass over
    four interleaved streams (see :func:`_zero_block`)."""
    _, emask = _abs_mask(xu)
    q = xu.size // 4
    b0 = b1 = b2 = b3 = np.uint8(0)
    for i in range(q):
        v0 = xu[i]
        v1 = xu[q + i]
        v2 = xu[2 * q + i]
        v3 = xu[3 * q + i]
        b0 |= np.uint8((v0 & emask) == emask)
        b1 |= np.uint8((v1 & emask) == emask)
        b2 |= np.uint8((v2 & emask) == emask)
        b3 |= np.uint8((v3 & emask) == emask)
        ou[i] = v0
        ou[q + i] = v1
        ou[2 * q + i] = v2
        ou[3 * q + i] = v3
    for i in range(4 * q, xu.size):
        v0 = xu[i]
        b0 |= np.uint8((v0 & emask) == emask)
        ou[i] = v0
    return bool((b0 | b1 | b2 | b3) != 0)


@njit(cache=True, nogil=True)
def copy_rows(  # pragma: no cover - compiled
    xu: np.ndarray, outu: np.ndarray, w0: int, w1: int, status: np.ndarray
) -> None:
    """out = x (bit patterns) chunk by chunk, checking x finite in the same pass (identity:
    one read and one write of every entry, instead of a finiteness pass and then a copy)."""
    d = xu.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        j1 = min(d, j0 + CHUNK)
        status[w] = NON_FINITE if _copy_check_block(xu[r, j0:j1], outu[r, j0:j1]) else OK


@njit(cache=True, nogil=True)
def bernoulli_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    p: float,
    scale: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """Keep x_j with probability p (same draw rule as the rounding kernels), times scale[0].

    Same layout as :func:`round_rows`; the flags also mark non-finite inputs and kept values
    whose scaling overflows."""
    d = x2.shape[1]
    dt = x2.dtype.type
    sc = scale[0]
    t = p * 256.0
    ti = np.int32(math.floor(t))
    nch = (d + CHUNK - 1) // CHUNK
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    byts = words.view(np.uint8)
    flags = np.empty(CHUNK, dtype=np.uint8)
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x2[r, j0 : j0 + m]
        os = out[r, j0 : j0 + m]
        fill_words(lo[r], hi[r], j0 // 4, words[: (m + 3) // 4])
        _bernoulli_block(xs, byts[:m], sc, ti, os, flags[:m])
        st = OK
        for i in range(m):
            f = flags[i]
            if f:
                if f & 1 and _tie_up(t, float(ti), lo2[r], hi2[r], j0 + i):
                    os[i] = xs[i] * sc + dt(0.0)
                if f & 2:
                    xv = xs[i]
                    if (xv - xv) != 0:
                        st = NON_FINITE
                    elif os[i] != 0 and st == OK:
                        st = OVERFLOW
        status[w] = st


@njit(cache=True)
def _keep_block(  # pragma: no cover - compiled
    xs: np.ndarray, byts: np.ndarray, sc: float, ti: np.int32, keep: np.ndarray, tie: np.ndarray
) -> np.uint8:
    """keep[i] = x_i kept by the 8-bit draw (byte < ⌊256p⌋) and x_i · sc ≠ 0; tie[i] = the
    byte ties (resolved later); returns whether xs holds inf or nan (one vectorizable pass)."""
    bad = np.uint8(0)
    for i in range(xs.size):
        xv = xs[i]
        bi = np.int32(byts[i])
        nz = np.uint8(xv * sc != 0)
        keep[i] = np.uint8(bi < ti) & nz
        tie[i] = np.uint8(bi == ti) & nz
        bad |= np.uint8((xv - xv) != 0)
    return bad


@njit(cache=True)
def _count_block(keep: np.ndarray) -> int:  # pragma: no cover - compiled
    c = 0
    for i in range(keep.size):
        c += keep[i]
    return c


@njit(cache=True, nogil=True)
def bernoulli_pairs(  # pragma: no cover - compiled
    x2: np.ndarray,
    p: float,
    scale: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    counts: np.ndarray,
    starts: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    fill: bool,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """The (index, value) pairs of :func:`bernoulli_rows` for one vector (``x2``: (1, d)),
    without a dense output: the same draws decide which x_j are kept, and the kept non-zero
    x_j · scale[0] are either counted per chunk (``fill`` False: ``counts[w]``) or written from
    ``starts[w]`` on (``fill`` True, after a prefix sum of the counts; the draws are made
    again). Flags are scanned 8 at a time (a kept entry or a tie has probability ≈ p).
    Statuses as there."""
    d = x2.shape[1]
    sc = scale[0]
    t = p * 256.0
    ti = np.int32(math.floor(t))
    words = np.empty(CHUNK // 4, dtype=np.uint32)
    byts = words.view(np.uint8)
    keep = np.zeros(CHUNK + 8, dtype=np.uint8)
    tie = np.zeros(CHUNK + 8, dtype=np.uint8)
    k64 = keep.view(np.uint64)
    t64 = tie.view(np.uint64)
    for w in range(w0, w1):
        j0 = w * CHUNK
        m = min(d, j0 + CHUNK) - j0
        xs = x2[0, j0 : j0 + m]
        fill_words(lo[0], hi[0], j0 // 4, words[: (m + 3) // 4])
        if _keep_block(xs, byts[:m], sc, ti, keep[:m], tie[:m]):
            status[w] = NON_FINITE
            continue
        keep[m : (m + 7) & ~7] = 0
        tie[m : (m + 7) & ~7] = 0
        for q in range((m + 7) >> 3):
            if t64[q] == 0:
                continue
            for i in range(q << 3, (q << 3) + 8):
                if tie[i] and _tie_up(t, float(ti), lo2[0], hi2[0], j0 + i):
                    keep[i] = 1
        st = OK
        if not fill:
            counts[w] = _count_block(keep[:m])
        else:
            o = starts[w]
            for q in range((m + 7) >> 3):
                if k64[q] == 0:
                    continue
                for i in range(q << 3, (q << 3) + 8):
                    if keep[i]:
                        v = xs[i] * sc
                        if not (abs(v) < np.inf):
                            st = OVERFLOW
                        idx[o] = j0 + i
                        vals[o] = v
                        o += 1
        status[w] = st


# --------------------------------------------------------------------------------------------
# the driver: work items (row, chunk) split over threads
# --------------------------------------------------------------------------------------------
#: (creating process id, workers, pool): a forked child gets a pool of its own (the parent's
#: worker threads do not exist in the child, so submitting to the inherited pool would hang)
_POOL: list[tuple[int, int, ThreadPoolExecutor]] = []
_POOL_LOCK = threading.Lock()


def threads() -> int:
    """Threads for the kernels: ``SHRINKGRAD_THREADS`` or torch's intra-op thread count."""
    env = os.environ.get("SHRINKGRAD_THREADS")
    return max(1, int(env)) if env else max(1, torch.get_num_threads())


def run(kernel: Callable[..., None], x2: np.ndarray, *args: object) -> int:
    """Run ``kernel(*args, w0, w1, status)`` over the work items (row, chunk of CHUNK) of the
    rows of ``x2``, on :func:`threads` threads (the kernels release the GIL). Every item's
    result depends only on its own coordinates, so the output is the same for any number of
    threads. Returns the worst status (NON_FINITE before OVERFLOW before OK)."""
    n, d = x2.shape
    items = n * ((d + CHUNK - 1) // CHUNK)
    status = np.zeros(max(items, 1), dtype=np.int64)
    t = min(threads(), items)
    if t <= 1:
        kernel(*args, 0, items, status)
    else:
        with _POOL_LOCK:
            pid = os.getpid()
            if not _POOL or _POOL[0][0] != pid or _POOL[0][1] < t:
                new = ThreadPoolExecutor(max_workers=t, thread_name_prefix="shrinkgrad")
                _POOL[:] = [(pid, t, new)]
            pool = _POOL[0][2]
        bounds = [items * i // t for i in range(t + 1)]
        futures = [pool.submit(kernel, *args, bounds[i], bounds[i + 1], status) for i in range(t)]
        for f in futures:
            f.result()
    if not status.any():  # (one reduction in the usual case)
        return OK
    if (status == NON_FINITE).any():
        return NON_FINITE
    return OVERFLOW if (status == OVERFLOW).any() else OK


# --------------------------------------------------------------------------------------------
# sparse vectors: add one to a dense vector, replace one by another inside a dense one
# --------------------------------------------------------------------------------------------
#: the block of the output that :func:`sparse_add` updates from every ascending run in turn
#: (float32: 64 KB, the size of the core's L2 share that stays hot across the runs)
ADD_BLOCK = 1 << 14
#: above this many ascending runs the indices have no structure to use: one loop in order
ADD_MAX_RUNS = 256


@njit(cache=True, inline="always")
def _count_runs(idx: np.ndarray, n: int, strict: bool) -> int:  # pragma: no cover - compiled
    """The number of ascending runs of ``idx`` (strictly ascending with ``strict``, else
    non-decreasing), or −1 when an index lies outside [0, n)."""
    runs = 1
    for t in range(idx.size):
        j = idx[t]
        if j < 0 or j >= n:
            return -1
        if t > 0 and (j < idx[t - 1] or (strict and j == idx[t - 1])):
            runs += 1
    return runs


@njit(cache=True, inline="always")
def _run_bounds(  # pragma: no cover - compiled
    idx: np.ndarray, runs: int, strict: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(first entry, end) of each of the ``runs`` ascending runs of ``idx``
    (:func:`_count_runs`): the runs' cursors of the block-wise kernels."""
    cur = np.empty(runs, dtype=np.int64)
    end = np.empty(runs, dtype=np.int64)
    r = 0
    cur[0] = 0
    for t in range(1, idx.size):
        if idx[t] < idx[t - 1] or (strict and idx[t] == idx[t - 1]):
            end[r] = t
            r += 1
            cur[r] = t
    end[runs - 1] = idx.size
    return cur, end


@njit(cache=True, inline="always")
def _next_pending(  # pragma: no cover - compiled
    idx: np.ndarray, cur: np.ndarray, end: np.ndarray, n: int
) -> int:
    """The smallest index not yet visited by any run (n when all are done): the block-wise
    kernels go on with the block that holds it."""
    lo = n
    for r in range(cur.size):
        if cur[r] < end[r] and idx[cur[r]] < lo:
            lo = idx[cur[r]]
    return lo


@njit(cache=True, nogil=True)
def sparse_add(  # pragma: no cover - compiled
    out: np.ndarray, idx: np.ndarray, vals: np.ndarray, negate: bool
) -> bool:
    """out[idx] += vals (or −= with ``negate``), repeated indices adding up in order: the values
    of ``index_add_`` with alpha = ±1 (each a single rounded addition in index order;
    x − v = x + (−v) exactly), at a few ns per entry against its 12 (the DDP hook's EF21 sums:
    every rank's Top-k message into g and the rank's own into g_i). False, with ``out``
    untouched, when an index lies outside [0, out.size).

    Indices made of a few strictly ascending runs (the hook's aggregate: the n ranks' sorted
    Top-k lists one after the other) are added block by block of ``out`` (ADD_BLOCK entries):
    every run's entries of a block in run order, so each block is fetched once for all the
    runs instead of once per run. An index occurs at most once per run, so its additions keep
    their order: the same bits as the loop in order."""
    n = out.size
    m = idx.size
    runs = _count_runs(idx, n, True)
    if runs < 0:
        return False
    if runs == 1 or runs > ADD_MAX_RUNS:
        if negate:
            for t in range(m):
                out[idx[t]] -= vals[t]
        else:
            for t in range(m):
                out[idx[t]] += vals[t]
        return True
    cur, end = _run_bounds(idx, runs, True)  # each run's next entry, and its end
    while True:
        lo = _next_pending(idx, cur, end, n)  # the next block: the one that holds it
        if lo == n:
            return True
        hi = (lo // ADD_BLOCK + 1) * ADD_BLOCK
        for r in range(runs):
            t = cur[r]
            e = end[r]
            if negate:
                while t < e and idx[t] < hi:
                    out[idx[t]] -= vals[t]
                    t += 1
            else:
                while t < e and idx[t] < hi:
                    out[idx[t]] += vals[t]
                    t += 1
            cur[r] = t


@njit(cache=True, nogil=True)
def sparse_replace(  # pragma: no cover - compiled
    out: np.ndarray, old: np.ndarray, idx: np.ndarray, vals: np.ndarray, distinct: bool = False
) -> None:
    """out[old] = 0, then out[idx] += vals (repeated indices add up, in order): a dense vector
    that held a sparse one at ``old`` holds the new one afterwards, in O(k) (the DDP hook's
    sparse directions). The same values as ``index_fill_`` followed by ``index_add_``.

    ``distinct`` (the caller knows ``idx`` distinct and ``out`` zero outside ``old``): every
    entry added to is a 0, so 0 + vals[t] is stored without reading it — the same bits (+0 + v
    is v, with −0 as +0), a store instead of a read-modify-write (the shared-seed directions,
    whose ranks share one index set)."""
    z = out.dtype.type(0)
    for t in range(old.size):
        out[old[t]] = z
    for t in range(idx.size):
        j = idx[t]
        out[j] = (z if distinct else out[j]) + vals[t]


@njit(cache=True, inline="always")
def _bf16_of(v: Any) -> Any:  # pragma: no cover - compiled
    """The bfloat16 pattern of the float32 pattern ``v`` (uint32): round to nearest even, NaN
    as 0x7FC0 (:func:`_round_bf16_block`: torch's ``.to(torch.bfloat16)`` bit for bit on
    every number; torch's vectorized loop writes its NaNs as 0xFFFF, its scalar one as
    0x7FC0, so a NaN only stays a NaN)."""
    r = (v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(0x7FC0) if nan else np.uint16(r)


@njit(cache=True, inline="always")
def _bf16_marked(  # pragma: no cover - compiled
    marks: np.ndarray, b0: int, out: np.ndarray, src: np.ndarray
) -> None:
    """out[j] = bfloat16(src[j]) (:func:`_bf16_of`) at the entries j = b0 + q of the block at
    ``b0`` whose bit q is set in ``marks``, in one ascending sweep (each entry once: repeats
    merged), clearing the marks: the block-wise kernels' conversion of a block's changed
    entries, which the hardware prefetcher follows as it follows a single run."""
    for w in range(marks.size):
        word = marks[w]
        while word:
            j = b0 + (w << 6) + np.int64(trailing_zeros(word))  # type: ignore[call-arg]
            out[j] = _bf16_of(src[j])
            word &= word - np.uint64(1)
        marks[w] = 0


@njit(cache=True, inline="always")
def _mirror_blocks(  # pragma: no cover - compiled
    g: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    negate: bool,
    add: bool,
    mirror: np.ndarray,
    runs: int,
    strict: bool,
) -> None:
    """The block-wise walk of :func:`bf16_at` and :func:`sparse_add_bf16_at` over the ``runs``
    ascending runs of ``idx`` (:func:`_count_runs`, checked in range): block by block of the
    float32 ``g`` (ADD_BLOCK entries), every run's entries of the block in run order.

    With ``add``: g[j] += vals[t] (−= with ``negate``; ``sparse_add``'s order), each followed
    by mirror[j] = bfloat16(g[j]) while g[j] is in a register. An entry that several runs
    touch is converted once per run, the last time after its last addition, so it ends as the
    bfloat16 of its final sum. This measured 0.82–0.90× the time of the bitmap sweep below
    (2 and 4 runs of 1 % of 10.5 M entries, cold), which re-read g and paid a mispredicted
    loop exit per bitmap word.

    Without: the block's entries are marked in a bitmap, then converted in one ascending sweep
    (:func:`_bf16_marked`), which the hardware prefetcher follows as it follows a single run;
    here g is not loaded by the runs, and converting at each run's entry measured 1.15–1.7×
    as long."""
    n = g.size
    src = g.view(np.uint32)  # the float32 patterns of g (the same memory)
    cur, end = _run_bounds(idx, runs, strict)  # each run's next entry, and its end
    marks = np.zeros(ADD_BLOCK // 64, dtype=np.uint64)  # the block's entries, 1 bit each
    while True:
        lo = _next_pending(idx, cur, end, n)  # the next block: the one that holds it
        if lo == n:
            return
        b0 = (lo // ADD_BLOCK) * ADD_BLOCK
        hi = b0 + ADD_BLOCK
        for r in range(runs):
            t = cur[r]
            e = end[r]
            while t < e and idx[t] < hi:
                j = idx[t]
                if add:
                    g[j] += -vals[t] if negate else vals[t]  # x − v = x + (−v) exactly
                    mirror[j] = _bf16_of(src[j])
                else:
                    q = j - b0
                    marks[q >> 6] |= np.uint64(1) << np.uint64(q & 63)
                t += 1
            cur[r] = t
        if not add:
            _bf16_marked(marks, b0, mirror, src)


def bf16_patterns(t: torch.Tensor) -> np.ndarray:
    """The bit patterns (uint16) of a contiguous bfloat16 CPU tensor, as a numpy view (what
    the bfloat16 kernels below read and write)."""
    return t.view(torch.int16).numpy().view(np.uint16)


@njit(cache=True, nogil=True)
def bf16_at(  # pragma: no cover - compiled
    out: np.ndarray, src: np.ndarray, idx: np.ndarray
) -> bool:
    """out[j] = bfloat16(src[j]) for the positions j of ``idx`` (repeats allowed): ``out``
    the bit patterns (uint16) of a bfloat16 vector, ``src`` the float32 patterns (uint32) of
    one of the same length (:func:`_bf16_of`: the values of torch's ``.to(torch.bfloat16)``).
    O(k): a float32 vector that changed only at ``idx`` is mirrored into its bfloat16 copy
    without a dense pass. Indices made of a few ascending runs (the hook's aggregate: the n
    ranks' sorted Top-k lists) are converted block by block (ADD_BLOCK entries), as in
    :func:`sparse_add`: the runs' entries of a block are marked in a bitmap, then converted in
    one ascending sweep (:func:`_mirror_blocks`; each entry once; the result does not depend
    on the order). False (nothing written) when an index is outside [0, len)."""
    n = out.size
    m = idx.size
    runs = _count_runs(idx, n, False)  # repeats allowed within a run
    if runs < 0:
        return False
    if runs == 1 or runs > ADD_MAX_RUNS:
        for t in range(m):
            out[idx[t]] = _bf16_of(src[idx[t]])
        return True
    none = src.view(np.float32)[:0]  # (no additions)
    _mirror_blocks(src.view(np.float32), idx, none, False, False, out, runs, False)
    return True


@njit(cache=True, nogil=True)
def sparse_add_bf16_at(  # pragma: no cover - compiled
    out: np.ndarray, idx: np.ndarray, vals: np.ndarray, negate: bool, mirror: np.ndarray
) -> bool:
    """:func:`sparse_add` on a float32 ``out`` and :func:`bf16_at` of the result at ``idx``,
    in one pass: out[idx] += vals (or −= with ``negate``), then mirror[j] = bfloat16(out[j])
    at every touched j, ``mirror`` the bit patterns (uint16) of a bfloat16 vector of out's
    length. The DDP hook's EF21 server step g^{t+1} = g^t + Σ_i w_i c_i ([EF21] Alg. 1,
    g^{t+1} = g^t + (1/n) Σ_i c_i) with g the direction D of a bfloat16 model: DDP's
    bfloat16 copy of g is written while the block of g is in cache, instead of by a second
    pass over the same n·k random positions.

    The same bits as the two calls: the additions in :func:`sparse_add`'s order (block by
    block, the runs' entries of a block in run order: each index's additions in index order),
    and each touched entry converted (:func:`_bf16_of`) right after each addition to it
    (:func:`_mirror_blocks`), so a repeated index (several ranks picked it) ends with the
    bfloat16 of its final sum. False, with both vectors untouched, when an index lies outside
    [0, out.size) or ``mirror`` has another length."""
    n = out.size
    m = idx.size
    runs = _count_runs(idx, n, True)
    if runs < 0 or mirror.size != n:
        return False
    src = out.view(np.uint32)  # the float32 patterns of out (the same memory)
    if runs == 1 or runs > ADD_MAX_RUNS:  # the loop in order, converting after each addition
        for t in range(m):
            j = idx[t]
            out[j] += -vals[t] if negate else vals[t]  # x − v = x + (−v) exactly
            mirror[j] = _bf16_of(src[j])
        return True
    _mirror_blocks(out, idx, vals, negate, True, mirror, runs, True)
    return True


@intrinsic
def _bits_of_f32(typingctx: Any, v: Any) -> Any:  # pragma: no cover - compiled
    """The bit pattern (uint32) of the float32 ``v`` (an LLVM bitcast)."""
    if v != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True)
def sparse_replace_bf16(  # pragma: no cover - compiled
    out: np.ndarray, old: np.ndarray, idx: np.ndarray, vals: np.ndarray, distinct: bool = False
) -> bool:
    """:func:`sparse_replace` on bfloat16 vectors given by their patterns (uint16 ``out`` and
    ``vals``): out[old] = +0, then out[idx] += vals in order, each addition in float32 and
    rounded to bfloat16 (:func:`_bf16_of`) — what torch's ``index_fill_`` and ``index_add_``
    compute on a bfloat16 tensor, one rounded addition per entry. False when an index is
    outside [0, out.size) (checked as it is used: the entries before it are written).
    ``distinct`` as there: +0 + vals[t] rounded, the entry not read (on 1 % of a 4 M vector,
    cache-cold, ≈ 0.4 against 0.9–1.4 ms: the read-modify-write of 2-byte entries costs twice
    float32's)."""
    n = out.size
    zero = np.float32(0.0)
    for t in range(old.size):
        j = old[t]
        if j < 0 or j >= n:
            return False
        out[j] = np.uint16(0)
    for t in range(idx.size):
        j = idx[t]
        if j < 0 or j >= n:
            return False
        a = zero if distinct else _widen_bf16(out[j])  # type: ignore[call-arg]
        s = a + _widen_bf16(vals[t])  # type: ignore[call-arg]
        out[j] = _bf16_of(_bits_of_f32(s))
    return True


@njit(cache=True, nogil=True)
def weighted_rows_sum(  # pragma: no cover - compiled
    flat: np.ndarray, vals: np.ndarray, w: np.ndarray, out: np.ndarray
) -> bool:
    """out = Σ_t w[r_t] · vals[t] at column q_t, where the flat position flat[t] = r_t·d + q_t
    of an (m, d) batch (d = out.size) names the row r_t and column q_t: the weighted sum over
    the rows of a batch of sparse messages (``methods.base.weighted_sum`` of a SparseMessage),
    each product rounded, then added in the order of ``flat``: the values of
    ``out.zero_().index_add_(0, q, vals * w[r])``. False when a position lies outside
    [0, m·d) (m = w.size)."""
    d = out.size
    lim = d * w.size
    z = out.dtype.type(0)
    for q in range(d):
        out[q] = z
    for t in range(flat.size):
        f = flat[t]
        if f < 0 or f >= lim:
            return False
        r = f // d
        out[f - r * d] += w[r] * vals[t]
    return True
