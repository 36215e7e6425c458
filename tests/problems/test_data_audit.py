"""Audit of how user data becomes a problem: the LIBSVM loader against scikit-learn's
``load_svmlight_file`` (the independent reference), its refusals (one line, file and line), the
client splits on uneven sample counts, and the L_i of those splits against numpy."""

from __future__ import annotations

import bz2
import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_svmlight_file

from shrinkgrad.problems import logistic_regression, make_split
from shrinkgrad.problems.datasets import DatasetError, load
from shrinkgrad.problems.linear import LinearModelProblem


def _write(tmp_path: Path, data: str | bytes, name: str = "data.svm") -> Path:
    raw = data.encode() if isinstance(data, str) else data
    if name.endswith(".gz"):
        raw = gzip.compress(raw)
    elif name.endswith(".bz2"):
        raw = bz2.compress(raw)
    p = tmp_path / name
    p.write_bytes(raw)
    return p


# valid files with every quirk the format allows (the reference parses them all)
VALID = {
    "comments_blank_lines": "# header\n\n+1 1:0.5 3:2 # trailing\n   # indented\n\n-1 2:1.5\n",
    "qid": "1 qid:3 1:1 2:2\n-1 qid:x 2:1\n",
    "explicit_zeros": "1 1:0 3:0\n-1 2:1 3:0\n1 1:2\n",
    "crlf_trailing_ws": "1 1:1   \r\n-1\t2:1\t\r\n1 3:1 # c\r\n",
    "labels_0_1": "0 1:1\n1 2:1\n0 3:1\n",
    "labels_1_2": "2 1:1\n1 2:1\n",
    "labels_plus_and_floats": "-1.0 1:1\n+1 2:1\n1.0 3:1\n-1 1:2\n",
    "scientific": "1e0 1:1e-3 2:2.5E+2\n-1 3:-4e1\n",
    "label_only_row_no_final_newline": "1\n-1 2:1",
    "underscore_and_plus": "1 1_0:1\n-1 +2:1\n",
}


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2"])
@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_files_equal_sklearn(tmp_path: Path, case: str, suffix: str) -> None:
    path = _write(tmp_path, VALID[case], f"{case}.svm{suffix}")
    X_ref, y_ref = load_svmlight_file(str(path), zero_based=False)
    for nf in (None, X_ref.shape[1] + 3):
        ds = load(path, n_features=nf)
        ref = X_ref.toarray() if nf is None else np.pad(X_ref.toarray(), ((0, 0), (0, 3)))
        np.testing.assert_array_equal(ds.X.toarray(), ref)
        lo, hi = np.unique(y_ref)
        np.testing.assert_array_equal(ds.y, np.where(y_ref == hi, 1.0, -1.0))
        assert ds.label_values == (lo, hi)


def _refusal(path: Path, **kw: object) -> str:
    with pytest.raises(DatasetError) as err:
        load(path, **kw)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_third_class_is_reported_at_the_line_where_it_first_appears(tmp_path: Path) -> None:
    # labels 1, 2, then −1: lines 1–2 are a valid binary file, line 3 brings the third class
    # (before: "line 2", the first line of the third-smallest value 2)
    msg = _refusal(_write(tmp_path, "1 1:1\n2 2:1\n-1 1:1\n"))
    assert "line 3: more than two labels" in msg


def test_non_ascii_comment_does_not_hide_the_bad_line(tmp_path: Path) -> None:
    # the reference reads the UTF-8 comment fine and fails on line 3 (before: "line 1:
    # contains non-ASCII bytes", the comment line)
    path = _write(tmp_path, "# données brutes\n1 1:1\n-1 2:x\n")
    with pytest.raises(ValueError):
        load_svmlight_file(str(path), zero_based=False)
    msg = _refusal(path)
    assert "line 3" in msg and "'x' is not a number" in msg


def test_bytes_whitespace_is_split_like_the_parser(tmp_path: Path) -> None:
    # \x1c is whitespace for str.split but not for bytes.split (the parser): the validator
    # must find the line (before: no line, "cannot read it as a LIBSVM file")
    msg = _refusal(_write(tmp_path, b"1 1:1\n-1 1:1\x1c2:1\n"))
    assert "line 2" in msg and "is not a number" in msg


def test_single_class_message_counts_samples_not_lines(tmp_path: Path) -> None:
    # samples on lines 3 and 5 (before: "every sample (lines 1–2)")
    msg = _refusal(_write(tmp_path, "# c\n\n1 1:1\n\n1 2:1\n"))
    assert "lines 1–2" not in msg and "2 samples" in msg and "two classes" in msg


def test_refusals_name_the_fix(tmp_path: Path) -> None:
    zero = _refusal(_write(tmp_path, "1 1:1\n-1 0:1 2:1\n", "zero.svm"))
    assert "line 2" in zero and "add 1 to every index" in zero
    cr = _refusal(_write(tmp_path, "1 1:1\r-1 2:1\r1 1:2\r", "cr.svm"))
    assert "line 1" in cr and "CR-only line ends" in cr


def test_rewritten_file_with_an_unchanged_mtime_is_read_again(tmp_path: Path) -> None:
    # coarse mtime (1–2 s on some file systems), `cp -p`, `touch -r`: the cache must not
    # return the old contents (before: the first file's data, silently)
    path = _write(tmp_path, "1 1:1\n-1 2:1\n")
    first = load(path)
    st = os.stat(path)
    path.write_bytes(b"1 1:5.5\n-1 2:7.25\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    X_ref, _ = load_svmlight_file(str(path), zero_based=False)
    again = load(path)
    assert first.X.toarray()[0, 0] == 1.0
    np.testing.assert_array_equal(again.X.toarray(), X_ref.toarray())


def test_numpy_integer_n_features_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, "1 1:1\n-1 2:1\n")
    assert load(path, n_features=np.int64(5)).n_features == 5  # before: ValueError
    with pytest.raises(ValueError, match="positive integer"):
        load(path, n_features=np.int64(0))


@pytest.mark.parametrize("n", [3, 4, 7, 10])
@pytest.mark.parametrize("spec", ["contiguous", "shuffled[seed=2]", "by_label", "dirichlet"])
def test_uneven_splits_partition_and_L_i_match_numpy(tmp_path: Path, spec: str, n: int) -> None:
    rng = np.random.default_rng(n)
    N, d = 23, 6
    X = np.round(rng.standard_normal((N, d)) * (rng.random((N, d)) < 0.5), 3)
    y = np.where(np.arange(N) % 3 == 0, 1, -1)
    lines = [
        f"{y[j]:+d} " + " ".join(f"{k + 1}:{X[j, k]}" for k in np.flatnonzero(X[j]))
        for j in range(N)
    ]
    path = _write(tmp_path, "\n".join(lines) + "\n")
    X_ref = load_svmlight_file(str(path), n_features=d, zero_based=False)[0].toarray()
    ds = load(path, n_features=d)
    parts = make_split(spec)(ds, n)
    np.testing.assert_array_equal(np.sort(np.concatenate(list(parts))), np.arange(N))
    if spec == "contiguous":  # the EF21 authors' chunks: ⌊N/n⌋ each, the last takes the rest
        m = N // n
        assert [p.tolist() for p in parts] == [
            list(range(i * m, (i + 1) * m if i < n - 1 else N)) for i in range(n)
        ]
    lam = 0.1
    p = logistic_regression(ds, n, split=spec, lam=lam)
    # L_i = λ_max(A_iᵀA_i)/(4 m_i) + 2λ (methods.md §1, nonconvex regularizer)
    ref = [np.linalg.eigvalsh(X_ref[q].T @ X_ref[q])[-1] / (4 * q.size) + 2 * lam for q in parts]
    np.testing.assert_allclose(p.L_i.numpy(), ref, rtol=1e-12, atol=1e-15)


def test_too_many_clients_is_a_clear_error(tmp_path: Path) -> None:
    ds = load(_write(tmp_path, "1 1:1\n-1 2:1\n1 1:2\n"))
    for spec in ("contiguous", "shuffled", "by_label", "dirichlet", "heterogeneous_smoothness"):
        with pytest.raises(ValueError, match="n_clients=4 exceeds the 3 samples"):
            make_split(spec)(ds, 4)


def test_dense_data_lanczos_handles_one_sample_and_all_zero_clients() -> None:
    # before: TypeError from eigsh (1 × 1 operator) and ArpackError (zero operator)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((7, 4))
    A[3:6] = 0.0
    y = np.where(np.arange(7) % 2 == 0, 1.0, -1.0)
    parts = [np.arange(0, 3), np.arange(3, 6), np.array([6])]
    p = LinearModelProblem(A, y, parts, loss="logistic", lam=0.0, eig_method="lanczos")
    ref = [np.linalg.eigvalsh(A[q].T @ A[q])[-1] / (4 * q.size) for q in parts]
    np.testing.assert_allclose(p.L_i.numpy(), ref, rtol=1e-10, atol=1e-15)
    sparse = LinearModelProblem(sp.csr_matrix(A), y, parts, loss="logistic", lam=0.0)
    np.testing.assert_allclose(sparse.L_i.numpy(), ref, rtol=1e-12, atol=1e-15)
