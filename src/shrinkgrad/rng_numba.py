"""The numba twin of :mod:`shrinkgrad.rng`: ``mix32`` and ``bits32`` as scalar kernels.

CPU fast paths of the compressors draw their random words here; a test checks that
:func:`bits32` equals :func:`shrinkgrad.rng.bits32_numpy` (and so the torch path) bit for bit.
All arithmetic is done on ``uint64`` holding values in [0, 2³²) with an explicit mask, which
avoids numba's promotion rules for mixed-width integers.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .rng import _C1, _C2, MASK32

__all__ = ["bits32", "bits32_array", "fill_words", "mix32", "mix32_u32"]

_M = np.uint64(MASK32)
_K1 = np.uint64(_C1)
_K2 = np.uint64(_C2)
_S15 = np.uint64(15)
_S16 = np.uint64(16)


@njit(cache=True, inline="always")
def mix32(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """lowbias32 of the low 32 bits of ``x`` (C. Wellons, *hash-prospector*)."""
    x = np.uint64(x) & _M
    x ^= x >> _S16
    x = (x * _K1) & _M
    x ^= x >> _S15
    x = (x * _K2) & _M
    x ^= x >> _S16
    return x


@njit(cache=True, inline="always")
def bits32(lo: np.uint64, hi: np.uint64, j: np.uint64) -> np.uint64:  # pragma: no cover
    """Word ``j`` of the row key ``(lo, hi)``: mix32((mix32(j ⊕ lo) + hi) mod 2³²)."""
    return mix32((mix32((np.uint64(j) & _M) ^ np.uint64(lo)) + np.uint64(hi)) & _M)


@njit(cache=True, inline="always")
def mix32_u32(x: np.uint32) -> np.uint32:  # pragma: no cover - compiled
    """:func:`mix32` in wrapping ``uint32`` arithmetic (lets LLVM vectorize whole blocks)."""
    x ^= x >> np.uint32(16)
    x = np.uint32(x * np.uint32(_C1))
    x ^= x >> np.uint32(15)
    x = np.uint32(x * np.uint32(_C2))
    x ^= x >> np.uint32(16)
    return x


@njit(cache=True, inline="always")
def fill_words(lo: np.uint64, hi: np.uint64, g0: int, out: np.ndarray) -> None:  # pragma: no cover
    """out[i] = bits32(lo, hi, g0 + i) for a block of consecutive counters (``uint32`` out)."""
    a = np.uint32(lo)
    b = np.uint32(hi)
    for i in range(out.size):
        out[i] = mix32_u32(np.uint32(mix32_u32(np.uint32(g0 + i) ^ a) + b))


@njit(cache=True)
def bits32_array(
    lo: np.ndarray, hi: np.ndarray, offset: int, d: int
) -> np.ndarray:  # pragma: no cover
    """Words ``offset … offset+d−1`` of every row key, shape ``(n, d)`` (a test helper)."""
    n = lo.shape[0]
    out = np.empty((n, d), dtype=np.uint64)
    for r in range(n):
        a = np.uint64(lo[r])
        b = np.uint64(hi[r])
        for j in range(d):
            out[r, j] = bits32(a, b, np.uint64(offset + j))
    return out
