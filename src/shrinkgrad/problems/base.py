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

Problems are built by name from the :data:`PROBLEMS` registry (``make_problem(
"logistic_regression[dataset=a9a,n_clients=100]")``) or with the functions of
:mod:`shrinkgrad.problems`.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from ..registry import Registry, Spec
from ..rng import Keys

__all__ = ["PROBLEMS", "Problem", "make_problem"]


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
    #: smoothness constant of f
    L: float
    #: smoothness constants of the f_i, shape (n,), float64 on the CPU
    L_i: torch.Tensor
    #: strong convexity / PL constant of f when known, else None
    mu: float | None = None
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

    # -- derived constants ----------------------------------------------------------------------
    @property
    def L_AM(self) -> float:
        from ..theory import L_AM

        return L_AM(self.L_i)

    @property
    def L_QM(self) -> float:
        from ..theory import L_QM

        return L_QM(self.L_i)

    @property
    def L_max(self) -> float:
        return float(torch.as_tensor(self.L_i).max())

    @property
    def L_var(self) -> float:
        from ..theory import L_var

        return L_var(self.L_i)

    # -- conveniences ---------------------------------------------------------------------------
    def x0(self) -> torch.Tensor:
        """The default starting point (zeros unless a problem says otherwise)."""
        return torch.zeros(self.d, dtype=self.dtype, device=self.device)

    def info(self) -> dict[str, Any]:
        """Identifying metadata for result tables."""
        return {"problem": self.name, "dataset": self.dataset, "n_clients": self.n, "d": self.d}


PROBLEMS: Registry[Problem] = Registry("problem", base=Problem)


def make_problem(spec: str | Spec | Problem, **params: Any) -> Problem:
    """Build a problem by name (see ``shrinkgrad list problems`` for names and parameters).

    Example: ``make_problem("logistic_regression[dataset=a9a,n_clients=20]")``, or with keyword
    arguments ``make_problem("logistic_regression", dataset="a9a", n_clients=20)``.
    """
    from . import linear, synthetic  # noqa: F401  (registers the factories)

    return PROBLEMS.make(spec, **params)
