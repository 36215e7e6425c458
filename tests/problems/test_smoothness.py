"""Exact smoothness constants: eigen-solvers, upper bounds, tightness, and the L ≤ L_AM order."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from shrinkgrad.problems import least_squares, load, logistic_regression, make_split
from shrinkgrad.problems import smoothness as S

DATASETS = ["a1a", "a9a", "australian", "australian_scale", "mushrooms", "phishing", "w1a", "w8a"]


def _random_blocks(seed: int, d: int = 40) -> tuple[sp.csr_matrix, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 60, size=9)
    A = sp.random(int(sizes.sum()), d, density=0.2, random_state=rng, format="csr")
    return A, np.concatenate([[0], np.cumsum(sizes)])


@pytest.mark.parametrize("seed", [0, 1])
def test_client_lambda_max_dense_batched_and_lanczos_agree_with_numpy(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    A, off = _random_blocks(seed)
    blocks = [A[off[i] : off[i + 1]].toarray() for i in range(len(off) - 1)]
    ref = np.array([np.linalg.eigvalsh(B.T @ B)[-1] for B in blocks])
    np.testing.assert_allclose(S.client_lambda_max(A, off, method="dense"), ref, rtol=1e-12)
    np.testing.assert_allclose(S.client_lambda_max(A, off, method="lanczos"), ref, rtol=1e-10)
    monkeypatch.setattr(S, "_BUDGET", 500)  # force many small batches
    np.testing.assert_allclose(S.client_lambda_max(A, off, method="auto"), ref, rtol=1e-12)
    dense = A.toarray()
    np.testing.assert_allclose(S.client_lambda_max(dense, off), ref, rtol=1e-12)


def test_weighted_gram_lambda_max_lanczos_vs_dense() -> None:
    A, _ = _random_blocks(3, d=60)
    w = np.random.default_rng(3).uniform(0.1, 2.0, A.shape[0])
    ref = np.linalg.eigvalsh(A.toarray().T @ (w[:, None] * A.toarray()))[-1]
    assert S.lambda_max_gram(A, w, method="dense") == pytest.approx(ref, rel=1e-12)
    assert S.lambda_max_gram(A, w, method="lanczos") == pytest.approx(ref, rel=1e-10)
    wide = A[:20]  # m < d: the m × m side is used
    ref_w = np.linalg.eigvalsh(wide.toarray().T @ wide.toarray())[-1]
    assert S.lambda_max_gram(wide, method="lanczos") == pytest.approx(ref_w, rel=1e-10)
    with pytest.raises(ValueError, match="method must be"):
        S.lambda_max_gram(A, method="power")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", DATASETS)
def test_L_le_L_AM_le_L_QM_le_L_max_on_every_bundled_dataset(name: str) -> None:
    p = logistic_regression(name, n_clients=min(100, load(name).n_samples // 10))
    assert p.L <= p.L_AM * (1 + 1e-12)
    assert p.L_AM <= p.L_QM <= p.L_max
    assert p.L_var == pytest.approx(p.L_QM**2 - p.L_AM**2, rel=1e-9, abs=1e-12)
    assert bool((p.L_i >= 2 * 0.1).all())  # every L_i contains the regularizer's 2λ


def test_L_is_the_averaged_curvature_not_the_pooled_gram() -> None:
    # unequal clients (the last one takes the remainder): L = λ_max((1/n) Σ A_iᵀA_i/(4 m_i)) + 2λ
    ds = load("a1a")
    p = logistic_regression("a1a", split=[np.arange(0, 100), np.arange(100, 1605)])
    assert p.n == 2
    blocks = [ds.X[:100].toarray(), ds.X[100:].toarray()]
    avg = sum(B.T @ B / (4 * B.shape[0]) for B in blocks) / 2
    L_ref = np.linalg.eigvalsh(avg)[-1] + 0.2
    pooled = np.linalg.eigvalsh(ds.X.toarray().T @ ds.X.toarray() / (4 * 1605))[-1] + 0.2
    assert float(p.L) == pytest.approx(L_ref, rel=1e-12)
    assert abs(p.L - pooled) > 1e-3 * p.L  # the pooled formula would be wrong here
    L_i_ref = [np.linalg.eigvalsh(B.T @ B)[-1] / (4 * B.shape[0]) + 0.2 for B in blocks]
    np.testing.assert_allclose(p.L_i.numpy(), L_i_ref, rtol=1e-12)


@pytest.mark.parametrize(
    ("factory", "kw"),
    [
        (logistic_regression, {"lam": 0.1, "reg": "nonconvex"}),
        (logistic_regression, {"lam": 0.1, "reg": "l2"}),
        (least_squares, {"lam": 0.0}),
        (least_squares, {"lam": 0.2, "reg": "nonconvex"}),
    ],
)
def test_L_i_bounds_random_pairs_and_is_tight_at_zero(factory, kw) -> None:  # type: ignore[no-untyped-def]
    p = factory("australian_scale", n_clients=6, split="shuffled[seed=1]", **kw)
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        x = torch.randn(p.d, dtype=torch.float64, generator=gen)
        y = x + torch.randn(p.d, dtype=torch.float64, generator=gen) * 0.5
        dG = (p.client_grads(x) - p.client_grads(y)).norm(dim=1)
        assert bool((dG <= p.L_i * (x - y).norm() * (1 + 1e-12)).all())
        assert float((p.grad(x) - p.grad(y)).norm()) <= p.L * float((x - y).norm()) * (1 + 1e-12)
    # tight: along the top eigenvector of client i's curvature at x = 0 the ratio reaches L_i
    ds = load("australian_scale")
    parts = make_split("shuffled[seed=1]")(ds, 6)
    eps = 1e-5
    for i in (0, 3):
        B = ds.X[parts[i]].toarray()
        v = torch.from_numpy(np.linalg.eigh(B.T @ B)[1][:, -1])
        zero = torch.zeros(p.d, dtype=torch.float64)
        ratio = float((p.client_grads(eps * v)[i] - p.client_grads(zero)[i]).norm()) / eps
        assert ratio == pytest.approx(float(p.L_i[i]), rel=1e-8)


def test_least_squares_solution_and_mu_are_exact() -> None:
    p = least_squares("australian_scale", n_clients=10)
    A = p.data_matrix()
    A = A.toarray() if sp.issparse(A) else A
    w = 1.0 / np.repeat(p.client_sizes.numpy(), p.client_sizes.numpy()) / p.n
    H = 2 * A.T @ (w[:, None] * A)
    assert p.mu == pytest.approx(np.linalg.eigvalsh(H)[0], rel=1e-10)
    assert float(p.L) == pytest.approx(np.linalg.eigvalsh(H)[-1], rel=1e-12)
    assert p.x_star is not None and p.f_star is not None
    assert float(p.grad(p.x_star).norm()) < 1e-12
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        delta = torch.randn(p.d, dtype=torch.float64, generator=gen)
        # exact quadratic: f(x* + δ) − f* = ½ δᵀ H δ
        gap = p.loss(p.x_star + delta) - p.f_star
        assert gap == pytest.approx(0.5 * float(delta @ torch.from_numpy(H) @ delta), rel=1e-9)


def test_l2_logistic_solution_is_optimal_to_machine_precision() -> None:
    from scipy.optimize import minimize

    p = logistic_regression("australian_scale", n_clients=10, reg="l2", lam=0.01)
    assert p.mu == 0.01 and p.x_star is not None and p.f_star is not None
    assert float(p.grad(p.x_star).norm()) < 1e-12

    def fg(x: np.ndarray) -> tuple[float, np.ndarray]:
        t = torch.from_numpy(x)
        return p.loss(t), p.grad(t).numpy()

    ref = minimize(
        fg, np.zeros(p.d), jac=True, method="L-BFGS-B", options={"gtol": 1e-11, "ftol": 0}
    )
    assert p.f_star <= ref.fun + 1e-15
    assert p.f_star == pytest.approx(ref.fun, rel=1e-10)
    assert p.f_lower == p.f_star


def test_nonconvex_problems_have_no_mu_or_solution() -> None:
    p = logistic_regression("australian_scale", n_clients=3)
    assert p.mu is None and p.f_star is None and p.x_star is None
