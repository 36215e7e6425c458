"""The exact Lyapunov decrease of methods.md §4 for EF21 + Top-k, checked at every round.

With θ = 1 − √(1 − α), ξ(α) = (1 + √(1 − α))/α − 1 and Φ^t = f(x^t) − f^inf + (γ/(2θ)) G^t:

* reloaded: γ = 1/(L + L_AM ξ), G_w^t = (1/n) Σ (L_AM/L_i) ‖g_i^t − ∇f_i(x^t)‖²  ([EFR] Thm 3);
* original: γ = 1/(L + L_QM ξ), G^t = (1/n) Σ ‖g_i^t − ∇f_i(x^t)‖²  ([EF21] Thm 1);

and Φ^{t+1} ≤ Φ^t − (γ/2) ‖∇f(x^t)‖² pointwise (Top-k is deterministic). The step sizes and the
potential are computed here from the closed forms, independently of shrinkgrad.theory.
"""

from __future__ import annotations

import math

import pytest
import torch
from methods_fixtures import LeastSquares, run

ROUNDS = 150


def xi(alpha: float) -> float:
    return (1.0 + math.sqrt(1.0 - alpha)) / alpha - 1.0


def potentials(
    p: LeastSquares, states: list[object], gamma: float, alpha: float, weighted: bool
) -> tuple[list[float], list[float]]:
    theta = 1.0 - math.sqrt(1.0 - alpha)
    L_AM = float(p.L_i.mean())
    coef = (L_AM / p.L_i).unsqueeze(1) if weighted else torch.ones(p.n, 1, dtype=torch.float64)
    phi, gns = [], []
    for s in states:
        x, g = s.x, s.clients.g  # type: ignore[attr-defined]
        G = float((coef * (g - p.client_grads(x)) ** 2).sum() / p.n)
        phi.append(p.loss(x) + gamma / (2 * theta) * G)
        gns.append(float(p.grad(x).norm() ** 2))
    return phi, gns


def violations(phi: list[float], gns: list[float], gamma: float) -> list[float]:
    """Φ^{t+1} − Φ^t + (γ/2)‖∇f(x^t)‖², relative to the size of the terms (≤ 0 is the claim)."""
    out = []
    for t in range(len(phi) - 1):
        slack = phi[t + 1] - phi[t] + gamma / 2 * gns[t]
        out.append(slack / (abs(phi[t]) + gamma * gns[t] + 1e-300))
    return out


CASES = [
    (LeastSquares(n=8, d=10, m=6, seed=1, spread=30.0), 1),
    (LeastSquares(n=5, d=6, m=4, seed=2, spread=5.0), 2),
    (LeastSquares(n=12, d=7, m=3, seed=3, spread=100.0), 1),
]


@pytest.mark.parametrize("init", ["full", "compressed", "zero"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("rule", ["reloaded", "original"])
def test_ef21_top_k_lyapunov_decrease_every_round(case: int, init: str, rule: str) -> None:
    p, k = CASES[case]
    alpha = k / p.d
    Lbar = float(p.L_i.mean()) if rule == "reloaded" else math.sqrt(float((p.L_i**2).mean()))
    gamma = 1.0 / (p.L + Lbar * xi(alpha))
    _, states = run(f"ef21[init={init}]", p, f"top_k[k={k}]", gamma, ROUNDS, x0=torch.ones(p.d))
    phi, gns = potentials(p, states, gamma, alpha, weighted=(rule == "reloaded"))
    worst = max(violations(phi, gns, gamma))
    assert worst <= 1e-12, f"Lyapunov decrease violated by {worst:.3g} (relative)"
    assert gns[-1] < gns[0]  # and the run makes progress


def test_ef21_theory_step_is_the_reloaded_rule_and_the_invariant_can_fail() -> None:
    """The library's ``rule=reloaded`` step equals the closed form, and the check has teeth:
    a step far above the rule breaks the decrease at some round."""
    p, k = CASES[0]
    alpha = k / p.d
    gamma = 1.0 / (p.L + float(p.L_i.mean()) * xi(alpha))
    bound, _ = run("ef21[rule=reloaded]", p, "top_k[k=1]", "theory", 0)
    assert bound.stepsize == pytest.approx(gamma, rel=1e-12)  # type: ignore[attr-defined]
    big = 40 * gamma
    _, states = run("ef21[init=zero]", p, "top_k[k=1]", big, ROUNDS, x0=torch.ones(p.d))
    phi, gns = potentials(p, states, big, alpha, weighted=True)
    assert max(violations(phi, gns, big)) > 1e-6
