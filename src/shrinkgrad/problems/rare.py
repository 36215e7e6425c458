"""The constants c and L_+ of "EF21 shines when features are rare" [RF].

* c = max over features k of the number of clients whose gradient ∇f_i can be non-zero in
  coordinate k. From the data alone that is the number of clients with a non-zero a_jk; a
  regularizer with λ > 0 has a gradient on every coordinate, so with ``include_regularizer``
  (default) c = n then (the [RF] premise needs the regularizer handled elsewhere).
* L_+ with (1/n) Σ_i ‖∇f_i(x) − ∇f_i(y)‖² ≤ L_+² ‖x − y‖²:
  - quadratics (least squares with λ = 0 or the ℓ2 term; [RF], V with the authors' code):
    L_+² = λ_max((1/n) Σ H_i²), H_i = 2A_iᵀA_i/m_i + λI, exact;
  - logistic loss (D): ∇f_i(x) − ∇f_i(y) = H̄_i (x − y) with 0 ⪯ H̄_i ⪯ B_i = A_iᵀA_i/(4m_i), and
    ‖H̄_i v‖² ≤ ‖H̄_i‖ vᵀH̄_i v ≤ ‖B_i‖ vᵀB_i v, so L_+² ≤ λ_max((1/n) Σ ‖B_i‖ B_i) for the loss
    part (note B_i² is *not* a valid bound: A ⪯ B does not imply A² ⪯ B²);
  - a regularizer that is not a quadratic (the nonconvex R, with |R''| ≤ 2) adds its constant
    by the triangle inequality: L_+ ≤ L_+(loss) + 2λ. The same is used for the squared loss
    with the nonconvex regularizer.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.sparse as sp

from .linear import LinearModelProblem

__all__ = ["RareFeatures", "rare_features"]


@dataclasses.dataclass(frozen=True)
class RareFeatures:
    """c, L_+ and whether L_+ is exact (True) or an upper bound (False)."""

    c: int
    L_plus: float
    exact: bool
    #: number of clients using each feature (from the data), shape (d,)
    clients_per_feature: np.ndarray


def rare_features(problem: LinearModelProblem, *, include_regularizer: bool = True) -> RareFeatures:
    """c and L_+ of a linear-model problem (see the module docstring for the formulas)."""
    if not isinstance(problem, LinearModelProblem):
        raise TypeError(
            f"rare_features needs a data-based linear-model problem, got {type(problem).__name__}"
        )
    A = problem.data_matrix()
    n, d = problem.n, problem.d
    client = np.repeat(np.arange(n), np.diff(problem.offsets))
    if sp.issparse(A):
        coo = sp.coo_matrix(A)
        rows, cols = coo.row[coo.data != 0], coo.col[coo.data != 0]
    else:
        rows, cols = np.nonzero(np.asarray(A))
    pairs = np.unique(client[rows].astype(np.int64) * d + cols)
    per_feature = np.bincount(pairs % d, minlength=d)
    c = int(per_feature.max()) if per_feature.size else 0
    if include_regularizer and problem.lam > 0:
        c = n

    quadratic = problem.loss_kind == "squared" and (problem.lam == 0 or problem.reg == "l2")
    lam_l2 = problem.lam if (quadratic and problem.reg == "l2") else 0.0
    S = np.zeros((d, d))
    for i in range(n):  # setup-time helper: one d × d product per client
        Ai = A[problem.offsets[i] : problem.offsets[i + 1]]
        m_i = Ai.shape[0]
        gram = (Ai.T @ Ai).toarray() if sp.issparse(Ai) else np.asarray(Ai).T @ np.asarray(Ai)
        if problem.loss_kind == "squared":
            H = 2.0 * gram / m_i + lam_l2 * np.eye(d)
            S += H @ H
        else:
            B = gram / (4.0 * m_i)
            S += float(np.linalg.eigvalsh(B)[-1]) * B
    L_plus = math.sqrt(max(0.0, float(np.linalg.eigvalsh(S / n)[-1])))
    if not quadratic:
        L_plus += problem.reg_curvature
    return RareFeatures(c=c, L_plus=L_plus, exact=quadratic, clients_per_feature=per_feature)
