"""θ, β, ξ and the smoothness means: pinned published values and defining identities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shrinkgrad import theory as T


def test_pinned_xi_values() -> None:
    assert T.xi(1 / 300) == pytest.approx(598.4996, abs=5e-5)  # issue #3
    # methods.md §4, Top-1 on d = 14, 112, 123 (australian, mushrooms, a9a)
    assert T.xi(1 / 14) == pytest.approx(26.49, abs=5e-3)
    assert T.xi(1 / 112) == pytest.approx(222.5, abs=5e-2)
    assert T.xi(1 / 123) == pytest.approx(244.5, abs=5e-2)
    assert T.xi(1.0) == 0.0 and T.beta(1.0) == 0.0 and T.theta(1.0) == 1.0


def test_pinned_smoothness_means() -> None:
    L = [1, 1, 1, 100]
    assert T.L_AM(L) == 25.75
    assert T.L_QM(L) == pytest.approx(50.0075, abs=5e-5)
    assert T.L_max(L) == 100.0
    assert T.L_var(L) == pytest.approx(T.L_QM(L) ** 2 - T.L_AM(L) ** 2, rel=1e-12)
    # methods.md §4: 999 clients with L_i = 1 and one with 1000
    L2 = [1.0] * 999 + [1000.0]
    assert T.L_AM(L2) == pytest.approx(1.999, rel=1e-12)
    assert T.L_QM(L2) == pytest.approx(31.6386, abs=1e-4)


@given(st.floats(min_value=1e-9, max_value=1.0))
def test_theta_beta_xi_match_their_definitions(alpha: float) -> None:
    s = math.sqrt(1 - alpha)
    th, be = T.theta(alpha), T.beta(alpha)
    assert th == pytest.approx(1 - s, rel=1e-9, abs=1e-15)
    if alpha < 1:
        assert be == pytest.approx((1 - alpha) / (1 - s), rel=1e-6)  # cancellation in 1 − s
        assert T.xi(alpha) == pytest.approx(math.sqrt(be / th), rel=1e-12)
    assert T.xi(alpha) == pytest.approx((1 + s) / alpha - 1, rel=1e-6, abs=1e-12)


def test_xi_is_accurate_for_tiny_alpha() -> None:
    # ξ(α) = s(1 + s)/α ≈ 2/α − 3/2 − α/8 for small α (series of the closed form)
    a = 1e-12
    assert T.xi(a) == pytest.approx(2 / a - 1.5, rel=1e-15)


@given(st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=1, max_size=30))
def test_means_are_ordered(L: list[float]) -> None:
    assert T.L_AM(L) <= T.L_QM(L) * (1 + 1e-12) + 1e-300
    assert T.L_QM(L) <= T.L_max(L) * (1 + 1e-12)
    assert T.L_var(L) >= 0


def test_ef21w_weights() -> None:
    w = T.ef21w_weights(torch.tensor([1.0, 3.0, 4.0]))
    torch.testing.assert_close(w, torch.tensor([0.125, 0.375, 0.5], dtype=torch.float64))
    w2 = T.ef21w_weights(np.array([2.0, 2.0]))
    assert float(w2.sum()) == 1.0 and w2.dtype == torch.float64
    with pytest.raises(ValueError, match="Σ L_i > 0"):
        T.ef21w_weights([0.0, 0.0])


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_alpha_out_of_range_is_an_error(bad: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        T.xi(bad)


def test_invalid_smoothness_inputs() -> None:
    with pytest.raises(ValueError, match="at least one"):
        T.L_AM([])
    with pytest.raises(ValueError, match="finite and non-negative"):
        T.L_QM([1.0, -2.0])
    with pytest.raises(TypeError, match="alpha must be a number"):
        T.theta("0.5")  # type: ignore[arg-type]
