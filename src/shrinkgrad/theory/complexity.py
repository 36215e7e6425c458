"""Predicted rounds and bits to reach a target accuracy, from the theorems' rates.

* Nonconvex ([EF21] Thm 1, [EFR] Thms 2–3): for γ at most the rule's step,
  (1/T) Σ_{t<T} E‖∇f(x^t)‖² ≤ 2Φ⁰/(γT) (+ a noise floor for SGD), with
  Φ⁰ = f(x⁰) − f^inf + (γ/(2θ)) G⁰ and G⁰ = (1/n) Σ ‖g_i⁰ − ∇f_i(x⁰)‖² (G_w⁰ for the reloaded
  analysis). So T ≥ 2Φ⁰/(γ(ε − floor)) rounds guarantee min_t E‖∇f(x^t)‖² ≤ ε.
* PL ([EF21] Thm 2): E[Φ^T] ≤ (1 − γμ)^T Φ⁰ with Φ = f − f* + (γ/θ) G, so
  T ≥ log(Φ⁰/ε)/(−log(1 − γμ)) rounds give E[f(x^T) − f*] ≤ ε.

Bits are rounds × the bits of one message per client (``compressor.bits(d)``) plus whatever the
initialisation sends (e.g. 32d for g_i⁰ = ∇f_i(x⁰) in float32): the x-axis "#bits/n" of the
[EFR] plots.
"""

from __future__ import annotations

import math
from typing import SupportsFloat

from .constants import check_alpha, check_nonnegative, check_positive, theta

__all__ = ["bits_to_accuracy", "lyapunov0", "rounds_ef21", "rounds_ef21_pl"]


def lyapunov0(
    stepsize: SupportsFloat,
    f_gap: SupportsFloat,
    alpha: SupportsFloat = 1.0,
    G0: SupportsFloat = 0.0,
    *,
    pl: bool = False,
) -> float:
    """Φ⁰ = f(x⁰) − f^inf + (γ/(2θ)) G⁰ ([EF21] Thm 1); with ``pl=True`` the Thm 2 form (γ/θ) G⁰.

    ``f_gap`` is f(x⁰) − f^inf (an upper bound on it is fine, e.g. f(x⁰) − 0 for a non-negative
    loss); G⁰ is 0 when the clients start with g_i⁰ = ∇f_i(x⁰).
    """
    g = check_positive("stepsize", stepsize)
    gap = check_nonnegative("f_gap", f_gap)
    G = check_nonnegative("G0", G0)
    th = theta(alpha)
    return gap + (g / th if pl else g / (2.0 * th)) * G


def rounds_ef21(
    stepsize: SupportsFloat,
    f_gap: SupportsFloat,
    eps: SupportsFloat,
    *,
    alpha: SupportsFloat = 1.0,
    G0: SupportsFloat = 0.0,
    noise_floor: SupportsFloat = 0.0,
) -> int:
    """Rounds T = ⌈2Φ⁰/(γ(ε − floor))⌉ guaranteeing min_{t<T} E‖∇f(x^t)‖² ≤ ε ([EF21] Thm 1).

    Valid for EF21 / EF21-W / EF21-PP / EF21-SGD at any γ not above their rule (``noise_floor``
    from :func:`~shrinkgrad.theory.stepsizes.ef21_sgd_noise_floor` for SGD). Raises ValueError
    when ε does not exceed the floor (no finite T is guaranteed).
    """
    g = check_positive("stepsize", stepsize)
    e = check_positive("eps", eps)
    floor = check_nonnegative("noise_floor", noise_floor)
    check_alpha(alpha)
    if e <= floor:
        raise ValueError(
            f"eps = {e:.3g} is not above the noise floor {floor:.3g} of the stochastic bound: no "
            "number of rounds guarantees it; use larger minibatches or a larger eps"
        )
    phi0 = lyapunov0(g, f_gap, alpha, G0)
    return max(0, math.ceil(2.0 * phi0 / (g * (e - floor))))


def rounds_ef21_pl(
    stepsize: SupportsFloat,
    mu: SupportsFloat,
    f_gap: SupportsFloat,
    eps: SupportsFloat,
    *,
    alpha: SupportsFloat = 1.0,
    G0: SupportsFloat = 0.0,
) -> int:
    """Rounds T = ⌈log(Φ⁰/ε)/(−log(1 − γμ))⌉ giving E[f(x^T) − f*] ≤ ε under PL ([EF21] Thm 2).

    γ must not exceed :func:`~shrinkgrad.theory.stepsizes.stepsize_ef21_pl` (so γμ ≤ θ/2 < 1).
    """
    g, m = check_positive("stepsize", stepsize), check_positive("mu", mu)
    e = check_positive("eps", eps)
    if g * m >= 1.0:
        raise ValueError(f"stepsize·mu = {g * m:.3g} must be < 1 (the PL rule gives γμ ≤ θ/2)")
    phi0 = lyapunov0(g, f_gap, alpha, G0, pl=True)
    if phi0 <= e:
        return 0
    return math.ceil(math.log(phi0 / e) / -math.log1p(-g * m))


def bits_to_accuracy(
    rounds: int, bits_per_message: SupportsFloat, *, initial_bits: SupportsFloat = 0.0
) -> float:
    """Uplink bits per client, ``initial_bits + rounds × bits_per_message`` ([EFR] "#bits/n")."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer ≥ 0, got {rounds!r}")
    b = check_nonnegative("bits_per_message", bits_per_message)
    return check_nonnegative("initial_bits", initial_bits) + rounds * b
