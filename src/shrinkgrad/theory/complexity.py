"""Predicted rounds and bits to reach a target accuracy, from the theorems' rates.

* Nonconvex ([EF21] Thm 1, [EFR] Thms 2–3): for γ at most the rule's step,
  (1/T) Σ_{t<T} E‖∇f(x^t)‖² ≤ 2Φ⁰/(γT) (+ a noise floor for SGD), with
  Φ⁰ = f(x⁰) − f^inf + (γ/(2θ)) G⁰ and G⁰ = (1/n) Σ ‖g_i⁰ − ∇f_i(x⁰)‖² (G_w⁰ for the reloaded
  analysis). So T ≥ 2Φ⁰/(γ(ε − floor)) rounds guarantee min_t E‖∇f(x^t)‖² ≤ ε.
* PL ([EF21] Thm 2): E[Φ^T] ≤ (1 − γμ)^T Φ⁰ with Φ = f − f* + (γ/θ) G, so
  T ≥ log(Φ⁰/ε)/(−log(1 − γμ)) rounds give E[f(x^T) − f*] ≤ ε.
* DCGD with unbiased ω-compressors ([K18]'s distributed quantized GD), nonconvex: the ABC
  analysis of SGD (Khaled & Richtárik, *Better theory for SGD in the nonconvex world*, TMLR 2023,
  Thm 2) gives min_{t<T} E‖∇f(x^t)‖² ≤ 2(1 + Lγ²A)^T δ⁰/(γT) with A = ωL_max/n
  (:func:`rounds_dcgd`).

Bits are rounds × the bits of one message per client (``compressor.bits(d)``) plus whatever the
initialisation sends (e.g. 32d for g_i⁰ = ∇f_i(x⁰) in float32): the x-axis "#bits/n" of the
[EFR] plots.
"""

from __future__ import annotations

import math
from typing import SupportsFloat

import numpy as np

from .constants import check_alpha, check_nonnegative, check_positive, theta

__all__ = ["bits_to_accuracy", "lyapunov0", "rounds_dcgd", "rounds_ef21", "rounds_ef21_pl"]


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


def _ceil_rounds(t: float, eps: float) -> int:
    """⌈t⌉ for a bound's round count t, or a ValueError where t overflows floating point (a
    tiny ε or step: no finite count can be given)."""
    if not math.isfinite(t):
        raise ValueError(
            f"the bound for eps = {eps:.3g} needs more rounds than floating point can count "
            "(over 1.8e308): use a larger eps (or step size)"
        )
    return math.ceil(t)


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
    return max(0, _ceil_rounds(2.0 * phi0 / (g * (e - floor)), e))


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
    return _ceil_rounds((math.log(phi0) - math.log(e)) / -math.log1p(-g * m), e)


def rounds_dcgd(
    stepsize: SupportsFloat,
    f_gap: SupportsFloat,
    eps: SupportsFloat,
    *,
    L: SupportsFloat,
    L_max: SupportsFloat,
    omega: SupportsFloat,
    n: int,
) -> int:
    """Rounds T guaranteeing min_{t<T} E‖∇f(x^t)‖² ≤ ε for DCGD with unbiased ω-compressors.

    DCGD ([K18]; methods.md §3): x^{t+1} = x^t − γ ĝ^t, ĝ^t = (1/n) Σ_i Q_i(∇f_i(x^t)) with
    independent Q_i, E Q_i(v) = v, E‖Q_i(v) − v‖² ≤ ω‖v‖². Assumptions: f is L-smooth, every
    f_i is L_i-smooth (L_i ≤ L_max) and bounded below by a common f_low; ``f_gap`` = δ⁰ =
    f(x⁰) − f_low (an upper bound is fine; f_low = 0 for every problem of
    :mod:`shrinkgrad.problems`, whose losses and regularizers are ≥ 0). Nothing convex.

    Derivation ((D), the argument of Khaled & Richtárik, TMLR 2023, Thm 2, with their ABC
    constants A = ωL_max/n, B = 1, C = 0 relative to f_low):

    * E‖ĝ‖² = ‖∇f‖² + (1/n²) Σ_i E‖Q_i(∇f_i) − ∇f_i‖² ≤ ‖∇f‖² + (ω/n²) Σ_i ‖∇f_i‖², and
      ‖∇f_i(x)‖² ≤ 2L_i(f_i(x) − f_low), so E‖ĝ‖² ≤ ‖∇f‖² + 2A(f(x) − f_low);
    * the descent lemma with γ ≤ 1/L: δ^{t+1} ≤ (1 + a)δ^t − (γ/2)E‖∇f(x^t)‖², a = Lγ²A,
      δ^t = E f(x^t) − f_low;
    * weights (1 + a)^{−(t+1)} telescope: min_{t<T} E‖∇f(x^t)‖² ≤ 2(1 + a)^T δ⁰/(γT).

    T is the smallest integer with 2(1 + a)^T δ⁰ ≤ γTε; ω = 0 (GD) gives ⌈2δ⁰/(γε)⌉, the
    [EF21] Thm 1 count with α = 1 (:func:`rounds_ef21`). (1 + a)^T/T is smallest at
    T = 1/log(1 + a); when even there the bound exceeds ε, no T is guaranteed at this step
    (the compression noise outgrows the descent) and a ValueError says to use a smaller step.
    Raises ValueError for γ > 1/L (outside the lemma).
    """
    g = check_positive("stepsize", stepsize)
    gap = check_nonnegative("f_gap", f_gap)
    e = check_positive("eps", eps)
    L_ = check_positive("L", L)
    Lm = check_nonnegative("L_max", L_max)
    w = check_nonnegative("omega", omega)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (number of clients) must be an integer >= 1, got {n!r}")
    n = int(n)
    if g * L_ > 1.0 + 1e-12:
        raise ValueError(
            f"the step size γ = {g:.4g} exceeds 1/L = {1.0 / L_:.4g}: the DCGD rate needs γ ≤ 1/L"
        )
    if gap == 0.0:
        return 0
    a = L_ * g * g * w * Lm / n
    T0 = _ceil_rounds(2.0 * gap / (g * e), e)  # the bound without the growth factor: T ≥ T0
    if a == 0.0:
        return T0
    log1a = math.log1p(a)

    def ok(T: int) -> bool:  # 2(1 + a)^T δ⁰ ≤ γTε, in logs
        return T * log1a + math.log(2.0 * gap) <= math.log(g * T * e)

    best = max(1, math.floor(1.0 / log1a))  # (1 + a)^T/T is smallest at T = 1/log(1 + a)
    if not (ok(best) or ok(best + 1)):
        # the bound's floor is ≈ 2e·δ⁰·Lγ·ωL_max/n: a step below ε/(2e(1 + a)δ⁰LA) reaches ε
        A = w * Lm / n
        small = e / (2.0 * math.e * (1.0 + a) * gap * L_ * A)
        raise ValueError(
            f"no number of rounds guarantees min E‖∇f‖² ≤ {e:.3g} for DCGD at γ = {g:.4g} "
            f"(ω = {w:.3g}, n = {n}): the bound 2(1 + Lγ²ωL_max/n)^T δ⁰/(γT) never gets below "
            f"≈ {2.0 * math.e * gap * g * L_ * A:.3g}; use a step size <= {small:.3g} or a "
            "larger eps"
        )
    hi = best if ok(best) else best + 1
    lo = max(1, T0)
    if lo >= hi:
        return hi
    while lo < hi:  # ok is monotone on [1, hi]: the left branch of a convex function
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def bits_to_accuracy(
    rounds: int, bits_per_message: SupportsFloat, *, initial_bits: SupportsFloat = 0.0
) -> float:
    """Uplink bits per client, ``initial_bits + rounds × bits_per_message`` ([EFR] "#bits/n")."""
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise ValueError(f"rounds must be an integer ≥ 0, got {rounds!r}")
    rounds = int(rounds)
    b = check_nonnegative("bits_per_message", bits_per_message)
    return check_nonnegative("initial_bits", initial_bits) + rounds * b
