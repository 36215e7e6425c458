"""Theory: smoothness means, compressor constants and one cited function per step-size rule.

See methods.md §1 and §4 and ``docs/theory.md``. Every function is small and pure, cites its
source and validates its input. Formulas marked (?) in methods.md are all in
:mod:`shrinkgrad.theory.stepsizes` and say so in their docstrings.

* :mod:`~shrinkgrad.theory.constants`: L_AM, L_QM, L_max, L_var, EF21-W weights, θ(α), β(α), ξ(α);
* :mod:`~shrinkgrad.theory.stepsizes`: EF21 (original, reloaded/EF21-W, PL, PP, SGD, SGDM), EF21+,
  rare features, delayed gradients, single-node unbiased compression, DCGD, DIANA;
* :mod:`~shrinkgrad.theory.complexity`: predicted rounds and bits to reach ‖∇f‖² ≤ ε (EF21 and
  its variants, EF21 under PL, DCGD with unbiased compressors).
"""

from __future__ import annotations

from .complexity import bits_to_accuracy, lyapunov0, rounds_dcgd, rounds_ef21, rounds_ef21_pl
from .constants import L_AM, L_QM, L_max, L_var, beta, ef21w_weights, theta, xi
from .stepsizes import (
    dcgd_neighborhood,
    diana_alpha,
    ef21_sgd_noise_floor,
    ef21_sgd_nu,
    ef21_speedup,
    pp_constants,
    stepsize_dcgd,
    stepsize_delayed,
    stepsize_diana,
    stepsize_ef21,
    stepsize_ef21_pl,
    stepsize_ef21_plus,
    stepsize_ef21_pp,
    stepsize_ef21_reloaded,
    stepsize_ef21_sgd,
    stepsize_ef21_sgdm,
    stepsize_ef21w,
    stepsize_ef21w_pl,
    stepsize_ef21w_pp,
    stepsize_ef21w_sgd,
    stepsize_rare_features,
    stepsize_unbiased_single,
    stepsize_unbiased_single_optimal,
)

__all__ = [
    "L_AM",
    "L_QM",
    "L_max",
    "L_var",
    "beta",
    "bits_to_accuracy",
    "dcgd_neighborhood",
    "diana_alpha",
    "ef21_sgd_noise_floor",
    "ef21_sgd_nu",
    "ef21_speedup",
    "ef21w_weights",
    "lyapunov0",
    "pp_constants",
    "rounds_dcgd",
    "rounds_ef21",
    "rounds_ef21_pl",
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
    "theta",
    "xi",
]
