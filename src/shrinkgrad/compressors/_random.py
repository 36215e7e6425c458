"""Keyed random decisions shared by the torch paths (twins of the numba kernels' rules).

:func:`draw_up` decides, for every coordinate j of every row, "round up" with probability
``frac_j``. Coordinate j reads byte ``j mod 4`` of ``bits32(K, ⌊j/4⌋)`` and compares it with
the first 8 bits of ``frac_j``; only on a tie (probability 1/256) does it read the 32-bit words
``bits32(K₂, 2j)`` and, on a second tie, ``bits32(K₂, 2j+1)``, where ``K₂ = K.fold("extra")``.
Hence P(up) = frac_j up to 2⁻⁷², while the common case costs a quarter of a hash per coordinate
(this is what makes QSGD fast on CPU, see ``benchmarks/compressors.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..rng import Keys, bits32_torch

__all__ = ["EXTRA", "draw_up", "kernel_keys", "key_table"]

#: fold tag of the second key K₂ used on ties
EXTRA = "extra"
_TWO32 = float(2**32)


def draw_up(frac: torch.Tensor, keys: Keys) -> torch.Tensor:
    """Boolean tensor, True with probability ``frac`` (shape ``(..., d)``, values in [0, 1])."""
    d = frac.shape[-1]
    keys = keys.expand(frac.shape[:-1])
    j = torch.arange(d, device=frac.device, dtype=torch.int64)
    words = keys.bits32((d + 3) // 4)
    byte = (words.index_select(-1, j >> 2) >> (8 * (j & 3))) & 255
    t = frac.to(torch.float64) * 256.0
    tb = torch.floor(t)
    b = byte.to(torch.float64)
    up = b < tb
    tie = b == tb
    if bool(tie.any()):
        pos = tie.nonzero(as_tuple=True)
        jj = pos[-1]
        k2 = keys.fold(EXTRA)
        lo2 = k2.lo[pos[:-1]] if pos[:-1] else k2.lo
        hi2 = k2.hi[pos[:-1]] if pos[:-1] else k2.hi
        t2 = (t[pos] - tb[pos]) * _TWO32
        tb2 = torch.floor(t2)
        w1 = bits32_torch(lo2, hi2, 2 * jj).to(torch.float64)
        w2 = bits32_torch(lo2, hi2, 2 * jj + 1).to(torch.float64)
        up_t = (w1 < tb2) | ((w1 == tb2) & (w2 < (t2 - tb2) * _TWO32))
        up[pos] = up_t
    return up


def kernel_keys(keys: Keys) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, lo₂, hi₂) as flat ``uint64`` arrays for the numba kernels (K and K₂)."""
    k2 = keys.fold(EXTRA)
    lo, hi = keys.numpy()
    lo2, hi2 = k2.numpy()
    return (
        lo.reshape(-1).astype(np.uint64),
        hi.reshape(-1).astype(np.uint64),
        lo2.reshape(-1).astype(np.uint64),
        hi2.reshape(-1).astype(np.uint64),
    )


def key_table(keys: Keys) -> np.ndarray:
    """The same four key arrays as rows of one ``(4, rows)`` ``uint64`` array."""
    return np.stack(kernel_keys(keys))
