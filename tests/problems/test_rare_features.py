"""The rare-feature constants c and L_+ against brute force and their defining inequality."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from shrinkgrad.problems import (
    Dataset,
    least_squares,
    logistic_regression,
    rare_features,
)


def _sparse_dataset() -> Dataset:
    rng = np.random.default_rng(0)
    X = sp.random(120, 30, density=0.05, random_state=rng, format="csr")
    y = np.where(rng.random(120) < 0.5, -1.0, 1.0)
    return Dataset.from_arrays(X, y, name="sparse_toy")


def test_c_counts_clients_per_feature_by_brute_force() -> None:
    ds = _sparse_dataset()
    p = least_squares(ds, n_clients=12)
    rf = rare_features(p)
    expected = [0] * 30
    X = ds.X.toarray()
    for i in range(12):
        rows = X[i * 10 : (i + 1) * 10]
        for k in range(30):
            expected[k] += int(np.any(rows[:, k] != 0))
    assert rf.clients_per_feature.tolist() == expected
    assert rf.c == max(expected) < 12
    # a regularizer touches every coordinate at every client
    q = least_squares(ds, n_clients=12, lam=0.1, reg="l2")
    assert rare_features(q).c == 12
    assert rare_features(q, include_regularizer=False).c == rf.c


def test_L_plus_exact_for_quadratics() -> None:
    ds = _sparse_dataset()
    p = least_squares(ds, n_clients=12, lam=0.3, reg="l2")
    rf = rare_features(p)
    assert rf.exact
    X = ds.X.toarray()
    Hs = [2 * X[i * 10 : (i + 1) * 10].T @ X[i * 10 : (i + 1) * 10] / 10 + 0.3 * np.eye(30)
          for i in range(12)]  # fmt: skip
    M = sum(H @ H for H in Hs) / 12
    assert rf.L_plus == pytest.approx(np.sqrt(np.linalg.eigvalsh(M)[-1]), rel=1e-12)
    # the defining inequality holds with equality along the top eigenvector of M
    v = torch.from_numpy(np.linalg.eigh(M)[1][:, -1])
    zero = torch.zeros(30, dtype=torch.float64)
    diff = p.client_grads(v) - p.client_grads(zero)
    assert float((diff**2).sum(1).mean().sqrt()) == pytest.approx(rf.L_plus, rel=1e-10)
    assert rf.L_plus <= p.L_QM


def test_L_plus_bound_for_logistic_holds_on_random_pairs() -> None:
    p = logistic_regression("australian_scale", n_clients=10)
    rf = rare_features(p)
    assert not rf.exact and rf.L_plus <= p.L_QM + 1e-12
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        x = torch.randn(p.d, dtype=torch.float64, generator=gen) * 2
        y = torch.randn(p.d, dtype=torch.float64, generator=gen) * 2
        lhs = float(((p.client_grads(x) - p.client_grads(y)) ** 2).sum(1).mean().sqrt())
        assert lhs <= rf.L_plus * float((x - y).norm()) * (1 + 1e-12)
