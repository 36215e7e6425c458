"""One small cited function per step-size rule of methods.md §4.

Every rule returns a Python float. Conventions (methods.md §1): f = (1/n) Σ f_i is the *average*
of the client functions, L is the smoothness constant of f, L_AM / L_QM / L_max are the means of
the clients' constants L_i (:mod:`shrinkgrad.theory.constants`), α ∈ (0, 1] is the contraction
constant of a contractive compressor and ω ≥ 0 the variance of an unbiased one.

Marks as in methods.md: (V) checked in a source or the authors' code, (D) derived here (the
derivation is in the docstring) and checked numerically in the tests, (?) not confirmed from the
paper text — implemented as stated in methods.md, and *all* such formulas live in this module.

Two rules are *strict* bounds (γ must be strictly smaller): :func:`stepsize_delayed` and
:func:`stepsize_unbiased_single`. They return the bound itself (the supremum of the allowed
steps); a caller must multiply it by a factor < 1. :func:`stepsize_unbiased_single_optimal` gives
the step that maximises the guaranteed decrease instead. All other rules are inclusive (γ ≤ rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import SupportsFloat

import numpy as np
import torch

from .constants import _as_float, check_alpha, check_nonnegative, check_positive, xi

__all__ = [
    "dcgd_neighborhood",
    "diana_alpha",
    "ef21_sgd_noise_floor",
    "ef21_sgd_nu",
    "ef21_speedup",
    "pp_constants",
    "stepsize_dcgd",
    "stepsize_delayed",
    "stepsize_diana",
    "stepsize_ef21",
    "stepsize_ef21_pl",
    "stepsize_ef21_plus",
    "stepsize_ef21_pp",
    "stepsize_ef21_reloaded",
    "stepsize_ef21_sgd",
    "stepsize_ef21_sgdm",
    "stepsize_ef21w",
    "stepsize_ef21w_pl",
    "stepsize_ef21w_pp",
    "stepsize_ef21w_sgd",
    "stepsize_rare_features",
    "stepsize_unbiased_single",
    "stepsize_unbiased_single_optimal",
]


def _inverse(denominator: float, rule: str) -> float:
    if not denominator > 0:
        raise ValueError(
            f"{rule}: the step-size denominator is {denominator}; the smoothness constant L of f "
            "must be > 0"
        )
    if not math.isfinite(denominator):
        raise ValueError(
            f"{rule}: the step-size denominator overflows ({denominator}: a contraction α so "
            "small that ξ(α) leaves the float range, or constants near it), so the step would "
            "be 0; check α and the constants"
        )
    return 1.0 / denominator


# --------------------------------------------------------------------------------------------
# EF21 and EF21-W, deterministic gradients
# --------------------------------------------------------------------------------------------
def stepsize_ef21(L: SupportsFloat, L_QM: SupportsFloat, alpha: SupportsFloat) -> float:
    """EF21, original analysis: γ = 1/(L + L_QM ξ(α)) ([EF21] Thm 1, V).

    Any γ ≤ this value gives (1/T) Σ_t E‖∇f(x^t)‖² ≤ 2Φ⁰/(γT) with
    Φ⁰ = f(x⁰) − f^inf + (γ/(2θ)) (1/n) Σ_i ‖g_i⁰ − ∇f_i(x⁰)‖².
    """
    L_, Q = check_nonnegative("L", L), check_nonnegative("L_QM", L_QM)
    return _inverse(L_ + Q * xi(alpha), "stepsize_ef21")


def stepsize_ef21_reloaded(L: SupportsFloat, L_AM: SupportsFloat, alpha: SupportsFloat) -> float:
    """EF21 reloaded / EF21-W: γ = 1/(L + L_AM ξ(α)) ([EFR] Thms 2, 3).

    Thm 2 is EF21-W (weights w_i = L_i/Σ L_j); Thm 3 is the improved analysis of plain EF21 with
    the weighted Lyapunov term G_w = (1/n) Σ (L_AM/L_i) ‖g_i − ∇f_i‖² (methods.md §4, invariant).
    """
    L_, A = check_nonnegative("L", L), check_nonnegative("L_AM", L_AM)
    return _inverse(L_ + A * xi(alpha), "stepsize_ef21_reloaded")


#: EF21-W uses the reloaded rule ([EFR] Thm 2); the alias keeps call sites readable.
stepsize_ef21w = stepsize_ef21_reloaded


def stepsize_ef21_plus(L: SupportsFloat, L_QM: SupportsFloat, alpha: SupportsFloat) -> float:
    """EF21+ ([EF21] §EF21+; the authors' ``bdfg_plus_*`` code): γ = 1/(L + L_QM ξ(α)).

    EF21+ keeps, per client, whichever of the EF21 estimator g_i + C(∇f_i − g_i) and the plain
    compressed gradient C(∇f_i) is closer to ∇f_i. (D) The chosen estimator's error is, draw by
    draw, at most that of the EF21 candidate, so the per-client contraction of [EF21] Lemma 3
    (E‖g_i⁺ − ∇f_i⁺‖² ≤ (1 − θ)‖g_i − ∇f_i‖² + β L_i² ‖x⁺ − x‖²) holds for EF21+ as well, and
    with it every EF21 rule that uses only that contraction: this one ([EF21] Thm 1) and the
    reloaded 1/(L + L_AM ξ(α)) ([EFR] Thm 3, :func:`stepsize_ef21_reloaded`). The authors' code
    runs EF21+ at the EF21 step (V).
    """
    return _inverse(
        check_nonnegative("L", L) + check_nonnegative("L_QM", L_QM) * xi(alpha),
        "stepsize_ef21_plus",
    )


def stepsize_ef21_pl(
    L: SupportsFloat, L_QM: SupportsFloat, alpha: SupportsFloat, mu: SupportsFloat
) -> float:
    """EF21 under the PL condition: γ = min{1/(L + L_QM √(2β/θ)), θ/(2μ)} ([EF21] Thm 2, V).

    With this γ, E[Φ^T] ≤ (1 − γμ)^T Φ⁰ where Φ = f − f* + (γ/θ) G. Note √(2β/θ) = √2 ξ(α).
    """
    L_, Q, m = check_nonnegative("L", L), check_nonnegative("L_QM", L_QM), check_positive("mu", mu)
    a = check_alpha(alpha)
    th = a / (1.0 + math.sqrt(1.0 - a))
    return min(_inverse(L_ + Q * math.sqrt(2.0) * xi(a), "stepsize_ef21_pl"), th / (2.0 * m))


def stepsize_ef21w_pl(
    L: SupportsFloat, L_AM: SupportsFloat, alpha: SupportsFloat, mu: SupportsFloat
) -> float:
    """EF21-W / reloaded EF21 under PL: min{1/(L + L_AM √(2β/θ)), θ/(2μ)} ([EFR] appendix, (?)).

    (?) methods.md marks this formula as not confirmed from the paper text: it is the [EF21] Thm 2
    rule with L_QM replaced by L_AM, implemented as stated.
    """
    L_, A, m = check_nonnegative("L", L), check_nonnegative("L_AM", L_AM), check_positive("mu", mu)
    a = check_alpha(alpha)
    th = a / (1.0 + math.sqrt(1.0 - a))
    return min(_inverse(L_ + A * math.sqrt(2.0) * xi(a), "stepsize_ef21w_pl"), th / (2.0 * m))


def ef21_speedup(
    L: SupportsFloat, L_AM: SupportsFloat, L_QM: SupportsFloat, alpha: SupportsFloat
) -> float:
    """Predicted ratio of EF21 rounds, original over reloaded: (L + L_QM ξ)/(L + L_AM ξ) ([EFR] §2).

    It tends to L_QM/L_AM as compression gets aggressive (ξ → ∞) (methods.md §4).
    """
    return stepsize_ef21_reloaded(L, L_AM, alpha) / stepsize_ef21(L, L_QM, alpha)


# --------------------------------------------------------------------------------------------
# partial participation
# --------------------------------------------------------------------------------------------
def _participation(
    p: SupportsFloat | Sequence[float] | np.ndarray | torch.Tensor,
) -> tuple[float, float]:
    if isinstance(p, torch.Tensor):
        arr = p.detach().cpu().to(torch.float64).numpy().reshape(-1)
    else:
        arr = np.asarray(p, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("participation probabilities p: need at least one value")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0) or np.any(arr > 1):
        raise ValueError(
            f"participation probabilities p must be in (0, 1], got min {arr.min()}, max {arr.max()}"
        )
    return float(arr.min()), float(arr.max())


def pp_constants(
    alpha: SupportsFloat,
    p: SupportsFloat | Sequence[float] | np.ndarray | torch.Tensor,
    s: SupportsFloat,
    rho: SupportsFloat,
) -> tuple[float, float]:
    """(θ_p, B/L̃²) of EF21-PP for given free parameters s > 0, ρ > 0 ([BW] Thm 7, (?) in part).

    θ = 1 − (1 + s)(1 − α), β = (1 + 1/s)(1 − α),
    θ_p = ρ p_min + θ p_max − ρ − (p_max − p_min),
    B/L̃² = β p_max + (1 + 1/ρ)(1 − p_min),
    where L̃ is L_QM (EF21-PP) or L_AM (EF21-W-PP). The form is the one of methods.md §4: the
    authors' code for p_min = p_max (V); the p_min ≠ p_max form is (?).
    """
    a = check_alpha(alpha)
    s_, r = check_positive("s", s), check_positive("rho", rho)
    p_min, p_max = _participation(p)
    th = 1.0 - (1.0 + s_) * (1.0 - a)
    be = (1.0 + 1.0 / s_) * (1.0 - a)
    theta_p = r * p_min + th * p_max - r - (p_max - p_min)
    b = be * p_max + (1.0 + 1.0 / r) * (1.0 - p_min)
    return theta_p, b


def pp_best_parameters(a: float, p_min: float, p_max: float) -> tuple[float, float, float]:
    """(min over s, ρ > 0 of B/(L̃² θ_p) subject to θ_p > 0, and the minimising s and ρ) of
    EF21-PP ([BW] Thm 7; see :func:`stepsize_ef21_pp`): the inner minimum over ρ in closed
    form, the outer one over u = (1 + s)(1 − α) numerically. The ratio is ∞ (and s, ρ NaN)
    when no s, ρ give θ_p > 0."""
    from scipy.optimize import minimize_scalar

    q = 1.0 - p_min  # coefficient of ρ in θ_p and of 1/ρ in B
    nan = math.nan

    def best_over_rho(th: float, be: float) -> tuple[float, float]:
        # minimise (A + q/ρ)/(c − qρ) over 0 < ρ < c/q, with A = β p_max + q, c = θ p_max − Δp.
        A = be * p_max + q
        c = th * p_max - (p_max - p_min)
        if c <= 0:
            return math.inf, nan
        if q == 0.0:  # everybody always participates: ρ plays no role
            return A / c, 1.0
        # stationary point of (Aρ + q)/(ρ(c − qρ)): A q ρ² + 2 q² ρ − q c = 0
        rho = (-q + math.sqrt(q * q + A * c)) / A
        return (A + q / rho) / (c - q * rho), rho

    if a == 1.0:  # no compression: θ = 1, β = 0 for every s
        ratio, rho = best_over_rho(1.0, 0.0)
        return ratio, 1.0, rho
    # parametrise by u = (1 + s)(1 − α) ∈ (1 − α, 1): θ = 1 − u, β = u(1 − α)/(u − (1 − α))
    lo, hi = 1.0 - a, 1.0
    if p_max > p_min:
        hi = min(hi, 1.0 - (p_max - p_min) / p_max)

    def at(u: float) -> tuple[float, float]:
        return best_over_rho(1.0 - u, u * (1.0 - a) / (u - (1.0 - a)))

    if not hi > lo:
        return math.inf, nan, nan
    width = hi - lo
    res = minimize_scalar(
        lambda u: at(u)[0],
        bounds=(lo + 1e-15 * width, hi - 1e-15 * width),
        method="bounded",
        options={"xatol": 1e-13 * max(width, 1e-300)},
    )
    u = float(res.x)
    ratio, rho = at(u)
    if not ratio <= res.fun:  # (the optimiser's value, if smaller: the same point in practice)
        ratio = float(res.fun)
    return ratio, u / (1.0 - a) - 1.0, rho


def _pp_best_ratio(a: float, p_min: float, p_max: float) -> float:
    """min over s, ρ > 0 of B/(L̃² θ_p) subject to θ_p > 0 (:func:`pp_best_parameters`)."""
    return pp_best_parameters(a, p_min, p_max)[0]


def _stepsize_pp(
    rule: str,
    L: SupportsFloat,
    L_tilde: float,
    alpha: SupportsFloat,
    p: SupportsFloat | Sequence[float] | np.ndarray | torch.Tensor,
    s: SupportsFloat | None,
    rho: SupportsFloat | None,
) -> float:
    L_ = check_nonnegative("L", L)
    a = check_alpha(alpha)
    p_min, p_max = _participation(p)
    if (s is None) != (rho is None):
        raise ValueError(f"{rule}: give both free parameters s and rho, or neither (optimised)")
    if s is not None and rho is not None:
        theta_p, b = pp_constants(a, p, s, rho)
        if theta_p <= 0:
            raise ValueError(
                f"{rule}: θ_p = {theta_p:.3g} ≤ 0 for s = {s}, rho = {rho}; choose a smaller "
                "rho, or omit s and rho to use the optimal values"
            )
        ratio = b / theta_p
    elif p_min == p_max:
        # (D) homogeneous participation: the optimum over s, ρ is ξ(α p)², i.e. EF21 with the
        # contractive operator "C with probability p, else no update" (α' = α p); the tests
        # check it against the numerical optimum of the general form. Its square root is
        # ξ(α p) itself (squaring it overflowed for α p < 1e-154)
        return _inverse(L_ + L_tilde * xi(a * p_min), rule)
    else:
        ratio = _pp_best_ratio(a, p_min, p_max)
        if not math.isfinite(ratio):
            raise ValueError(
                f"{rule}: no valid step size: the theory needs θ_p > 0, i.e. "
                f"α·p_max > p_max − p_min (here α = {a:.4g}, p_min = {p_min:.4g}, "
                f"p_max = {p_max:.4g}); use participation probabilities closer to each other or a "
                "milder compressor"
            )
    return _inverse(L_ + L_tilde * math.sqrt(ratio), rule)


def stepsize_ef21_pp(
    L: SupportsFloat,
    L_QM: SupportsFloat,
    alpha: SupportsFloat,
    p: SupportsFloat | Sequence[float] | np.ndarray | torch.Tensor,
    *,
    s: SupportsFloat | None = None,
    rho: SupportsFloat | None = None,
) -> float:
    """EF21-PP: γ = 1/(L + √(B/θ_p)) ([BW] Thm 7; methods.md §4).

    θ_p = ρ p_min + θ p_max − ρ − (p_max − p_min), B = (β p_max + (1 + 1/ρ)(1 − p_min)) L_QM²,
    θ = 1 − (1 + s)(1 − α), β = (1 + 1/s)(1 − α), with free s > 0, ρ > 0 (see :func:`pp_constants`).
    ``p`` is one probability for every client or the vector of the clients' probabilities.

    Without ``s`` and ``rho`` the step is maximised over both: the inner minimum over ρ in closed
    form, ρ* = (−q + √(q² + A c))/A with q = 1 − p_min, A = β p_max + q and
    c = θ p_max − (p_max − p_min); the outer one over s numerically. For one common p the optimum
    is B/θ_p = L_QM² ξ(αp)² (D: EF21-PP is then EF21 with the contractive operator "C with
    probability p, else no update", whose constant is αp; checked numerically), which is used
    exactly; with p ≡ 1 this is the EF21 rule 1/(L + L_QM ξ(α)). Marks as in methods.md: (V) for
    p_min = p_max, (?) for the p_min ≠ p_max form, implemented as stated. Note: the [BW] authors'
    public script ``ef21_pp.py`` runs EF21-PP with the plain EF21 step 1/(L + L_QM ξ(α)), which
    is larger than this rule when p < 1.
    """
    Q = check_nonnegative("L_QM", L_QM)
    return _stepsize_pp("stepsize_ef21_pp", L, Q, alpha, p, s, rho)


def stepsize_ef21w_pp(
    L: SupportsFloat,
    L_AM: SupportsFloat,
    alpha: SupportsFloat,
    p: SupportsFloat | Sequence[float] | np.ndarray | torch.Tensor,
    *,
    s: SupportsFloat | None = None,
    rho: SupportsFloat | None = None,
) -> float:
    """EF21-W-PP: the EF21-PP rule with L_QM replaced by L_AM ([EFR] §3.2, (?)).

    (?) implemented as stated in methods.md; see :func:`stepsize_ef21_pp` for the constants.
    """
    A = check_nonnegative("L_AM", L_AM)
    return _stepsize_pp("stepsize_ef21w_pp", L, A, alpha, p, s, rho)


# --------------------------------------------------------------------------------------------
# stochastic gradients
# --------------------------------------------------------------------------------------------
def ef21_sgd_nu(alpha: SupportsFloat, sigma2: SupportsFloat = 0.0) -> float:
    """Default Young parameter ν of the EF21-SGD rule: 0 without noise, else α/(2(1 − α)).

    The default makes the effective contraction α_ν = 1 − (1 + ν)(1 − α) equal to α/2 (see
    :func:`stepsize_ef21_sgd`); ν = ∞ for α = 1 (no compression, where ν does not enter the step).
    """
    a = check_alpha(alpha)
    if check_nonnegative("sigma2", sigma2) == 0.0:
        return 0.0
    return math.inf if a == 1.0 else a / (2.0 * (1.0 - a))


def _nu(a: float, sigma2: SupportsFloat, nu: SupportsFloat | None) -> float:
    """ν as given (or :func:`ef21_sgd_nu`'s default), validated for the contraction α = ``a``.

    ν = ∞ is accepted at α = 1 only: it is :func:`ef21_sgd_nu`'s value there, the limit of
    α/(2(1 − α)) as α → 1, and a legitimate one, since without compression error
    (1 + ν)(1 − α) = 0 for every finite ν, the step 1/(L + L̃ ξ(1)) = 1/L does not depend on ν,
    and the noise constant (1 + ν)(1 − α) + 1 + 1/ν of the recursion tends to 1 (the floor σ²;
    the (D) derivation of :func:`stepsize_ef21_sgd`, from [EF21] Lemma 3).
    """
    if nu is None:
        return ef21_sgd_nu(a, sigma2)
    v = _as_float("nu", nu)
    if a == 1.0 and v == math.inf:
        return v
    return check_nonnegative("nu", v)


def _alpha_nu(a: float, nu: float) -> float:
    if a == 1.0 or nu == 0.0:
        return a
    if not (0.0 <= nu < a / (1.0 - a)):
        raise ValueError(
            f"nu must be in [0, α/(1 − α)) = [0, {a / (1.0 - a):.4g}) for alpha = {a:.4g}, got {nu}"
        )
    return a - nu * (1.0 - a)  # = 1 − (1 + ν)(1 − α), without its cancellation at tiny α


def stepsize_ef21_sgd(
    L: SupportsFloat,
    L_QM: SupportsFloat,
    alpha: SupportsFloat,
    *,
    sigma2: SupportsFloat = 0.0,
    nu: SupportsFloat | None = None,
) -> float:
    """EF21-SGD: γ = 1/(L + L_QM ξ(α_ν)) with α_ν = 1 − (1 + ν)(1 − α) ((D); [BW] Thm 4 is (?)).

    Derivation (D), under bounded variance E‖ĝ_i(x) − ∇f_i(x)‖² ≤ σ_i² for unbiased minibatch
    estimators ĝ_i, σ² = (1/n) Σ σ_i². With v = ĝ_i(x^{t+1}) − g_i^t, Young's inequality with ν,
    the contraction of C and E‖v‖² = ‖∇f_i(x^{t+1}) − g_i^t‖² + E‖ĝ_i − ∇f_i(x^{t+1})‖²:

        G^{t+1} ≤ (1 − θ̂) G^t + β̂ L_QM² ‖x^{t+1} − x^t‖² + ((1 + ν)(1 − α) + 1 + 1/ν) σ²

    with 1 − θ̂ = (1 + ν)(1 − α)(1 + s), β̂ = (1 + ν)(1 − α)(1 + 1/s): the deterministic recursion
    of [EF21] Lemma 3 with 1 − α replaced by (1 + ν)(1 − α). The [EF21] descent lemma and Lemma 5
    then give the step above (s optimal) and
    (1/T) Σ_t E‖∇f(x^t)‖² ≤ 2Φ⁰/(γT) + :func:`ef21_sgd_noise_floor`.

    ``nu`` defaults to :func:`ef21_sgd_nu` (0 when ``sigma2`` is 0, so the rule is then exactly
    :func:`stepsize_ef21`); ν = ∞, that function's value at α = 1, is accepted there (no
    compression: the step is 1/L for every ν). (?) [BW] Thm 4 states EF21-SGD under the more
    general "ABC" assumption with its own constants, which were not available to check; this
    rule is the bounded-variance special case derived above, and the authors' code runs EF21-SGD
    with the deterministic step (V).
    """
    L_, Q = check_nonnegative("L", L), check_nonnegative("L_QM", L_QM)
    a = check_alpha(alpha)
    v = _nu(a, sigma2, nu)
    return _inverse(L_ + Q * xi(_alpha_nu(a, v)), "stepsize_ef21_sgd")


def stepsize_ef21w_sgd(
    L: SupportsFloat,
    L_AM: SupportsFloat,
    alpha: SupportsFloat,
    *,
    sigma2: SupportsFloat = 0.0,
    nu: SupportsFloat | None = None,
) -> float:
    """EF21-W-SGD: the EF21-SGD rule with L_QM → L_AM ((D); [EFR] §3.1 is (?)).

    The derivation of :func:`stepsize_ef21_sgd` with the weighted Lyapunov term
    G_w = Σ_i w_i ‖g_i − ∇f_i/(n w_i)‖², for which Σ_i w_i (L_i/(n w_i))² = L_AM²; the noise enters
    as σ_w² = (1/n) Σ_i (L_AM/L_i) σ_i² (the variance of ĝ_i/(n w_i), averaged with weights w_i).
    """
    L_, A = check_nonnegative("L", L), check_nonnegative("L_AM", L_AM)
    a = check_alpha(alpha)
    v = _nu(a, sigma2, nu)
    return _inverse(L_ + A * xi(_alpha_nu(a, v)), "stepsize_ef21w_sgd")


def stepsize_ef21_sgdm(
    L: SupportsFloat, L_QM: SupportsFloat, alpha: SupportsFloat, eta: SupportsFloat
) -> float:
    """EF21-SGDM: γ = min{α/(20 L_QM), η/(7L)} ([FTR23] Thm 3, (?)).

    [FTR23] Fatkhullin, Tyurin, Richtárik, *Momentum Provably Improves Error Feedback!*,
    NeurIPS 2023, Alg. 1: v_i ← (1 − η) v_i + η ∇f_i(x, ξ_i), then EF21 on v_i (the method
    ``ef21_sgdm[beta]`` with η = 1 − β). Its main theorem allows any γ up to
    min{α/(20 L̃), η/(7L)} with L̃ = L_QM, under smoothness and bounded variance, and then tunes η
    to the noise (η = 1 for exact gradients). (?) The constants 20 and 7 are the ones of the
    theorem as we read it; the text available here (the abstract) could not confirm them, so the
    rule is marked unconfirmed, like the others of this module that methods.md marks (?). The
    rule is conservative: for α = η = 1 it is min{1/(20 L_QM), 1/(7L)}, far below GD's 1/L.
    """
    L_, Q = check_positive("L", L), check_positive("L_QM", L_QM)
    a = check_alpha(alpha)
    e = check_positive("eta", eta)
    if e > 1.0:
        raise ValueError(
            f"eta (= 1 − beta, the momentum weight of the new gradient) must be in (0, 1], got {e}"
        )
    return min(a / (20.0 * Q), e / (7.0 * L_))


def ef21_sgd_noise_floor(
    alpha: SupportsFloat, sigma2: SupportsFloat, *, nu: SupportsFloat | None = None
) -> float:
    """The non-vanishing term C̃/θ̂ of the EF21-SGD bound on (1/T) Σ E‖∇f(x^t)‖² ((D), see above).

    C̃ = ((1 + ν)(1 − α) + 1 + 1/ν) σ², θ̂ = 1 − √((1 + ν)(1 − α)) (s optimal); for α = 1 it is
    σ² (no compression error, ν = ∞). Pass σ_w² for EF21-W-SGD. Infinite when ν = 0 and σ² > 0.
    """
    a = check_alpha(alpha)
    s2 = check_nonnegative("sigma2", sigma2)
    v = _nu(a, s2, nu)
    if s2 == 0.0:
        return 0.0
    if a == 1.0:
        return s2 if math.isinf(v) or v == 0.0 else (1.0 + 1.0 / v) * s2
    if v == 0.0:
        return math.inf
    u = (1.0 + v) * (1.0 - a)
    _alpha_nu(a, v)  # validates the range of ν
    return (u + 1.0 + 1.0 / v) * s2 / (1.0 - math.sqrt(u))


# --------------------------------------------------------------------------------------------
# rare features
# --------------------------------------------------------------------------------------------
def stepsize_rare_features(
    L: SupportsFloat, L_plus: SupportsFloat, c: int, n: int, alpha: SupportsFloat
) -> float:
    """EF21 when features are rare: γ = 1/(L + L_+ √(c/n) ξ(α)) ([RF], V with the authors' code).

    c = max over features of the number of clients whose data use the feature (0 ≤ c ≤ n; 0
    when no client's data use any feature),
    L_+² = λ_max((1/n) Σ H_i²) for quadratics (see :mod:`shrinkgrad.problems.rare`).
    """
    L_, Lp = check_nonnegative("L", L), check_nonnegative("L_plus", L_plus)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (number of clients) must be an integer ≥ 1, got {n!r}")
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not (0 <= c <= n):
        raise ValueError(
            f"c (max clients sharing a feature) must be an integer in [0, n={n}], got {c!r}"
        )
    return _inverse(L_ + Lp * math.sqrt(int(c) / int(n)) * xi(alpha), "stepsize_rare_features")


# --------------------------------------------------------------------------------------------
# unbiased compression: delayed gradients, single node, DCGD
# --------------------------------------------------------------------------------------------
def _check_int(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer ≥ {low}, got {value!r}")
    return int(value)


def stepsize_delayed(L: SupportsFloat, tau: int) -> float:
    """Delayed / asynchronous compressed gradients: the bound 2/[L(1 + √(1 + 8τ(τ + 1)))] ([K18]).

    STRICT: the theorem needs γ *strictly below* the returned value (its supremum); multiply it by
    a factor < 1. τ is the maximal delay; τ = 0 gives 1/L. L is the smoothness constant of the
    function whose gradient the step uses, so [K18]'s sum convention and the library's average
    convention give the same formula (γ_avg = n γ_sum and L_sum = n L_avg cancel).
    (?) methods.md records this from a summary of [K18]: which algorithm it covers and how the
    compressor's ω enters are not confirmed; implemented as stated, without ω.
    """
    L_ = check_positive("L", L)
    t = _check_int("tau (maximal delay)", tau, 0)
    return 2.0 / (L_ * (1.0 + math.sqrt(1.0 + 8.0 * t * (t + 1))))


def stepsize_unbiased_single(L: SupportsFloat, omega: SupportsFloat) -> float:
    """One node, unbiased compressor Q with variance ω: the bound 2/(L(1 + ω)) (descent lemma, D).

    STRICT (supremum of the allowed steps). Derivation: for x⁺ = x − γ Q(∇f(x)),
    E f(x⁺) ≤ f(x) − γ‖∇f‖² + (Lγ²/2) E‖Q(∇f)‖² ≤ f(x) − γ(1 − Lγ(1 + ω)/2)‖∇f(x)‖²,
    a strict decrease iff γ < 2/(L(1 + ω)). With ω = 0 the bound is 2/L, where plain gradient
    descent stops converging on a quadratic: use a factor < 1, or
    :func:`stepsize_unbiased_single_optimal`.
    """
    L_, w = check_positive("L", L), check_nonnegative("omega", omega)
    return 2.0 / (L_ * (1.0 + w))


def stepsize_unbiased_single_optimal(L: SupportsFloat, omega: SupportsFloat) -> float:
    """γ = 1/(L(1 + ω)), the maximiser of the guaranteed decrease γ(1 − Lγ(1 + ω)/2) (D).

    Half of :func:`stepsize_unbiased_single`; it guarantees E f(x⁺) ≤ f(x) − ‖∇f(x)‖²/(2L(1 + ω)).
    """
    return 0.5 * stepsize_unbiased_single(L, omega)


def diana_alpha(omega: SupportsFloat, alpha: SupportsFloat | None = None) -> float:
    """DIANA's shift step size α: ``alpha`` checked against α ≤ 1/(1 + ω), or 1/(1 + ω) itself.

    [DIANA] (Mishchenko, Gorbunov, Takáč, Richtárik 2019) and [HKMSR] (Horváth et al. 2019) take
    α ≤ 1/(1 + ω); then E‖h_i + αQ(Δ) − ∇f_i‖² ≤ (1 − α)‖Δ‖² for Δ = ∇f_i − h_i (see
    :func:`stepsize_diana`).
    """
    w = check_nonnegative("omega", omega)
    bound = 1.0 / (1.0 + w)
    if alpha is None:
        return bound
    a = check_positive("alpha", alpha)
    if a > bound * (1.0 + 1e-12):
        raise ValueError(
            f"DIANA's theory needs alpha ≤ 1/(1 + ω) = {bound:.6g} (ω = {w:g}), got alpha = {a:g}; "
            "omit alpha (it defaults to 1/(1 + ω)) or pass a numeric stepsize"
        )
    return min(a, bound)


def stepsize_diana(
    L: SupportsFloat,
    L_QM: SupportsFloat,
    omega: SupportsFloat,
    n: int,
    alpha: SupportsFloat | None = None,
) -> float:
    """DIANA, smooth nonconvex f_i: γ = 2/(L + √(L² + 4K²)), K = √(ω/n) L_QM/(1 − √(1 − α)) (D).

    The largest step of the following analysis (derived here; the published nonconvex DIANA rate
    of [HKMSR] has the same dependence (1 + (1 + ω)√(ω/n)) L, its constants are (?)).
    Assumptions: f L-smooth and bounded below by f^inf, f_i L_i-smooth, independent unbiased
    compressors with variance ω, α ≤ 1/(1 + ω) (:func:`diana_alpha`, default 1/(1 + ω)).
    DIANA: Δ_i = ∇f_i(x^k) − h_i, ĝ = h + (1/n) Σ Q_i(Δ_i), x^{k+1} = x^k − γĝ,
    h_i ← h_i + αQ_i(Δ_i). With H^k = (1/n) Σ ‖h_i^k − ∇f_i(x^k)‖²:

    1. E ĝ = ∇f(x^k) and E‖ĝ − ∇f‖² ≤ (ω/n) H^k (independent draws);
    2. E‖h_i + αQ(Δ_i) − ∇f_i(x^k)‖² = (1 − 2α)‖Δ_i‖² + α² E‖Q(Δ_i)‖² ≤ (1 − α)‖Δ_i‖²;
    3. Young (s > 0) and L_i-smoothness: E H^{k+1} ≤ (1 − θ) H^k + β L_QM² γ² E‖ĝ‖² with
       θ = 1 − (1 + s)(1 − α), β = 1 + 1/s;
    4. the descent lemma: E f(x^{k+1}) ≤ f(x^k) − γ‖∇f‖² + (Lγ²/2)(‖∇f‖² + (ω/n) H^k).

    For Φ = f − f^inf + cH with c = Lγ²ω/(2n(θ − βL_QM²γ²ω/n)) these give
    E Φ^{k+1} ≤ Φ^k − (γ/2)‖∇f(x^k)‖² whenever Lγ + (β/θ)(ω/n) L_QM² γ² ≤ 1; β/θ is smallest,
    1/(1 − √(1 − α))², at 1 + s = 1/√(1 − α), and the positive root of the quadratic is the
    step above. Then (1/T) Σ_k E‖∇f(x^k)‖² ≤ 2Φ⁰/(γT) with Φ⁰ = f(x⁰) − f^inf + cH⁰ (H⁰ = 0 when
    h_i⁰ = ∇f_i(x⁰)). ω = 0 gives 1/L (gradient descent); the tests check the decrease exactly,
    by enumerating every draw of rand-1, at this step.
    """
    L_, Q = check_nonnegative("L", L), check_nonnegative("L_QM", L_QM)
    w = check_nonnegative("omega", omega)
    k = _check_int("n (number of clients)", n, 1)
    a = diana_alpha(w, alpha)
    if w == 0.0:
        return _inverse(L_, "stepsize_diana")
    K = math.sqrt(w / k) * Q * (1.0 + math.sqrt(1.0 - a)) / a  # 1/(1 − √(1 − α)), stably
    denominator = L_ + math.sqrt(L_ * L_ + 4.0 * K * K)
    return 2.0 * _inverse(denominator, "stepsize_diana")


def stepsize_dcgd(L: SupportsFloat, L_max: SupportsFloat, omega: SupportsFloat, n: int) -> float:
    """DCGD with n clients and independent unbiased compressors: γ = 1/(L + 2ω L_max/n) (D).

    Assumes every f_i convex and L_i-smooth, f μ-strongly convex (μ ≥ 0), x* a minimiser.
    Derivation: ĝ = (1/n) Σ Q_i(∇f_i(x)); independence gives
    E‖ĝ‖² ≤ ‖∇f(x)‖² + (ω/n²) Σ ‖∇f_i(x)‖², and with ‖∇f_i(x)‖² ≤ 2‖∇f_i(x) − ∇f_i(x*)‖² +
    2‖∇f_i(x*)‖² ≤ 4 L_i D_{f_i}(x, x*) + 2‖∇f_i(x*)‖² and ‖∇f(x)‖² ≤ 2L (f(x) − f*):

        E‖ĝ‖² ≤ 2 (L + 2ω L_max/n)(f(x) − f*) + 2ω σ*/n,   σ* = (1/n) Σ ‖∇f_i(x*)‖².

    The standard SGD recursion (expected smoothness A = L + 2ω L_max/n) then gives, for γ ≤ 1/A,
    E‖x^k − x*‖² ≤ (1 − γμ)^k ‖x⁰ − x*‖² + :func:`dcgd_neighborhood`: linear convergence to a
    neighbourhood that vanishes only when every ∇f_i(x*) = 0 (methods.md §3, DCGD). n = 1, ω = 0
    gives 1/L. Nonconvex f_i are not covered by this rule.
    """
    L_, Lm = check_nonnegative("L", L), check_nonnegative("L_max", L_max)
    w = check_nonnegative("omega", omega)
    k = _check_int("n (number of clients)", n, 1)
    return _inverse(L_ + 2.0 * w * Lm / k, "stepsize_dcgd")


def dcgd_neighborhood(
    stepsize: SupportsFloat,
    omega: SupportsFloat,
    n: int,
    mu: SupportsFloat,
    sigma_star: SupportsFloat,
) -> float:
    """Radius γ·2ωσ*/(nμ) of the ball E‖x^k − x*‖² converges to under :func:`stepsize_dcgd` (D)."""
    g, w = check_positive("stepsize", stepsize), check_nonnegative("omega", omega)
    k = _check_int("n (number of clients)", n, 1)
    m, s = check_positive("mu", mu), check_nonnegative("sigma_star", sigma_star)
    return g * 2.0 * w * s / (k * m)
