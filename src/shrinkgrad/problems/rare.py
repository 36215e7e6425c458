"""The constants c and L_+ of "EF21 shines when features are rare" [RF].

* c = max over features k of the number of clients whose gradient ∇f_i can be non-zero in
  coordinate k. From the data alone that is the number of clients with a non-zero a_jk; a
  regularizer with λ > 0 has a gradient on every coordinate, so with ``include_regularizer``
  (default) c = n then (the [RF] premise needs the regularizer handled elsewhere).
* L_+ with (1/n) Σ_i ‖∇f_i(x) − ∇f_i(y)‖² ≤ L_+² ‖x − y‖²:
  - quadratics (least squares with λ = 0 or the ℓ2 term; [RF], V with the authors' code):
    L_+² = λ_max((1/n) Σ H_i²), H_i = G_i + λI with G_i = 2A_iᵀA_i/m_i, exact;
  - logistic loss (D): ∇f_i(x) − ∇f_i(y) = H̄_i (x − y) with 0 ⪯ H̄_i ⪯ B_i = A_iᵀA_i/(4m_i), and
    ‖H̄_i v‖² ≤ ‖H̄_i‖ vᵀH̄_i v ≤ ‖B_i‖ vᵀB_i v, so L_+² ≤ λ_max((1/n) Σ ‖B_i‖ B_i) for the loss
    part (note B_i² is *not* a valid bound: A ⪯ B does not imply A² ⪯ B²);
  - a regularizer that is not a quadratic (the nonconvex R, with |R''| ≤ 2) adds its constant
    by the triangle inequality: L_+ ≤ L_+(loss) + 2λ. The same is used for the squared loss
    with the nonconvex regularizer.

Nothing is quadratic in d (issue 12): c comes from the sparsity pattern (the distinct
(client, feature) pairs, O(nnz)); the matrices above are never formed in d × d:

* logistic: (1/n) Σ ‖B_i‖ B_i = Aᵀ diag(w) A with w_j = ‖B_i‖/(4 m_i n) for the samples j of
  client i, whose λ_max is a weighted Gram eigenvalue
  (:func:`~shrinkgrad.problems.smoothness.lambda_max_gram`: smaller side, used columns);
* quadratics: λ_max((1/n) Σ (G_i + λI)²) = λ² + λ_max(M) with M = (1/n) Σ (G_i² + 2λG_i), and

      M v = (1/n) Aᵀ (s ⊙ (K (s ⊙ Av) + 2λ Av)),   s_j = 2/m_i,   K = blockdiag_i(A_iA_iᵀ),

  with K applied as Q Qᵀ, Q the data with each client's columns relabelled to its own (client,
  feature) pairs (so the block structure needs no per-client loop). M acts on the u used
  features only (the others carry no curvature); for u ≤ ``DENSE_LIMIT`` it is formed column
  block by column block and solved densely (exact to rounding), above by Lanczos on the operator.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.sparse as sp

from .linear import LinearModelProblem
from .smoothness import (
    DENSE_LIMIT,
    client_feature_pairs,
    client_lambda_max,
    lambda_max_gram,
    used_columns,
)

__all__ = ["RareFeatures", "rare_features"]

#: element budget of one column block when M is formed densely (float64)
_BLOCK_BUDGET = 1 << 23


@dataclasses.dataclass(frozen=True)
class RareFeatures:
    """c, L_+ and whether L_+ is exact (True) or an upper bound (False).

    ``features`` (sorted) are the features some client uses and ``counts`` how many clients use
    each: the sparse form of the per-feature client counts (O(nnz), not O(d)).
    """

    c: int
    L_plus: float
    exact: bool
    #: the used features (sorted indices into 0..d−1)
    features: np.ndarray
    #: number of clients whose data use each of ``features``
    counts: np.ndarray
    #: the dimension d
    d: int

    @property
    def clients_per_feature(self) -> np.ndarray:
        """Number of clients using each feature, shape (d,) (dense: O(d) memory, on request)."""
        out = np.zeros(self.d, dtype=np.int64)
        out[self.features] = self.counts
        return out


def rare_features(problem: LinearModelProblem, *, include_regularizer: bool = True) -> RareFeatures:
    """c and L_+ of a linear-model problem (see the module docstring for the formulas)."""
    if not isinstance(problem, LinearModelProblem):
        raise TypeError(
            f"rare_features needs a data-based linear-model problem, got {type(problem).__name__}"
        )
    A = problem.data_matrix()
    n, d = problem.n, problem.d
    offsets = np.asarray(problem.offsets, dtype=np.int64)
    pairs = client_feature_pairs(A, offsets)
    features, counts = np.unique(pairs % np.int64(d), return_counts=True)
    c = int(counts.max()) if counts.size else 0
    if include_regularizer and problem.lam > 0:
        c = n

    quadratic = problem.loss_kind == "squared" and (problem.lam == 0 or problem.reg == "l2")
    if problem.loss_kind == "squared":
        lam_l2 = problem.lam if (quadratic and problem.reg == "l2") else 0.0
        L_plus = math.sqrt(max(0.0, _squared_lplus2(A, offsets, lam_l2)))
    else:
        sizes = np.diff(offsets).astype(np.float64)
        norm_B = client_lambda_max(A, offsets) / (4.0 * sizes)  # ‖B_i‖ = λ_max(A_iᵀA_i)/(4m_i)
        w = np.repeat(norm_B / (4.0 * sizes * n), np.diff(offsets))
        L_plus = math.sqrt(lambda_max_gram(A, w))
    if not quadratic:
        L_plus += problem.reg_curvature
    return RareFeatures(
        c=c, L_plus=L_plus, exact=quadratic, features=features, counts=counts, d=int(d)
    )


def _squared_lplus2(A: sp.csr_matrix | np.ndarray, offsets: np.ndarray, lam: float) -> float:
    """λ_max((1/n) Σ_i (G_i + λI)²), G_i = 2A_iᵀA_i/m_i, without any d × d matrix."""
    n = offsets.size - 1
    sizes = np.diff(offsets)
    Ac, _ = used_columns(A)  # N × u: the used features only
    u = Ac.shape[1]
    if u == 0 or Ac.nnz == 0:
        return lam * lam
    # Q: each client's non-zeros in columns of their own (client, feature) pair, so that
    # Q Qᵀ = blockdiag_i(A_i A_iᵀ) = K
    coo = Ac.tocoo()
    client = np.searchsorted(offsets, coo.row, side="right") - 1
    _, pair = np.unique(client * np.int64(u) + coo.col, return_inverse=True)
    pair = pair.reshape(-1)
    Q = sp.csr_matrix((coo.data, (coo.row, pair)), shape=(Ac.shape[0], int(pair.max()) + 1))
    Qt = Q.T.tocsr()
    At = Ac.T.tocsr()
    s = np.repeat(2.0 / sizes.astype(np.float64), sizes)

    def apply(V: np.ndarray) -> np.ndarray:
        """M V for a (u,) vector or a (u, b) block."""
        Z = Ac @ V
        sZ = s[:, None] * Z if Z.ndim == 2 else s * Z
        KsZ = Q @ (Qt @ sZ)
        inner = KsZ + 2.0 * lam * Z
        return np.asarray(At @ ((s[:, None] if Z.ndim == 2 else s) * inner)) / n

    if u <= DENSE_LIMIT:
        width = max(1, min(u, _BLOCK_BUDGET // max(Ac.shape[0], Q.shape[1], u)))
        M = np.empty((u, u))
        eye = np.eye(u)
        for start in range(0, u, width):  # column blocks of M = M·I (setup time, u/width passes)
            M[:, start : start + width] = apply(eye[:, start : start + width])
        M = 0.5 * (M + M.T)
        top = float(np.linalg.eigvalsh(M)[-1])
    else:
        from scipy.sparse.linalg import LinearOperator, eigsh

        from .smoothness import _start_vector

        op = LinearOperator((u, u), matvec=apply, dtype=np.float64)
        vals = eigsh(op, k=1, which="LA", tol=1e-14, v0=_start_vector(u), return_eigenvectors=False)
        top = float(vals[0])
    return lam * lam + max(0.0, top)
