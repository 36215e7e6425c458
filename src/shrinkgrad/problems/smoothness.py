"""Exact largest eigenvalues of (weighted) Gram matrices: the raw material of L and L_i.

For a data block A (m × d, CSR or dense) the smoothness constants of the problems are multiples
of λ_max(AᵀA) (docs/problems.md). Nothing here is quadratic in the declared dimension d, so a
LIBSVM file with d = 3·10⁸ features and a few non-zeros per sample costs what its non-zeros cost:

* only the **used** columns count: AᵀA restricted to the u columns that hold a non-zero has the
  same non-zero spectrum (the other rows and columns of AᵀA are zero), so sparse data is first
  compacted to its u ≤ min(d, nnz) used columns (:func:`used_columns`; per client, the client's
  own used columns);
* AᵀA (u × u) and AAᵀ (m × m) share their non-zero eigenvalues, so the **smaller side**
  k = min(m, u) is used;
* a Gram that would not be small is never formed: Lanczos runs on the operator
  v ↦ Aᵀ(w ⊙ (Av)) of the compacted block instead (memory O(nnz + k)).

Solvers:

* a dense symmetric eigensolver (LAPACK ``syevd`` through ``numpy.linalg.eigvalsh``, batched
  over clients): exact to rounding, O(k³) per matrix;
* ARPACK's implicitly restarted Lanczos (``scipy.sparse.linalg.eigsh``, relative tolerance
  1e-14, fixed keyed start vector) on the k × k Gram or on the operator; it agrees with the dense
  solver to a few ulps (the tests check it) and is ~20× faster at k = 300.

``method="auto"`` takes the dense solver for k ≤ :data:`SMALL_GRAM` (clients) or
k ≤ :data:`DENSE_LIMIT` (whole data), Lanczos on the formed Gram for clients up to the batch
budget, and Lanczos on the operator beyond; ``"dense"`` and ``"lanczos"`` force one.
"""

from __future__ import annotations

import functools
from typing import Literal, TypeAlias

import numpy as np
import scipy.sparse as sp

from .memory import check_memory

__all__ = [
    "DENSE_LIMIT",
    "SMALL_GRAM",
    "Method",
    "client_feature_pairs",
    "client_lambda_max",
    "gram_matrix",
    "lambda_max_gram",
    "used_columns",
]

#: largest Gram side solved with a dense eigensolver under ``method="auto"``
DENSE_LIMIT = 2048
#: Gram side up to which client Grams are solved by a dense eigensolver under "auto"
SMALL_GRAM = 64
#: element budget of one batch of client Gram matrices (float64: 8 bytes each); a client whose
#: Gram alone exceeds it is solved by Lanczos on its operator under "auto"
_BUDGET = 1 << 23

Method = Literal["auto", "dense", "lanczos"]
Matrix: TypeAlias = "sp.csr_matrix | np.ndarray"


def _check_method(method: str) -> None:
    if method not in ("auto", "dense", "lanczos"):
        raise ValueError(f"method must be 'auto', 'dense' or 'lanczos', got {method!r}")


# --------------------------------------------------------------------------------------------
# sparsity pattern
# --------------------------------------------------------------------------------------------
def _nonzeros(A: Matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, cols, values) of the non-zero entries of A, in row-major order."""
    if sp.issparse(A):
        csr = sp.csr_matrix(A)
        rows = np.repeat(np.arange(csr.shape[0], dtype=np.int64), np.diff(csr.indptr))
        cols, vals = csr.indices.astype(np.int64), np.asarray(csr.data, dtype=np.float64)
        keep = vals != 0
        return rows[keep], cols[keep], vals[keep]
    dense = np.asarray(A, dtype=np.float64)
    rows, cols = np.nonzero(dense)
    return rows.astype(np.int64), cols.astype(np.int64), dense[rows, cols]


def used_columns(A: Matrix) -> tuple[sp.csr_matrix, np.ndarray]:
    """A restricted to its used columns (m × u CSR, float64) and their indices in A (u,).

    Memory O(nnz); the non-zero spectrum of the Gram matrices is unchanged.
    """
    rows, cols, vals = _nonzeros(A)
    used, local = np.unique(cols, return_inverse=True)
    B = sp.csr_matrix((vals, (rows, local.reshape(-1))), shape=(A.shape[0], used.size))
    return B, used


def client_feature_pairs(A: Matrix, offsets: np.ndarray) -> np.ndarray:
    """The sorted distinct keys i·d + k of the (client i, feature k) pairs with a non-zero a_jk.

    Client i holds the rows ``offsets[i]:offsets[i+1]``. ``keys // d`` is the client and
    ``keys % d`` the feature (int64; O(nnz) memory, nothing of size d).
    """
    rows, cols, _ = _nonzeros(A)
    offsets = np.asarray(offsets, dtype=np.int64)
    client = np.searchsorted(offsets, rows, side="right") - 1
    return np.unique(client * np.int64(A.shape[1]) + cols)


# --------------------------------------------------------------------------------------------
# whole data
# --------------------------------------------------------------------------------------------
def gram_matrix(A: Matrix, weights: np.ndarray | None = None) -> np.ndarray:
    """Dense Aᵀ diag(w) A (d × d, float64). Quadratic in d: for small d only (d ≤ DENSE_LIMIT)."""
    d = A.shape[1]
    check_memory(8.0 * d * d, f"a dense {d} × {d} Gram matrix", "use lambda_max_gram instead")
    if sp.issparse(A):
        A64 = sp.csr_matrix(A, dtype=np.float64)
        W = A64 if weights is None else sp.csr_matrix(A64.multiply(weights[:, None]))
        return np.asarray((A64.T @ W).toarray())
    A64d = np.asarray(A, dtype=np.float64)
    Wd = A64d if weights is None else A64d * weights[:, None]
    return A64d.T @ Wd


def _operator_lambda_max(A: Matrix, w: np.ndarray) -> float:
    """λ_max(Aᵀ diag(w) A) by Lanczos on the smaller side's operator (no Gram matrix formed).

    A zero block gives 0 (ARPACK refuses a zero start residual) and a side of at most 2 is
    solved densely (ARPACK needs k < side): one-sample clients and all-zero rows included.
    """
    from scipy.sparse.linalg import LinearOperator, eigsh

    if min(A.shape) == 0 or not np.any(A.data if sp.issparse(A) else A):
        return 0.0
    if min(A.shape) <= 2:
        return max(0.0, float(np.linalg.eigvalsh(_small_gram(A, w))[-1]))
    m, k = A.shape
    if m < k:  # A diag(w) Aᵀ has the same non-zero spectrum as diag(√w) A Aᵀ diag(√w)
        sw = np.sqrt(w)
        op = LinearOperator((m, m), matvec=lambda v: sw * (A @ (A.T @ (sw * v))), dtype=np.float64)
    else:
        op = LinearOperator((k, k), matvec=lambda v: A.T @ (w * (A @ v)), dtype=np.float64)
    val = eigsh(
        op, k=1, which="LA", tol=1e-14, v0=_start_vector(op.shape[0]), return_eigenvectors=False
    )
    return max(0.0, float(val[0]))


def _small_gram(A: Matrix, w: np.ndarray) -> np.ndarray:
    """The smaller of A diag(w) Aᵀ-like (m × m) and Aᵀ diag(w) A (k × k), dense."""
    m, k = A.shape
    if m < k:
        sw = np.sqrt(w)
        B = sp.csr_matrix(A).multiply(sw[:, None]).tocsr() if sp.issparse(A) else A * sw[:, None]
        K = B @ B.T
    else:
        W = sp.csr_matrix(A).multiply(w[:, None]).tocsr() if sp.issparse(A) else A * w[:, None]
        K = A.T @ W
    return np.asarray(K.toarray() if sp.issparse(K) else K, dtype=np.float64)


def lambda_max_gram(A: Matrix, weights: np.ndarray | None = None, method: Method = "auto") -> float:
    """λ_max(Aᵀ diag(w) A) for non-negative weights w (all ones by default), exactly.

    Sparse data is compacted to its used columns first; the dense solver works on the smaller
    side k = min(m, u) (``"auto"``: for k ≤ :data:`DENSE_LIMIT`), Lanczos on the operator
    otherwise.
    """
    _check_method(method)
    if weights is not None and np.any(np.asarray(weights) < 0):
        raise ValueError("Gram weights must be non-negative")
    m = A.shape[0]
    w = np.ones(m) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    B: Matrix
    if sp.issparse(A):  # only the used columns count (compaction matters when d is large)
        B = used_columns(A)[0] if A.shape[1] > DENSE_LIMIT else sp.csr_matrix(A, dtype=np.float64)
    else:
        B = np.asarray(A, dtype=np.float64)
    k = min(B.shape)
    if k == 0 or not np.any(B.data if sp.issparse(B) else B):
        return 0.0
    if method == "lanczos" or (method == "auto" and k > DENSE_LIMIT):
        if k <= 2:
            return max(0.0, float(np.linalg.eigvalsh(_small_gram(B, w))[-1]))
        return _operator_lambda_max(B, w)
    check_memory(8.0 * k * k, f"a dense {k} × {k} Gram matrix", "use method='lanczos'")
    return max(0.0, float(np.linalg.eigvalsh(_small_gram(B, w))[-1]))


# --------------------------------------------------------------------------------------------
# per client
# --------------------------------------------------------------------------------------------
def client_lambda_max(A: Matrix, offsets: np.ndarray, method: Method = "auto") -> np.ndarray:
    """λ_max(A_iᵀA_i) for the row blocks A_i = A[offsets[i]:offsets[i+1]], as a float64 array.

    Each client's block is compacted to the u_i columns it uses, and its Gram is taken on the
    smaller side k_i = min(m_i, u_i) (A_iA_iᵀ when m_i ≤ u_i, A_iᵀA_i otherwise). The Grams are
    formed in batches of clients of similar k_i, in one sparse product per batch (each client's
    rows and columns are placed in their own block, so the product is block diagonal with the
    clients' Grams), and solved by a dense symmetric eigensolver (``"dense"``, and ``"auto"``
    for k_i ≤ :data:`SMALL_GRAM`) or by Lanczos on the k_i × k_i Gram (``"auto"`` for larger
    k_i, about 20× faster at k = 300 and within a few ulps of the dense solver). A client whose
    Gram alone exceeds the batch budget (``"auto"``), and every client under ``"lanczos"``, is
    solved by Lanczos on the operator v ↦ A_iᵀ(A_i v) of its compacted block, without any Gram.
    Memory: O(nnz) plus one batch, never O(d).
    """
    _check_method(method)
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.diff(offsets)
    n = sizes.size
    out = np.zeros(n)
    if n == 0:
        return out
    if not sp.issparse(A):
        return _dense_client_lambda_max(np.asarray(A, dtype=np.float64), offsets, method)
    blocks = _ClientBlocks(A, offsets)
    big = blocks.k * blocks.k > _BUDGET
    operator = (sizes > 0) & (big if method == "auto" else np.full(n, method == "lanczos"))
    for i in np.flatnonzero(operator):  # setup-time loop over the few very large clients
        out[i] = _block_lambda_max(blocks.block(int(i)))
    rest = np.flatnonzero(~operator & (blocks.k > 0))
    for rows_side in (True, False):
        group = rest[blocks.rows_side[rest] == rows_side]
        order = group[np.argsort(blocks.k[group], kind="stable")]
        for chunk in _chunks(blocks.k[order], order):
            out[chunk] = _solve(blocks.grams(chunk, rows_side), method)
    return np.maximum(out, 0.0)


def _solve(grams: np.ndarray, method: str) -> np.ndarray:
    """λ_max of a batch of symmetric PSD matrices (dense solver for small ones, else Lanczos)."""
    if method == "dense" or grams.shape[-1] <= SMALL_GRAM:
        return np.asarray(np.linalg.eigvalsh(grams)[:, -1])
    return np.array([_lanczos_dense(g) for g in grams])


def _dense_client_lambda_max(A: np.ndarray, offsets: np.ndarray, method: str) -> np.ndarray:
    """:func:`client_lambda_max` for data held as a dense array (batched dense products)."""
    sizes = np.diff(offsets)
    d = A.shape[1]
    out = np.zeros(sizes.size)
    k_all = np.minimum(sizes, d)
    operator = (sizes > 0) & (
        k_all * k_all > _BUDGET if method == "auto" else np.full(sizes.size, method == "lanczos")
    )
    for i in np.flatnonzero(operator):  # setup-time loop over the few very large clients
        block = A[offsets[i] : offsets[i + 1]]
        out[i] = _operator_lambda_max(block, np.ones(block.shape[0]))
    idx = np.flatnonzero(~operator & (sizes > 0))
    order = idx[np.argsort(sizes[idx], kind="stable")]
    for chunk in _chunks(k_all[order], order, extra=d * sizes[order]):
        m = sizes[chunk]
        m_max = int(m.max())
        mask = np.arange(m_max)[None, :] < m[:, None]
        P = np.zeros((chunk.size, m_max, d))
        P[mask] = A[(offsets[chunk][:, None] + np.arange(m_max)[None, :])[mask]]
        grams = P @ P.transpose(0, 2, 1) if m_max < d else P.transpose(0, 2, 1) @ P
        out[chunk] = _solve(grams, method)
    return np.maximum(out, 0.0)


def _chunks(
    k_sorted: np.ndarray, clients: np.ndarray, extra: np.ndarray | None = None
) -> list[np.ndarray]:
    """Split clients (sorted by k) into batches whose padded Grams fit the element budget.

    ``extra[j]`` elements are added to the k² of the batch's largest client j (the dense path's
    padded m × d rows).
    """
    if extra is None:
        extra = np.zeros_like(k_sorted)
    out: list[np.ndarray] = []
    start = 0
    while start < clients.size:
        stop = start + 1
        small = k_sorted[start] <= SMALL_GRAM  # small Grams stay in batches of dense solves
        while (
            stop < clients.size
            and (stop + 1 - start) * (int(k_sorted[stop]) ** 2 + int(extra[stop])) <= _BUDGET
            and (k_sorted[stop] <= SMALL_GRAM) == small
        ):
            stop += 1
        out.append(clients[start:stop])
        start = stop
    return out


class _ClientBlocks:
    """The clients' compacted blocks of a data matrix: entries, local rows and local columns.

    Client i's rows are ``offsets[i]:offsets[i+1]``; its local columns number the features it
    uses, 0..u_i−1 in increasing feature order. Everything is O(nnz).
    """

    def __init__(self, A: Matrix, offsets: np.ndarray) -> None:
        self.sizes = np.diff(offsets)
        n = self.sizes.size
        rows, cols, self.vals = _nonzeros(A)
        client = np.searchsorted(offsets, rows, side="right") - 1
        pairs, self.pair = np.unique(client * np.int64(A.shape[1]) + cols, return_inverse=True)
        self.pair = self.pair.reshape(-1)
        pair_client = pairs // np.int64(A.shape[1])
        self.u = np.bincount(pair_client, minlength=n).astype(np.int64)
        first_pair = np.concatenate([[0], np.cumsum(self.u)[:-1]])
        self.local_col = (np.arange(pairs.size) - first_pair[pair_client])[self.pair]
        self.local_row = rows - offsets[client]
        self.start = np.searchsorted(client, np.arange(n + 1))  # entries are in client order
        self.k = np.minimum(self.sizes, self.u)
        self.rows_side = self.sizes <= self.u

    def _entries(self, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Indices of the entries of ``clients`` (concatenated) and each entry's batch position."""
        lo, hi = self.start[clients], self.start[clients + 1]
        counts = hi - lo
        pos = np.repeat(np.arange(clients.size), counts)
        idx = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return lo[pos] + idx, pos

    def block(self, i: int) -> sp.csr_matrix:
        """Client i's compacted block (m_i × u_i)."""
        sl = slice(self.start[i], self.start[i + 1])
        shape = (int(self.sizes[i]), int(self.u[i]))
        return sp.csr_matrix((self.vals[sl], (self.local_row[sl], self.local_col[sl])), shape)

    def grams(self, clients: np.ndarray, rows_side: bool) -> np.ndarray:
        """(c, k, k) Grams of ``clients`` on one side (A_iA_iᵀ or A_iᵀA_i), zero-padded to k."""
        idx, pos = self._entries(clients)
        m, u = self.sizes[clients], self.u[clients]
        k = int((m if rows_side else u).max())
        check_memory(8.0 * clients.size * k * k, f"{clients.size} client Gram matrices")
        # client j's rows and columns get their own ranges: B is block diagonal, O(nnz) in size
        row0 = np.concatenate([[0], np.cumsum(m)[:-1]])
        col0 = np.concatenate([[0], np.cumsum(u)[:-1]])
        r = row0[pos] + self.local_row[idx]
        c = col0[pos] + self.local_col[idx]
        B = sp.csr_matrix((self.vals[idx], (r, c)), shape=(int(m.sum()), int(u.sum())))
        G = (B @ B.T if rows_side else B.T @ B).tocoo()
        start, counts = (row0, m) if rows_side else (col0, u)
        owner = np.repeat(np.arange(clients.size), counts)
        out = np.zeros((clients.size, k, k))
        blk = owner[G.row]
        out[blk, G.row - start[blk], G.col - start[blk]] = G.data
        return out


def _block_lambda_max(B: sp.csr_matrix) -> float:
    """λ_max(BᵀB) of one compacted client block, by Lanczos on its operator (tiny: exactly)."""
    if min(B.shape) == 0 or B.nnz == 0:
        return 0.0
    w = np.ones(B.shape[0])
    if min(B.shape) <= 2:
        return max(0.0, float(np.linalg.eigvalsh(_small_gram(B, w))[-1]))
    return _operator_lambda_max(B, w)


def _lanczos_dense(K: np.ndarray) -> float:
    """λ_max of a symmetric PSD matrix by ARPACK Lanczos (relative tolerance 1e-14).

    A zero matrix gives 0; should ARPACK not converge, the dense solver answers instead.
    """
    from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, eigsh

    if K.shape[0] <= 2 or not np.any(K):
        return float(np.linalg.eigvalsh(K)[-1]) if K.size else 0.0
    try:
        val = eigsh(
            K, k=1, which="LA", tol=1e-14, v0=_start_vector(K.shape[0]), return_eigenvectors=False
        )
    except (ArpackError, ArpackNoConvergence):  # pragma: no cover - a safety net
        return float(np.linalg.eigvalsh(K)[-1])
    return float(val[0])


@functools.lru_cache(maxsize=64)
def _start_vector(k: int) -> np.ndarray:
    """A fixed keyed pseudo-random Lanczos start (not orthogonal to structured eigenvectors)."""
    from ..rng import Keys

    v = Keys.derive(0, stream="lanczos").uniform(k).numpy() - 0.5
    v.flags.writeable = False
    return v
