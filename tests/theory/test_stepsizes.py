"""Step-size rules: formulas, reductions between rules, optimality of the free parameters, and
exact expectations showing the derived (D) rules are valid (and, where claimed, tight)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from shrinkgrad import theory as T
from shrinkgrad.problems import logistic_regression, synthetic_least_squares
from shrinkgrad.theory.stepsizes import _pp_best_ratio


def test_ef21_rules_formulas_and_order() -> None:
    L, A, Q, a = 2.0, 3.0, 7.0, 0.05
    assert T.stepsize_ef21(L, Q, a) == 1 / (L + Q * T.xi(a))
    assert T.stepsize_ef21_reloaded(L, A, a) == 1 / (L + A * T.xi(a))
    assert T.stepsize_ef21w is T.stepsize_ef21_reloaded
    assert T.stepsize_ef21_reloaded(L, A, a) > T.stepsize_ef21(L, Q, a)
    assert T.stepsize_ef21(L, Q, 1.0) == 1 / L  # identity compressor: gradient descent


def test_predicted_speedup_of_the_methods_md_example() -> None:
    # 999 clients with L_i = 1 and one with 1000: "a ~16× larger step" under aggressive compression
    L_i = [1.0] * 999 + [1000.0]
    ratio = T.ef21_speedup(1.0, T.L_AM(L_i), T.L_QM(L_i), 1e-6)
    assert ratio == pytest.approx(T.L_QM(L_i) / T.L_AM(L_i), rel=1e-5)
    assert 15.5 < ratio < 16.5
    assert T.ef21_speedup(1.0, 2.0, 2.0, 0.1) == pytest.approx(1.0)


def test_pl_rules_take_the_minimum_of_both_terms() -> None:
    L, Q, a = 1.0, 4.0, 0.1
    first = 1 / (L + Q * math.sqrt(2 * T.beta(a) / T.theta(a)))
    assert T.stepsize_ef21_pl(L, Q, a, mu=1e-9) == pytest.approx(first, rel=1e-14)
    assert T.stepsize_ef21_pl(L, Q, a, mu=1e3) == pytest.approx(T.theta(a) / 2e3, rel=1e-14)
    assert T.stepsize_ef21w_pl(L, 2.0, a, mu=1e-9) > T.stepsize_ef21_pl(L, Q, a, mu=1e-9)
    with pytest.raises(ValueError, match="mu"):
        T.stepsize_ef21_pl(L, Q, a, mu=0.0)


def test_pp_with_full_participation_is_ef21() -> None:
    for a in (0.01, 0.3, 1.0):
        assert T.stepsize_ef21_pp(1.5, 2.0, a, 1.0) == pytest.approx(T.stepsize_ef21(1.5, 2.0, a))
        assert T.stepsize_ef21w_pp(1.5, 2.0, a, [1.0, 1.0]) == pytest.approx(
            T.stepsize_ef21_reloaded(1.5, 2.0, a)
        )


@pytest.mark.parametrize("alpha", [0.003, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_pp_homogeneous_optimum_is_xi_of_alpha_p(alpha: float, p: float) -> None:
    """(D) the optimum of the [BW] form over s, ρ is ξ(αp)² (numerical optimum vs closed form)."""
    numeric = _pp_best_ratio(alpha, p, p)
    assert numeric == pytest.approx(T.xi(alpha * p) ** 2, rel=1e-7)
    assert T.stepsize_ef21_pp(1.0, 1.0, alpha, p) == pytest.approx(
        1 / (1 + T.xi(alpha * p)), rel=1e-14
    )


@pytest.mark.parametrize("alpha", [1e-200, 1e-300])
def test_pp_homogeneous_rule_holds_for_tiny_alpha(alpha: float) -> None:
    """ξ(αp)² overflows for αp < 1e-154; the rule is 1/(L + L̃ ξ(αp)), EF21's with α' = αp."""
    got = T.stepsize_ef21_pp(2.0, 3.0, alpha, 0.5)
    assert got == T.stepsize_ef21(2.0, 3.0, alpha * 0.5)
    assert 0.0 < got < 1e-150
    assert T.stepsize_ef21w_pp(2.0, 3.0, alpha, [0.5, 0.5]) == got


def test_pp_optimiser_beats_a_grid_and_explicit_parameters_follow_the_formula() -> None:
    a, pmin, pmax = 0.4, 0.6, 0.8
    best = _pp_best_ratio(a, pmin, pmax)
    grid = math.inf
    for s in np.geomspace(1e-3, a / (1 - a) * 0.999, 200):
        for rho in np.geomspace(1e-4, 10, 200):
            th_p, b = T.pp_constants(a, [pmin, pmax], s, rho)
            if th_p > 0:
                grid = min(grid, b / th_p)
    assert best <= grid * (1 + 1e-9) and best >= grid * (1 - 1e-2)
    s, rho = 0.2, 0.05
    theta = 1 - (1 + s) * (1 - a)
    beta = (1 + 1 / s) * (1 - a)
    th_p = rho * pmin + theta * pmax - rho - (pmax - pmin)
    B = beta * pmax + (1 + 1 / rho) * (1 - pmin)
    got = T.stepsize_ef21_pp(2.0, 3.0, a, [pmin, pmax], s=s, rho=rho)
    assert got == pytest.approx(1 / (2.0 + 3.0 * math.sqrt(B / th_p)), rel=1e-14)
    assert got <= T.stepsize_ef21_pp(2.0, 3.0, a, [pmin, pmax])


def test_pp_errors() -> None:
    with pytest.raises(ValueError, match=r"α·p_max > p_max − p_min"):
        T.stepsize_ef21_pp(1.0, 1.0, 0.01, [0.1, 0.9])
    with pytest.raises(ValueError, match="give both"):
        T.stepsize_ef21_pp(1.0, 1.0, 0.5, 0.5, s=1.0)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        T.stepsize_ef21_pp(1.0, 1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="θ_p"):
        T.stepsize_ef21_pp(1.0, 1.0, 0.5, 0.5, s=0.1, rho=10.0)


def test_sgd_rules_reduce_to_the_deterministic_ones_without_noise() -> None:
    L, A, Q = 1.0, 2.0, 5.0
    for a in (0.01, 0.2, 1.0):
        assert T.stepsize_ef21_sgd(L, Q, a) == T.stepsize_ef21(L, Q, a)
        assert T.stepsize_ef21_sgd(L, Q, a, sigma2=0.0) == T.stepsize_ef21(L, Q, a)
        assert T.stepsize_ef21w_sgd(L, A, a) == T.stepsize_ef21_reloaded(L, A, a)
        assert T.ef21_sgd_noise_floor(a, 0.0) == 0.0
    # with noise the default ν halves the effective α
    assert T.stepsize_ef21_sgd(L, Q, 0.2, sigma2=1.0) == pytest.approx(T.stepsize_ef21(L, Q, 0.1))
    assert T.stepsize_ef21w_sgd(L, A, 1.0, sigma2=3.0) == 1 / L
    assert T.ef21_sgd_noise_floor(1.0, 3.0) == 3.0  # no compression: the plain SGD floor σ²
    with pytest.raises(ValueError, match=r"nu must be in \[0"):
        T.stepsize_ef21_sgd(L, Q, 0.2, nu=0.5)


def test_sgd_rule_is_the_optimal_young_split() -> None:
    """(D) min over s of β̂/θ̂ (1 − θ̂ = u(1 + s), β̂ = u(1 + 1/s), u = (1 + ν)(1 − α)) is ξ(α_ν)²."""
    a, nu = 0.3, 0.2
    u = (1 + nu) * (1 - a)
    s = np.geomspace(1e-4, (1 - u) / u * 0.9999, 200001)
    ratio = (u * (1 + 1 / s)) / (1 - u * (1 + s))
    xi_nu = T.xi(1 - u)
    assert float(ratio.min()) == pytest.approx(xi_nu**2, rel=1e-8)
    assert T.stepsize_ef21_sgd(1.0, 2.0, a, nu=nu) == pytest.approx(1 / (1 + 2 * xi_nu))
    floor = T.ef21_sgd_noise_floor(a, 0.7, nu=nu)
    assert floor == pytest.approx((u + 1 + 1 / nu) * 0.7 / (1 - math.sqrt(u)), rel=1e-14)


def test_rare_features_rule() -> None:
    a = 0.05
    assert T.stepsize_rare_features(1.0, 4.0, 10, 10, a) == T.stepsize_ef21(1.0, 4.0, a)
    assert T.stepsize_rare_features(1.0, 4.0, 0, 10, a) == 1.0
    assert T.stepsize_rare_features(1.0, 4.0, 1, 100, a) == pytest.approx(1 / (1 + 0.4 * T.xi(a)))
    with pytest.raises(ValueError, match="c "):
        T.stepsize_rare_features(1.0, 4.0, 11, 10, a)


def test_delayed_rule() -> None:
    assert T.stepsize_delayed(4.0, 0) == 0.25  # τ = 0: 1/L
    assert T.stepsize_delayed(1.0, 1) == pytest.approx(2 / (1 + math.sqrt(17)))
    steps = [T.stepsize_delayed(1.0, t) for t in range(10)]
    assert all(x > y for x, y in itertools.pairwise(steps))
    assert steps[9] == pytest.approx(2 / (1 + math.sqrt(1 + 8 * 90)))
    with pytest.raises(ValueError, match="tau"):
        T.stepsize_delayed(1.0, -1)
    with pytest.raises(ValueError, match="L must be"):
        T.stepsize_delayed(0.0, 1)


def test_unbiased_single_bound_is_exactly_the_supremum() -> None:
    """f = (L/2)‖x‖², Q = rand-1 scaled by d (ω = d − 1): E f(x − γQ(∇f)) by enumeration."""
    L, d = 3.0, 5
    omega = d - 1
    x = np.array([1.0, -2.0, 0.5, 3.0, -1.0])

    def expected_f(gamma: float) -> float:
        g = L * x
        outs = []
        for j in range(d):  # each coordinate kept with probability 1/d, scaled by d
            q = np.zeros(d)
            q[j] = d * g[j]
            outs.append(0.5 * L * float((x - gamma * q) @ (x - gamma * q)))
        return float(np.mean(outs))

    f0 = 0.5 * L * float(x @ x)
    bound = T.stepsize_unbiased_single(L, omega)
    assert bound == 2 / (L * d)
    assert expected_f(bound) == pytest.approx(f0, rel=1e-12)  # no decrease at the bound
    assert expected_f(0.999 * bound) < f0 < expected_f(1.001 * bound)
    gammas = np.linspace(0.01, 0.99, 99) * bound
    best = gammas[np.argmin([expected_f(g) for g in gammas])]
    assert best == pytest.approx(T.stepsize_unbiased_single_optimal(L, omega), rel=0.02)


def test_dcgd_expected_smoothness_and_one_step_contraction_exactly() -> None:
    """(D) E‖ĝ‖² ≤ 2A(f(x) − f*) + 2ωσ*/n with A = 1/γ, on a convex least-squares problem.

    Independent rand-1 compressors (scaled by d, ω = d − 1) give exactly
    E‖ĝ‖² = ‖∇f‖² + (ω/n²) Σ‖∇f_i‖².
    """
    p = synthetic_least_squares(n_clients=8, d=4, m=6, L_var=30.0, seed=3)
    n, d, omega = p.n, p.d, p.d - 1
    assert p.x_star is not None and p.f_star is not None and p.mu is not None
    gamma = T.stepsize_dcgd(p.L, p.L_max, omega, n)
    sigma_star = float((p.client_grads(p.x_star) ** 2).sum(1).mean())
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = p.x_star + torch.randn(d, dtype=torch.float64, generator=gen) * 3
        G = p.client_grads(x)
        g = G.mean(0)
        second = float(g @ g) + omega / n**2 * float((G**2).sum())
        assert second <= 2 / gamma * (p.loss(x) - p.f_star) + 2 * omega * sigma_star / n + 1e-9
        dist = float(((x - p.x_star) ** 2).sum())
        after = dist - 2 * gamma * float(g @ (x - p.x_star)) + gamma**2 * second
        assert after <= (1 - gamma * p.mu) * dist + gamma**2 * 2 * omega * sigma_star / n + 1e-9
    assert T.stepsize_dcgd(2.0, 5.0, 0.0, 3) == 0.5
    assert T.dcgd_neighborhood(0.1, 3.0, 4, 0.5, 2.0) == pytest.approx(0.1 * 2 * 3 * 2 / (4 * 0.5))


def _top1(V: np.ndarray) -> np.ndarray:
    out = np.zeros_like(V)
    j = np.argmax(np.abs(V), axis=1)
    out[np.arange(V.shape[0]), j] = V[np.arange(V.shape[0]), j]
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_ef21_lyapunov_decrease_with_the_theory_step(weighted: bool) -> None:
    """methods.md §4 invariant (D): Φ^{t+1} ≤ Φ^t − (γ/2)‖∇f(x^t)‖² pointwise for Top-1.

    Uses the problem's exact L, L_i and the rules (reloaded with G_w, or original with G), so a
    wrong constant or rule breaks it. f^inf cancels in the differences.
    """
    p = logistic_regression("australian_scale", n_clients=10, split="heterogeneous_smoothness")
    d, alpha = p.d, 1 / p.d
    L_i = p.L_i.numpy()
    if weighted:
        gamma, w = T.stepsize_ef21_reloaded(p.L, p.L_AM, alpha), p.L_AM / L_i
    else:
        gamma, w = T.stepsize_ef21(p.L, p.L_QM, alpha), np.ones(p.n)
    th = T.theta(alpha)
    x = torch.full((d,), 0.5, dtype=torch.float64)
    g_i = np.zeros((p.n, d))  # g_i⁰ = 0: G⁰ > 0, a harder start
    grads = p.client_grads(x).numpy()

    def phi(f: float, gr: np.ndarray, gi: np.ndarray) -> float:
        return f + gamma / (2 * th) * float((w * ((gi - gr) ** 2).sum(1)).mean())

    for _ in range(60):
        before = phi(p.loss(x), grads, g_i)
        grad_norm2 = float((grads.mean(0) ** 2).sum())
        x = x - gamma * torch.from_numpy(g_i.mean(0))
        grads = p.client_grads(x).numpy()
        g_i = g_i + _top1(grads - g_i)
        after = phi(p.loss(x), grads, g_i)
        assert after <= before - gamma / 2 * grad_norm2 + 1e-14 * abs(before)


def test_theory_functions_accept_numpy_and_torch_scalars() -> None:
    assert T.stepsize_ef21(np.float64(1.0), torch.tensor(2.0), np.float32(0.5)) == pytest.approx(
        T.stepsize_ef21(1.0, 2.0, 0.5)
    )
    with pytest.raises(ValueError, match="L must be a finite number"):
        T.stepsize_ef21(float("inf"), 1.0, 0.5)
    with pytest.raises(ValueError, match="denominator"):
        T.stepsize_ef21(0.0, 0.0, 0.5)


# --------------------------------------------------------------------------------------------
# DIANA (D) and EF21+
# --------------------------------------------------------------------------------------------
def _diana_lyapunov_gap(seed: int, d: int = 3) -> float:
    """E Φ^{k+1} − Φ^k + (γ/2)‖∇f(x^k)‖² for one DIANA step at the rule's γ, with the exact
    expectation over every joint draw of rand-1 (Q(v) = d v_j e_j, j uniform; ω = d − 1) on two
    heterogeneous quadratics f_i(x) = ½ xᵀH_i x − b_iᵀx from a random state (x, h_1, h_2)."""
    import itertools

    rng = np.random.default_rng(seed)
    n = 2
    Hs, bs = [], []
    for _ in range(n):
        M = rng.standard_normal((d, d)) * rng.uniform(0.3, 3.0)
        Hs.append(M @ M.T)
        bs.append(rng.standard_normal(d))
    L = float(np.linalg.eigvalsh(sum(Hs) / n)[-1])
    L_QM = float(np.sqrt(np.mean([np.linalg.eigvalsh(H)[-1] ** 2 for H in Hs])))
    omega = d - 1.0
    alpha = 1.0 / (1.0 + omega)
    gamma = T.stepsize_diana(L, L_QM, omega, n)
    # the Lyapunov weight of the derivation, with the optimal Young parameter 1 + s = 1/√(1 − α)
    s = 1.0 / np.sqrt(1.0 - alpha) - 1.0
    theta, beta = 1.0 - (1.0 + s) * (1.0 - alpha), 1.0 + 1.0 / s
    c = L * gamma**2 * omega / (2 * n * (theta - beta * L_QM**2 * gamma**2 * omega / n))

    def f(x: np.ndarray) -> float:
        return float(np.mean([0.5 * x @ H @ x - b @ x for H, b in zip(Hs, bs, strict=True)]))

    def grads(x: np.ndarray) -> list[np.ndarray]:
        return [H @ x - b for H, b in zip(Hs, bs, strict=True)]

    def lyap(x: np.ndarray, h: list[np.ndarray]) -> float:
        errors = [np.sum((hi - g) ** 2) for hi, g in zip(h, grads(x), strict=True)]
        return f(x) + c * float(np.mean(errors))

    x = rng.standard_normal(d) * 2
    h = [rng.standard_normal(d) * 3 for _ in range(n)]
    G = grads(x)
    expected = 0.0
    for js in itertools.product(range(d), repeat=n):
        qs = []
        for i, j in enumerate(js):
            q = np.zeros(d)
            q[j] = d * (G[i][j] - h[i][j])
            qs.append(q)
        g_hat = np.mean(h, axis=0) + np.mean(qs, axis=0)
        x_new = x - gamma * g_hat
        h_new = [hi + alpha * q for hi, q in zip(h, qs, strict=True)]
        expected += lyap(x_new, h_new) / d**n
    grad_f = np.mean(G, axis=0)
    return expected - lyap(x, h) + 0.5 * gamma * float(grad_f @ grad_f)


@pytest.mark.parametrize("seed", range(12))
def test_diana_rule_decreases_the_lyapunov_function_exactly_in_expectation(seed: int) -> None:
    gap = _diana_lyapunov_gap(seed)
    assert gap <= 1e-9, f"E Φ⁺ − Φ + (γ/2)‖∇f‖² = {gap} > 0"


def test_diana_rule_closed_form_and_limits() -> None:
    L, Q, n = 2.0, 5.0, 10
    for omega in (0.5, 3.0, 99.0):
        alpha = 1 / (1 + omega)
        g = T.stepsize_diana(L, Q, omega, n)
        K = np.sqrt(omega / n) * Q / (1 - np.sqrt(1 - alpha))
        assert L * g + (K * g) ** 2 == pytest.approx(1.0, rel=1e-13)  # the root of the condition
        assert g < T.stepsize_diana(L, Q, omega, 10 * n)  # more clients average the noise
        assert T.stepsize_diana(L, Q, omega, n, alpha / 2) < g  # a smaller α is slower
    assert T.stepsize_diana(L, Q, 0.0, n) == 1 / L  # no compression: gradient descent
    assert T.diana_alpha(3.0) == 0.25 and T.diana_alpha(3.0, 0.1) == 0.1
    with pytest.raises(ValueError, match=r"alpha ≤ 1/\(1 \+ ω\) = 0.25"):
        T.stepsize_diana(L, Q, 3.0, n, 0.5)
    with pytest.raises(ValueError, match=r"n \(number of clients\) must be an integer"):
        T.stepsize_diana(L, Q, 3.0, 0)


def test_ef21_plus_rule_is_the_ef21_rule() -> None:
    for a in (1 / 123, 0.3, 1.0):
        assert T.stepsize_ef21_plus(1.5, 4.0, a) == T.stepsize_ef21(1.5, 4.0, a)
