"""Issue 12.2: nothing in ``theory`` (and the set-up it relies on) is quadratic in d.

A sparse LIBSVM file may declare d = 2·10⁹ features in a few bytes. The constants L, L_i, c and
L_+ must come out of the sparsity pattern in O(nnz) memory, equal to what a dense computation
gives on the same data with its used features relabelled into a small d; a declared dimension
that cannot be held says so in one line before anything d-sized is allocated.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shrinkgrad.cli import main
from shrinkgrad.compressors import make_compressor
from shrinkgrad.problems import (
    DatasetError,
    least_squares,
    load,
    logistic_regression,
    rare_features,
)
from shrinkgrad.problems import memory as M
from shrinkgrad.problems import smoothness as S
from shrinkgrad.theory import stepsize_rare_features, xi

HUGE_D = 2_000_000_000  # a float64 d-vector is 16 GB, a d × d matrix 3.2·10¹⁹ bytes
N_SAMPLES, N_CLIENTS, POOL = 60, 6, 40


def _samples(seed: int = 0) -> list[tuple[int, list[int], list[float]]]:
    """Labels and sparse rows drawing from a pool of POOL features; client j (rows 10j..10j+9)
    mostly uses its own slice of the pool, so features are rare (c < n)."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(N_SAMPLES):
        client = j // (N_SAMPLES // N_CLIENTS)
        own = np.arange(client * 5, client * 5 + 10) % POOL
        k = int(rng.integers(1, 5))
        cols = np.unique(rng.choice(own, size=k, replace=False))
        vals = np.round(rng.uniform(0.5, 2.0, size=cols.size), 3)
        out.append((1 if rng.random() < 0.5 else -1, cols.tolist(), vals.tolist()))
    out[0] = (out[0][0], [*out[0][1], POOL], [*out[0][2], 1.5])  # one more feature: the last
    return out


def _write(path: Path, index_of: dict[int, int]) -> Path:
    with open(path, "w") as fh:
        for label, cols, vals in _samples():
            toks = " ".join(f"{index_of[c]}:{v}" for c, v in zip(cols, vals, strict=True))
            fh.write(f"{label} {toks}\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same data twice: features spread up to index 2·10⁹, and relabelled to 1..POOL+1."""
    tmp = tmp_path_factory.mktemp("hd")
    spread = np.linspace(3, HUGE_D, POOL + 1).astype(np.int64)
    huge = _write(tmp / "huge.svm", {c: int(spread[c]) for c in range(POOL + 1)})
    small = _write(tmp / "small.svm", {c: c + 1 for c in range(POOL + 1)})
    return huge, small


def _dense_reference(path: Path) -> dict[str, Any]:
    """Every constant from dense d × d matrices (small d only), independently of the library."""
    ds = load(path)
    X = ds.X.toarray()
    blocks = [X[i * 10 : (i + 1) * 10] for i in range(N_CLIENTS)]
    lam = 0.1
    L_i = [np.linalg.eigvalsh(B.T @ B)[-1] / (4 * 10) + 2 * lam for B in blocks]
    L = np.linalg.eigvalsh(sum(B.T @ B / (4 * 10) for B in blocks) / N_CLIENTS)[-1] + 2 * lam
    per_feature = sum((np.abs(B).sum(0) > 0).astype(int) for B in blocks)
    Bs = [B.T @ B / 40 for B in blocks]
    lp_logistic = np.sqrt(
        np.linalg.eigvalsh(sum(np.linalg.eigvalsh(b)[-1] * b for b in Bs) / N_CLIENTS)[-1]
    )
    Hs = [2 * B.T @ B / 10 + 0.3 * np.eye(X.shape[1]) for B in blocks]
    lp_l2 = np.sqrt(np.linalg.eigvalsh(sum(H @ H for H in Hs) / N_CLIENTS)[-1])
    return {
        "L_i": np.array(L_i),
        "L": L,
        "c": int(per_feature.max()),
        "per_feature": per_feature,
        "L_plus_logistic": lp_logistic + 2 * lam,
        "L_plus_l2": lp_l2,
    }


def test_constants_of_a_huge_declared_dimension_equal_the_dense_computation(
    files: tuple[Path, Path],
) -> None:
    huge, small = files
    ref = _dense_reference(small)
    tracemalloc.start()
    try:
        p = logistic_regression(huge, n_clients=N_CLIENTS)
        rf = rare_features(p, include_regularizer=False)
        q = least_squares(huge, n_clients=N_CLIENTS, lam=0.3, reg="l2")
        rq = rare_features(q)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert p.d == HUGE_D
    assert peak < 64 * 2**20, f"peak {peak} bytes: something scales with d = {HUGE_D}"
    np.testing.assert_allclose(p.L_i.numpy(), ref["L_i"], rtol=1e-12)
    assert float(p.L) == pytest.approx(ref["L"], rel=1e-12)
    assert rf.c == ref["c"] < N_CLIENTS  # the features are rare
    assert rf.L_plus == pytest.approx(ref["L_plus_logistic"], rel=1e-12) and not rf.exact
    assert rq.L_plus == pytest.approx(ref["L_plus_l2"], rel=1e-12) and rq.exact
    assert rq.c == N_CLIENTS  # the ℓ2 regularizer touches every coordinate
    # the per-feature client counts, kept sparse: the used features and their counts
    small_rf = rare_features(logistic_regression(small, n_clients=N_CLIENTS))
    np.testing.assert_array_equal(small_rf.clients_per_feature, ref["per_feature"])
    np.testing.assert_array_equal(rf.counts, small_rf.counts)
    assert rf.features.size == int((ref["per_feature"] > 0).sum())
    assert int(rf.features.max()) == HUGE_D - 1


def test_eigen_solvers_agree_on_the_compacted_side(files: tuple[Path, Path]) -> None:
    """Dense on the smaller Gram, Lanczos on the Gram, Lanczos on the operator: one answer."""
    huge, _ = files
    A = load(huge).X
    off = np.arange(0, N_SAMPLES + 1, 10)
    dense = S.client_lambda_max(A, off, method="dense")
    np.testing.assert_allclose(S.client_lambda_max(A, off, method="lanczos"), dense, rtol=1e-10)
    used = [_used_block(A[off[i] : off[i + 1]]) for i in range(N_CLIENTS)]  # small, dense
    np.testing.assert_allclose(dense, [np.linalg.eigvalsh(U @ U.T)[-1] for U in used], rtol=1e-12)
    w = np.linspace(0.5, 2.0, N_SAMPLES)
    assert S.lambda_max_gram(A[:10], method="dense") == pytest.approx(dense[0], rel=1e-12)
    assert S.lambda_max_gram(A, w, method="lanczos") == pytest.approx(
        S.lambda_max_gram(A, w, method="dense"), rel=1e-10
    )


def _used_block(B: object) -> np.ndarray:
    """A sparse block restricted to its non-zero columns, as a small dense array."""
    coo = B.tocoo()  # type: ignore[attr-defined]
    cols = np.unique(coo.col)
    out = np.zeros((coo.shape[0], cols.size))
    out[coo.row, np.searchsorted(cols, coo.col)] = coo.data
    return out


def test_budget_forces_operator_lanczos_without_any_gram(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    huge, _ = files
    A = load(huge).X
    off = np.arange(0, N_SAMPLES + 1, 10)
    dense = S.client_lambda_max(A, off, method="dense")
    monkeypatch.setattr(S, "_BUDGET", 3)  # every Gram is "too large": the operator path
    np.testing.assert_allclose(S.client_lambda_max(A, off), dense, rtol=1e-10)


def test_theory_cli_on_high_dimensional_data_is_linear_in_d(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: d = 2·10⁵ used to allocate a 298 GiB d × d matrix."""
    d = 200_000
    spread = np.linspace(1, d, POOL + 1).astype(np.int64)
    path = _write(tmp_path / "d2e5.svm", {c: int(spread[c]) for c in range(POOL + 1)})
    tracemalloc.start()
    try:
        code = _run(["theory", "--dataset", str(path), "--clients", "6", "--json"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = capsys.readouterr()
    assert code == 0, out.err
    assert peak < 64 * 8 * d, f"peak {peak} bytes at d = {d}"  # a few d-vectors, never d²
    report = json.loads(out.out)
    rule = next(r for r in report["stepsizes"] if r["rule"] == "rare_features")
    p = logistic_regression(path, n_clients=6)
    rf = rare_features(p)
    alpha = make_compressor("top_k[k=1]").alpha(d)
    assert rule["stepsize"] == stepsize_rare_features(p.L, rf.L_plus, rf.c, 6, alpha)
    assert rule["stepsize"] > 0 and xi(alpha) > 0


def _run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_theory_leaves_out_what_it_cannot_hold_and_says_so(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """f(x⁰) at d = 2·10⁹ takes 89 GiB: the predictions are left out (one note), the constants
    and step sizes are printed, and nothing d-sized is allocated."""
    huge, _ = files
    monkeypatch.setattr(M, "available_memory", lambda: 20 * 2**30)  # the loader's 14.9 GiB fit
    assert _run(["theory", "--dataset", str(huge), "--clients", "6"]) == 0  # imports: ~70 MiB
    capsys.readouterr()
    tracemalloc.start()
    try:
        code = _run(["theory", "--dataset", str(huge), "--clients", "6"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err
    text = " ".join(out.out.split())
    assert "note: predicted rounds and bits left out: evaluating f(x⁰) at d = 2,000,000,000" in text
    assert "89.4 GiB" in text and "20 GiB" in text and "rare_features" in text
    assert peak < 64 * 2**20  # nothing d-sized was allocated


def test_loader_refuses_a_declared_dimension_without_memory_for_one_vector(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    huge, _ = files
    monkeypatch.setattr(M, "available_memory", lambda: 2**30)
    with pytest.raises(DatasetError, match=r"d = 2,000,000,000 features.*needs 14.9 GiB.*1 GiB"):
        load(huge, n_features=HUGE_D)  # checked before parsing
    with pytest.raises(DatasetError, match=r"d = 3,000,000,000 features"):
        load(huge, n_features=3 * 10**9)


def test_loader_names_an_index_beyond_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "giant.svm"
    path.write_text("-1 1:1 5:2\n1 2:1 100000000000:2\n")
    with pytest.raises(
        DatasetError, match=r"line 2: token 3 .* is too large \(at most 2147483646\)"
    ):
        load(path)


def test_memory_check_reads_a_limit_and_formats_it() -> None:
    free = M.available_memory()
    assert free > 0
    M.check_memory(1.0, "one byte")
    with pytest.raises(M.MemoryBudgetError, match=r"needs 1.6e\+03 PiB, more than"):
        M.check_memory(1.8e18, "a lot")
    assert M.format_bytes(1536) == "1.5 KiB" and M.format_bytes(3 * 2**30) == "3 GiB"
    assert isinstance(M.MemoryBudgetError("x"), ValueError)
    assert torch.zeros(1).numel() == 1  # torch stays importable alongside (sanity)
