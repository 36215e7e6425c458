"""Gradient oracles: the simulator's view of a :class:`~shrinkgrad.problems.Problem`.

A method's client step asks an oracle for the gradients of a group of clients given by their
global ids (:class:`~shrinkgrad.methods.base.GradientOracle`). :class:`ProblemOracle` answers from
a problem that holds every client; when the group is all clients in order it calls the problem's
batched oracles directly (one pass over the data), otherwise it computes the full batch and keeps
the requested rows (a convenience for tests and small groups, not a fast path).

Metrics from what a round already computed (docs/simulator.md, "metrics for free"). The logged
metrics of a round are ∇f(x) = (1/n) Σ_i ∇f_i(x) and f(x) at the round's iterate. Whenever a
gradient pass evaluates every client at one point x, those are the mean of its rows and the mean
of the clients' losses, which a problem with a fused pass (``client_grads_and_losses(x)``: the
rows of ``client_grads(x)`` bit for bit, with ``client_losses(x)`` from the same margins) gets at
almost no cost; a problem whose pass also sums its rows (``client_grads_losses_and_mean(x)``,
the linear models' numba pass) hands ∇f over without a second pass over G. So the oracle

* keeps the :class:`PointMetrics` of a full-batch, one-point gradient pass made while
  :attr:`ProblemOracle.record` is set (the runtime sets it before a round whose row is logged):
  EF21's clients evaluate ∇f_i at the new iterate x^{t+1}, which is the row's point;
* answers :meth:`ProblemOracle.metrics` from them when the point matches, and otherwise makes
  the fused pass itself and keeps its client gradients for the next request at that point: GD,
  DCGD and EF evaluate ∇f_i at x^t in the step *after* the row of round t. That step then uses
  the kept gradients (the same tensor the problem would return), and the time the metric pass
  spent on them is handed to the runtime (:meth:`ProblemOracle.take_prepaid`) so that ``time_s``
  still counts the step's gradient pass.

A method that never evaluates every client's exact gradient at its iterate (minibatches, partial
participation, stale points) gets no match, and its row costs one fused pass, as before. Every
value is bit for bit what the separate evaluation ``problem.grad(x)``, ``problem.loss(x)`` and
``problem.client_grads(x)`` gives, so caching changes no result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from .._sums import all_finite, mean_value
from ..rng import Keys
from .base import NonFiniteError, ProblemLike

__all__ = ["PointMetrics", "ProblemOracle"]


class _Oracles(ProblemLike, Protocol):
    def client_grads(self, x: torch.Tensor) -> torch.Tensor: ...
    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor: ...
    def client_stoch_grads(
        self, X: torch.Tensor, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> torch.Tensor: ...


class PointMetrics(NamedTuple):
    """The full objective's gradient and value at one point, over the oracle's clients.

    ``grad`` = (1/m) Σ_i ∇f_i(x) (the mean of ``client_grads(x)``'s rows, i.e. ``problem.grad(x)``
    bit for bit), ``loss`` = (1/m) Σ_i f_i(x) (``problem.loss(x)`` bit for bit), m = ``clients``.
    ``x`` is the point's tensor itself and ``version`` its version counter then (an in-place
    change of x bumps it: the metrics no longer hold); −1 when ``x`` is a private copy (a tensor
    without a counter, made under ``torch.inference_mode``).
    """

    x: torch.Tensor
    grad: torch.Tensor
    loss: float
    clients: int
    version: int = -1


def _stamp(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` and its version counter, or a private copy and −1 where x has no counter.

    Holding the tensor rather than a copy, a later request at the same unchanged tensor is an
    identity test, not a copy and a comparison (two small torch calls that cost 10–30 µs each
    right after a pass over the data)."""
    try:
        return x, int(x._version)
    except RuntimeError:  # an inference tensor tracks no version
        return x.clone(), -1


def _holds(ref: torch.Tensor, version: int, x: torch.Tensor) -> bool:
    """Whether ``x`` is the point that ``(ref, version)`` (:func:`_stamp`) recorded: the same
    tensor unchanged since, or a tensor of equal values."""
    if version >= 0 and int(ref._version) != version:
        return False  # changed in place: its values at the stamp are gone
    return ref is x or torch.equal(ref, x)


#: ``client_grads_and_losses(x) -> (G (n, d), losses (n,))`` of a problem with a fused pass
Fused = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: ``client_grads_losses_and_mean(x) -> (G, losses, ∇f (d,))``: the fused pass with the mean
#: gradient from the pass itself (``problem.grad(x)`` bit for bit)
FusedMean = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _with_mean(fused: Fused) -> FusedMean:
    """A fused pass that also returns ∇f as the mean of its rows (taken before the caller may
    overwrite G, ``fresh``)."""

    def call(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        G, losses = fused(x)
        return G, losses, G.mean(dim=0)

    return call


class ProblemOracle:
    """Client gradients of a problem, for any group of client ids (module docstring)."""

    def __init__(self, problem: _Oracles) -> None:
        self.problem = problem
        self.n = int(problem.n)
        self._all: torch.Tensor | None = None
        #: every result is a new tensor the caller may overwrite (``Problem.fresh_grads``)
        self.fresh = bool(getattr(problem, "fresh_grads", False))
        fused = getattr(problem, "client_grads_and_losses", None)
        with_mean = getattr(problem, "client_grads_losses_and_mean", None)
        self._fused: FusedMean | None = (
            with_mean if callable(with_mean) else _with_mean(fused) if callable(fused) else None
        )
        #: set by the runtime before a round whose row is logged: keep the metrics of the
        #: round's full-batch gradient pass
        self.record = False
        self._seen: PointMetrics | None = None
        #: (x, its version, client gradients at x, seconds they cost) left by a metric pass
        #: for the next step
        self._ahead: tuple[torch.Tensor, int, torch.Tensor, float] | None = None
        self._prepaid = 0.0

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
        if not all_finite(x):
            raise NonFiniteError(
                "a gradient was requested at a point with NaN or inf entries: the method "
                "diverged (try a smaller step size)"
            )

    # -- metrics ------------------------------------------------------------------------------
    def _metrics_pass(
        self, x: torch.Tensor, grad: torch.Tensor, losses: torch.Tensor
    ) -> PointMetrics:
        ref, version = _stamp(x)
        m = PointMetrics(ref, grad, mean_value(losses), self.n, version)
        self._seen = m
        return m

    def metrics(self, x: torch.Tensor) -> PointMetrics | None:
        """∇f(x) and f(x) over the oracle's clients, or None when the problem has no fused pass.

        From the last recorded gradient pass when it was at ``x``; otherwise from one fused pass,
        whose client gradients are kept for the next :meth:`grads` request at ``x``.
        """
        seen = self._seen
        if seen is not None and _holds(seen.x, seen.version, x):
            return seen
        if self._fused is None:
            return None
        t0 = time.perf_counter()
        G, losses, grad = self._fused(x)
        m = self._metrics_pass(x, grad, losses)
        self._ahead = (m.x, m.version, G, time.perf_counter() - t0)
        return m

    def take_prepaid(self) -> float:
        """Seconds of gradient work that steps took from metric passes since the last call."""
        out, self._prepaid = self._prepaid, 0.0
        return out

    def _at_point(self, x: torch.Tensor) -> torch.Tensor:
        """``client_grads(x)`` (every client), from a metric pass or recording its metrics."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and _holds(ahead[0], ahead[1], x):
            self._prepaid += ahead[3]
            return ahead[2]
        if self.record and self._fused is not None:
            G, losses, grad = self._fused(x)
            self._metrics_pass(x, grad, losses)
            return G
        return self.problem.client_grads(x)

    # -- gradients ----------------------------------------------------------------------------
    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Row j: ∇f_{ids[j]}(x) (x of shape (d,)) or ∇f_{ids[j]}(x[j]) (x of shape (m, d))."""
        p = self.problem
        self._finite(x)
        if x.ndim == 1:
            G = self._at_point(x)
            return G if self._is_all(ids) else G[ids]
        self._ahead = None
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
        self._ahead = None
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
