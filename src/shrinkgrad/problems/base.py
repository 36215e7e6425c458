"""The problem abstraction: f = (1/n) Σ_i f_i over n clients, with its smoothness constants.

Convention (methods.md §1, as in the EF21 authors' code): f is the *average* of the client
functions, and f_i is the mean loss over client i's samples plus the regularizer. A problem knows

* ``loss(x)`` = f(x), ``grad(x)`` = ∇f(x), and the stacked client gradients ``client_grads(x)`` of
  shape (n, d), computed in one pass over the data (clients are a tensor axis);
* ``client_grads_at(X)``: row i is ∇f_i(X[i]) (a different point per client: stale gradients);
* ``client_stoch_grads(X, batch_sizes, keys)``: minibatch estimators with keyed sampling;
* ``L`` (smoothness of f), ``L_i`` (vector of the clients' constants), ``mu`` (PL / strong
  convexity constant when known), ``f_star`` / ``x_star`` when known, ``f_lower`` (a certified
  lower bound on inf f, e.g. 0 for non-negative losses) and the derived ``L_AM``, ``L_QM``,
  ``L_max``, ``L_var`` (defined once, in :mod:`shrinkgrad.theory`).

Unknown constants are a state, not an error (design.md principle 14): a neural network
(:func:`~shrinkgrad.problems.model_problem`) has ``L = None`` and ``L_i = None``. Numeric step
sizes work for every method; what needs a constant (``L_AM``, a theory step size, EF21-W's
weights) raises :class:`~shrinkgrad.methods.UnknownConstantError` with one message. Local
estimates (:func:`~shrinkgrad.problems.estimate_smoothness`) can be put on a problem explicitly
with :meth:`Problem.with_constants`; the copy says ``constants_estimated = True``, and a theory
step computed from it records ``(estimated L)``.

A problem with a held-out part (rows kept back from the clients) names its metrics in
``held_out_columns`` (e.g. ``("test_loss", "test_accuracy")``) and evaluates them with
``held_out(x)``; the simulator appends those columns to its tables.

Problems are built by name from the :data:`PROBLEMS` registry (``make_problem(
"logistic_regression[dataset=a9a,n_clients=100]")``) or with the functions of
:mod:`shrinkgrad.problems`.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import math
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np
import scipy.sparse as sp
import torch

from .._sums import all_finite
from ..registry import Registry, Spec
from ..rng import Keys
from ..theory import L_AM, L_QM, L_var

__all__ = ["PROBLEMS", "Problem", "data_digest_of", "digest_arrays", "make_problem"]


class Problem(abc.ABC):
    """Base class of every objective (see the module docstring)."""

    #: short identifier used in result tables, e.g. "logreg_nonconvex"
    name: str = "problem"
    #: dataset name for result tables ("a9a", "synthetic", ...)
    dataset: str = ""
    n: int
    d: int
    dtype: torch.dtype = torch.float64
    device: torch.device = torch.device("cpu")
    #: smoothness constant of f; None when unknown (a neural network)
    L: float | None = None
    #: smoothness constants of the f_i, shape (n,), float64 on the CPU; None when unknown
    L_i: torch.Tensor | None = None
    #: True when ``L`` / ``L_i`` are estimates (:meth:`with_constants`), not bounds
    constants_estimated: bool = False
    #: the metrics :meth:`held_out` returns (empty: the problem keeps no rows back)
    held_out_columns: tuple[str, ...] = ()
    #: strong convexity / PL constant of f when known, else None
    mu: float | None = None
    #: whether every f_i is convex (the DCGD and delayed theory rules assume it); None when not
    #: known (a neural network)
    convex: bool | None = None
    #: optimal value and point when known, else None
    f_star: float | None = None
    x_star: torch.Tensor | None = None
    #: a certified lower bound on inf f (f_star when known; 0 for non-negative losses), else None
    f_lower: float | None = None
    #: number of samples of each client, int64 (n,), for sample-based problems; else None
    client_sizes: torch.Tensor | None = None
    #: True when ``client_grads``, ``client_grads_at`` and ``client_stoch_grads`` always return
    #: a new tensor that no one else holds, so a caller may overwrite it (the simulator then
    #: computes EF21's ∇f_i − g_i in place, saving an (n, d) buffer per round). A subclass that
    #: caches or returns views of its own tensors must leave this False.
    fresh_grads: bool = False

    # -- oracles --------------------------------------------------------------------------------
    @abc.abstractmethod
    def loss(self, x: torch.Tensor) -> float:
        """f(x) = (1/n) Σ_i f_i(x)."""

    @abc.abstractmethod
    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) tensor whose row i is ∇f_i(x)."""

    @abc.abstractmethod
    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor:
        """(n, d) tensor whose row i is ∇f_i(X[i])."""

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        """∇f(x) = (1/n) Σ_i ∇f_i(x)."""
        return self.client_grads(x).mean(dim=0)

    def client_losses(self, x: torch.Tensor) -> torch.Tensor:
        """(n,) tensor of f_i(x)."""
        raise NotImplementedError

    def client_stoch_grads(
        self, X: torch.Tensor, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> torch.Tensor:
        """Minibatch estimators: row i averages ∇ of b_i samples of client i drawn with ``keys[i]``.

        ``X`` is (d,) (same point for all clients) or (n, d).
        """
        raise NotImplementedError(f"{self.name} has no stochastic gradients")

    def restrict(self, ids: torch.Tensor) -> Problem | None:
        """The problem of the clients ``ids`` alone, or None when this problem cannot do that.

        Client j of the result is client ``ids[j]`` of this problem with exactly the same f_j:
        its losses and gradients equal those rows of this problem's, bit for bit. A distributed
        rank holds only its clients' data this way. None (the default) means "evaluate the full
        problem and keep the rows of ``ids``" (correct, not cheaper).
        """
        return None

    def held_out(self, x: torch.Tensor) -> dict[str, float]:
        """The held-out metrics at x, one per name of :attr:`held_out_columns` (default: none)."""
        return {}

    # -- constants ------------------------------------------------------------------------------
    @property
    def constants_known(self) -> bool:
        """True when both ``L`` and ``L_i`` are known (exactly, or as explicit estimates)."""
        return self.L is not None and self.L_i is not None

    def smoothness(self) -> tuple[float, torch.Tensor]:
        """(L, L_i), or :class:`~shrinkgrad.methods.UnknownConstantError` when either is unknown."""
        if self.L is None or self.L_i is None:
            _unknown()
        return self.L, self.L_i

    def _known_L_i(self) -> torch.Tensor:
        if self.L_i is None:
            _unknown()
        return self.L_i

    @property
    def L_AM(self) -> float:
        """(1/n) Σ L_i; :class:`~shrinkgrad.methods.UnknownConstantError` when L_i is unknown."""
        return L_AM(self._known_L_i())

    @property
    def L_QM(self) -> float:
        """√((1/n) Σ L_i²); raises like :attr:`L_AM` when L_i is unknown."""
        return L_QM(self._known_L_i())

    @property
    def L_max(self) -> float:
        """max_i L_i; raises like :attr:`L_AM` when L_i is unknown."""
        return float(torch.as_tensor(self._known_L_i()).max())

    @property
    def L_var(self) -> float:
        """L_QM² − L_AM²; raises like :attr:`L_AM` when L_i is unknown."""
        return L_var(self._known_L_i())

    def with_constants(
        self,
        L: float | None = None,
        L_i: torch.Tensor | None = None,
        *,
        estimated: bool = True,
    ) -> Problem:
        """A copy of this problem that carries the smoothness constants ``L`` and ``L_i``.

        The copy shares the data (a shallow copy); only the constants differ. ``estimated=True``
        (default) marks them as estimates, e.g. from
        :func:`~shrinkgrad.problems.estimate_smoothness`: step-size rules then record
        ``(estimated L)`` (:class:`~shrinkgrad.methods.Constants` reads
        ``constants_estimated``). A value left ``None`` stays unknown.
        """
        out = copy.copy(self)
        if L is not None:
            value = float(L)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"L must be a finite number > 0, got {L!r}")
            out.L = value
        else:
            out.L = None
        if L_i is not None:
            t = torch.as_tensor(L_i, dtype=torch.float64).detach().reshape(-1).cpu().clone()
            if t.numel() != self.n:
                raise ValueError(
                    f"L_i must have one entry per client (n={self.n}), got {t.numel()}"
                )
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise ValueError("L_i must be finite and >= 0 for every client")
            out.L_i = t
        else:
            out.L_i = None
        out.constants_estimated = bool(estimated)
        return out

    # -- input checks shared by the problems ------------------------------------------------------
    @staticmethod
    def check_finite(x: torch.Tensor, what: str) -> torch.Tensor:
        """``x``, or a ValueError when it has NaN or inf entries (a diverged method)."""
        if not all_finite(x):
            raise ValueError(
                f"{what} contains NaN or inf (did the method diverge? try a smaller step size)"
            )
        return x

    def check_point(self, x: torch.Tensor, what: str = "x", hint: str = "") -> torch.Tensor:
        """A (d,) point in the problem's dtype and device, or a one-line error saying why not."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{what} must be a torch tensor of shape ({self.d},), got {type(x).__name__}"
            )
        if x.shape != (self.d,):
            extra = f" ({hint})" if hint else " for this problem"
            raise ValueError(f"{what} must have shape ({self.d},){extra}, got {tuple(x.shape)}")
        return self.check_finite(x.detach().to(device=self.device, dtype=self.dtype), what)

    def check_points(self, X: torch.Tensor) -> torch.Tensor:
        """An (n, d) array of points (one per client; a (d,) point is broadcast), checked."""
        if not isinstance(X, torch.Tensor):
            raise TypeError(
                f"X must be a torch tensor of shape ({self.n}, {self.d}), got {type(X).__name__}"
            )
        if X.shape == (self.d,):
            X = X.expand(self.n, self.d)
        if X.shape != (self.n, self.d):
            raise ValueError(
                f"X must have shape (n, d) = ({self.n}, {self.d}) (one point per client) or "
                f"({self.d},), got {tuple(X.shape)}"
            )
        return self.check_finite(X.detach().to(device=self.device, dtype=self.dtype), "X")

    def check_batch_sizes(
        self, batch_sizes: torch.Tensor | int, sizes: torch.Tensor
    ) -> torch.Tensor:
        """Minibatch sizes as an int64 CPU (n,) tensor with 1 ≤ b_i ≤ m_i (``sizes``), checked."""
        if isinstance(batch_sizes, bool):
            raise TypeError("batch_sizes must be an integer or an integer tensor of shape (n,)")
        b = torch.as_tensor(batch_sizes)
        if b.dtype.is_floating_point or b.dtype == torch.bool:
            raise TypeError(f"batch_sizes must be integers, got dtype {b.dtype}")
        b = b.to(torch.int64).cpu()
        b = b.expand(self.n).clone() if b.ndim == 0 else b
        if b.shape != (self.n,):
            raise ValueError(
                f"batch_sizes must be one integer or shape ({self.n},), got {tuple(b.shape)}"
            )
        bad = (b < 1) | (b > sizes)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"batch size {int(b[i])} for client {i} must be in [1, m_i = {int(sizes[i])}] "
                "(the client's number of samples)"
            )
        return b

    # -- conveniences ---------------------------------------------------------------------------
    def x0(self) -> torch.Tensor:
        """The default starting point (zeros unless a problem says otherwise)."""
        return torch.zeros(self.d, dtype=self.dtype, device=self.device)

    def info(self) -> dict[str, Any]:
        """Identifying metadata for result tables."""
        return {"problem": self.name, "dataset": self.dataset, "n_clients": self.n, "d": self.d}

    def data_digest(self) -> str | None:
        """A hex digest of the data that defines f beyond x (samples, targets, their clients,
        the held-out part), or None for a problem that holds no data of its own (the default).

        Two problems that agree on name, data set, n, d, ``info()`` and x⁰ but not on their data
        get different digests, so a checkpoint of one is not resumed by the other (the
        simulator's fingerprint, :func:`shrinkgrad.sim.engine.problem_identity`). The digest is
        deterministic (the same data built twice, in another process or on another device, gives
        the same one) and changes when any entry changes; :func:`digest_arrays` computes it.
        A problem that keeps its digest (it is called for every run) must return that of what
        it is now: compute it again when its data may have changed since (as
        :class:`~shrinkgrad.problems.ModelProblem` does), or say that its data must not change.
        """
        return None


def data_digest_of(problem: object) -> str | None:
    """``problem.data_digest()`` (:meth:`Problem.data_digest`), or None for an object without
    one (a problem-like class not derived from :class:`Problem`): what the simulator's and the
    parameter server's checkpoint fingerprints record as ``problem.data``."""
    method = getattr(problem, "data_digest", None)
    if not callable(method):
        return None
    digest = method()
    if digest is not None and not isinstance(digest, str):
        raise TypeError(
            f"{type(problem).__name__}.data_digest() must return a str or None, got "
            f"{type(digest).__name__}"
        )
    return digest


def digest_arrays(items: Iterable[tuple[str, Any]]) -> str:
    """The SHA-1 hex digest of labelled arrays, in the order given (:meth:`Problem.data_digest`).

    Each item is (label, value) with value a NumPy array, a torch tensor (any device: its bytes
    are read on the CPU), a SciPy sparse matrix (hashed as CSR: data, indices and indptr as
    int64, and shape; so the same values given dense and sparse differ), a string or None.
    Every array's label, kind, dtype and shape are hashed with its raw bytes, so arrays of the
    same bytes but another shape or dtype differ. Contiguous arrays are fed without a copy:
    about 1 ms per MB.
    """
    h = hashlib.sha1()

    def add(label: str, value: Any) -> None:
        if value is None or isinstance(value, str):
            h.update(f"{label}:{type(value).__name__}:{value!s}\n".encode())
        elif sp.issparse(value):
            csr = sp.csr_matrix(value)
            h.update(f"{label}:csr:{csr.shape}\n".encode())
            add(f"{label}.data", csr.data)
            # int64 whatever scipy chose (int32 or int64 indices for the same matrix)
            add(f"{label}.indices", csr.indices.astype(np.int64, copy=False))
            add(f"{label}.indptr", csr.indptr.astype(np.int64, copy=False))
        elif isinstance(value, torch.Tensor):
            t = value.detach()
            h.update(f"{label}:tensor:{t.dtype}:{tuple(t.shape)}\n".encode())
            raw = t.cpu().contiguous().reshape(-1).view(torch.uint8)  # bfloat16 has no NumPy dtype
            h.update(raw.numpy().data)
        else:
            a = np.ascontiguousarray(value)
            if a.dtype.hasobject:
                raise TypeError(f"{label}: cannot digest an array of Python objects")
            h.update(f"{label}:array:{a.dtype.str}:{a.shape}\n".encode())
            h.update(a.reshape(-1).view(np.uint8).data)

    for label, value in items:
        add(label, value)
    return h.hexdigest()


def _unknown() -> NoReturn:
    # imported here, on the error path only: problems do not depend on methods
    from ..methods.base import UNKNOWN_L, UnknownConstantError

    raise UnknownConstantError(UNKNOWN_L)


PROBLEMS: Registry[Problem] = Registry("problem", base=Problem)


def make_problem(spec: str | Spec | Problem, **params: Any) -> Problem:
    """Build a problem by name (see ``shrinkgrad list problems`` for names and parameters).

    Example: ``make_problem("logistic_regression[dataset=a9a,n_clients=20]")``, or with keyword
    arguments ``make_problem("logistic_regression", dataset="a9a", n_clients=20)``. Every factory
    is registered when the package :mod:`shrinkgrad.problems` is imported, which importing this
    module already does.
    """
    return PROBLEMS.make(spec, **params)
