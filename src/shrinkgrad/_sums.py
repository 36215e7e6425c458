"""The logged row's reductions, each in one compiled call on CPU tensors.

A logged round of the simulator reduces a few small vectors right after the round's pass over
the data: f(x) as the mean of the n client losses, ‖∇f(x)‖² from the d-vector ∇f(x), and the
mean bits of the n clients. Each is microseconds in a warm loop, but right after a pass that
evicted the caches every separate torch call costs 5–10× that (measured: a ``mean`` of 1000
float64 values 6 µs warm, 39 µs after the pass; three of them 28 vs 88 µs); one numba call that
does them all costs about a third of that. So the values are defined by these kernels:

* :func:`mean_value`: (1/n) Σ_i t_i, accumulated in float64 in index order;
* :func:`squared_norm`: Σ_j g_j², accumulated in float64 in index order;
* :func:`row_values`: both for a row, ‖∇f‖² and the three means of the bit counters, in one
  call;
* :func:`all_finite`: whether a tensor has no NaN or ±inf — the per-round checks of the iterate
  (engine, oracle, problem), 3.5 µs through numpy against 9 µs for ``torch.isfinite(x).all()``
  on a vector of a hundred entries; the same answer.

Every runtime and every problem's ``loss`` use the same functions, so a logged value equals the
separate evaluation bit for bit. Tensors that numpy cannot view (other devices, autograd, other
dtypes) take the equivalent torch reductions, whose summation order is torch's.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

__all__ = ["all_finite", "mean_value", "row_values", "squared_norm"]

_jit: Any = numba.njit(cache=True, nogil=True)
_NUMPY_FLOATS = (torch.float32, torch.float64)


@_jit
def _mean(a):  # type: ignore[no-untyped-def]  # pragma: no cover
    acc = 0.0
    for i in range(a.shape[0]):
        acc += np.float64(a[i])
    return acc / a.shape[0] if a.shape[0] else np.nan


@_jit
def _squares(g):  # type: ignore[no-untyped-def]  # pragma: no cover
    acc = 0.0
    for j in range(g.shape[0]):
        v = np.float64(g[j])  # numba's float() keeps a float32 a float32
        acc += v * v
    return acc


@_jit
def _row(g, up, paper, down):  # type: ignore[no-untyped-def]  # pragma: no cover
    return _squares(g), _mean(up), _mean(paper), _mean(down)


def _numpy_ok(t: torch.Tensor) -> bool:
    """Whether ``t.numpy()`` views t's values (is_cpu, not device.type: building a device object
    costs a microsecond)."""
    return t.is_cpu and not t.requires_grad and t.dtype in _NUMPY_FLOATS


def _viewable(*ts: torch.Tensor) -> bool:
    return all(t.ndim == 1 and _numpy_ok(t) for t in ts)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite (no NaN, no ±inf); True for an empty tensor."""
    if _numpy_ok(x):
        return bool(np.isfinite(x.numpy()).all())
    return bool(torch.isfinite(x).all())


def mean_value(t: torch.Tensor) -> float:
    """(1/n) Σ_i t_i of a 1-D tensor in float64, added in index order (NaN when empty)."""
    if _viewable(t):
        return float(_mean(t.numpy()))
    return float(t.detach().double().mean())


def squared_norm(g: torch.Tensor) -> float:
    """Σ_j g_j² of a 1-D tensor in float64, added in index order."""
    if _viewable(g):
        return float(_squares(g.numpy()))
    g64 = g.detach().double()
    return float(torch.dot(g64, g64))


def row_values(
    g: torch.Tensor, up: torch.Tensor, paper: torch.Tensor, down: torch.Tensor
) -> tuple[float, float, float, float]:
    """(Σ_j g_j², mean(up), mean(paper), mean(down)): the squared norm in float64 in index
    order, the means as :func:`mean_value`; one call."""
    if _viewable(g, up, paper, down):
        gns, u, p, d = _row(g.numpy(), up.numpy(), paper.numpy(), down.numpy())
        return float(gns), float(u), float(p), float(d)
    return squared_norm(g), mean_value(up), mean_value(paper), mean_value(down)
