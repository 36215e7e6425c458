"""Numba CPU kernels: the fast paths of the compressors.

Every kernel here has a torch twin in the compressor's module that defines the operator; a test
checks that both give bit-identical outputs for the same keys (given the same row norms, which
are float64 sums whose summation order differs between the two paths). Kernels work on 2-D
C-contiguous arrays ``(rows, d)`` and return a status code instead of raising (numba cannot
format the messages): :data:`OK`, :data:`NON_FINITE` (inf/nan in the input) or :data:`OVERFLOW`
(the result does not fit the dtype).

Random bits (shared with the torch twins, see :func:`shrinkgrad.compressors.quantize._draw_up`):
coordinate ``j`` of a row with key ``K`` uses byte ``j mod 4`` of ``bits32(K, ⌊j/4⌋)``; only
when that byte ties with the first 8 bits of the rounding probability (probability 1/256) are
the words ``bits32(K₂, 2j)`` and, on a second tie (2⁻³²), ``bits32(K₂, 2j+1)`` drawn, with
``K₂ = K.fold("extra")``. The probability of rounding up is thus the exact one up to 2⁻⁷², far
below the dtype's resolution, at the cost of one hash per four coordinates.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..rng_numba import bits32, mix32

__all__ = [
    "CHUNK",
    "NON_FINITE",
    "OK",
    "OVERFLOW",
    "bernoulli_rows",
    "dither_rows",
    "natural_rows",
    "randk_indices",
    "round_rows",
    "row_stats",
    "scatter_rows",
    "topk_rows",
]

OK = 0
NON_FINITE = 1
OVERFLOW = 2

_TWO32 = 4294967296.0
_U8 = np.uint64(8)
_U255 = np.uint64(255)
_U3 = np.uint64(3)
_U2 = np.uint64(2)
_U1 = np.uint64(1)


# --------------------------------------------------------------------------------------------
# row statistics: sum of squares or of |x| (float64, deterministic chunked order), finiteness
# --------------------------------------------------------------------------------------------
#: chunk length of the parallel loops (a multiple of 4, so a chunk starts on a fresh word)
CHUNK = 1 << 14


@njit(cache=True, parallel=True)
def row_stats(x2: np.ndarray, what: int, res: np.ndarray) -> int:  # pragma: no cover - compiled
    """``what`` = 0: Σ x_j², 2: Σ |x_j| per row into ``res`` (float64).

    Partial sums over fixed chunks are added in chunk order, so the result does not depend on
    the number of threads; NON_FINITE when a row holds inf or nan.
    """
    n, d = x2.shape
    nch = (d + CHUNK - 1) // CHUNK
    part = np.empty(nch, dtype=np.float64)
    for r in range(n):
        row = x2[r]
        for c in prange(nch):
            j = c * CHUNK
            end = min(d, j + CHUNK)
            a0 = 0.0
            a1 = 0.0
            a2 = 0.0
            a3 = 0.0
            while j + 4 <= end:
                v0 = abs(np.float64(row[j]))
                v1 = abs(np.float64(row[j + 1]))
                v2 = abs(np.float64(row[j + 2]))
                v3 = abs(np.float64(row[j + 3]))
                if what == 0:
                    a0 += v0 * v0
                    a1 += v1 * v1
                    a2 += v2 * v2
                    a3 += v3 * v3
                else:
                    a0 += v0
                    a1 += v1
                    a2 += v2
                    a3 += v3
                j += 4
            while j < end:
                v0 = abs(np.float64(row[j]))
                a0 += v0 * v0 if what == 0 else v0
                j += 1
            part[c] = (a0 + a1) + (a2 + a3)
        total = 0.0
        for c in range(nch):
            total += part[c]
        if not (total < np.inf):  # inf or nan: a non-finite entry (float32 squares never overflow)
            for j in range(d):
                if not (abs(row[j]) < np.inf):
                    return NON_FINITE
        res[r] = total
    return OK


# --------------------------------------------------------------------------------------------
# stochastic rounding decisions
# --------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _round_up(
    frac: float, byte: np.uint64, e0: np.uint64, e1: np.uint64, j: int
) -> bool:  # pragma: no cover
    """True with probability ``frac`` (to 2⁻⁷²): 8 bits first, 32 + 32 more only on ties."""
    t = frac * 256.0
    tb = math.floor(t)
    b = float(byte)
    if b < tb:
        return True
    if b > tb:
        return False
    t2 = (t - tb) * _TWO32
    w1 = float(bits32(e0, e1, np.uint64(2 * j)))
    tb2 = math.floor(t2)
    if w1 < tb2:
        return True
    if w1 > tb2:
        return False
    w2 = float(bits32(e0, e1, np.uint64(2 * j + 1)))
    return w2 < (t2 - tb2) * _TWO32


@njit(cache=True, parallel=True)
def round_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    scale: np.ndarray,
    s: int,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    out: np.ndarray,
) -> int:
    """Unbiased rounding of |x_j|/scale to the grid {0, 1, …, s}: QSGD and TernGrad.

    out_j = copysign(scale · ℓ_j, x_j) with ℓ_j = ⌊r⌋ + [U < r − ⌊r⌋], r = |x_j|/scale clamped
    to s; a zero scale gives a zero row. The input was checked finite by :func:`row_stats`.
    """
    n, d = x2.shape
    fs = x2.dtype.type(s)
    one = x2.dtype.type(1.0)
    zero = x2.dtype.type(0.0)
    nch = (d + CHUNK - 1) // CHUNK
    for r in range(n):
        row = x2[r]
        o = out[r]
        sc = scale[r]
        k0 = lo[r]
        k1 = hi[r]
        e0 = lo2[r]
        e1 = hi2[r]
        for c in prange(nch):
            word = np.uint64(0)
            for j in range(c * CHUNK, min(d, (c + 1) * CHUNK)):
                xv = row[j]
                if sc == 0:
                    o[j] = np.copysign(zero, xv)
                    continue
                if (j & 3) == 0:
                    word = bits32(k0, k1, np.uint64(j >> 2))
                rr = abs(xv) / sc
                fl = np.floor(rr)
                if fl >= fs:
                    lev = fs
                else:
                    byte = (word >> (_U8 * (np.uint64(j) & _U3))) & _U255
                    lev = fl
                    if _round_up(float(rr - fl), byte, e0, e1, j):
                        lev = fl + one
                o[j] = np.copysign(sc * lev, xv)
    return OK


@njit(cache=True, parallel=True)
def dither_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    norm: np.ndarray,
    s: int,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    out: np.ndarray,
) -> int:
    """Natural dithering: unbiased rounding of u = |x_j|/‖x‖ to {0, 2^{1−s}, …, 1/2, 1}."""
    n, d = x2.shape
    one = x2.dtype.type(1.0)
    zero = x2.dtype.type(0.0)
    low = x2.dtype.type(2.0 ** (1 - s))
    nch = (d + CHUNK - 1) // CHUNK
    for r in range(n):
        row = x2[r]
        o = out[r]
        nr = norm[r]
        k0 = lo[r]
        k1 = hi[r]
        e0 = lo2[r]
        e1 = hi2[r]
        for c in prange(nch):
            word = np.uint64(0)
            for j in range(c * CHUNK, min(d, (c + 1) * CHUNK)):
                xv = row[j]
                if nr == 0:
                    o[j] = np.copysign(zero, xv)
                    continue
                if (j & 3) == 0:
                    word = bits32(k0, k1, np.uint64(j >> 2))
                u = min(abs(xv) / nr, one)
                byte = (word >> (_U8 * (np.uint64(j) & _U3))) & _U255
                if u < low:
                    a = zero
                    b = low
                    frac = float(u / low)
                else:
                    _, e = math.frexp(u)
                    a = x2.dtype.type(math.ldexp(1.0, e - 1))
                    b = a + a
                    frac = float(u / a - one)
                lev = b if _round_up(frac, byte, e0, e1, j) else a
                o[j] = np.copysign(nr * lev, xv)
    return OK


@njit(cache=True, parallel=True)
def natural_rows(  # pragma: no cover - compiled
    xu: np.ndarray,
    nbits: int,
    mant: int,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    outu: np.ndarray,
) -> int:
    """Natural compression on the IEEE bit patterns (unsigned views of x and out).

    |x_j| = (1 + m/2^mant)·2^e rounds to 2^{e+1} with probability m/2^mant, else to 2^e
    (zero exponent field: subnormals round to 0 or the smallest normal, with probability
    m/2^mant = |x_j|/2^{e_min}); the sign bit is kept. An all-ones exponent (inf/nan) gives
    NON_FINITE, a value above the largest power of two gives OVERFLOW.
    """
    n, d = xu.shape
    sign = np.uint64(1) << np.uint64(nbits - 1)
    um = np.uint64(mant)
    mmask = (np.uint64(1) << um) - _U1
    emax = (np.uint64(1) << np.uint64(nbits - 1 - mant)) - _U1
    inv = 2.0**-mant
    nch = (d + CHUNK - 1) // CHUNK
    status = np.zeros(nch, dtype=np.int64)
    for r in range(n):
        row = xu[r]
        o = outu[r]
        k0 = lo[r]
        k1 = hi[r]
        e0 = lo2[r]
        e1 = hi2[r]
        for c in prange(nch):
            word = np.uint64(0)
            for j in range(c * CHUNK, min(d, (c + 1) * CHUNK)):
                if (j & 3) == 0:
                    word = bits32(k0, k1, np.uint64(j >> 2))
                v = np.uint64(row[j])
                sg = v & sign
                mag = v ^ sg
                e = mag >> um
                m = mag & mmask
                if e == emax:
                    status[c] = NON_FINITE
                    break
                if e == emax - _U1 and m != 0 and status[c] == OK:
                    status[c] = OVERFLOW
                byte = (word >> (_U8 * (np.uint64(j) & _U3))) & _U255
                if _round_up(float(m) * inv, byte, e0, e1, j):
                    e = e + _U1
                o[j] = sg | (e << um)
        worst = OK
        for c in range(nch):
            if status[c] == NON_FINITE:
                return NON_FINITE
            worst = max(worst, status[c])
        if worst != OK:
            return worst
    return OK


# --------------------------------------------------------------------------------------------
# Top-k: sampled threshold, one candidate pass, exact selection with lowest-index tie-break
# --------------------------------------------------------------------------------------------
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
    kth = np.partition(vals, c - k)[c - k]
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


@njit(cache=True)
def _topk_row(row: np.ndarray, k: int, idx: np.ndarray) -> bool:  # pragma: no cover - compiled
    d = row.size
    if d >= 1 << 16 and k * 16 <= d:
        m = 4096
        sample = np.empty(m, dtype=row.dtype)
        for i in range(m):
            sample[i] = abs(row[(i * d) // m])
        mu = m * k / d
        rank = int(mu + 4.0 * math.sqrt(mu) + 4.0)
        if rank < m:
            sample.sort()
            tau = sample[m - rank]
            cap = int(3.0 * rank * d / m) + 1024
            cidx = np.empty(cap, dtype=np.int64)
            c = 0
            bad = row.dtype.type(0.0)
            for j in range(d):
                a = abs(row[j])
                bad += a * 0
                if a >= tau:
                    if c < cap:
                        cidx[c] = j
                    c += 1
            if bad != 0:
                return False
            if k <= c <= cap:
                _select_exact(row, cidx[:c], k, idx)
                return True
    bad2 = row.dtype.type(0.0)
    for j in range(d):
        bad2 += row[j] * 0
    if bad2 != 0:
        return False
    _select_exact(row, np.arange(d), k, idx)
    return True


@njit(cache=True)
def topk_rows(x2: np.ndarray, k: int, idx: np.ndarray) -> int:  # pragma: no cover - compiled
    """Indices (ascending) of the k largest |x_j| of every row; NON_FINITE on inf/nan."""
    for r in range(x2.shape[0]):
        if not _topk_row(x2[r], k, idx[r]):
            return NON_FINITE
    return OK


# --------------------------------------------------------------------------------------------
# rand-k indices: a keyed Feistel permutation with cycle walking, then a uniform rotation
# --------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _feistel(  # pragma: no cover - compiled
    v: np.uint64,
    m: np.uint64,
    mask_lo: np.uint64,
    mask_hi: np.uint64,
    r0: np.uint64,
    r1: np.uint64,
    r2: np.uint64,
    r3: np.uint64,
) -> np.uint64:
    left = v >> m
    right = v & mask_lo
    left ^= mix32(right ^ r0) & mask_hi
    right ^= mix32(left ^ r1) & mask_lo
    left ^= mix32(right ^ r2) & mask_hi
    right ^= mix32(left ^ r3) & mask_lo
    return (left << m) | right


@njit(cache=True)
def randk_indices(  # pragma: no cover - compiled
    lo: np.ndarray, hi: np.ndarray, d: int, k: int, rot_tries: int, idx: np.ndarray
) -> None:
    """idx[r, i] = (π_r(i) + ρ_r) mod d for i < k (twin of ``sparse.randk_indices_torch``)."""
    b = 0
    while (1 << b) < d:
        b += 1
    m = np.uint64(b // 2)
    mask_lo = (np.uint64(1) << m) - _U1
    mask_hi = (np.uint64(1) << np.uint64(b - b // 2)) - _U1
    ud = np.uint64(d)
    limit = np.uint64(4294967296 - (4294967296 % d))
    for r in range(lo.shape[0]):
        k0 = lo[r]
        k1 = hi[r]
        r0 = bits32(k0, k1, np.uint64(0))
        r1 = bits32(k0, k1, np.uint64(1))
        r2 = bits32(k0, k1, np.uint64(2))
        r3 = bits32(k0, k1, np.uint64(3))
        rot = np.uint64(0)
        for t in range(rot_tries):
            w = bits32(k0, k1, np.uint64(4 + t))
            rot = w % ud
            if w < limit:
                break
        row = idx[r]
        for i in range(k):
            y = _feistel(np.uint64(i), m, mask_lo, mask_hi, r0, r1, r2, r3)
            while y >= ud:
                y = _feistel(y, m, mask_lo, mask_hi, r0, r1, r2, r3)
            row[i] = np.int64((y + rot) % ud)


@njit(cache=True, parallel=True)
def scatter_rows(  # pragma: no cover - compiled
    x2: np.ndarray, idx: np.ndarray, scale: np.ndarray, check: bool, out: np.ndarray
) -> int:
    """out = 0 except out[r, idx[r]] = x[r, idx[r]] · scale[0]; with ``check`` the zeroing
    pass also verifies that the whole input is finite (NON_FINITE), and a product that leaves
    the dtype's range gives OVERFLOW."""
    n, d = x2.shape
    sc = scale[0]
    nch = (d + CHUNK - 1) // CHUNK
    bad = np.zeros(nch, dtype=np.int64)
    for r in range(n):
        row = x2[r]
        o = out[r]
        for c in prange(nch):
            nb = 0
            for j in range(c * CHUNK, min(d, (c + 1) * CHUNK)):
                if check:
                    v = row[j]
                    nb += (v - v) != 0
                o[j] = 0
            bad[c] = nb
        if check:
            for c in range(nch):
                if bad[c] != 0:
                    return NON_FINITE
        ir = idx[r]
        for i in range(ir.size):
            j = ir[i]
            v = row[j] * sc
            if not (abs(v) < np.inf):
                return OVERFLOW
            o[j] = v
    return OK


@njit(cache=True, parallel=True)
def bernoulli_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    p: float,
    scale: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    out: np.ndarray,
) -> int:
    """Keep x_j with probability p (same draw rule as the rounding kernels), times scale[0]."""
    n, d = x2.shape
    sc = scale[0]
    nch = (d + CHUNK - 1) // CHUNK
    bad = np.zeros(nch, dtype=np.int64)
    for r in range(n):
        row = x2[r]
        o = out[r]
        k0 = lo[r]
        k1 = hi[r]
        e0 = lo2[r]
        e1 = hi2[r]
        for c in prange(nch):
            word = np.uint64(0)
            nb = 0
            for j in range(c * CHUNK, min(d, (c + 1) * CHUNK)):
                if (j & 3) == 0:
                    word = bits32(k0, k1, np.uint64(j >> 2))
                xv = row[j]
                nb += (xv - xv) != 0
                byte = (word >> (_U8 * (np.uint64(j) & _U3))) & _U255
                if _round_up(p, byte, e0, e1, j):
                    v = xv * sc
                    if abs(v) == np.inf and abs(xv) < np.inf:
                        nb += 1 << 40
                    o[j] = v
                else:
                    o[j] = 0
            bad[c] = nb
        total = 0
        for c in range(nch):
            total += bad[c]
        if total % (1 << 40) != 0:
            return NON_FINITE
        if total != 0:
            return OVERFLOW
    return OK
