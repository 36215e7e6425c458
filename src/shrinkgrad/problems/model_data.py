"""The data of a model problem: which rows each client holds, which are kept back, and padding.

:func:`prepare_data` turns ``data`` (a bundled dataset name, a LIBSVM path, a
:class:`~shrinkgrad.problems.datasets.Dataset`, or an ``(X, y)`` pair of arrays/tensors) and the
``split`` / ``test`` arguments of :func:`~shrinkgrad.problems.model_problem` into

* the clients' samples on a tensor axis, in a few groups of similar size (:class:`ClientGroup`):
  clients whose sizes m_i lie in one octave [2^k, 2^{k+1}) share a :class:`ClientBatch` padded to
  the group's largest client — ``X`` of shape (n_g, m_g, …), targets ``y`` (n_g, m_g, …) and
  weights ``w`` (n_g, m_g) with w_ij = 1/m_i on client i's rows and 0 on its padding, which
  repeats the client's first row so that padded values are always finite. Padding thus costs
  less than a factor 2 in rows whatever the split (the EF21 authors' ``contiguous`` split gives
  the remainder to the last client: one client of 593 rows beside 999 of 32 at n = 1000 on
  a9a, which one common padded length would inflate 18-fold);
* the held-out rows (:class:`HeldOut`).

Held-out rows (``test=``): a fraction (seeded by ``seed``, stream ``"test_split"``: the rows with
the smallest keyed uniforms), explicit row indices of ``data``, or an ``(X, y)`` pair of its own.
With a named split the clients share the remaining rows (the split sees only them); an explicit
split lists rows of ``data`` itself, and then a fractional test set is drawn from the rows no
client holds, while explicit test rows that a client also holds are an error.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from ..registry import Spec
from ..rng import Keys
from .datasets import Dataset, load
from .model_losses import ModelLoss
from .splits import Split, resolve_split

__all__ = ["ClientBatch", "ClientGroup", "HeldOut", "PreparedData", "group_clients", "prepare_data"]

#: what ``data=`` accepts
DataArg = str | os.PathLike[str] | Dataset | tuple[Any, Any]
#: what ``test=`` accepts: a fraction, row indices, an (X, y) pair, or None (no held-out part)
TestArg = float | Sequence[int] | np.ndarray | torch.Tensor | tuple[Any, Any] | None


@dataclasses.dataclass(frozen=True)
class ClientBatch:
    """The clients' samples padded to one length (see the module docstring)."""

    X: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    #: m_i, int64 CPU (n,)
    sizes: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.sizes.numel())

    @property
    def m_pad(self) -> int:
        return int(self.X.shape[1])

    def subset(self, ids: torch.Tensor) -> ClientBatch:
        """The clients ``ids`` (in that order), with the same padded length."""
        dev = self.X.device
        i = ids.to(dev)
        return ClientBatch(self.X[i], self.y[i], self.w[i], self.sizes[ids.cpu()].clone())

    def to(self, dtype: torch.dtype, device: torch.device) -> ClientBatch:
        y = self.y.to(device) if not self.y.dtype.is_floating_point else self.y.to(device, dtype)
        return ClientBatch(self.X.to(device, dtype), y, self.w.to(device, dtype), self.sizes)


@dataclasses.dataclass(frozen=True)
class ClientGroup:
    """Clients of similar size on one padded axis: ``batch`` holds them, ``members`` are their
    indices among the problem's clients (int64 CPU, increasing)."""

    batch: ClientBatch
    members: torch.Tensor


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Held-out samples: inputs ``X`` (N_test, …) and targets ``y``; ``rows`` are their rows of
    ``data`` (None for an own ``(X, y)`` pair)."""

    X: torch.Tensor
    y: torch.Tensor
    rows: np.ndarray | None

    @property
    def size(self) -> int:
        return int(self.X.shape[0])

    def to(self, dtype: torch.dtype, device: torch.device) -> HeldOut:
        y = self.y.to(device) if not self.y.dtype.is_floating_point else self.y.to(device, dtype)
        return HeldOut(self.X.to(device, dtype), y, self.rows)


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """What :func:`prepare_data` returns."""

    groups: list[ClientGroup]
    test: HeldOut | None
    #: the clients' rows of ``data`` (int64), in client order
    parts: list[np.ndarray]
    dataset: str
    split: str
    #: classes of a named dataset (2 for LIBSVM files), None for user data
    n_classes: int | None


@dataclasses.dataclass(frozen=True)
class _Source:
    X: np.ndarray  # (N, …) float64
    y: np.ndarray  # (N,) or (N, k)
    name: str
    n_classes: int | None
    for_split: Dataset  # what a named split sees (labels, and the flattened rows)


def prepare_data(
    data: DataArg,
    *,
    loss: ModelLoss,
    n_clients: int | None,
    split: str | Spec | Split | Sequence[Any],
    test: TestArg,
    seed: int,
    input_shape: Sequence[int] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> PreparedData:
    """The clients' padded samples and the held-out part (see the module docstring)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer ≥ 0, got {seed!r}")
    src = _source(data)
    where = f"data {src.name!r}"
    y_all = loss.targets(src.y, src.n_classes, dtype, where)
    X_all = _reshape(src.X, input_shape, src.name)
    N = X_all.shape[0]

    explicit = not isinstance(split, (str, Spec, Split))
    own_pair = _is_pair(test)
    if explicit:
        rows, split_name = resolve_split(split, src.for_split, n_clients)
        parts = list(rows)
        held = np.unique(np.concatenate(parts))
        test_rows = None if own_pair else _test_rows(test, N, seed, allowed=_complement(held, N))
        if test_rows is not None and np.isin(test_rows, held).any():
            bad = test_rows[np.isin(test_rows, held)]
            raise ValueError(
                f"test rows and the explicit client index lists overlap ({bad.size} rows, e.g. "
                f"row {int(bad[0])}): a held-out row must not be a client's; drop those rows from "
                "test=, or pass test=0 (no held-out part)"
            )
    else:
        test_rows = None if own_pair else _test_rows(test, N, seed, allowed=None)
        train = _complement(test_rows, N) if test_rows is not None else np.arange(N)
        if train.size == 0:
            raise ValueError("test= keeps back every row; the clients need samples")
        sub = _subset(src.for_split, train)
        try:
            sub_parts, split_name = resolve_split(split, sub, n_clients)
        except ValueError as e:  # the split saw the training rows only: say where the rest are
            if train.size == N or "exceeds the" not in str(e):
                raise
            raise ValueError(
                f"{e} (the training rows: test={test!r} holds back {N - train.size} of the "
                f"{N} rows; a smaller test= leaves the clients more)"
            ) from None
        parts = [train[p] for p in sub_parts]

    groups = group_clients(X_all, y_all, parts, dtype, device)
    held_out: HeldOut | None = None
    if own_pair:
        assert isinstance(test, tuple)
        tsrc = _pair(test, "test")
        if tsrc.X.shape[1:] != src.X.shape[1:]:
            raise ValueError(
                f"the test inputs have shape {tsrc.X.shape[1:]} per sample, the training data "
                f"{src.X.shape[1:]}"
            )
        ty = loss.targets(tsrc.y, src.n_classes, dtype, "the test pair")
        tX = torch.from_numpy(_reshape(tsrc.X, input_shape, "test"))
        held_out = HeldOut(tX.to(device, dtype), _target_to(ty, dtype, device), None)
    elif test_rows is not None and test_rows.size:
        idx = torch.from_numpy(test_rows)
        tX = torch.from_numpy(X_all)[idx].to(device, dtype)
        held_out = HeldOut(tX, _target_to(y_all[idx], dtype, device), test_rows)
    return PreparedData(groups, held_out, parts, src.name, split_name, src.n_classes)


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------
def _source(data: DataArg) -> _Source:
    if isinstance(data, (str, os.PathLike, Dataset)):
        ds = load(data)
        X = np.asarray(ds.X.toarray(), dtype=np.float64)
        return _Source(X, np.asarray(ds.y), ds.name, ds.n_classes, ds)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return _pair(data, "data")
    raise TypeError(
        "data must be a bundled dataset name ('a9a', 'digits', ...), a LIBSVM path, a Dataset, "
        f"or an (X, y) pair of arrays or tensors; got {type(data).__name__}"
    )


def _pair(pair: Any, what: str) -> _Source:
    X, y = (np.asarray(_numpy(v)) for v in pair)
    if X.ndim < 2:
        raise ValueError(f"{what}: X must have one row per sample (shape (N, ...)), got {X.shape}")
    if y.ndim < 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"{what}: X has {X.shape[0]} rows but y has shape {y.shape}")
    if X.shape[0] == 0:
        raise ValueError(f"{what}: no samples")
    if X.dtype.kind not in "fiub":
        raise TypeError(f"{what}: X must be numeric, got dtype {X.dtype}")
    Xf = np.asarray(X, dtype=np.float64)
    if not np.all(np.isfinite(Xf)):
        raise ValueError(f"{what}: X must be finite (found NaN or inf)")
    yf = np.asarray(y, dtype=np.float64)
    label = yf if yf.ndim == 1 else yf.reshape(yf.shape[0], -1)[:, 0]
    flat = sp.csr_matrix(Xf.reshape(Xf.shape[0], -1))
    return _Source(Xf, yf, "memory", None, Dataset("memory", flat, label, ()))


def _numpy(v: Any) -> Any:
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v


def _reshape(X: np.ndarray, shape: Sequence[int] | None, name: str) -> np.ndarray:
    if shape is None:
        return X
    want = tuple(int(s) for s in shape)
    if any(s < 1 for s in want) or math.prod(want) != math.prod(X.shape[1:]):
        raise ValueError(
            f"input_shape={want} does not fit the {math.prod(X.shape[1:])} values per sample of "
            f"{name!r}"
        )
    return X.reshape(X.shape[0], *want)


def _subset(ds: Dataset, rows: np.ndarray) -> Dataset:
    y = np.asarray(ds.y)[rows]
    return Dataset(ds.name, ds.X[rows], y, ds.label_values, ds.source, ds.image_shape)


# --------------------------------------------------------------------------------------------
# held-out rows
# --------------------------------------------------------------------------------------------
def _is_pair(test: Any) -> bool:
    if not isinstance(test, (tuple, list)) or len(test) != 2:
        return False
    first = _numpy(test[0])
    return np.ndim(first) >= 2


def _test_rows(test: TestArg, N: int, seed: int, allowed: np.ndarray | None) -> np.ndarray | None:
    """Sorted held-out rows of ``data``, or None when nothing is kept back."""
    if test is None:
        return None
    if isinstance(test, (float, int, np.floating, np.integer)) and not isinstance(test, bool):
        frac = float(test)
        if not (0.0 <= frac < 1.0):
            raise ValueError(
                f"test must be a fraction in [0, 1), row indices, an (X, y) pair or None; got "
                f"{test!r}"
            )
        if frac == 0.0:
            return None
        k = max(1, round(frac * N))
        pool = np.arange(N) if allowed is None else allowed
        if pool.size < k:
            raise ValueError(
                f"test={frac:g} asks for {k} held-out rows but only {pool.size} rows are not held "
                "by a client; pass fewer, explicit test rows, or test=0"
            )
        u = Keys.derive(seed, stream="test_split").uniform(N).numpy()[pool]
        return np.sort(pool[np.argsort(u, kind="stable")[:k]]).astype(np.int64)
    if isinstance(test, (bool, str, bytes)):
        raise TypeError(
            f"test must be a fraction, row indices, an (X, y) pair or None; got {test!r}"
        )
    rows = np.asarray(_numpy(test))
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise TypeError(
            f"test row indices must be a 1-D array of integers, got {rows.dtype} of shape "
            f"{rows.shape}"
        )
    rows = rows.astype(np.int64)
    if rows.size == 0:
        return None
    if rows.min() < 0 or rows.max() >= N:
        raise ValueError(f"test row indices must lie in [0, {N}) (the rows of data)")
    if np.unique(rows).size != rows.size:
        raise ValueError("test row indices must be distinct")
    return np.sort(rows)


def _complement(rows: np.ndarray, N: int) -> np.ndarray:
    keep = np.ones(N, dtype=bool)
    keep[rows] = False
    return np.flatnonzero(keep).astype(np.int64)


# --------------------------------------------------------------------------------------------
# padding
# --------------------------------------------------------------------------------------------
def group_clients(
    X: np.ndarray,
    y: torch.Tensor,
    parts: Sequence[np.ndarray],
    dtype: torch.dtype,
    device: torch.device,
) -> list[ClientGroup]:
    """The clients in groups of sizes within one octave, each padded to its largest client."""
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    octave = np.floor(np.log2(sizes)).astype(np.int64)
    groups = []
    for k in np.unique(octave):  # a handful of groups (≤ log2 of the largest client)
        members = np.flatnonzero(octave == k)
        batch = _pad(X, y, [parts[int(i)] for i in members], dtype, device)
        groups.append(ClientGroup(batch, torch.from_numpy(members.astype(np.int64))))
    return groups


def _pad(
    X: np.ndarray,
    y: torch.Tensor,
    parts: Sequence[np.ndarray],
    dtype: torch.dtype,
    device: torch.device,
) -> ClientBatch:
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    flat = np.concatenate(parts)
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    j = np.arange(int(sizes.max()))[None, :]
    real = j < sizes[:, None]
    index = torch.from_numpy(flat[start[:, None] + np.where(real, j, 0)])  # padding: first row
    w = torch.from_numpy(real / sizes[:, None].astype(np.float64))
    Xt = torch.from_numpy(X)[index].to(device, dtype)
    yt = _target_to(y[index], dtype, device)
    return ClientBatch(Xt, yt, w.to(device, dtype), torch.from_numpy(sizes))


def _target_to(y: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return y.to(device, dtype) if y.dtype.is_floating_point else y.to(device)
