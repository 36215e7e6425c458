"""The synthetic heterogeneous least-squares generator: requested L_var, exact constants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shrinkgrad.problems import synthetic_L_i, synthetic_least_squares
from shrinkgrad.theory import L_var


@pytest.mark.parametrize("target", [5.4e3, 4.4e6])
def test_hits_requested_L_var_within_one_percent_with_2000_clients(target: float) -> None:
    # the range of [EFR] Fig. 3 (n = 2000 clients)
    p = synthetic_least_squares(n_clients=2000, L_var=target, seed=1)
    assert p.n == 2000
    assert abs(p.L_var - target) <= 0.01 * target
    assert p.L_var == pytest.approx(target, rel=1e-9)  # in fact exact up to rounding
    np.testing.assert_allclose(p.L_i.numpy(), synthetic_L_i(2000, target), rtol=1e-10)


def test_profile_has_the_requested_variance_and_minimum() -> None:
    L = synthetic_L_i(100, 250.0, L_min=3.0, shape=5.0)
    assert L.min() == 3.0 and L_var(L) == pytest.approx(250.0, rel=1e-12)
    assert np.all(np.diff(L) >= 0)
    np.testing.assert_array_equal(synthetic_L_i(5, 0.0, L_min=2.0), np.full(5, 2.0))


def test_constants_and_solution_are_exact() -> None:
    p = synthetic_least_squares(n_clients=50, d=8, m=12, L_var=100.0, seed=2)
    A = p.data_matrix()
    H = 2 * A.T @ A / (12 * 50)  # equal client sizes: the average of the client Hessians
    evals = np.linalg.eigvalsh(H)
    assert float(p.L) == pytest.approx(evals[-1], rel=1e-12)
    assert p.mu == pytest.approx(evals[0], rel=1e-10) and p.mu > 0
    assert p.x_star is not None and p.f_star is not None
    assert float(p.grad(p.x_star).norm()) <= 1e-10 * p.L
    # f* is the noise level: f(x_true) ≥ f*
    x_true = p.x_true  # type: ignore[attr-defined]
    assert p.f_star <= p.loss(x_true)
    L_i = [np.linalg.eigvalsh(2 * B.T @ B / 12)[-1] for B in A.reshape(50, 12, 8)]
    np.testing.assert_allclose(p.L_i.numpy(), L_i, rtol=1e-10)


def test_nonconvex_variant_includes_the_regularizer() -> None:
    p = synthetic_least_squares(n_clients=20, d=5, m=5, L_var=10.0, L_min=1.0, lam=0.1, seed=0)
    assert p.name == "synthetic_least_squares_nonconvex"
    assert p.mu is None and p.f_star is None
    np.testing.assert_allclose(p.L_i.numpy(), synthetic_L_i(20, 10.0), rtol=1e-10)
    with pytest.raises(ValueError, match="exceed the regularizer's curvature"):
        synthetic_least_squares(n_clients=20, L_min=0.1, lam=0.1)


def test_explicit_L_i_and_determinism() -> None:
    L = np.array([1.0, 2.0, 50.0, 7.0])
    p = synthetic_least_squares(n_clients=4, d=3, m=6, L_i=L, seed=5)
    np.testing.assert_allclose(p.L_i.numpy(), L, rtol=1e-10)
    q = synthetic_least_squares(n_clients=4, d=3, m=6, L_i=L, seed=5)
    r = synthetic_least_squares(n_clients=4, d=3, m=6, L_i=L, seed=6)
    x = torch.ones(3, dtype=torch.float64)
    assert torch.equal(p.client_grads(x), q.client_grads(x))
    assert not torch.equal(p.client_grads(x), r.client_grads(x))
    with pytest.raises(ValueError, match="L_i has 4 values but n_clients=5"):
        synthetic_least_squares(n_clients=5, L_i=L)
