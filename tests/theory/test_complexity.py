"""Predicted rounds and bits, and the guarantee they encode on a real run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shrinkgrad import theory as T
from shrinkgrad.problems import logistic_regression


def test_rounds_formula() -> None:
    gamma, gap, eps, a = 0.01, 2.0, 1e-3, 0.1
    assert T.rounds_ef21(gamma, gap, eps, alpha=a) == math.ceil(2 * gap / (gamma * eps))
    G0 = 5.0
    phi0 = gap + gamma / (2 * T.theta(a)) * G0
    assert T.lyapunov0(gamma, gap, a, G0) == pytest.approx(phi0)
    assert T.rounds_ef21(gamma, gap, eps, alpha=a, G0=G0) == math.ceil(2 * phi0 / (gamma * eps))
    floor = 4e-4
    assert T.rounds_ef21(gamma, gap, eps, alpha=a, noise_floor=floor) == math.ceil(
        2 * gap / (gamma * (eps - floor))
    )
    with pytest.raises(ValueError, match="noise floor"):
        T.rounds_ef21(gamma, gap, eps, noise_floor=eps)


def test_pl_rounds_and_bits() -> None:
    gamma, mu, gap, eps = 0.1, 0.5, 3.0, 1e-6
    T_pl = T.rounds_ef21_pl(gamma, mu, gap, eps)
    assert (1 - gamma * mu) ** T_pl * gap <= eps < (1 - gamma * mu) ** (T_pl - 1) * gap
    assert T.rounds_ef21_pl(gamma, mu, 1e-9, 1e-6) == 0
    with pytest.raises(ValueError, match="must be < 1"):
        T.rounds_ef21_pl(3.0, 1.0, gap, eps)
    assert T.bits_to_accuracy(10, 36.0, initial_bits=448.0) == 808.0
    with pytest.raises(ValueError, match="rounds"):
        T.bits_to_accuracy(-1, 36.0)


def test_predicted_rounds_are_enough_for_ef21_with_top1() -> None:
    """Run EF21 (Top-1, g_i⁰ = ∇f_i(x⁰)) for the predicted T: min_t ‖∇f(x^t)‖² ≤ ε."""
    p = logistic_regression("australian_scale", n_clients=5)
    alpha = 1 / p.d
    gamma = T.stepsize_ef21_reloaded(p.L, p.L_AM, alpha)
    x = torch.zeros(p.d, dtype=torch.float64)
    gap = p.loss(x) - 0.0  # f ≥ 0: f(x⁰) bounds f(x⁰) − f^inf
    eps = 0.2 * float((p.grad(x) ** 2).sum())
    rounds = T.rounds_ef21(gamma, gap, eps, alpha=alpha)
    assert 100 < rounds < 5000
    g_i = p.client_grads(x).numpy()
    best = math.inf
    for _ in range(rounds):
        best = min(best, float((p.grad(x) ** 2).sum()))
        x = x - gamma * torch.from_numpy(g_i.mean(0))
        diff = p.client_grads(x).numpy() - g_i
        j = np.argmax(np.abs(diff), axis=1)
        g_i[np.arange(p.n), j] += diff[np.arange(p.n), j]
    assert best <= eps


def _dcgd_rounds_by_scan(gamma: float, gap: float, eps: float, a: float) -> int:
    """The smallest T with 2(1 + a)^T δ⁰/(γT) ≤ ε, by a plain scan (independent of the search)."""
    T = 1
    while 2 * (1 + a) ** T * gap / (gamma * T) > eps:
        T += 1
    return T


def test_dcgd_rounds_closed_form_on_a_hand_case() -> None:
    # γ = 0.1, L = 1, L_max = 2, ω = 4, n = 8: a = Lγ²ωL_max/n = 0.01; δ⁰ = 1, ε = 1:
    # 2·1.01^T/(0.1·T) ≤ 1 first at T = 26 (T = 25: 20·1.01²⁵ = 25.65 > 25; T = 26: 25.9 ≤ 26)
    kw = {"L": 1.0, "L_max": 2.0, "omega": 4.0, "n": 8}
    assert T.rounds_dcgd(0.1, 1.0, 1.0, **kw) == 26
    assert 20 * 1.01**25 > 25 and 20 * 1.01**26 <= 26
    for eps in (0.9, 0.7, 0.55):
        assert T.rounds_dcgd(0.1, 1.0, eps, **kw) == _dcgd_rounds_by_scan(0.1, 1.0, eps, 0.01)
    # ω = 0 is GD: ⌈2δ⁰/(γε)⌉, the EF21 (α = 1) count
    gamma, gap, eps = 0.01, 2.0, 1e-3
    zero = {"L": 50.0, "L_max": 70.0, "omega": 0.0, "n": 3}
    assert T.rounds_dcgd(gamma, gap, eps, **zero) == math.ceil(2 * gap / (gamma * eps))
    assert T.rounds_dcgd(gamma, gap, eps, **zero) == T.rounds_ef21(gamma, gap, eps)
    assert T.rounds_dcgd(0.1, 0.0, 1.0, **kw) == 0  # already at f_low


def test_dcgd_rounds_refuse_what_the_bound_cannot_give() -> None:
    kw = {"L": 1.0, "L_max": 2.0, "omega": 4.0, "n": 8}
    # the bound's smallest value, at T = 1/log(1.01) ≈ 100.5: 20·1.01^T/T ≈ 0.5413
    lowest = min(20 * 1.01**t / t for t in range(1, 400))
    assert 0.54 < lowest < 0.542
    assert T.rounds_dcgd(0.1, 1.0, 0.542, **kw) == _dcgd_rounds_by_scan(0.1, 1.0, 0.542, 0.01)
    with pytest.raises(ValueError, match=r"^no number of rounds guarantees .*") as e:
        T.rounds_dcgd(0.1, 1.0, 0.54, **kw)
    # the step it suggests does reach ε
    suggested = float(str(e.value).split("use a step size <= ")[1].split()[0])
    assert 0 < suggested < 0.1
    assert T.rounds_dcgd(suggested, 1.0, 0.54, **kw) == _dcgd_rounds_by_scan(
        suggested, 1.0, 0.54, 1.0 * suggested**2 * 4.0 * 2.0 / 8
    )
    with pytest.raises(ValueError, match=r"exceeds 1/L = 1: the DCGD rate needs γ ≤ 1/L"):
        T.rounds_dcgd(1.5, 1.0, 1.0, **kw)
    with pytest.raises(ValueError, match="n \\(number of clients\\) must be an integer"):
        T.rounds_dcgd(0.1, 1.0, 1.0, L=1.0, L_max=2.0, omega=4.0, n=0)
