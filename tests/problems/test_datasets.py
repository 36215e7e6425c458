"""Bundled datasets and the LIBSVM loader: sizes, label quirks, and line-level errors."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import shrinkgrad.datasets as sd
from shrinkgrad.problems.datasets import BUNDLED, Dataset, DatasetError, load

# Published sizes (data/README.md, LIBSVM page): samples, features, raw label counts
# (smaller label, larger label), stored non-zeros after dropping explicit zeros.
PUBLISHED = {
    "mushrooms": (8124, 112, (3916, 4208), 170604),
    "a9a": (32561, 123, (24720, 7841), 451592),
    "w8a": (49749, 300, (48270, 1479), 579586),
    "phishing": (11055, 68, (4898, 6157), 331650),
    "australian": (690, 14, (383, 307), 7724),
    "australian_scale": (690, 14, (383, 307), 8447),
    "w1a": (2477, 300, (2405, 72), 28410),
    "a1a": (1605, 123, (1210, 395), 22249),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bundled_dataset_matches_published_sizes(name: str) -> None:
    N, d, (neg, pos), nnz = PUBLISHED[name]
    ds = load(name)
    assert ds.X.shape == (N, d)
    assert sp.isspmatrix_csr(ds.X) and ds.X.dtype == np.float64
    assert ds.nnz == nnz  # explicit zeros (australian writes them) are dropped
    assert set(np.unique(ds.y)) == {-1.0, 1.0}
    assert int((ds.y < 0).sum()) == neg and int((ds.y > 0).sum()) == pos
    assert ds.label_values == BUNDLED[name].label_values


def test_a1a_has_the_libsvm_feature_count_although_the_file_stops_at_119() -> None:
    ds = load("a1a")
    assert ds.n_features == 123
    assert ds.X[:, 119:].nnz == 0 and ds.X[:, 118].nnz > 0


def test_label_quirks_map_smaller_label_to_minus_one() -> None:
    mush = load("mushrooms")  # raw {1, 2}: 1 (poisonous, 3916) -> -1
    assert mush.label_values == (1.0, 2.0) and int((mush.y < 0).sum()) == 3916
    phish = load("phishing")  # raw {0, 1}
    assert phish.label_values == (0.0, 1.0) and int((phish.y > 0).sum()) == 6157


def test_shrinkgrad_datasets_module_is_the_loader() -> None:
    assert sd.load is load and sd.available() == sorted([*PUBLISHED, "digits"])
    assert sd.load("australian") is load("australian")  # cached: one copy per process


def test_digits_is_scikit_learns_bundled_image_data() -> None:
    from sklearn.datasets import load_digits

    ds = load("digits")
    raw = load_digits()
    assert ds.X.shape == (1797, 64) and ds.image_shape == (1, 8, 8) and ds.n_classes == 10
    assert np.array_equal(ds.X.toarray(), raw.data / 16.0) and float(ds.X.max()) == 1.0
    assert np.array_equal(ds.y, raw.target.astype(np.float64)) and ds.label_values == tuple(
        float(c) for c in range(10)
    )
    assert load("digits") is ds and not ds.y.flags.writeable
    with pytest.raises(DatasetError, match="'digits' has 64 features, not n_features=10"):
        load("digits", n_features=10)
    with pytest.raises(DatasetError, match=r"least squares needs binary \(±1\) labels"):
        ds.require_binary("least squares")
    load("a9a").require_binary("least squares")  # binary data passes


def test_loaded_arrays_are_read_only() -> None:
    ds = load("a1a")
    with pytest.raises(ValueError):
        ds.X.data[0] = 5.0
    with pytest.raises(ValueError):
        ds.y[0] = 0.0


def _write(tmp_path: Path, text: str, name: str = "data.svm") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode())
    return p


def test_load_by_path_plain_and_gzip(tmp_path: Path) -> None:
    text = "+1 1:0.5 3:2\n-1.0 2:1.5\n# a comment line\n+1 1:1 # trailing comment\n"
    plain = load(_write(tmp_path, text))
    gz = tmp_path / "data.svm.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    zipped = load(str(gz))
    for ds in (plain, zipped):
        assert ds.X.shape == (3, 3)
        np.testing.assert_array_equal(ds.X.toarray(), [[0.5, 0, 2], [0, 1.5, 0], [1, 0, 0]])
        np.testing.assert_array_equal(ds.y, [1, -1, 1])
    assert load(_write(tmp_path, text, "b.svm"), n_features=10).n_features == 10


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("1 1:0.5 2:1\n-1 1:0.3 foo\n", 2, "not of the form index:value"),
        ("1 1:0.5\n-1 0:0.3\n", 2, "indices start at 1"),
        ("1 1:0.5\n-1 2:abc\n", 2, "is not a number"),
        ("1 1:0.5\nxx 2:1\n", 2, "label 'xx' is not a number"),
        ("1 1:0.5\n-1 3:1 2:1\n1 1:1\n", 2, "increasing"),
        ("1 1:0.5\n-1 2:1\n1 1:nan\n", 3, "not finite"),
        ("1 1:0.5\n\n-1 1.5:1\n", 3, "not an integer"),
        ("", 1, "empty"),
        ("# only a comment\n", 1, "no samples"),
    ],
)
def test_malformed_file_names_file_and_line(
    tmp_path: Path, text: str, line: int, fragment: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(DatasetError) as err:
        load(path)
    msg = str(err.value)
    assert str(path) in msg and f"line {line}" in msg and fragment in msg


def test_too_many_features_for_declared_count(tmp_path: Path) -> None:
    path = _write(tmp_path, "1 1:1\n-1 2:1 7:1\n")
    with pytest.raises(DatasetError, match=r"line 2: .*exceeds n_features=5"):
        load(path, n_features=5)


def test_single_class_and_three_classes_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="two classes"):
        load(_write(tmp_path, "1 1:1\n1 2:1\n", "one.svm"))
    with pytest.raises(DatasetError, match=r"line 3: more than two labels"):
        load(_write(tmp_path, "1 1:1\n-1 2:1\n2 1:1\n", "three.svm"))


def test_unknown_name_and_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"not a bundled name .*did you mean 'a9a'"):
        load("A9A")
    with pytest.raises(DatasetError, match="is a directory"):
        load(tmp_path)
    with pytest.raises(TypeError, match="bundled name"):
        load(3)  # type: ignore[arg-type]


def test_from_arrays_checks_and_maps_labels() -> None:
    ds = Dataset.from_arrays(np.eye(3), [0, 1, 1], name="toy")
    np.testing.assert_array_equal(ds.y, [-1, 1, 1])
    with pytest.raises(DatasetError, match="finite"):
        Dataset.from_arrays([[np.nan]], [1], name="bad")
    with pytest.raises(DatasetError, match="rows but y has"):
        Dataset.from_arrays(np.eye(3), [0, 1], name="bad")


# sha256 of the uncompressed bundled files (data/PROVENANCE.md, from the checked copies)
SHA256 = {
    "mushrooms": "f39a4eb628dc61a7d43760815b061c9e497aa728ce1ad8bde57a09ef6043b538",
    "a9a": "f5d5ffd8d865ff41328e7ee043e4b020816914ff6843ff15b98905ddbedce906",
    "w8a": "6a9fa8fd5f524303240a5db07d4b3d4a51e8b7b4b20a914105d8e3e8c81640f2",
    "phishing": "0cf66ef36604c393da9359b2e5d894a2df8aee31fd184633cefa138add2ef08a",
    "australian": "615e24252961b52e297f9b70942f166631ab412ad9060ba98bf41b1e027be607",
    "australian_scale": "86799bcc4dbcd41929a514fa181d1c1a40e01f009dee139d4141a194d7ecd9e3",
    "w1a": "0ae2b1c40f6a99061d1c6f4a1f3b50eea58a2f3b8bf851a337c25c2a65a49d32",
    "a1a": "eb54c45f1bdb51286f803dd092eb8202b44637a858fc6c4e533a2d64a0d94b4e",
}


@pytest.mark.parametrize("name", sorted(SHA256))
def test_bundled_files_match_their_provenance_checksums(name: str) -> None:
    import hashlib

    content = gzip.decompress(sd.bundled_path(name).read_bytes())
    assert hashlib.sha256(content).hexdigest() == SHA256[name]
    assert f"`{SHA256[name]}`" in (sd.bundled_path(name).parent / "PROVENANCE.md").read_text()
