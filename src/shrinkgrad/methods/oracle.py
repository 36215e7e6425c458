"""Gradient oracles: the simulator's view of a :class:`~shrinkgrad.problems.Problem`.

A method's client step asks an oracle for the gradients of a group of clients given by their
global ids (:class:`~shrinkgrad.methods.base.GradientOracle`). :class:`ProblemOracle` answers from
a problem that holds every client; when the group is all clients in order it calls the problem's
batched oracles directly (one pass over the data), otherwise it computes the full batch and keeps
the requested rows (a convenience for tests and small groups, not a fast path).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..rng import Keys
from .base import NonFiniteError, ProblemLike

__all__ = ["ProblemOracle"]


class _Oracles(ProblemLike, Protocol):
    def client_grads(self, x: torch.Tensor) -> torch.Tensor: ...
    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor: ...
    def client_stoch_grads(
        self, X: torch.Tensor, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> torch.Tensor: ...


class ProblemOracle:
    """Client gradients of a problem, for any group of client ids."""

    def __init__(self, problem: _Oracles) -> None:
        self.problem = problem
        self.n = int(problem.n)
        self._all: torch.Tensor | None = None
        #: every result is a new tensor the caller may overwrite (``Problem.fresh_grads``)
        self.fresh = bool(getattr(problem, "fresh_grads", False))

    def _is_all(self, ids: torch.Tensor) -> bool:
        if ids is self._all:
            return True
        if ids.numel() != self.n:
            return False
        full = torch.arange(self.n, device=ids.device)
        if torch.equal(ids, full):
            self._all = ids
            return True
        return False

    @staticmethod
    def _finite(x: torch.Tensor) -> None:
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError(
                "a gradient was requested at a point with NaN or inf entries: the method "
                "diverged (try a smaller step size)"
            )

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Row j: ∇f_{ids[j]}(x) (x of shape (d,)) or ∇f_{ids[j]}(x[j]) (x of shape (m, d))."""
        p = self.problem
        self._finite(x)
        if x.ndim == 1:
            G = p.client_grads(x)
            return G if self._is_all(ids) else G[ids]
        if self._is_all(ids):
            return p.client_grads_at(x)
        X = x[:1].expand(self.n, -1).clone()
        X[ids] = x
        return p.client_grads_at(X)[ids]

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        """Minibatch estimators of the clients ``ids`` (sampling keyed per client)."""
        p = self.problem
        self._finite(x)
        if self._is_all(ids):
            return p.client_stoch_grads(x, batch_sizes, keys)
        lo = torch.zeros(self.n, dtype=torch.int64, device=keys.lo.device)
        hi = torch.zeros_like(lo)
        lo[ids], hi[ids] = keys.lo, keys.hi
        b = torch.ones(self.n, dtype=batch_sizes.dtype, device=batch_sizes.device)
        b[ids] = batch_sizes
        X = x
        if x.ndim == 2:
            X = x[:1].expand(self.n, -1).clone()
            X[ids] = x
        return p.client_stoch_grads(X, b, Keys(lo, hi))[ids]
