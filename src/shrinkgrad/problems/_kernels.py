"""Single-pass CPU kernels (numba) for linear-model problems with clients as a tensor axis.

The samples of all clients are stored in client order. For a list of rows ``rows`` (all rows for
full gradients, a minibatch for stochastic ones), with ``client[k]`` the client of ``rows[k]``:

* :func:`rowdot_csr` / :func:`rowdot_dense`: z_k = ⟨a_{rows[k]}, X[client[k]]⟩ — one pass over
  the non-zeros of the chosen rows, whatever the number of clients;
* :func:`scatter_csr` / :func:`scatter_dense`: G[client[k]] += r_k a_{rows[k]} — the per-client
  weighted sums of rows, also one pass.

So the stacked client gradients cost O(nnz + n·d) for any n (benchmarks/problems.py). The
kernels are compiled per dtype (float32 / float64) on first use and cached on disk. Each sum is
accumulated in the order of the stored non-zeros (rows in order, columns in order), so results
do not depend on how the kernels are written.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

__all__ = [
    "dphi_weighted",
    "rowdot_csr",
    "rowdot_dense",
    "scatter_csr",
    "scatter_dense",
    "select_smallest",
]

_jit: Any = numba.njit(cache=True, nogil=True)


@_jit
def rowdot_csr(indptr, indices, data, rows, client, X, ones, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``ones``: every stored value is 1.0 (binary features, e.g. a9a), so ``data`` is not read
    (1.0·v = v exactly: the same result). Unsigned indices skip numba's negative-index check."""
    for k in range(rows.shape[0]):
        j = rows[k]
        xr = X[client[k]]
        s = 0.0
        if ones:
            for p in range(indptr[j], indptr[j + 1]):
                s += xr[np.uint64(indices[p])]
        else:
            for p in range(indptr[j], indptr[j + 1]):
                s += data[p] * xr[np.uint64(indices[p])]
        out[k] = s


@_jit
def scatter_csr(indptr, indices, data, rows, client, r, ones, G):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``ones`` as in :func:`rowdot_csr` (r_k·1.0 = r_k exactly)."""
    for k in range(rows.shape[0]):
        j = rows[k]
        g = G[client[k]]
        rk = r[k]
        if rk == 0.0:
            continue
        if ones:
            for p in range(indptr[j], indptr[j + 1]):
                g[np.uint64(indices[p])] += rk
        else:
            for p in range(indptr[j], indptr[j + 1]):
                g[np.uint64(indices[p])] += rk * data[p]


@_jit
def dphi_weighted(logistic, z, y, w, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out_k = φ'(z_k; y_k)·w_k with the arithmetic of the numpy expressions it replaces
    (``-y * expit(-y * z) * w``, expit(t) = 1/(1 + exp(−t)) as scipy computes it, or
    ``2 * (z - y) * w``), in z's dtype: the same bits, without the temporaries."""
    one = z.dtype.type(1.0)
    two = z.dtype.type(2.0)
    if logistic:
        for k in range(z.shape[0]):
            ny = -y[k]
            out[k] = (ny * (one / (one + math.exp(-(ny * z[k]))))) * w[k]
    else:
        for k in range(z.shape[0]):
            out[k] = (two * (z[k] - y[k])) * w[k]


@_jit
def rowdot_dense(A, rows, client, X, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    d = A.shape[1]
    for k in range(rows.shape[0]):
        j = rows[k]
        c = client[k]
        s = 0.0
        for q in range(d):
            s += A[j, q] * X[c, q]
        out[k] = s


@_jit
def scatter_dense(A, rows, client, r, G):  # type: ignore[no-untyped-def]  # pragma: no cover
    d = A.shape[1]
    for k in range(rows.shape[0]):
        j = rows[k]
        c = client[k]
        rk = r[k]
        for q in range(d):
            G[c, q] += rk * A[j, q]


@_jit
def select_smallest(u, offsets, b, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out ← for each client i, the rows of its b_i smallest u (ascending, ties by position)."""
    pos = 0
    for i in range(offsets.shape[0] - 1):
        lo = offsets[i]
        order = np.argsort(u[lo : offsets[i + 1]], kind="mergesort")
        for k in range(b[i]):
            out[pos] = lo + order[k]
            pos += 1
