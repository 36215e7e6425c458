"""Smoothness means, EF21-W weights and the contractive-compressor constants θ, β, ξ.

All functions are pure, take plain numbers (or a vector of the clients' constants) and return
Python floats; they validate their input and raise :class:`ValueError` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import SupportsFloat

import numpy as np
import torch

__all__ = [
    "L_AM",
    "L_QM",
    "L_max",
    "L_var",
    "beta",
    "check_alpha",
    "check_nonnegative",
    "check_positive",
    "ef21w_weights",
    "theta",
    "xi",
]

Vector = torch.Tensor | np.ndarray | Sequence[float]


# --------------------------------------------------------------------------------------------
# validation helpers (shared by the whole theory package)
# --------------------------------------------------------------------------------------------
def _as_float(name: str, value: SupportsFloat) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if math.isnan(v):
        raise ValueError(f"{name} must be a number, got NaN")
    return v


def check_positive(name: str, value: SupportsFloat) -> float:
    """``value`` as a float, or a ValueError unless it is finite and > 0."""
    v = _as_float(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {v}")
    return v


def check_nonnegative(name: str, value: SupportsFloat) -> float:
    """``value`` as a float, or a ValueError unless it is finite and ≥ 0."""
    v = _as_float(name, value)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number ≥ 0, got {v}")
    return v


def check_alpha(alpha: SupportsFloat) -> float:
    """α of a contractive compressor, in (0, 1] ([EF21] Def. 1)."""
    a = _as_float("alpha", alpha)
    if not (0.0 < a <= 1.0):
        raise ValueError(
            f"alpha (the contraction constant of the compressor) must be in (0, 1], got {a}; "
            "for an unbiased compressor with variance ω use alpha = 1/(1 + ω)"
        )
    return a


def _as_vector(L_i: Vector) -> torch.Tensor:
    t = torch.as_tensor(
        np.asarray(L_i, dtype=np.float64) if not isinstance(L_i, torch.Tensor) else L_i
    )
    t = t.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if t.numel() == 0:
        raise ValueError("need at least one smoothness constant L_i")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError("smoothness constants L_i must be finite and non-negative")
    return t


# --------------------------------------------------------------------------------------------
# smoothness means (methods.md §1)
# --------------------------------------------------------------------------------------------
def L_AM(L_i: Vector) -> float:
    """Arithmetic mean L_AM = (1/n) Σ L_i ([EFR] §2, methods.md §1)."""
    return float(_as_vector(L_i).mean())


def L_QM(L_i: Vector) -> float:
    """Quadratic mean L_QM = √((1/n) Σ L_i²) ([EF21] Thm 1, methods.md §1)."""
    return math.sqrt(float((_as_vector(L_i) ** 2).mean()))


def L_max(L_i: Vector) -> float:
    """L_max = max_i L_i (methods.md §1)."""
    return float(_as_vector(L_i).max())


def L_var(L_i: Vector) -> float:
    """L_var = L_QM² − L_AM² = (1/n) Σ (L_i − L_AM)², the heterogeneity measure of the [EFR] plots.

    Computed as the mean squared deviation (no cancellation), which equals L_QM² − L_AM² exactly
    in exact arithmetic.
    """
    t = _as_vector(L_i)
    return float(((t - t.mean()) ** 2).mean())


def ef21w_weights(L_i: Vector) -> torch.Tensor:
    """EF21-W client weights w_i = L_i / Σ_j L_j ([EFR] Alg. 2): a float64 CPU tensor, sum 1."""
    t = _as_vector(L_i)
    total = float(t.sum())
    if total <= 0:
        raise ValueError("EF21-W weights need Σ L_i > 0 (all smoothness constants are zero)")
    return t / total


# --------------------------------------------------------------------------------------------
# contractive compressor constants (methods.md §4)
# --------------------------------------------------------------------------------------------
def theta(alpha: SupportsFloat) -> float:
    """θ(α) = 1 − √(1 − α) ([EF21] Lemma 3 with the optimal s; methods.md §4, V).

    Evaluated as α/(1 + √(1 − α)), which is the same number without cancellation for small α.
    """
    a = check_alpha(alpha)
    return a / (1.0 + math.sqrt(1.0 - a))


def beta(alpha: SupportsFloat) -> float:
    """β(α) = (1 − α)/(1 − √(1 − α)) ([EF21] Lemma 3 with the optimal s; methods.md §4, V).

    Evaluated as (1 − α)(1 + √(1 − α))/α (the same number, stable for small α); β(1) = 0.
    """
    a = check_alpha(alpha)
    return (1.0 - a) * (1.0 + math.sqrt(1.0 - a)) / a


def xi(alpha: SupportsFloat) -> float:
    """ξ(α) = √(β/θ) = (1 + √(1 − α))/α − 1 ([EF21] Thm 1; closed form D in methods.md §4).

    Evaluated as s(1 + s)/α with s = √(1 − α) (no cancellation). Examples (Top-1, α = 1/d):
    d = 14 → 26.49, 112 → 222.5, 123 → 244.5, 300 → 598.4996; ξ(1) = 0.
    """
    a = check_alpha(alpha)
    s = math.sqrt(1.0 - a)
    return s * (1.0 + s) / a
