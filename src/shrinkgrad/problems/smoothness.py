"""Exact largest eigenvalues of (weighted) Gram matrices: the raw material of L and L_i.

For a data block A (m × d, CSR or dense) the smoothness constants of the problems are multiples
of λ_max(AᵀA) (docs/problems.md). Two exact methods:

* ``"dense"``: a symmetric eigensolver (LAPACK ``syevd``) on the smaller Gram matrix, AᵀA (d × d)
  or AAᵀ (m × m) — they share their non-zero eigenvalues. For the clients, blocks of similar size
  are zero-padded and solved in batches (``numpy.linalg.eigvalsh`` on an (c, k, k) stack), in
  chunks that bound the memory (about 256 MB);
* ``"lanczos"``: ARPACK's implicitly restarted Lanczos (``scipy.sparse.linalg.eigsh``) on the
  operator v ↦ Aᵀ(w ⊙ (Av)), to relative tolerance 1e-13; for d beyond :data:`DENSE_LIMIT`.

``"auto"`` uses the dense solver whenever the smaller Gram side is at most :data:`DENSE_LIMIT`.
The test suite checks the Lanczos path against the dense one.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import numpy as np
import scipy.sparse as sp

__all__ = [
    "DENSE_LIMIT",
    "Method",
    "client_lambda_max",
    "gram_matrix",
    "lambda_max_gram",
]

#: largest Gram side solved with a dense eigensolver under ``method="auto"``
DENSE_LIMIT = 2048
#: element budget of one batch of padded client blocks (float64: 8 bytes each)
_BUDGET = 1 << 25

Method = Literal["auto", "dense", "lanczos"]
Matrix: TypeAlias = "sp.csr_matrix | np.ndarray"


def _check_method(method: str) -> None:
    if method not in ("auto", "dense", "lanczos"):
        raise ValueError(f"method must be 'auto', 'dense' or 'lanczos', got {method!r}")


def gram_matrix(A: Matrix, weights: np.ndarray | None = None) -> np.ndarray:
    """Dense Aᵀ diag(w) A (d × d, float64)."""
    if sp.issparse(A):
        A64 = sp.csr_matrix(A, dtype=np.float64)
        W = A64 if weights is None else sp.csr_matrix(A64.multiply(weights[:, None]))
        return np.asarray((A64.T @ W).toarray())
    A64d = np.asarray(A, dtype=np.float64)
    Wd = A64d if weights is None else A64d * weights[:, None]
    return A64d.T @ Wd


def _lanczos(A: Matrix, weights: np.ndarray | None) -> float:
    from scipy.sparse.linalg import LinearOperator, eigsh

    m, d = A.shape
    A64 = sp.csr_matrix(A, dtype=np.float64) if sp.issparse(A) else np.asarray(A, np.float64)
    w = np.ones(m) if weights is None else np.asarray(weights, dtype=np.float64)
    if min(m, d) <= 2:
        return _dense_lambda_max(A64, w)
    if m < d:  # A diag(w) Aᵀ has the same non-zero spectrum as diag(√w) A Aᵀ diag(√w)
        sw = np.sqrt(w)
        op = LinearOperator(
            (m, m), matvec=lambda v: sw * (A64 @ (A64.T @ (sw * v))), dtype=np.float64
        )
    else:
        op = LinearOperator((d, d), matvec=lambda v: A64.T @ (w * (A64 @ v)), dtype=np.float64)
    start = np.ones(op.shape[0]) / np.sqrt(op.shape[0])
    val = eigsh(op, k=1, which="LA", tol=1e-13, v0=start, return_eigenvectors=False)
    return max(0.0, float(val[0]))


def _dense_lambda_max(A: Matrix, w: np.ndarray | None) -> float:
    m, d = A.shape
    if m == 0:
        return 0.0
    if m < d:
        sw = np.ones(m) if w is None else np.sqrt(w)
        B = (
            (sp.csr_matrix(A).multiply(sw[:, None])).toarray()
            if sp.issparse(A)
            else A * sw[:, None]
        )
        K = B @ B.T
    else:
        K = gram_matrix(A, w)
    return max(0.0, float(np.linalg.eigvalsh(K)[-1]))


def lambda_max_gram(A: Matrix, weights: np.ndarray | None = None, method: Method = "auto") -> float:
    """λ_max(Aᵀ diag(w) A) for non-negative weights w (all ones by default), exactly."""
    _check_method(method)
    if weights is not None and np.any(np.asarray(weights) < 0):
        raise ValueError("Gram weights must be non-negative")
    if method == "lanczos" or (method == "auto" and min(A.shape) > DENSE_LIMIT):
        return _lanczos(A, weights)
    return _dense_lambda_max(A, None if weights is None else np.asarray(weights, np.float64))


def client_lambda_max(A: Matrix, offsets: np.ndarray, method: Method = "auto") -> np.ndarray:
    """λ_max(A_iᵀA_i) for the row blocks A_i = A[offsets[i]:offsets[i+1]], as a float64 array.

    ``"dense"`` (and ``"auto"`` for small blocks): zero-padded blocks of similar size are
    stacked and solved in batches, so n = 1000 clients cost a handful of LAPACK calls.
    """
    _check_method(method)
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.diff(offsets)
    n, d = sizes.size, A.shape[1]
    out = np.zeros(n)
    small = np.minimum(sizes, d) <= DENSE_LIMIT
    if method == "lanczos":
        small[:] = False
    elif method == "dense":
        small[:] = True
    for i in np.flatnonzero(~small):  # large blocks: Lanczos, one client at a time (setup only)
        out[i] = _lanczos(A[offsets[i] : offsets[i + 1]], None)
    idx = np.flatnonzero(small & (sizes > 0))
    if idx.size == 0:
        return out
    order = idx[np.argsort(sizes[idx], kind="stable")]
    start = 0
    while start < order.size:
        stop = start + 1
        while stop < order.size:
            m_max = int(sizes[order[stop]])
            k = min(m_max, d)
            if (stop + 1 - start) * (m_max * d + k * k) > _BUDGET:
                break
            stop += 1
        out[order[start:stop]] = _batched(A, offsets, sizes, order[start:stop])
        start = stop
    return out


def _batched(A: Matrix, offsets: np.ndarray, sizes: np.ndarray, clients: np.ndarray) -> np.ndarray:
    m = sizes[clients]
    m_max, d = int(m.max()), A.shape[1]
    mask = np.arange(m_max)[None, :] < m[:, None]
    rows = (offsets[clients][:, None] + np.arange(m_max)[None, :])[mask]
    block = A[rows]
    dense = block.toarray() if sp.issparse(block) else np.asarray(block)
    P = np.zeros((clients.size, m_max, d))
    P[mask] = dense
    K = P @ P.transpose(0, 2, 1) if m_max < d else P.transpose(0, 2, 1) @ P
    return np.maximum(np.linalg.eigvalsh(K)[:, -1], 0.0)
