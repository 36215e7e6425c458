"""Theory: smoothness means, compressor constants and one cited function per step-size rule.

See methods.md §1 and §4. Every function is small and pure and cites its source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["L_AM", "L_QM", "L_var"]


def _as_list(L_i: torch.Tensor | Sequence[float]) -> torch.Tensor:
    t = torch.as_tensor(L_i, dtype=torch.float64).reshape(-1)
    if t.numel() == 0:
        raise ValueError("need at least one smoothness constant L_i")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError("smoothness constants L_i must be finite and non-negative")
    return t


def L_AM(L_i: torch.Tensor | Sequence[float]) -> float:
    """Arithmetic mean (1/n) Σ L_i ([EFR] §2, methods.md §1)."""
    return float(_as_list(L_i).mean())


def L_QM(L_i: torch.Tensor | Sequence[float]) -> float:
    """Quadratic mean √((1/n) Σ L_i²) ([EF21] Thm 1, methods.md §1)."""
    return math.sqrt(float((_as_list(L_i) ** 2).mean()))


def L_var(L_i: torch.Tensor | Sequence[float]) -> float:
    """L_QM² − L_AM² = (1/n) Σ (L_i − L_AM)², the heterogeneity measure of the [EFR] plots."""
    t = _as_list(L_i)
    return float(((t - t.mean()) ** 2).mean())
