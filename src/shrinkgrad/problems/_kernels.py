"""Single-pass CPU kernels (numba) for linear-model problems with clients as a tensor axis.

The samples of all clients are stored in client order. For a list of rows ``rows`` (all rows for
full gradients, a minibatch for stochastic ones), with ``client[k]`` the client of ``rows[k]``:

* :func:`rowdot_csr` / :func:`rowdot_dense`: z_k = ⟨a_{rows[k]}, X[client[k]]⟩ — one pass over
  the non-zeros of the chosen rows, whatever the number of clients;
* :func:`scatter_csr` / :func:`scatter_dense`: G[client[k]] += r_k a_{rows[k]} — the per-client
  weighted sums of rows, also one pass.

So the stacked client gradients cost O(nnz + n·d) for any n (benchmarks/problems.py). The
kernels are compiled per dtype (float32 / float64) on first use and cached on disk.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

__all__ = ["rowdot_csr", "rowdot_dense", "scatter_csr", "scatter_dense", "select_smallest"]

_jit: Any = numba.njit(cache=True, nogil=True)


@_jit
def rowdot_csr(indptr, indices, data, rows, client, X, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    for k in range(rows.shape[0]):
        j = rows[k]
        c = client[k]
        s = 0.0
        for p in range(indptr[j], indptr[j + 1]):
            s += data[p] * X[c, indices[p]]
        out[k] = s


@_jit
def scatter_csr(indptr, indices, data, rows, client, r, G):  # type: ignore[no-untyped-def]  # pragma: no cover
    for k in range(rows.shape[0]):
        j = rows[k]
        c = client[k]
        rk = r[k]
        if rk == 0.0:
            continue
        for p in range(indptr[j], indptr[j + 1]):
            G[c, indices[p]] += rk * data[p]


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
