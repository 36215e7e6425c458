"""Numba CPU kernels of the block-stratified sparsifier ``strat_k`` (:class:`.sparse.StratK`).

Blocks. [0, d) is cut into k blocks B_b = [⌊b·d/k⌋, ⌊(b+1)·d/k⌋) of sizes q = ⌊d/k⌋ or q + 1
(r = d mod k of them, spread evenly). Walking the blocks in order needs no division: with
b·d = lo_b·k + rem_b, the next block starts at lo_b + q + [rem_b + r ≥ k], its remainder is
(rem_b + r) mod k, so a block's size is q + [rem_b + r ≥ k].

Draw (the rule of :func:`.sparse.strat_indices_torch`, the torch twin). Block b of a row with
key K (``keys.fold("strat_k")``) keeps j_b = lo_b + ⌊w·s/2³²⌋, s = |B_b|, w = ``bits32(K, b)``:
Lemire's multiply-shift map of a 32-bit word to [0, s) ("Fast random integer generation in an
interval", ACM TOMACS 2019), made exactly uniform by rejection: the word is rejected when
(w·s mod 2³²) < 2³² mod s, and then redrawn from ``bits32(K₂, (TRIES·b + t) mod 2³²)``, t = 1,
2, …, with K₂ = K.fold("extra"). Of the 2³² words every offset keeps exactly ⌊2³²/s⌋ accepted
ones, so j_b is uniform on B_b unless all :data:`TRIES` words are rejected, probability
< (s/2³²)^TRIES (< 2⁻¹²⁸ for blocks of up to 2¹⁶ entries; the last word is used then). The
rejection test costs one compare in the common case (2³² mod s < s, so w·s mod 2³² ≥ s is
never rejected) and no division.

Work items are (row, chunk of :data:`~._kernels.CHUNK` entries), as for every kernel of
:mod:`._kernels` (:func:`~._kernels.run`): an item checks its chunk finite (the vectorized
unsigned-max check :func:`~._kernels._check_block`), hashes the words of the blocks that
intersect its chunk in one vectorized loop (:func:`~..rng_numba.fill_words`), and handles
each of those blocks whose kept entry lies in the chunk, while the chunk is in cache. A block
that straddles two chunks is drawn by both items (the same draw) and handled by the one that
holds j_b, so every kept entry is read and written exactly once, whatever the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..rng_numba import bits32, fill_words
from ._kernels import CHUNK, NON_FINITE, OK, OVERFLOW, _check_block, _zero_check_block, load

__all__ = ["TRIES", "strat_draw", "strat_gather", "strat_rows"]

#: 32-bit words tried per block before the last one is used (exactly uniform otherwise)
TRIES = 8

_MASK = np.uint64(0xFFFFFFFF)
_TWO32 = np.uint64(1 << 32)
_SHIFT = np.uint64(32)


@njit(cache=True, inline="always")
def _redraw(  # pragma: no cover - compiled
    m: np.uint64, s: np.uint64, b: int, lo2: np.uint64, hi2: np.uint64
) -> np.uint64:
    """The accepted product w·s of block b whose first product ``m`` has a low word below s
    (the only case that can be rejected): Lemire's rejection with the words of K₂."""
    t = (_TWO32 - s) % s  # 2³² mod s
    tries = 1
    while (m & _MASK) < t and tries < TRIES:
        w = bits32(lo2, hi2, np.uint64(TRIES * b + tries) & _MASK)
        m = w * s
        tries += 1
    return m


@njit(cache=True, inline="always")
def _blocks_of(j0: int, j1: int, d: int, k: int) -> tuple[int, int]:  # pragma: no cover
    """[b0, b1): the blocks that intersect [j0, j1) (b holds p iff ⌊bd/k⌋ ≤ p < ⌊(b+1)d/k⌋,
    so the block of p is ⌊((p + 1)k − 1)/d⌋)."""
    return ((j0 + 1) * k - 1) // d, (j1 * k - 1) // d + 1


@njit(cache=True, inline="always")
def _kept_in_chunk(  # pragma: no cover - compiled
    row: np.ndarray,
    j0: int,
    j1: int,
    k: int,
    lo: np.uint64,
    hi: np.uint64,
    lo2: np.uint64,
    hi2: np.uint64,
    scale: np.ndarray,
    words: np.ndarray,
    irow: np.ndarray,
    orow: np.ndarray,
    dense: bool,
) -> bool:
    """The kept entries j_b ∈ [j0, j1) of the row: orow[j_b] (``dense``) or orow[b] =
    row[j_b] · scale[s_b − q] and irow[b] = j_b. True when a product is not finite
    (OVERFLOW)."""
    d = row.shape[0]
    q = d // k
    r = d - q * k
    b0, b1 = _blocks_of(j0, j1, d, k)
    nb = b1 - b0
    fill_words(lo, hi, b0, words[:nb])  # vectorized: the first word of every block
    num = b0 * d
    start = num // k
    rem = num - start * k
    over = False
    for i in range(nb):
        big = rem + r >= k
        s = np.uint64(q + 1) if big else np.uint64(q)
        m = np.uint64(words[i]) * s
        if (m & _MASK) < s:  # (rare: probability s/2³²) possibly rejected
            m = _redraw(m, s, b0 + i, lo2, hi2)
        j = start + np.int64(m >> _SHIFT)
        if j0 <= j < j1:
            v = load(row, j) * scale[1 if big else 0]
            if not (abs(v) < np.inf):
                over = True
            if dense:
                orow[j] = v
            else:
                orow[b0 + i] = v
                irow[b0 + i] = j
        start += np.int64(s)
        rem = rem + r - k if big else rem + r
    return over


@njit(cache=True, nogil=True)
def strat_gather(  # pragma: no cover - compiled
    x2: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    scale: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """The sparse form of strat_k, no dense output: idx[r, b] = j_b (ascending: one per
    block, :func:`strat_draw`'s) and vals[r, b] = x[r, j_b] · |B_b| (``scale`` = [q, q + 1]
    in the values' dtype) for the k = vals.shape[1] blocks of every row, each chunk checked
    finite (NON_FINITE) in the same pass that reads its kept entries (OVERFLOW if a product
    leaves the dtype's range). ``x2`` may be bfloat16 patterns (:func:`load`; then ``scale``
    and ``vals`` are float32: the products of the widened values)."""
    d = x2.shape[1]
    k = vals.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    words = np.empty(min(k, CHUNK) + 2, dtype=np.uint32)
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        j1 = min(d, j0 + CHUNK)
        row = x2[r]
        st = NON_FINITE if _check_block(row[j0:j1]) else OK
        over = _kept_in_chunk(
            row, j0, j1, k, lo[r], hi[r], lo2[r], hi2[r], scale, words, idx[r], vals[r], False
        )
        if over and st == OK:
            st = OVERFLOW
        status[w] = st


@njit(cache=True, nogil=True)
def strat_rows(  # pragma: no cover - compiled
    x2: np.ndarray,
    k: int,
    lo: np.ndarray,
    hi: np.ndarray,
    lo2: np.ndarray,
    hi2: np.ndarray,
    scale: np.ndarray,
    out: np.ndarray,
    w0: int,
    w1: int,
    status: np.ndarray,
) -> None:
    """The dense form of strat_k: out = 0 except out[r, j_b] = x[r, j_b] · |B_b|, chunk by
    chunk: one pass zeroes the chunk and checks its x finite (NON_FINITE), then the chunk's
    kept entries are written while both are in cache (OVERFLOW as in :func:`strat_gather`)."""
    d = x2.shape[1]
    nch = (d + CHUNK - 1) // CHUNK
    words = np.empty(min(k, CHUNK) + 2, dtype=np.uint32)
    none = np.empty(0, dtype=np.int64)
    for w in range(w0, w1):
        r = w // nch
        j0 = (w % nch) * CHUNK
        j1 = min(d, j0 + CHUNK)
        row = x2[r]
        st = NON_FINITE if _zero_check_block(row[j0:j1], out[r, j0:j1]) else OK
        over = _kept_in_chunk(
            row, j0, j1, k, lo[r], hi[r], lo2[r], hi2[r], scale, words, none, out[r], True
        )
        if over and st == OK:
            st = OVERFLOW
        status[w] = st


@njit(cache=True, nogil=True)
def strat_draw(  # pragma: no cover - compiled
    lo: np.ndarray, hi: np.ndarray, lo2: np.ndarray, hi2: np.ndarray, d: int, idx: np.ndarray
) -> None:
    """idx[r, b] = j_b of row r (ascending), for the k = idx.shape[1] blocks of [0, d): the
    indices alone (a shared-seed receiver redraws them), in blocks of CHUNK words."""
    n, k = idx.shape
    q = d // k
    rr = d - q * k
    words = np.empty(min(k, CHUNK), dtype=np.uint32)
    for r in range(n):
        start = np.int64(0)
        rem = 0
        for b0 in range(0, k, CHUNK):
            nb = min(k, b0 + CHUNK) - b0
            fill_words(lo[r], hi[r], b0, words[:nb])
            for i in range(nb):
                big = rem + rr >= k
                s = np.uint64(q + 1) if big else np.uint64(q)
                m = np.uint64(words[i]) * s
                if (m & _MASK) < s:
                    m = _redraw(m, s, b0 + i, lo2[r], hi2[r])
                idx[r, b0 + i] = start + np.int64(m >> _SHIFT)
                start += np.int64(s)
                rem = rem + rr - k if big else rem + rr
