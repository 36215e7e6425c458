"""Datasets: the bundled LIBSVM binary-classification files, any LIBSVM file by path, and digits.

``load("a9a")`` reads a bundled file (gzip-compressed package data, provenance in
``shrinkgrad/data/PROVENANCE.md``); ``load("/path/to/file")`` reads any svmlight file (plain or
``.gz``/``.bz2``) with :func:`sklearn.datasets.load_svmlight_file`. Either way:

* features stay a sparse CSR matrix (float64, 1-based indices in the file, explicit zeros
  dropped, indices sorted); a bundled file gets its LIBSVM feature count (a1a: 123, although the
  file never uses features 120–123);
* the two label values are mapped to ±1 as in the EF21 authors' code: the smaller one becomes −1,
  the larger +1 (mushrooms {1, 2}, phishing {0, 1}, ±1 and ±1.0 unchanged); the original values
  are kept in :attr:`Dataset.label_values`;
* a malformed file (bad token, index 0 or negative, unsorted indices, non-numeric or non-finite
  value, more features than declared, empty, one class only, more than two classes) raises one
  :class:`DatasetError` (a ValueError) naming the file and the first bad line; nothing is returned
  half-loaded. sklearn's messages carry no line numbers, so on failure the file is scanned line
  by line to locate the problem (the scan only validates; sklearn does the parsing).

``load("digits")`` is scikit-learn's bundled ``load_digits`` (UCI optical digits, 1,797 8 × 8
grey-scale images, 10 classes; shipped inside scikit-learn, no download): pixel values 0–16
scaled to [0, 1], labels the class indices 0–9 (``n_classes == 10``, not ±1), and
``image_shape == (1, 8, 8)`` for convolutional models (:func:`shrinkgrad.problems.model_problem`).
Linear problems need binary labels and refuse it.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import math
import os
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import IO, Any

import numpy as np
import scipy.sparse as sp

from .memory import MemoryBudgetError, check_memory

__all__ = [
    "BUNDLED",
    "IMAGE_DATASETS",
    "Dataset",
    "DatasetError",
    "available",
    "bundled_path",
    "load",
]


class DatasetError(ValueError):
    """A dataset file cannot be used; the message names the file and, when known, the line."""


@dataclasses.dataclass(frozen=True)
class BundledInfo:
    """What is known about a bundled LIBSVM file (checked when it is loaded)."""

    n_features: int
    n_samples: int
    label_values: tuple[float, float]
    description: str


#: The bundled datasets: LIBSVM feature counts, sizes and raw label values (data/PROVENANCE.md).
BUNDLED: dict[str, BundledInfo] = {
    "a1a": BundledInfo(123, 1605, (-1.0, 1.0), "UCI Adult subset (Platt 1998); file uses ≤ 119"),
    "a9a": BundledInfo(123, 32561, (-1.0, 1.0), "UCI Adult / census income (Platt 1998)"),
    "australian": BundledInfo(14, 690, (-1.0, 1.0), "Statlog Australian credit, raw values"),
    "australian_scale": BundledInfo(14, 690, (-1.0, 1.0), "australian scaled to [-1, 1]"),
    "mushrooms": BundledInfo(112, 8124, (1.0, 2.0), "UCI Mushroom, one-hot (labels 1/2)"),
    "phishing": BundledInfo(68, 11055, (0.0, 1.0), "UCI Phishing websites (labels 0/1)"),
    "w1a": BundledInfo(300, 2477, (-1.0, 1.0), "web page keywords (Platt 1998), subset of w8a"),
    "w8a": BundledInfo(300, 49749, (-1.0, 1.0), "web page keywords (Platt 1998)"),
}


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What is known about a bundled multi-class image dataset (shipped by scikit-learn)."""

    n_samples: int
    n_classes: int
    image_shape: tuple[int, ...]
    description: str


#: Multi-class image data that ships with an installed dependency (no download).
IMAGE_DATASETS: dict[str, ImageInfo] = {
    "digits": ImageInfo(
        1797, 10, (1, 8, 8), "UCI optical digits via sklearn.datasets.load_digits, 8×8, 10 classes"
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset: CSR features ``X`` (N × d, float64) and labels ``y`` (float64).

    Binary data (every LIBSVM file): ``y`` ∈ {±1} and ``label_values`` the two raw values mapped
    to (−1, +1). Multi-class data (``digits``): ``y`` holds the class indices 0 … C−1 and
    ``label_values`` = (0, …, C−1). ``image_shape`` is the shape of one sample as an image
    (channels, height, width) when the rows are images, else None. The arrays are read-only
    (datasets are cached and shared).
    """

    name: str
    X: sp.csr_matrix
    y: np.ndarray
    #: the raw label values mapped to (−1, +1) (binary), or the class indices (multi-class)
    label_values: tuple[float, ...]
    #: where the data came from (a file path, "bundled:<name>", "sklearn:<loader>" or "memory")
    source: str = "memory"
    #: (channels, height, width) of one sample when the rows are flattened images
    image_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not sp.issparse(self.X) or self.X.ndim != 2:
            raise TypeError(f"Dataset {self.name!r}: X must be a 2-D scipy sparse matrix")
        if self.y.shape != (self.X.shape[0],):
            raise ValueError(
                f"Dataset {self.name!r}: y has shape {self.y.shape}, expected ({self.X.shape[0]},)"
            )

    @classmethod
    def from_arrays(
        cls, X: Any, y: Any, *, name: str = "memory", source: str = "memory"
    ) -> Dataset:
        """Wrap in-memory data (dense or sparse X, two-valued y) with the checks files get."""
        Xc = sp.csr_matrix(X, dtype=np.float64)
        yv = np.asarray(y, dtype=np.float64).reshape(-1)
        if Xc.shape[0] != yv.shape[0]:
            raise DatasetError(f"{name}: X has {Xc.shape[0]} rows but y has {yv.shape[0]} labels")
        if Xc.shape[0] == 0:
            raise DatasetError(f"{name}: no samples")
        if not np.all(np.isfinite(Xc.data)) or not np.all(np.isfinite(yv)):
            raise DatasetError(f"{name}: features and labels must be finite (found NaN or inf)")
        y_pm, values = _map_labels(yv, name, locate=None)
        return cls(name, _freeze(Xc), y_pm, values, source)

    # convenience views ------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return int(self.X.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.X.shape[1])

    @property
    def nnz(self) -> int:
        return int(self.X.nnz)

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.n_samples * self.n_features)

    @property
    def n_classes(self) -> int:
        """The number of classes (2 for every LIBSVM file)."""
        return len(self.label_values)

    def require_binary(self, what: str) -> None:
        """Raise a :class:`DatasetError` unless the labels are ±1 (``what`` names the user)."""
        if self.n_classes != 2:
            raise DatasetError(
                f"{what} needs binary (±1) labels; dataset {self.name!r} has {self.n_classes} "
                "classes (use a neural network: shrinkgrad.problems.model_problem, e.g. "
                f"'cnn[dataset={self.name}]' or 'mlp[dataset={self.name}]')"
            )

    def __repr__(self) -> str:
        if self.n_classes != 2:
            return (
                f"<Dataset {self.name}: {self.n_samples} samples × {self.n_features} features, "
                f"{self.n_classes} classes>"
            )
        pos = int((self.y > 0).sum())
        return (
            f"<Dataset {self.name}: {self.n_samples} samples × {self.n_features} features, "
            f"density {self.density:.3g}, +1: {pos}, −1: {self.n_samples - pos}>"
        )


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def available() -> list[str]:
    """Names of the bundled datasets (the LIBSVM files and the image data of IMAGE_DATASETS)."""
    return sorted([*BUNDLED, *IMAGE_DATASETS])


def bundled_path(name: str) -> Path:
    """Path of the gzip file of a bundled dataset inside the installed package."""
    if name not in BUNDLED:
        raise DatasetError(f"{name!r} is not a bundled dataset; bundled: {', '.join(available())}")
    path = Path(str(resources.files("shrinkgrad") / "data" / f"{name}.gz"))
    if not path.is_file():  # pragma: no cover - a broken installation
        raise DatasetError(f"bundled dataset file {path} is missing; reinstall shrinkgrad")
    return path


def load(dataset: str | os.PathLike[str] | Dataset, *, n_features: int | None = None) -> Dataset:
    """Load a bundled dataset by name or any LIBSVM/svmlight file by path (see the module doc).

    ``n_features`` overrides the feature count (default: the LIBSVM count for bundled data, the
    largest index in the file otherwise). A :class:`Dataset` is passed through unchanged.
    """
    if isinstance(dataset, Dataset):
        if n_features is not None and n_features != dataset.n_features:
            raise DatasetError(
                f"dataset {dataset.name!r} has {dataset.n_features} features, not n_features="
                f"{n_features}"
            )
        return dataset
    if not isinstance(dataset, (str, os.PathLike)):
        raise TypeError(
            "dataset must be a bundled name (e.g. 'a9a'), a path to a LIBSVM file or a Dataset, "
            f"got {type(dataset).__name__}"
        )
    if n_features is not None:
        if (
            isinstance(n_features, bool)
            or not isinstance(n_features, (int, np.integer))
            or n_features < 1
        ):
            raise ValueError(f"n_features must be a positive integer, got {n_features!r}")
        n_features = int(n_features)  # numpy integers too (the cache key is a plain int)
    text = os.fspath(dataset)
    if n_features is not None:
        _check_dimension(n_features, text)
    if isinstance(dataset, str) and text in IMAGE_DATASETS:
        info_img = IMAGE_DATASETS[text]
        width = math.prod(info_img.image_shape)
        if n_features is not None and n_features != width:
            raise DatasetError(
                f"dataset {text!r} has {width} features, not n_features={n_features}"
            )
        return _load_image_dataset(text)
    if isinstance(dataset, str) and text in BUNDLED:
        info = BUNDLED[text]
        nf = info.n_features if n_features is None else n_features
        ds = _load_file(str(bundled_path(text)), nf, text, f"bundled:{text}")
        if n_features is None and (
            ds.n_samples != info.n_samples or ds.label_values != info.label_values
        ):  # pragma: no cover - a corrupted installation
            raise DatasetError(f"bundled dataset {text!r} does not match its provenance record")
        return ds
    path = Path(text).expanduser()
    if not path.exists():
        close = [n for n in available() if n.lower() == text.lower()]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DatasetError(
            f"unknown dataset {text!r}: not a bundled name ({', '.join(available())}) and no such "
            f"file{hint}"
        )
    if path.is_dir():
        raise DatasetError(f"dataset path {text!r} is a directory; give a LIBSVM file")
    resolved = path.resolve()
    return _load_file(str(resolved), n_features, path.name, str(resolved), _file_key(resolved))


def _file_key(path: Path) -> tuple[int, ...]:
    """What identifies a file's contents for the cache: device, inode, size, mtime and ctime.

    The mtime alone is not enough: it is coarse on some file systems (1–2 s) and is restored
    by ``cp -p``, ``touch -r`` or an archive, so a rewritten file could be served from the
    cache; the ctime cannot be set by the user and changes on every write.
    """
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@lru_cache(maxsize=4)
def _load_image_dataset(name: str) -> Dataset:
    """A bundled scikit-learn image dataset (only ``digits``: pixels 0–16 scaled to [0, 1])."""
    from sklearn.datasets import load_digits

    info = IMAGE_DATASETS[name]
    bunch = load_digits()
    X = np.asarray(bunch.data, dtype=np.float64) / 16.0
    y = np.asarray(bunch.target, dtype=np.float64)
    if X.shape[0] != info.n_samples:  # pragma: no cover - another scikit-learn's data
        raise DatasetError(f"sklearn's {name} has {X.shape[0]} samples, expected {info.n_samples}")
    y.flags.writeable = False
    labels = tuple(float(c) for c in range(info.n_classes))
    return Dataset(
        name, _freeze(sp.csr_matrix(X)), y, labels, "sklearn:load_digits", info.image_shape
    )


@lru_cache(maxsize=32)
def _load_file(
    path: str, n_features: int | None, name: str, source: str, key: tuple[int, ...] = ()
) -> Dataset:
    from sklearn.datasets import load_svmlight_file

    try:
        X, y = load_svmlight_file(
            path, n_features=n_features, dtype=np.float64, zero_based=False, multilabel=False
        )
    except (ValueError, TypeError, UnicodeDecodeError, EOFError, OSError, OverflowError) as e:
        line, why = _locate(path, n_features)
        if line is None:
            raise DatasetError(f"{path}: cannot read it as a LIBSVM file: {e}") from None
        raise DatasetError(f"{path}, line {line}: {why}") from None
    if X.shape[0] == 0:
        raise DatasetError(f"{path}, line 1: the file has no samples (it is empty or all comments)")
    _check_dimension(int(X.shape[1]), path)
    X = sp.csr_matrix(X, dtype=np.float64)
    if not np.all(np.isfinite(X.data)) or not np.all(np.isfinite(y)):
        line, why = _locate(path, n_features)
        raise DatasetError(f"{path}, line {line}: {why}")

    def locate_label(bad: float) -> int:
        return _first_line_with_label(path, bad)

    y_pm, values = _map_labels(np.asarray(y, dtype=np.float64), path, locate=locate_label)
    return Dataset(name, _freeze(X), y_pm, values, source)


def _check_dimension(d: int, where: str) -> None:
    """Refuse (one line) a declared dimension d whose float64 vector (the iterate) cannot fit."""
    try:
        check_memory(
            8.0 * d,
            f"{where}: d = {d:,} features; one float64 vector of d entries (the iterate x)",
            "select or hash the features to fewer dimensions",
        )
    except MemoryBudgetError as e:
        raise DatasetError(str(e)) from None


def _freeze(X: sp.csr_matrix) -> sp.csr_matrix:
    X = X.copy()
    X.eliminate_zeros()
    X.sort_indices()
    for arr in (X.data, X.indices, X.indptr):
        arr.flags.writeable = False
    return X


def _map_labels(y: np.ndarray, where: str, locate: Any) -> tuple[np.ndarray, tuple[float, float]]:
    values, first = np.unique(y, return_index=True)
    if values.size == 1:
        raise DatasetError(
            f"{where}: all {y.size} samples have label {values[0]:g}: binary "
            "classification needs two classes"
        )
    if values.size > 2:
        # the first sample whose label is a third distinct value: the first line of that label
        third = float(y[np.sort(first)[2]])
        line = f", line {locate(third)}" if locate is not None else ""
        raise DatasetError(
            f"{where}{line}: more than two labels ({', '.join(f'{v:g}' for v in values[:5])}"
            f"{', ...' if values.size > 5 else ''}): only binary LIBSVM data is supported"
        )
    lo, hi = float(values[0]), float(values[1])
    out = np.where(y == hi, 1.0, -1.0)
    out.flags.writeable = False
    return out, (lo, hi)


# --------------------------------------------------------------------------------------------
# locating errors (validation only; sklearn does the parsing)
# --------------------------------------------------------------------------------------------
def _open(path: str) -> IO[bytes]:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    return open(path, "rb")


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with _open(path) as fh:
        yield from enumerate(fh, start=1)


def _number(tok: bytes) -> float | None:
    try:
        return float(tok)
    except ValueError:
        return None


#: the largest feature index the sparse loader can hold (int32 indices)
_MAX_INDEX = 2**31 - 2


def _check_line(raw: bytes, n_features: int | None) -> str | None:
    """Why a line is not valid svmlight (None when it is).

    The line is cut at ``#`` and split into tokens on bytes, as sklearn's parser does: a
    comment may hold any bytes, and ``str.split`` would also split at the bytes 0x1c–0x1f.
    """
    body = raw.split(b"#", 1)[0]
    try:
        tokens = [t.decode("ascii") for t in body.split()]
    except UnicodeDecodeError:
        return "contains non-ASCII bytes"
    if not tokens:
        return None
    label = _number(tokens[0].encode())
    if label is None:
        return f"the label {tokens[0]!r} is not a number"
    if not math.isfinite(label):
        return f"the label {tokens[0]!r} is not finite"
    prev = 0
    for k, tok in enumerate(tokens[1:], start=2):
        if ":" not in tok:
            if b"\r" in body.rstrip(b"\r\n"):  # several samples on one line
                return (
                    f"token {k} {tok!r} is not of the form index:value; the line holds a "
                    "carriage return (CR-only line ends: convert them to LF)"
                )
            return f"token {k} {tok!r} is not of the form index:value"
        idx_s, val_s = tok.split(":", 1)
        if idx_s == "qid" and k == 2:
            continue
        try:
            idx = int(idx_s)
        except ValueError:
            return f"token {k} {tok!r}: the index {idx_s!r} is not an integer"
        if idx < 1:
            return (
                f"token {k} {tok!r}: feature index {idx}; LIBSVM indices start at 1 "
                "(a 0-based file: add 1 to every index)"
            )
        if idx <= prev:
            return f"token {k} {tok!r}: feature indices must be increasing (after {prev})"
        if idx > _MAX_INDEX:
            return f"token {k} {tok!r}: feature index {idx} is too large (at most {_MAX_INDEX})"
        if n_features is not None and idx > n_features:
            return f"token {k} {tok!r}: feature index {idx} exceeds n_features={n_features}"
        value = _number(val_s.encode())
        if value is None:
            return f"token {k} {tok!r}: the value {val_s!r} is not a number"
        if not math.isfinite(value):
            return f"token {k} {tok!r}: the value is not finite"
        prev = idx
    return None


def _locate(path: str, n_features: int | None) -> tuple[int | None, str]:
    """First bad line of a file and why (None when no line-level problem is found)."""
    try:
        last = 0
        for i, raw in _lines(path):
            last = i
            why = _check_line(raw, n_features)
            if why is not None:
                return i, why
        if last == 0:
            return 1, "the file is empty"
    except (OSError, EOFError) as e:
        return None, str(e)
    return None, ""


def _first_line_with_label(path: str, label: float) -> int:
    for i, raw in _lines(path):
        text = raw.split(b"#", 1)[0].split()
        if text and _number(text[0]) == label:
            return i
    return 0  # pragma: no cover - the label came from this file
