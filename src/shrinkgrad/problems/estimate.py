"""Local smoothness estimates: ‖∇²f_i(x)‖ and ‖∇²f(x)‖ at a point, by power iteration.

For a neural network L and L_i are unknown (design.md principle 14). :func:`estimate_smoothness`
measures the curvature the methods see *at one point*: for every client, the spectral norm
(largest |eigenvalue|) of the Hessian ∇²f_i(x), and that of ∇²f(x) = (1/n) Σ_i ∇²f_i(x). It is a
local estimate, not a global bound: the smoothness constants of the theory are suprema over all
x (and for ReLU networks the Hessian exists only almost everywhere), so a step size computed
from the estimate carries no guarantee, and results say so (``stepsize_rule`` ends with
``(estimated L)``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..rng import Keys
from .base import Problem

__all__ = ["SmoothnessEstimate", "estimate_smoothness"]


@dataclasses.dataclass(frozen=True)
class SmoothnessEstimate:
    """The result of :func:`estimate_smoothness`.

    ``L``: the estimate of ‖∇²f(x)‖₂; ``L_i``: of the ‖∇²f_i(x)‖₂ (float64 CPU, (n,));
    ``iterations``: power iterations run; ``converged``: whether every estimate's relative
    change fell below ``tol``; ``method``: ``"hvp"`` (exact Hessian-vector products by
    autodiff) or ``"finite differences"`` (of ``client_grads_at``, for problems without
    ``client_hvps``).
    """

    L: float
    L_i: torch.Tensor
    x: torch.Tensor
    iterations: int
    converged: bool
    method: str

    def apply(self, problem: Problem) -> Problem:
        """``problem`` with these estimates as its constants (``constants_estimated=True``)."""
        if not (self.L > 0 and bool((self.L_i > 0).all())):
            raise ValueError(
                "a curvature estimate is 0 (the Hessian vanishes at this x for some client); "
                "estimate at another point, or use a numeric step size"
            )
        return problem.with_constants(self.L, self.L_i, estimated=True)


def estimate_smoothness(
    problem: Problem,
    x: torch.Tensor | None = None,
    *,
    iters: int = 200,
    tol: float = 1e-6,
    seed: int = 0,
) -> SmoothnessEstimate:
    """Estimate the local smoothness ‖∇²f(x)‖₂ and ‖∇²f_i(x)‖₂ of every client at ``x``.

    This is a **local curvature estimate at x, not a global bound** on the smoothness constants
    (those are suprema of the Hessian's norm over every x): use it to choose step sizes for
    problems whose L is unknown, and read the results as such.

    Power iteration (Golub & Van Loan, *Matrix Computations*, §8.2.1) on each Hessian, all
    clients at once: v_i ← H_i v_i/‖H_i v_i‖ with the Hessian-vector products H_i v_i of
    ``problem.client_hvps`` (forward-over-reverse autodiff, ``torch.func.jvp`` of the gradient,
    vmapped over the clients: :class:`~shrinkgrad.problems.ModelProblem`); problems without
    them use central differences of ``client_grads_at``, (∇f_i(x + εv) − ∇f_i(x − εv))/(2ε).
    ‖H_i v_i‖ with ‖v_i‖ = 1 increases to the largest |eigenvalue| of the symmetric H_i, at the
    rate (|λ₂|/|λ₁|)^k; iterations stop when every relative change is below ``tol`` or after
    ``iters``. The start vectors are keyed by ``seed`` (stream ``"power_iteration"``).
    ``x`` defaults to ``problem.x0()``.

    Put the estimates on the problem with :meth:`SmoothnessEstimate.apply` (or
    :meth:`~shrinkgrad.problems.Problem.with_constants`): then ``stepsize="theory"`` works and
    records ``(estimated L)``, and EF21-W can weight the clients by the estimated L_i.
    """
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a shrinkgrad Problem, got {type(problem).__name__}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive integer, got {iters!r}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a number > 0, got {tol!r}")
    n, d = problem.n, problem.d
    point = problem.x0() if x is None else x
    if not isinstance(point, torch.Tensor) or point.shape != (d,):
        raise ValueError(f"x must be a tensor of shape ({d},)")
    point = point.detach().to(problem.device, problem.dtype)
    hvps, method = _hvp_operator(problem, point)

    ids = torch.arange(n + 1)
    start = Keys.derive(seed, client=ids, stream="power_iteration").uniform(d) - 0.5
    V = _unit(start.to(problem.device, problem.dtype))  # rows 0..n−1: clients; row n: f
    lam = torch.zeros(n + 1, dtype=torch.float64)
    converged = False
    k = 0
    for k in range(1, iters + 1):
        W = torch.cat([hvps(V[:n]), hvps(V[n].expand(n, d)).mean(dim=0, keepdim=True)])
        norms = torch.linalg.vector_norm(W, dim=1).double().cpu()
        change = (norms - lam).abs() / norms.clamp_min(1e-300)
        lam = norms
        V = _unit(W)
        if k > 1 and bool((change <= tol).all()):
            converged = True
            break
    return SmoothnessEstimate(
        L=float(lam[n]),
        L_i=lam[:n].clone(),
        x=point.clone(),
        iterations=k,
        converged=converged,
        method=method,
    )


def _unit(V: torch.Tensor) -> torch.Tensor:
    norms = torch.linalg.vector_norm(V, dim=1, keepdim=True)
    return V / torch.where(norms > 0, norms, torch.ones_like(norms))


def _hvp_operator(problem: Any, x: torch.Tensor) -> tuple[Any, str]:
    """V (n, d) ↦ rows ∇²f_i(x) V[i]: exact when the problem has ``client_hvps``."""
    exact = getattr(problem, "client_hvps", None)
    if callable(exact):
        return (lambda V: exact(x, V)), "hvp"
    eps: float = (torch.finfo(problem.dtype).eps ** (1.0 / 3.0)) * (1.0 + float(x.abs().max()))

    def central(V: torch.Tensor) -> torch.Tensor:
        up: torch.Tensor = problem.client_grads_at(x + eps * V)
        down: torch.Tensor = problem.client_grads_at(x - eps * V)
        return (up - down) / (2.0 * eps)

    if not math.isfinite(eps):  # pragma: no cover - x is checked finite by the problem
        raise ValueError("x must be finite")
    return central, "finite differences"
