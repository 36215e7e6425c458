"""Linear-model problems over client splits: logistic regression and least squares.

Client i holds the rows A_i (m_i × d) and targets y_i of a dataset; with the EF21 authors'
convention (methods.md §1)

    f_i(x) = (1/m_i) Σ_{j ∈ client i} φ(a_jᵀx; y_j) + λ R(x),      f = (1/n) Σ_i f_i,

* logistic loss φ(z; y) = log(1 + exp(−yz)), y ∈ {±1} (φ'' ≤ 1/4),
* squared loss φ(z; b) = (z − b)² (φ'' = 2; no ½, as in methods.md),
* regularizer ``"nonconvex"``: R(x) = Σ_k x_k²/(1 + x_k²) ([EF21] §5; 0 ≤ R'' + ½ and |R''| ≤ 2,
  the maximum 2 at x_k = 0), or ``"l2"``: R(x) = ½‖x‖² (R'' = 1).

Exact constants (docs/problems.md), with κ = 1/4 (logistic) or 2 (squared), c_R = 2 (nonconvex)
or 1 (l2), and W = diag(1/(n m_{c(j)})) the weight of sample j in f:

* L_i = κ λ_max(A_iᵀA_i)/m_i + c_R λ,
* L = κ λ_max(AᵀWA) + c_R λ — the λ_max of the *averaged* curvature bound
  (1/n) Σ_i κ A_iᵀA_i/m_i + c_R λ I; it is κλ_max(AᵀA)/N + c_R λ only when all m_i are equal.

Both are attained by the Hessian at x = 0 (φ''(0) = 1/4 for the logistic loss, R''(0) = 2), so
they are the smallest valid constants, not just bounds. μ: λ for the ℓ2-regularised logistic
loss (the infimum of the Hessian's smallest eigenvalue); for least squares without or with the
ℓ2 term, the smallest positive eigenvalue of the Hessian 2AᵀWA + λI (strong convexity when it is
non-singular, the PL constant otherwise); None with the nonconvex regularizer.

The oracles make one pass over the samples, which are stored in client order: z = Ax (or the
row-wise ⟨a_j, X[c(j)]⟩), per-sample residuals r_j = φ'(z_j) / m_{c(j)}, and the per-client sums
Σ_j r_j a_j (numba kernels on the CPU, ``index_add`` on other devices).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp
import torch

from .. import _buffers as buffers
from .._sums import mean_value
from ..rng import Keys, bits32_torch
from . import _kernels as K
from .base import PROBLEMS, Problem, digest_arrays
from .datasets import Dataset, load
from .smoothness import DENSE_LIMIT, client_lambda_max, gram_matrix, lambda_max_gram
from .splits import ClientRows, Split, resolve_split

__all__ = ["LinearModelProblem", "least_squares", "logistic_regression"]

Loss = Literal["logistic", "squared"]
Regularizer = Literal["nonconvex", "l2"]
Storage = Literal["auto", "sparse", "dense"]

#: sup of φ'' for each loss
CURVATURE: dict[str, float] = {"logistic": 0.25, "squared": 2.0}
#: smoothness constant of R for each regularizer (times λ)
REG_CURVATURE: dict[str, float] = {"nonconvex": 2.0, "l2": 1.0}

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "double": torch.float64,
    "float": torch.float32,
}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A floating torch dtype from a name ("float64", "float32") or a dtype."""
    if isinstance(dtype, torch.dtype) and dtype in (torch.float64, torch.float32):
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.replace("torch.", "")]
    raise TypeError(f"dtype must be 'float64' or 'float32' (or the torch dtype), got {dtype!r}")


def as_device(device: str | torch.device | None) -> torch.device:
    """A torch device, checking that it exists (e.g. "cuda" without a GPU is an error)."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:0', ..., got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available; use 'cpu'")
    return dev


class LinearModelProblem(Problem):
    """f = (1/n) Σ f_i with f_i the mean loss of a linear model over client i's samples (+ λR).

    Usually built by :func:`logistic_regression`, :func:`least_squares` or
    :func:`~shrinkgrad.problems.synthetic.synthetic_least_squares`; see the module docstring for
    the formulas. ``A`` is the N × d data (CSR or dense), ``targets`` the labels (±1, logistic) or
    the regression targets, ``parts`` the clients' row indices (a sequence of index arrays or a
    :class:`~shrinkgrad.problems.splits.ClientRows`). Data whose rows are already in client order
    are kept by reference, not copied (10⁵ clients of generated data): do not modify ``A`` or
    ``targets`` after building the problem (its constants, solution and
    :meth:`data_digest` are computed from them once); build a new one. ``intercept=True`` appends a
    column of ones to ``A`` (the problem is the linear model on [A, 1]: d + 1 coordinates, the
    last one the bias, regularized like the others, constants computed on [A, 1]); ``threads``
    spreads the one-point gradient pass over that many numba threads (same results).
    """

    fresh_grads = True  # every gradient oracle allocates its (n, d) result

    def __init__(
        self,
        A: sp.spmatrix | np.ndarray,
        targets: np.ndarray,
        parts: Sequence[np.ndarray],
        *,
        loss: Loss,
        lam: float = 0.0,
        reg: Regularizer = "nonconvex",
        dtype: str | torch.dtype = torch.float64,
        device: str | torch.device | None = None,
        storage: Storage = "auto",
        name: str | None = None,
        dataset: str = "",
        split: str = "",
        eig_method: Literal["auto", "dense", "lanczos"] = "auto",
        threads: int = 1,
        intercept: bool = False,
    ) -> None:
        if loss not in CURVATURE:
            raise ValueError(f"loss must be 'logistic' or 'squared', got {loss!r}")
        if reg not in REG_CURVATURE:
            raise ValueError(f"reg must be 'nonconvex' or 'l2', got {reg!r}")
        if (
            isinstance(lam, bool)
            or not isinstance(lam, (int, float))
            or not (math.isfinite(lam) and lam >= 0)
        ):
            raise ValueError(
                f"lam (regularization strength) must be a finite number ≥ 0, got {lam!r}"
            )
        if storage not in ("auto", "sparse", "dense"):
            raise ValueError(f"storage must be 'auto', 'sparse' or 'dense', got {storage!r}")
        self.threads = _check_threads(threads)
        if not isinstance(intercept, bool):
            raise ValueError(f"intercept must be True or False, got {intercept!r}")
        self.intercept = intercept
        if intercept:
            A = _with_intercept(A)
        self.loss_kind: Loss = loss
        self.lam = float(lam)
        self.reg: Regularizer = reg
        self.dtype = as_dtype(dtype)
        self.device = as_device(device)
        self.dataset = dataset
        self.split = split
        self.name = name or _default_name(loss, self.lam, reg)

        # -- clients' rows in client order -------------------------------------------------
        rows = ClientRows.of(parts)  # no Python object per client
        sizes = rows.sizes
        if sizes.size == 0 or np.any(sizes == 0):
            raise ValueError("every client needs at least one sample")
        perm = rows.order
        # samples already in client order (contiguous chunks, generated data) are not copied
        in_order = perm.size == A.shape[0] and bool(np.all(perm == np.arange(perm.size)))
        A64: sp.csr_matrix | np.ndarray
        if sp.issparse(A):
            A64 = sp.csr_matrix(A, dtype=np.float64)
            A64 = A64 if in_order else A64[perm]
            if not A64.has_sorted_indices:  # on a copy: the caller's matrix is not modified
                A64 = A64.copy()
                A64.sort_indices()
        else:
            A64 = np.asarray(A, dtype=np.float64)
            A64 = np.ascontiguousarray(A64 if in_order else A64[perm])
        if A64.ndim != 2:
            raise ValueError(f"the data matrix must be 2-D, got shape {A64.shape}")
        y = np.asarray(targets, dtype=np.float64).reshape(-1)
        if y.size != A.shape[0]:
            raise ValueError(f"{A.shape[0]} data rows but {y.size} targets")
        self.n = int(sizes.size)
        self.d = int(A64.shape[1])
        self.n_samples = int(perm.size)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._sizes = sizes
        self.client_sizes: torch.Tensor = torch.from_numpy(sizes.copy())
        self._client = np.repeat(np.arange(self.n, dtype=np.int64), sizes)
        self._rows = np.arange(self.n_samples, dtype=np.int64)
        self._zeros_client = np.zeros(self.n_samples, dtype=np.int64)
        self._w64 = 1.0 / sizes[self._client].astype(np.float64)
        self._A64 = A64
        self._y64 = y if in_order else y[perm]

        # -- storage (CSR until a dense copy is cheaper) -----------------------------------
        np_dtype = np.float64 if self.dtype == torch.float64 else np.float32
        itemsize = np.dtype(np_dtype).itemsize
        if storage == "auto":
            nnz = int(A64.nnz) if isinstance(A64, sp.csr_matrix) else np.count_nonzero(A64)
            dense_bytes = self.n_samples * self.d * itemsize
            storage = "dense" if nnz * (itemsize + 8) >= dense_bytes else "sparse"
        self.storage: Literal["sparse", "dense"] = storage
        if storage == "sparse":
            csr = sp.csr_matrix(A64, dtype=np_dtype)
            self._indptr = csr.indptr.astype(np.int64)
            # the kernels read the column indices in the narrowest unsigned type that holds
            # d − 1 (uint8 for a9a's 123 features): the gradient pass is bound by their traffic
            self._indices = csr.indices.astype(_index_dtype(self.d))
            self._data = csr.data.astype(np_dtype)
            self._A: sp.csr_matrix | np.ndarray = csr
            # binary features (every stored value 1.0): the kernels skip reading the values
            self._ones = bool(np.all(self._data == 1.0))
        else:
            dense = A64.toarray() if isinstance(A64, sp.csr_matrix) else A64
            self._A = np.ascontiguousarray(dense, dtype=np_dtype)
            self._ones = False
        self._y = self._y64.astype(np_dtype)
        self._w = self._w64.astype(np_dtype)
        self._inv_m = 1.0 / sizes.astype(np.float64)
        self._block_rows = K.block_rows(self.offsets)
        self._no_e = np.empty(0, dtype=np_dtype)
        self._no_loss = np.empty(0, dtype=np.float64)
        self._torch: dict[str, torch.Tensor] | None = None
        self._data_digest: str | None = None  # data_digest(), computed on first use
        self.backend: Literal["numba", "torch"] = "numba" if self.device.type == "cpu" else "torch"
        self._eig_method = eig_method

        # -- smoothness constants (float64, exact) ------------------------------------------
        kappa = CURVATURE[loss]
        c_reg = REG_CURVATURE[reg] * self.lam
        lam_i = client_lambda_max(A64, self.offsets, method=eig_method)
        self.L_i = torch.from_numpy(kappa * lam_i / sizes + c_reg)
        self._fweights = self._w64 / self.n  # weight of sample j in f
        quadratic = loss == "squared" and (reg == "l2" or self.lam == 0.0)
        gram = None
        if quadratic and self.d <= DENSE_LIMIT and eig_method != "lanczos":
            # the Hessian's data part, needed by the solve anyway: L from it (one Gram, blocked)
            gram = _weighted_gram(A64, self._fweights)
            self.L = kappa * max(0.0, float(np.linalg.eigvalsh(gram)[-1])) + c_reg
        else:
            self.L = kappa * lambda_max_gram(A64, self._fweights, method=eig_method) + c_reg
        self.f_lower = 0.0
        self.mu = None
        self._f_star: float | None = None
        self._x_star: torch.Tensor | None = None
        # the ℓ2 logistic solution is computed on first access of f_star / x_star
        self._solved = not (loss == "logistic" and reg == "l2" and self.lam > 0)
        if loss == "logistic" and reg == "l2" and self.lam > 0:
            self.mu = self.lam
        if quadratic and self.d <= DENSE_LIMIT:
            self._solve_quadratic(gram)

    # -- known solution (lazy for the logistic loss) ----------------------------------------
    @property
    def f_star(self) -> float | None:
        """f(x*) when computable: exactly for least squares, to high precision for ℓ2 logistic."""
        if not self._solved:
            self._solve_logistic()
        return self._f_star

    @f_star.setter
    def f_star(self, value: float | None) -> None:
        self._f_star = value
        self._solved = True

    @property
    def x_star(self) -> torch.Tensor | None:
        """The minimiser when computable (see :attr:`f_star`), in the problem's dtype/device."""
        if not self._solved:
            self._solve_logistic()
        return self._x_star

    @x_star.setter
    def x_star(self, value: torch.Tensor | None) -> None:
        self._x_star = value
        self._solved = True

    @property
    def convex(self) -> bool:  # type: ignore[override]
        """Every f_i is convex: the logistic and squared losses are, and so is the ℓ2 term;
        the nonconvex regularizer Σ x_k²/(1 + x_k²) is not (unless λ = 0)."""
        return self.reg == "l2" or self.lam == 0.0

    @property
    def lazy_solution(self) -> bool:
        """True when x*/f* are computed on first access (ℓ2 logistic: a Newton solve), so that
        ``f_lower`` tightens from 0 to f* when they are; a reader that must see the same bound
        in every run (the simulator's divergence test) uses :attr:`f_lower_a_priori`."""
        return self.loss_kind == "logistic" and self.reg == "l2" and self.lam > 0

    @property
    def f_lower_a_priori(self) -> float:
        """A lower bound on inf f known without solving anything: f* when it was computed at
        construction (least squares), else 0 (the losses and the regularizers are ≥ 0)."""
        return 0.0 if self.lazy_solution or self._f_star is None else float(self._f_star)

    def _set_solution(self, x: np.ndarray) -> None:
        xt = torch.from_numpy(np.asarray(x, dtype=np.float64))
        self._x_star = xt.to(device=self.device, dtype=self.dtype)
        self._f_star = self._loss64(xt.numpy())
        self.f_lower = self._f_star
        self._solved = True

    def _loss64(self, x: np.ndarray) -> float:
        z = self._A64 @ x
        per = _phi_np(self.loss_kind, z, self._y64)
        return float(per @ self._fweights) + self.lam * _reg_value_np(self.reg, x)

    def _solve_quadratic(self, H: np.ndarray | None = None) -> None:
        """Least squares (reg none or ℓ2): x* from the normal equations, μ from the spectrum.

        ``H`` = Aᵀ W A when already computed."""
        if H is None:
            H = _weighted_gram(self._A64, self._fweights)
        h = (self._A64.T @ (self._fweights * self._y64)).reshape(-1)
        lam2 = self.lam if self.reg == "l2" else 0.0
        hess = 2.0 * H + lam2 * np.eye(self.d)
        evals, evecs = np.linalg.eigh(hess)
        tol = max(float(evals[-1]), 1e-300) * self.d * 1e-13
        pos = evals > tol
        # pseudo-inverse solve: the minimum-norm minimiser when the Hessian is singular
        x = evecs[:, pos] @ ((evecs[:, pos].T @ (2.0 * h)) / evals[pos])
        self.mu = float(evals[pos][0]) if pos.any() else None
        self._set_solution(x)

    def _solve_logistic(self) -> None:
        """ℓ2 logistic: Newton's method with backtracking (L-BFGS for large d) to ‖∇f‖ ≤ 1e-13."""
        self._solved = True
        if not (self.loss_kind == "logistic" and self.reg == "l2" and self.lam > 0):
            return
        A, y, fw, lam = self._A64, self._y64, self._fweights, self.lam

        def fgrad(x: np.ndarray) -> tuple[float, np.ndarray]:
            t = y * (A @ x)
            f = float(np.logaddexp(0.0, -t) @ fw) + 0.5 * lam * float(x @ x)
            r = -y * _expit(-t) * fw
            return f, np.asarray(A.T @ r).reshape(-1) + lam * x

        x = np.zeros(self.d)
        if self.d <= DENSE_LIMIT:
            f, g = fgrad(x)
            for _ in range(100):
                t = y * (A @ x)
                s = _expit(t)
                curv = s * (1.0 - s) * fw
                Hm = gram_matrix(A, curv) + lam * np.eye(self.d)
                step = np.linalg.solve(Hm, g)
                decrement = float(g @ step)  # Newton decrement²: f(x) − f* ≈ decrement/2
                if not decrement > 0:
                    break
                a = 1.0
                while True:
                    f_new, g_new = fgrad(x - a * step)
                    # Armijo, or (at machine precision, where f cannot tell) a smaller gradient
                    if f_new <= f - 1e-4 * a * decrement or a < 1e-10:
                        break
                    if f_new <= f + 1e-15 * abs(f) and np.linalg.norm(g_new) < np.linalg.norm(g):
                        break
                    a *= 0.5
                if f_new > f + 1e-15 * abs(f) or not np.linalg.norm(g_new) < np.linalg.norm(g):
                    break  # no further progress
                x, f, g = x - a * step, f_new, g_new
        else:  # pragma: no cover - bundled data has d ≤ 300
            from scipy.optimize import minimize

            res = minimize(
                fgrad, x, jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "maxiter": 20000}
            )
            x = res.x
        self._set_solution(x)

    # -- input handling (the shared checks of Problem) -------------------------------------------
    def _point(self, x: torch.Tensor, what: str = "x") -> torch.Tensor:
        return self.check_point(x, what)

    def _points(self, X: torch.Tensor) -> torch.Tensor:
        return self.check_points(X)

    def _numpy(self, t: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.numpy())

    # -- regularizer ----------------------------------------------------------------------------
    def _reg_grad(self, x: torch.Tensor) -> torch.Tensor:
        if self.reg == "nonconvex":
            return (2.0 * self.lam) * x / (1.0 + x * x) ** 2
        return self.lam * x

    def _reg_value(self, x: torch.Tensor) -> torch.Tensor:
        if self.reg == "nonconvex":
            sq = x * x
            # a term whose x_j² overflows is 1 (its limit), not inf/inf = NaN
            return self.lam * torch.where(sq == torch.inf, 1.0, sq / (1.0 + sq)).sum(-1)
        return 0.5 * self.lam * (x * x).sum(-1)

    def _reg_numba(self, xn: np.ndarray, value: bool) -> tuple[np.ndarray, float]:
        """(∇ψ(x), ψ(x) or 0.0) of the numba backend in one call
        (:func:`~shrinkgrad.problems._kernels.regularizer`: the gradient with the bits of
        :meth:`_reg_grad`, the value summed in order); five small torch operations each cost
        more than the whole call."""
        grad = np.empty(self.d, dtype=self._A.dtype)
        out = np.empty(1 if value else 0, dtype=self._A.dtype)
        K.regularizer(self.reg == "nonconvex", self.lam, xn, grad, out)
        return grad, (float(out[0]) if value else 0.0)

    def _plus_reg(self, f_i: np.ndarray, value: float) -> torch.Tensor:
        """f_i + ψ(x) in the problem's dtype, f_i the float64 losses without the regularizer:
        rounded to the dtype first, then ψ added (the torch backend's order)."""
        if f_i.dtype == self._A.dtype:
            f_i += value
            return torch.from_numpy(f_i)
        return torch.from_numpy(f_i).to(self.dtype).add_(value)

    # -- the one-pass engine -----------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        """Device copies of the data for the torch backend (built on first use)."""
        if self._torch is None:
            dev, dt = self.device, self.dtype
            t: dict[str, torch.Tensor] = {
                "y": torch.from_numpy(self._y).to(dev),
                "w": torch.from_numpy(self._w).to(dev),
                "client": torch.from_numpy(self._client).to(dev),
                "offsets": torch.from_numpy(self.offsets).to(dev),
            }
            if self.storage == "sparse":
                row = np.repeat(np.arange(self.n_samples, dtype=np.int64), np.diff(self._indptr))
                t["row"] = torch.from_numpy(row).to(dev)
                t["col"] = torch.from_numpy(self._indices.astype(np.int64)).to(dev)
                t["val"] = torch.from_numpy(self._data).to(dev, dt)
            else:
                t["A"] = torch.from_numpy(np.asarray(self._A)).to(dev, dt)
            self._torch = t
        return self._torch

    def _rowdot(self, X: np.ndarray, rows: np.ndarray, client: np.ndarray) -> np.ndarray:
        z = np.empty(rows.size, dtype=self._A.dtype)
        if self.storage == "sparse":
            K.rowdot_csr(self._indptr, self._indices, self._data, rows, client, X, self._ones, z)
        else:
            K.rowdot_dense(self._A, rows, client, X, z)
        return z

    def _z_and_scatter_numba(
        self,
        X: np.ndarray,
        rows: np.ndarray,
        client: np.ndarray,
        weights: np.ndarray | None,
        same_x: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(z, G): z_k = ⟨a_{rows[k]}, X[client[k]]⟩, G[c] = Σ_k w_k φ'(z_k) a_{rows[k]}.

        Single-threaded kernels (no BLAS call: a multi-threaded BLAS matvec on a shared machine
        can be 10× slower than one thread, and results stay deterministic).
        """
        dt = self._A.dtype
        same = self._zeros_client if rows is self._rows else np.zeros_like(client)
        z = self._rowdot(X, rows, same if same_x else client)
        y = self._y if rows is self._rows else self._y[rows]
        w = self._w if weights is None else weights
        r = np.empty(z.shape[0], dtype=dt)  # (_dphi_np(loss, z, y) * w).astype(dt), fused
        K.dphi_weighted(self.loss_kind == "logistic", z, y, w, r)
        G = np.zeros((self.n, self.d), dtype=dt)
        if self.storage == "sparse":
            K.scatter_csr(self._indptr, self._indices, self._data, rows, client, r, self._ones, G)
        else:
            K.scatter_dense(self._A, rows, client, r, G)
        return z, G

    def _point_numba(
        self, x: torch.Tensor, losses: bool, mean: bool = False
    ) -> tuple[np.ndarray, torch.Tensor | None, np.ndarray | None]:
        """(G, f_i, ∇f) at one point x, the regularizer's gradient included, in one kernel call
        (:func:`~shrinkgrad.problems._kernels.point_pass_csr`: the values of the row-list
        kernels and of :func:`client_losses` bit for bit); with ``threads`` > 1 the clients are
        spread over numba threads (same values). The losses f_i(x) (the regularizer's value
        included, in the problem's dtype: :meth:`client_losses`' bits) only when ``losses``, the
        mean gradient (1/n) Σ_i G[i] from the pass's block sums
        (:func:`~shrinkgrad.problems._kernels.block_mean`) only when ``mean``; else None.
        """
        xn = self._numpy(x)
        reg, reg_value = self._reg_numba(xn, losses)
        logistic = self.loss_kind == "logistic"
        out = np.empty(self.n, dtype=np.float64) if losses else self._no_loss
        G = buffers.empty((self.n, self.d), self._A.dtype)  # recycled at federated scale
        blocks = -(-self.n // K.PASS_BLOCK) if mean else 0
        part = np.empty((blocks, self.d), dtype=G.dtype)
        parallel = self.threads > 1
        if parallel:
            import numba

            numba.set_num_threads(min(self.threads, getattr(numba.config, "NUMBA_NUM_THREADS", 1)))
        y, w, inv_m, rows = self._y, self._w, self._inv_m, self._block_rows
        if self.storage == "sparse":
            kernel = K.point_pass_csr_threads if parallel else K.point_pass_csr
            kernel(
                self._indptr, self._indices, self._data, self._ones, self.offsets, xn, y, w,
                logistic, reg, G, inv_m, out, rows, part,
            )  # fmt: skip
        else:
            kernel = K.point_pass_dense_threads if parallel else K.point_pass_dense
            kernel(self._A, self.offsets, xn, y, w, logistic, reg, G, inv_m, out, rows, part)
        g: np.ndarray | None = None
        if mean:
            g = np.empty(self.d, dtype=G.dtype)
            K.block_mean(part, self.n, g)
        return G, (self._plus_reg(out, reg_value) if losses else None), g

    def _losses_numba(self, z: np.ndarray, e: np.ndarray | None) -> np.ndarray:
        """f_i(x) (float64) from the margins z (and exp(−t) of the logistic loss), regularizer
        excluded."""
        logistic = self.loss_kind == "logistic"
        if logistic and e is None:
            e = np.empty_like(z)
            K.neg_margin_exp(z, self._y, e)
        buf = np.empty(self.n_samples, dtype=np.float64)
        out = np.empty(self.n, dtype=np.float64)
        e_arg = self._no_e if e is None else e
        K.client_losses(logistic, z, self._y, e_arg, self.offsets, self._inv_m, buf, out)
        return out

    def _grads_torch(
        self,
        X: torch.Tensor,
        rows: torch.Tensor | None,
        weights: torch.Tensor | None,
        keep_z: bool = False,
    ) -> Any:
        """G (and, with ``keep_z``, (G, z)) on the torch backend (``index_add``)."""
        t = self._tensors()
        client = t["client"] if rows is None else t["client"][rows]
        y = t["y"] if rows is None else t["y"][rows]
        w = t["w"] if weights is None else weights
        n_rows = self.n_samples if rows is None else rows.numel()
        if self.storage == "sparse":
            row, col, val = t["row"], t["col"], t["val"]
            local = torch.arange(n_rows, device=self.device)
            if rows is not None:  # keep the non-zeros of the chosen rows, renumbered 0..B−1
                pos = torch.full((self.n_samples,), -1, dtype=torch.int64, device=self.device)
                pos[rows] = local
                keep = pos[row] >= 0
                row, col, val = pos[row][keep], col[keep], val[keep]
            c_nz = client[row]
            z = torch.zeros(n_rows, dtype=self.dtype, device=self.device)
            z.index_add_(0, row, val * X[c_nz, col])
            r = _dphi_torch(self.loss_kind, z, y) * w
            G = torch.zeros(self.n * self.d, dtype=self.dtype, device=self.device)
            G.index_add_(0, c_nz * self.d + col, val * r[row])
            G = G.view(self.n, self.d)
        else:
            A = t["A"] if rows is None else t["A"][rows]
            z = (A * X[client]).sum(-1)
            r = _dphi_torch(self.loss_kind, z, y) * w
            G = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)
            G.index_add_(0, client, r[:, None] * A)
        return (G, z) if keep_z else G

    def _margins_torch(self, x: torch.Tensor) -> torch.Tensor:
        """z = Ax on the torch backend, with the arithmetic of :meth:`_grads_torch` (same bits)."""
        t = self._tensors()
        if self.storage == "sparse":
            z = torch.zeros(self.n_samples, dtype=self.dtype, device=self.device)
            return z.index_add_(0, t["row"], t["val"] * x[t["col"]])
        return (t["A"] * x).sum(-1)

    # -- oracles --------------------------------------------------------------------------------
    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d): row i is ∇f_i(x), in one pass over the data."""
        x = self._point(x)
        if self.backend == "numba":  # the regularizer's gradient is added in the kernel
            return torch.from_numpy(self._point_numba(x, False)[0])
        G: torch.Tensor = self._grads_torch(x.expand(self.n, self.d), None, None)
        return G.add_(self._reg_grad(x))

    def client_grads_and_losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``client_grads(x)``, ``client_losses(x)``), bit for bit, from one pass over the data.

        The losses reuse the margins z = Ax and, for the logistic loss, the exp(−t) of the
        gradient's φ' (:mod:`~shrinkgrad.problems._kernels`): one division and a vectorised
        polynomial per sample more than the gradient alone. The simulator logs ∇f and f from
        this (:mod:`shrinkgrad.methods.oracle`).
        """
        grads, losses, _ = self.client_grads_losses_and_mean(x)
        return grads, losses

    def client_grads_losses_and_mean(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``client_grads(x)``, ``client_losses(x)``, ``grad(x)``), bit for bit, from one pass.

        The numba pass adds each client's row to its block's column sum while the row is in
        cache, so the mean gradient costs no second pass over the (n, d) result
        (:func:`~shrinkgrad.problems._kernels.block_mean`); the simulator's logged ‖∇f‖² comes
        from here (:mod:`shrinkgrad.methods.oracle`).
        """
        x = self._point(x)
        if self.backend == "numba":
            G, losses, g = self._point_numba(x, True, True)
            assert losses is not None and g is not None
            return torch.from_numpy(G), losses, torch.from_numpy(g)
        grads, z = self._grads_torch(x.expand(self.n, self.d), None, None, keep_z=True)
        grads, losses = grads.add_(self._reg_grad(x)), self._losses_torch(z)
        return grads, losses + self._reg_value(x), grads.mean(dim=0)

    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor:
        """(n, d): row i is ∇f_i(X[i]), in one pass over the data."""
        X = self._points(X)
        if self.backend == "numba":
            Xn = self._numpy(X.contiguous())
            _, G = self._z_and_scatter_numba(Xn, self._rows, self._client, None, False)
            out = torch.from_numpy(G)
        else:
            out = self._grads_torch(X, None, None)
        return out.add_(self._reg_grad(X))

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        """∇f(x) = (1/n) Σ_i ∇f_i(x) (with the numba backend from the pass's block sums, as
        :meth:`client_grads_losses_and_mean`: the same bits)."""
        x = self._point(x)
        if self.backend == "numba":
            g = self._point_numba(x, False, True)[2]
            assert g is not None
            return torch.from_numpy(g)
        return self.client_grads(x).mean(dim=0)

    def client_losses(self, x: torch.Tensor) -> torch.Tensor:
        """(n,): f_i(x) (accumulated in float64, returned in the problem's dtype)."""
        x = self._point(x)
        if self.backend == "numba":
            xn = self._numpy(x)
            zn = self._rowdot(xn[None, :], self._rows, self._zeros_client)
            return self._plus_reg(self._losses_numba(zn, None), self._reg_numba(xn, True)[1])
        return self._losses_torch(self._margins_torch(x)) + self._reg_value(x)

    def _losses_torch(self, z: torch.Tensor) -> torch.Tensor:
        t = self._tensors()
        per = _phi_torch(self.loss_kind, z, t["y"]) * t["w"]
        out = torch.zeros(self.n, dtype=self.dtype, device=self.device)
        return out.index_add_(0, t["client"], per)

    def loss(self, x: torch.Tensor) -> float:
        """f(x) = (1/n) Σ_i f_i(x) (in float64, the clients in order: ``shrinkgrad._sums``)."""
        return mean_value(self.client_losses(x))

    def minibatch_rows(
        self, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows (in storage order) of every client's minibatch and their weights 1/b_i.

        Client i draws b_i of its m_i samples uniformly without replacement: sample j of client
        i gets the keyed uniform u = keys[i].uniform at counter j, and the b_i smallest u win.
        So client i's draw depends only on keys[i] (a client computed alone draws the same).
        """
        b = self._batch_sizes(batch_sizes)
        keys = keys.expand((self.n,)).to(self.device)
        dev = self.device
        t = self._tensors() if self.backend == "torch" else None
        client = t["client"] if t is not None else torch.from_numpy(self._client)
        offsets = t["offsets"] if t is not None else torch.from_numpy(self.offsets)
        local = torch.arange(self.n_samples, device=dev) - offsets[client]
        if bool((b == self.client_sizes.to(b.device)).all()):
            rows = torch.arange(self.n_samples, device=dev)
        else:
            w = bits32_torch(keys.lo[client], keys.hi[client], local)
            u = (w.to(torch.float64) + 0.5) * 2.0**-32
            if self.backend == "numba":  # per-client stable sorts, O(N log m)
                rows_np = np.empty(int(b.sum()), dtype=np.int64)
                K.select_smallest(u.numpy(), self.offsets, b.numpy(), rows_np)
                rows = torch.from_numpy(rows_np)
            else:  # one stable sort keyed by (client, u): the segments keep their place
                order = torch.argsort(client.to(torch.float64) + u, stable=True)
                rows = order[local < b.to(dev)[client]]
        weights = 1.0 / b.to(dev, torch.float64)[client[rows]]
        return rows, weights.to(self.dtype)

    def client_stoch_grads(
        self, X: torch.Tensor, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> torch.Tensor:
        """Row i averages ∇ of b_i samples of client i (without replacement, drawn with keys[i]).

        ``X`` is (d,) (same point for all clients) or (n, d); the regularizer's gradient is
        exact (it is not sampled). With b_i = m_i this is :meth:`client_grads_at`.
        """
        X = self._points(X)
        rows, weights = self.minibatch_rows(batch_sizes, keys)
        if self.backend == "numba":
            r_np = rows.numpy()
            out = torch.from_numpy(
                self._z_and_scatter_numba(
                    self._numpy(X.contiguous()), r_np, self._client[r_np], weights.numpy(), False
                )[1]
            )
        else:
            out = self._grads_torch(X, rows, weights)
        return out.add_(self._reg_grad(X))

    def minibatch_variance(self, x: torch.Tensor, batch_sizes: torch.Tensor | int) -> torch.Tensor:
        """(n,) float64: E‖ĝ_i(x) − ∇f_i(x)‖² of :meth:`client_stoch_grads` at x, exactly.

        Sampling b_i of m_i without replacement: (m_i − b_i)/(b_i (m_i − 1)) · V_i with
        V_i = (1/m_i) Σ_j ‖φ'_j a_j‖² − ‖(1/m_i) Σ_j φ'_j a_j‖² (finite-population correction;
        0 when b_i = m_i). The σ² of the EF21-SGD rule is a bound over all x: see
        :meth:`minibatch_variance_bound`.
        """
        b = self._batch_sizes(batch_sizes).double()
        xn = self._point(x).detach().cpu().double().numpy()
        A, y, m = self._A64, self._y64, self._sizes.astype(np.float64)
        r = _dphi_np(self.loss_kind, np.asarray(A @ xn).reshape(-1), y)
        sq = _row_norms2(A) * r * r
        second = np.bincount(self._client, weights=sq, minlength=self.n) / m
        G = np.zeros((self.n, self.d))
        rm = r / m[self._client]
        if isinstance(A, sp.csr_matrix):
            K.scatter_csr(*_csr_parts(A), self._rows, self._client, rm, False, G)
        else:
            K.scatter_dense(A, self._rows, self._client, rm, G)
        pop = np.maximum(second - (G * G).sum(1), 0.0)
        return torch.from_numpy(_fpc(m, b.numpy()) * pop)

    def minibatch_variance_bound(self, batch_sizes: torch.Tensor | int) -> torch.Tensor:
        """(n,) bounds σ_i² ≥ sup_x E‖ĝ_i(x) − ∇f_i(x)‖² (logistic loss only; float64).

        |φ'| ≤ 1 for the logistic loss, so V_i(x) ≤ (1/m_i) Σ_j ‖a_j‖² and
        σ_i² = (m_i − b_i)/(b_i (m_i − 1)) · (1/m_i) Σ_j ‖a_j‖² (see :meth:`minibatch_variance`).
        Pass their mean as ``sigma2`` to :func:`~shrinkgrad.theory.stepsize_ef21_sgd`. The squared
        loss has no such bound (its residuals grow with ‖x‖): a ValueError says so.
        """
        if self.loss_kind != "logistic":
            raise ValueError(
                "the squared loss has no uniform bound on the minibatch variance (it grows with "
                "‖x‖); use minibatch_variance(x, b) at the points of interest"
            )
        b = self._batch_sizes(batch_sizes).double().numpy()
        m = self._sizes.astype(np.float64)
        mean_norm = np.bincount(self._client, weights=_row_norms2(self._A64), minlength=self.n) / m
        return torch.from_numpy(_fpc(m, b) * mean_norm)

    def _batch_sizes(self, batch_sizes: torch.Tensor | int) -> torch.Tensor:
        if isinstance(batch_sizes, bool):
            raise TypeError("batch_sizes must be an integer or an integer tensor of shape (n,)")
        b = torch.as_tensor(batch_sizes)
        if b.dtype.is_floating_point or b.dtype == torch.bool:
            raise TypeError(f"batch_sizes must be integers, got dtype {b.dtype}")
        b = b.to(torch.int64).cpu().expand(self.n) if b.ndim == 0 else b.to(torch.int64).cpu()
        if b.shape != (self.n,):
            raise ValueError(
                f"batch_sizes must be one integer or shape ({self.n},), got {tuple(b.shape)}"
            )
        bad = (b < 1) | (b > self.client_sizes)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"batch size {int(b[i])} for client {i} must be in [1, m_i = "
                f"{int(self.client_sizes[i])}] (the client's number of samples)"
            )
        return b

    def restrict(self, ids: torch.Tensor) -> LinearModelProblem:
        """The problem of the clients ``ids`` alone (:meth:`Problem.restrict`).

        Client j of the result holds client ``ids[j]``'s rows in the same order, so its gradients
        and losses are computed exactly as here (each f_i depends on its own rows only); ``L_i``
        and ``client_sizes`` are those of ``ids``, ``L`` is the smoothness constant of the
        clients' average f = (1/m) Σ_j f_{ids[j]}.
        """
        idx = torch.as_tensor(ids).detach().cpu().reshape(-1)
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"client ids must be integers, got {idx.dtype}")
        if idx.numel() == 0:
            raise ValueError("restrict needs at least one client id")
        if int(idx.min()) < 0 or int(idx.max()) >= self.n:
            raise ValueError(f"client ids must lie in [0, n={self.n})")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("client ids must be distinct")
        ids_np = idx.numpy().astype(np.int64)
        sizes = self._sizes[ids_np]
        starts = self.offsets[ids_np]
        # the rows of the chosen clients, client by client, without a per-client loop
        local = np.arange(int(sizes.sum()), dtype=np.int64)
        new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        sel = np.repeat(starts - new_offsets[:-1], sizes) + local
        parts = ClientRows(local, new_offsets)
        data = self._A64[sel]
        if self.intercept:  # the constructor appends the column of ones again
            data = data[:, :-1]
        return LinearModelProblem(
            data,
            self._y64[sel],
            parts,
            loss=self.loss_kind,
            lam=self.lam,
            reg=self.reg,
            dtype=self.dtype,
            device=self.device,
            storage=self.storage,
            name=self.name,
            dataset=self.dataset,
            split=self.split,
            eig_method=self._eig_method,
            threads=self.threads,
            intercept=self.intercept,
        )

    # -- data access and metadata ----------------------------------------------------------------
    def data_matrix(self) -> sp.csr_matrix | np.ndarray:
        """The N × d data in client order (float64; rows offsets[i]:offsets[i+1] are client i's)."""
        return self._A64

    def data_digest(self) -> str:
        """SHA-1 hex digest of the data (:meth:`Problem.data_digest`): the N × d matrix in client
        order as stored in float64 (CSR: data, indices, indptr, shape; dense: its entries; the
        intercept's column included), the targets in that order and the clients' row offsets
        (so the split). Independent of ``dtype``, ``device``, ``storage`` and ``threads`` (how
        f is computed); the same values given once dense and once sparse digest differently.
        The loss is not in it: ``info()`` holds it (``loss``), and the fingerprint records both.

        Computed on first use and kept, as everything else computed from the data at
        construction (L, L_i, the solution): the data must not be changed afterwards (arrays
        already in client order are kept by reference, so changing the caller's ``A`` or
        ``targets`` in place would change f and leave all of these stale). To change the
        data, build a new problem."""
        digest: str | None = getattr(self, "_data_digest", None)
        if digest is None:
            digest = self._data_digest = digest_arrays(
                (("A", self._A64), ("targets", self._y64), ("offsets", self.offsets))
            )
        return digest

    @property
    def curvature(self) -> float:
        """κ = sup φ'' of the loss (1/4 logistic, 2 squared)."""
        return CURVATURE[self.loss_kind]

    @property
    def reg_curvature(self) -> float:
        """The smoothness constant of λR (2λ nonconvex, λ for ℓ2)."""
        return REG_CURVATURE[self.reg] * self.lam

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(
            {
                "split": self.split,
                "loss": self.loss_kind,
                "lam": self.lam,
                "reg": self.reg if self.lam > 0 else "none",
                "n_samples": self.n_samples,
                "intercept": self.intercept,
                "dtype": str(self.dtype).replace("torch.", ""),
            }
        )
        spec = getattr(self, "spec", None)
        if spec:
            out["spec"] = spec
        return out

    def __repr__(self) -> str:
        return (
            f"<problem {self.name} on {self.dataset or 'data'}: n={self.n} clients, d={self.d}, "
            f"N={self.n_samples}, split={self.split or '?'}, L={self.L:.4g}, L_AM={self.L_AM:.4g}, "
            f"L_QM={self.L_QM:.4g}>"
        )


def _row_norms2(A: sp.csr_matrix | np.ndarray) -> np.ndarray:
    if isinstance(A, sp.csr_matrix):
        return np.asarray(A.multiply(A).sum(axis=1)).reshape(-1)
    return np.asarray(np.einsum("ij,ij->i", A, A))


def _csr_parts(A: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return A.indptr.astype(np.int64), A.indices.astype(np.int64), A.data


def _fpc(m: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(m − b)/(b (m − 1)): variance factor of a b-of-m sample mean without replacement."""
    return np.where(m > 1, (m - b) / (b * np.maximum(m - 1, 1)), 0.0)


#: rows per block of :func:`_weighted_gram` (no weighted copy of a tall dense matrix)
_GRAM_ROWS = 1 << 16


def _weighted_gram(A: sp.csr_matrix | np.ndarray, w: np.ndarray) -> np.ndarray:
    """Aᵀ diag(w) A (d × d), for dense data by blocks of rows: memory O(d² + block·d) instead of
    a weighted copy of A (10⁶ × 100 at 10⁵ clients). One block is ``gram_matrix`` exactly."""
    if sp.issparse(A) or A.shape[0] <= _GRAM_ROWS:
        return gram_matrix(A, w)
    out = np.zeros((A.shape[1], A.shape[1]))
    for lo in range(0, A.shape[0], _GRAM_ROWS):
        blk = A[lo : lo + _GRAM_ROWS]
        out += blk.T @ (blk * w[lo : lo + _GRAM_ROWS, None])
    return out


def _with_intercept(A: sp.spmatrix | np.ndarray) -> sp.csr_matrix | np.ndarray:
    """[A, 1]: the data with a column of ones appended (the intercept's feature)."""
    ones = np.ones((A.shape[0], 1))
    if sp.issparse(A):
        return sp.hstack([sp.csr_matrix(A, dtype=np.float64), ones], format="csr")
    return np.hstack([np.asarray(A, dtype=np.float64), ones])


def _index_dtype(d: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest unsigned integer type that holds the column indices 0 … d − 1."""
    for t in (np.uint8, np.uint16, np.uint32):
        if d - 1 <= np.iinfo(t).max:
            return t
    return np.uint64


def _check_threads(threads: Any) -> int:
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1 (1: serial kernels), got {threads!r}")
    return int(threads)


def _default_name(loss: str, lam: float, reg: str) -> str:
    base = "logreg" if loss == "logistic" else "least_squares"
    if lam == 0:
        return base
    return f"{base}_{reg}"


def _expit(t: np.ndarray) -> np.ndarray:
    from scipy.special import expit

    return np.asarray(expit(t))


def _phi_np(loss: str, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    if loss == "logistic":
        return np.asarray(np.logaddexp(0.0, -y * z))
    return np.asarray((z - y) ** 2)


def _dphi_np(loss: str, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    if loss == "logistic":
        return np.asarray(-y * _expit(-y * z))
    return np.asarray(2.0 * (z - y))


def _phi_torch(loss: str, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if loss == "logistic":
        return torch.nn.functional.softplus(-y * z)
    return (z - y) ** 2


def _dphi_torch(loss: str, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if loss == "logistic":
        return -y * torch.sigmoid(-y * z)
    return 2.0 * (z - y)


def _reg_value_np(reg: str, x: np.ndarray) -> float:
    if reg == "nonconvex":
        with np.errstate(over="ignore", invalid="ignore"):  # x_j² overflows: that term is 1
            sq = x * x
            return float(np.sum(np.where(sq == np.inf, 1.0, sq / (1.0 + sq))))
    return 0.5 * float(x @ x)


# --------------------------------------------------------------------------------------------
# factories (Python API and PROBLEMS registry)
# --------------------------------------------------------------------------------------------
def _from_dataset(
    loss: Loss,
    dataset: str | os.PathLike[str] | Dataset,
    n_clients: int | None,
    split: str | Split | Sequence[Any],
    n_features: int | None,
    **options: Any,
) -> LinearModelProblem:
    data = load(dataset, n_features=n_features)
    data.require_binary("logistic regression" if loss == "logistic" else "least squares")
    parts, split_name = resolve_split(split, data, n_clients)
    return LinearModelProblem(
        data.X, data.y, parts, loss=loss, dataset=data.name, split=split_name, **options
    )


_OPTIONS_DOC = """
    ``intercept=True`` appends a feature equal to 1 to every sample (a bias b in a_jᵀw + b, as
    FL_PyTorch adds; x's last coordinate): the problem is then exactly this linear model on the
    data [A, 1], the regularizer included (it applies to the bias like to every coordinate), so
    L_i = κ λ_max(ÃᵢᵀÃᵢ)/m_i + c_R λ and L keep their formulas on Ã = [A, 1] and stay the
    smallest valid constants; d grows by one. ``threads`` > 1 spreads the one-point gradient
    pass over numba threads (results bit for bit those of 1 thread, the default).
"""


@PROBLEMS.register("logistic_regression")
def logistic_regression(
    dataset: str | os.PathLike[str] | Dataset,
    n_clients: int | None = None,
    split: str | Split | Sequence[Any] = "contiguous",
    lam: float = 0.1,
    reg: Regularizer = "nonconvex",
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    storage: Storage = "auto",
    n_features: int | None = None,
    intercept: bool = False,
    threads: int = 1,
) -> LinearModelProblem:
    """Logistic regression over n clients, with the nonconvex (default) or the ℓ2 regularizer.

    f_i(x) = (1/m_i) Σ_j log(1 + exp(−y_j a_jᵀx)) + λ Σ_k x_k²/(1 + x_k²)  ([EF21] §5, λ = 0.1),
    or + (λ/2)‖x‖² with ``reg="l2"`` (then μ = λ, and f_star/x_star are computed on first use).
    ``dataset``: a bundled name ("a9a"), a path to a LIBSVM file, or a :class:`Dataset`;
    ``split``: a split name ("contiguous", "shuffled[seed=0]", ...) or a list of per-client
    index arrays (then ``n_clients`` is implied).
    """
    return _from_dataset(
        "logistic", dataset, n_clients, split, n_features,
        lam=lam, reg=reg, dtype=dtype, device=device, storage=storage, intercept=intercept,
        threads=threads,
    )  # fmt: skip


@PROBLEMS.register("least_squares")
def least_squares(
    dataset: str | os.PathLike[str] | Dataset,
    n_clients: int | None = None,
    split: str | Split | Sequence[Any] = "contiguous",
    lam: float = 0.0,
    reg: Regularizer = "nonconvex",
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    storage: Storage = "auto",
    n_features: int | None = None,
    intercept: bool = False,
    threads: int = 1,
) -> LinearModelProblem:
    """Least squares on a dataset's labels: f_i(x) = (1/m_i)‖A_i x − y_i‖² (+ λR(x)).

    With λ = 0 (default) or ``reg="l2"``: exact x* (minimum-norm), f*, and μ (smallest positive
    eigenvalue of the Hessian); with the nonconvex regularizer those are unknown (None).
    """
    return _from_dataset(
        "squared", dataset, n_clients, split, n_features,
        lam=lam, reg=reg, dtype=dtype, device=device, storage=storage, intercept=intercept,
        threads=threads,
    )  # fmt: skip


logistic_regression.__doc__ = (logistic_regression.__doc__ or "") + _OPTIONS_DOC
least_squares.__doc__ = (least_squares.__doc__ or "") + _OPTIONS_DOC
