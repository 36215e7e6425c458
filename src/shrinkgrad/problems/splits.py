"""Client splits: which samples of a dataset each of the n clients holds.

A split maps ``(dataset, n_clients)`` to a list of n integer index arrays (one per client, each
non-empty). Build one by name with the shared syntax, ``make_split("dirichlet[alpha=0.5,seed=0]")``,
or pass an explicit list of index arrays to a problem. Registered splits (``shrinkgrad list
splits``):

* ``contiguous`` — equal chunks in file order as in the EF21 authors' code: client i < n − 1 gets
  samples [i·m, (i + 1)·m) with m = ⌊N/n⌋, the last client also gets the remainder;
* ``shuffled[seed=0]`` — the same chunks of a keyed random permutation;
* ``by_label`` — samples sorted by label (stable), then chunked: clients see one class each
  (except at most one mixed client), the most label-heterogeneous split;
* ``dirichlet[alpha=0.5,seed=0]`` — label skew: for every class, proportions over the clients
  drawn from Dir(α·1_n) (Hsu et al. 2019); small α, strong skew;
* ``heterogeneous_smoothness[key=projection]`` — samples sorted by ⟨a_j, v⟩² (v the top
  eigenvector of AᵀA) or, with ``key=norm``, by ‖a_j‖², then chunked, so that the per-client L_i
  spread widely.

Randomness comes only from :mod:`shrinkgrad.rng` (stream ``"split"``). ``n_clients`` larger than
the number of samples is an error, unless a split is asked to reuse samples
(``contiguous[reuse=true]``, ``shuffled[reuse=true]``): then client i gets sample i mod N.

A split's result is a :class:`ClientRows`: the sample indices of every client in one array with
the clients' offsets, a sequence of per-client index arrays (views) without a Python object per
client, so that 10⁵ clients cost two arrays (federated-scale client counts, issue 17).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal, overload

import numpy as np
import torch

from ..registry import Registry, Spec
from ..rng import Keys
from .datasets import Dataset

__all__ = [
    "SPLITS",
    "ByLabel",
    "ClientRows",
    "Contiguous",
    "Dirichlet",
    "ExplicitSplit",
    "HeterogeneousSmoothness",
    "Shuffled",
    "Split",
    "check_parts",
    "make_split",
    "resolve_split",
]


class ClientRows(Sequence[np.ndarray]):
    """The samples of n clients: client i holds ``order[offsets[i]:offsets[i + 1]]``.

    A sequence of int64 index arrays (``parts[i]`` is a view), stored as two arrays: ``order``
    (the concatenated indices, client by client) and ``offsets`` (n + 1 increasing positions).
    """

    def __init__(self, order: np.ndarray, offsets: np.ndarray) -> None:
        self.order = np.ascontiguousarray(order, dtype=np.int64)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or self.offsets.size < 1 or self.offsets[0] != 0:
            raise ValueError("offsets must be a 1-D array starting at 0")
        if self.offsets[-1] != self.order.size or np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must be non-decreasing and end at len(order)")

    @classmethod
    def of(cls, parts: Sequence[np.ndarray] | ClientRows) -> ClientRows:
        """``parts`` as :class:`ClientRows` (itself when it already is one)."""
        if isinstance(parts, ClientRows):
            return parts
        arrays = [_as_index_array(p, i) for i, p in enumerate(parts)]
        sizes = np.array([a.size for a in arrays], dtype=np.int64)
        order = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(order, np.concatenate([[0], np.cumsum(sizes)]))

    @property
    def sizes(self) -> np.ndarray:
        """The number of samples of every client, int64 (n,)."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...
    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"client {i} out of range for {n} clients")
        return self.order[self.offsets[k] : self.offsets[k + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for k in range(len(self)):
            yield self.order[self.offsets[k] : self.offsets[k + 1]]

    def __repr__(self) -> str:
        return f"<ClientRows: {len(self)} clients, {self.order.size} samples>"


class Split(abc.ABC):
    """Base class of every split (see the module docstring)."""

    __registry__: ClassVar[Registry[Split]]
    #: canonical name, set by the registry when built from a name
    spec: str = ""
    #: whether n_clients > N is allowed (samples then appear at several clients)
    reuse: bool = False

    def __call__(self, data: Dataset, n_clients: int) -> ClientRows:
        """The clients' index arrays (int64, each non-empty) for ``n_clients`` clients."""
        n = _check_n_clients(n_clients)
        N = data.n_samples
        if n > N and not self.reuse:
            raise ValueError(
                f"n_clients={n} exceeds the {N} samples of dataset {data.name!r}: every client "
                f"needs at least one sample; use at most {N} clients, or allow sample reuse "
                "explicitly, e.g. split='contiguous[reuse=true]'"
            )
        return check_parts(self._parts(data, n), N)

    @abc.abstractmethod
    def _parts(self, data: Dataset, n: int) -> ClientRows | list[np.ndarray]:
        """The index arrays (``n`` ≤ N unless ``reuse``)."""

    @property
    def name(self) -> str:
        return self.spec or type(self).__name__

    def __repr__(self) -> str:
        return f"<split {self.name}>"


SPLITS: Registry[Split] = Registry("split", base=Split)
Split.__registry__ = SPLITS


def _check_n_clients(n_clients: Any) -> int:
    if isinstance(n_clients, bool) or not isinstance(n_clients, (int, np.integer)) or n_clients < 1:
        raise ValueError(f"n_clients must be a positive integer, got {n_clients!r}")
    return int(n_clients)


def chunks(order: np.ndarray, n: int, reuse: bool = False) -> ClientRows:
    """The EF21 authors' chunking of ``order`` into n parts (last part takes the remainder).

    With ``reuse`` and n > len(order), part i is ``[order[i mod N]]``. No per-client loop.
    """
    N = order.size
    if n > N:
        if not reuse:  # pragma: no cover - guarded by Split.__call__
            raise ValueError(f"cannot split {N} samples over {n} clients")
        return ClientRows(order[np.arange(n, dtype=np.int64) % N], np.arange(n + 1))
    m = N // n
    offsets = np.arange(n + 1, dtype=np.int64) * m
    offsets[-1] = N
    return ClientRows(order, offsets)


def _uniform(seed: int, count: int, client: int = 0) -> np.ndarray:
    keys = Keys.derive(seed, client=client, stream="split")
    return keys.uniform(count).numpy()


def _permutation(seed: int, count: int, client: int = 0) -> np.ndarray:
    """A keyed random permutation of range(count) (stable sort of keyed uniforms)."""
    return np.argsort(_uniform(seed, count, client), kind="stable").astype(np.int64)


@SPLITS.register("contiguous")
class Contiguous(Split):
    """Equal chunks in file order, the last client takes the remainder (EF21 authors' code)."""

    def __init__(self, reuse: bool = False) -> None:
        self.reuse = reuse

    def _parts(self, data: Dataset, n: int) -> ClientRows:
        return chunks(np.arange(data.n_samples, dtype=np.int64), n, self.reuse)


@SPLITS.register("shuffled")
class Shuffled(Split):
    """Equal chunks of a keyed random permutation (stream "split", the given seed)."""

    def __init__(self, seed: int = 0, reuse: bool = False) -> None:
        if seed < 0:
            raise ValueError(f"split seed must be ≥ 0, got {seed}")
        self.seed = seed
        self.reuse = reuse

    def _parts(self, data: Dataset, n: int) -> ClientRows:
        return chunks(_permutation(self.seed, data.n_samples), n, self.reuse)


@SPLITS.register("by_label")
class ByLabel(Split):
    """Samples sorted by label (−1 first, stable), then equal chunks: one class per client."""

    def _parts(self, data: Dataset, n: int) -> ClientRows:
        return chunks(np.argsort(data.y, kind="stable").astype(np.int64), n)


@SPLITS.register("heterogeneous_smoothness")
class HeterogeneousSmoothness(Split):
    """Rows sorted by a smoothness score (ascending, stable), then equal chunks: spread-out L_i.

    ``key="projection"`` (default): ⟨a_j, v⟩² with v the top eigenvector of AᵀA — rows aligned
    with the dominant direction end up together, so those clients get a large λ_max(A_iᵀA_i)/m_i;
    it spreads the L_i even when all rows have the same norm (one-hot data: a9a, mushrooms,
    phishing). ``key="norm"``: ‖a_j‖² (λ_max(A_iᵀA_i)/m_i lies between max_j ‖a_j‖²/m_i and the
    mean of the client's ‖a_j‖²); no effect when all rows have the same norm.
    """

    def __init__(self, key: Literal["projection", "norm"] = "projection") -> None:
        if key not in ("projection", "norm"):
            raise ValueError(f"key must be 'projection' or 'norm', got {key!r}")
        self.key = key

    def _parts(self, data: Dataset, n: int) -> ClientRows:
        X = data.X
        if self.key == "norm":
            score = np.asarray(X.multiply(X).sum(axis=1)).reshape(-1)
        else:
            score = np.asarray(X @ _top_eigenvector(X)).reshape(-1) ** 2
        return chunks(np.argsort(score, kind="stable").astype(np.int64), n)


def _top_eigenvector(X: Any) -> np.ndarray:
    """Top eigenvector of XᵀX (dense solver up to 2048 features, Lanczos beyond)."""
    d = X.shape[1]
    if d <= 2048:
        gram = np.asarray((X.T @ X).toarray())
        return np.asarray(np.linalg.eigh(gram)[1][:, -1])
    from scipy.sparse.linalg import LinearOperator, eigsh

    op = LinearOperator((d, d), matvec=lambda v: X.T @ (X @ v), dtype=np.float64)
    start = Keys.derive(0, stream="lanczos").uniform(d).numpy() - 0.5
    return np.asarray(eigsh(op, k=1, which="LA", v0=start, tol=1e-12)[1][:, 0])


@SPLITS.register("dirichlet")
class Dirichlet(Split):
    """Label skew: class-c samples are divided in proportions p_c ~ Dir(α·1_n) (Hsu et al. 2019).

    Every class's samples are shuffled (keyed), the Dirichlet proportions come from Gamma(α)
    variates obtained by inverting the Gamma CDF at keyed uniforms, and the cut points are
    round(N_c · cumsum(p_c)). A client left empty then receives the last sample of the currently
    largest client (a deterministic fix-up, so that every client holds data).
    """

    def __init__(self, alpha: float = 0.5, seed: int = 0) -> None:
        if not (alpha > 0 and np.isfinite(alpha)):
            raise ValueError(
                f"dirichlet concentration alpha must be a finite number > 0, got {alpha}"
            )
        if seed < 0:
            raise ValueError(f"split seed must be ≥ 0, got {seed}")
        self.alpha = float(alpha)
        self.seed = seed

    def _parts(self, data: Dataset, n: int) -> ClientRows:
        from scipy.special import gammaincinv

        samples, owners = [], []
        for c, label in enumerate(np.unique(data.y)):
            idx = np.flatnonzero(data.y == label).astype(np.int64)
            idx = idx[_permutation(self.seed, idx.size, client=2 * c + 1)]
            u = _uniform(self.seed, n, client=2 * c + 2)
            g = gammaincinv(self.alpha, u)
            total = float(g.sum())
            p = g / total if total > 0 and np.isfinite(total) else (u == u.max()).astype(float)
            cuts = np.rint(np.cumsum(p) * idx.size).astype(np.int64)
            cuts[-1] = idx.size
            # client i gets idx[end_{i−1}:end_i], end = the running maximum of the cuts
            ends = np.minimum(np.maximum.accumulate(cuts), idx.size)
            samples.append(idx)
            owners.append(np.searchsorted(ends, np.arange(idx.size), side="right"))
        sample, owner = np.concatenate(samples), np.concatenate(owners)
        return _fill_empty(sample, owner, n)


def _fill_empty(sample: np.ndarray, owner: np.ndarray, n: int) -> ClientRows:
    """The clients' samples (client by client, in the order of ``sample``), where each empty
    client, in turn, receives the last sample of the currently largest client (the first of the
    largest on ties): a heap of the sizes, O(N + n log n) whatever the number of empty clients."""
    import heapq

    order = sample[np.argsort(owner, kind="stable")]
    sizes = np.bincount(owner, minlength=n)
    empty = np.flatnonzero(sizes == 0)
    if empty.size == 0:
        return ClientRows(order, np.concatenate([[0], np.cumsum(sizes)]))
    client = np.repeat(np.arange(n, dtype=np.int64), sizes)  # the client of each position
    ends = np.cumsum(sizes)  # one past the last position each client still holds
    heap = [(-int(sizes[i]), int(i)) for i in np.flatnonzero(sizes > 0)]
    heapq.heapify(heap)
    for e in empty.tolist():  # each donor keeps ≥ 1 sample: N ≥ n
        size, donor = heapq.heappop(heap)
        ends[donor] -= 1
        client[ends[donor]] = e
        heapq.heappush(heap, (size + 1, donor))
    keep = np.argsort(client, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(client, minlength=n))])
    return ClientRows(order[keep], offsets)


class ExplicitSplit(Split):
    """A split given as an explicit list of per-client index arrays (n_clients is implied)."""

    reuse = True

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = [_as_index_array(p, i) for i, p in enumerate(parts)]
        if not self.parts:
            raise ValueError("an explicit split needs at least one client's index array")
        self.spec = f"explicit[n_clients={len(self.parts)}]"

    def __call__(self, data: Dataset, n_clients: int | None = None) -> ClientRows:
        if n_clients is not None and n_clients != len(self.parts):
            raise ValueError(
                f"n_clients={n_clients} but the explicit split has {len(self.parts)} index "
                "arrays; omit n_clients (it is implied) or pass that many arrays"
            )
        return check_parts(self.parts, data.n_samples)

    def _parts(self, data: Dataset, n: int) -> list[np.ndarray]:  # pragma: no cover - unused
        return self.parts


def _as_index_array(p: Any, i: int) -> np.ndarray:
    if isinstance(p, torch.Tensor):
        p = p.detach().cpu().numpy()
    arr = np.asarray(p)
    if arr.ndim != 1:
        raise ValueError(f"client {i}'s indices must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "b":
            raise TypeError(
                f"client {i}'s indices are booleans; pass integer sample indices (np.flatnonzero)"
            )
        if arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise TypeError(f"client {i}'s indices must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def check_parts(parts: Sequence[np.ndarray] | ClientRows, n_samples: int) -> ClientRows:
    """Validate index arrays against a dataset of ``n_samples`` rows (non-empty, in range)."""
    rows = ClientRows.of(parts)
    empty = np.flatnonzero(rows.sizes == 0)
    if empty.size:
        raise ValueError(f"client {int(empty[0])} has no samples; every client needs at least one")
    bad = np.flatnonzero((rows.order < 0) | (rows.order >= n_samples))
    if bad.size:
        i = int(np.searchsorted(rows.offsets, bad[0], side="right") - 1)
        arr = rows[i]
        raise ValueError(
            f"client {i}'s indices must be in [0, {n_samples}) (the dataset's samples), got "
            f"min {arr.min()}, max {arr.max()}"
        )
    return rows


def make_split(spec: str | Spec | Split, **params: Any) -> Split:
    """Build a split from its name, e.g. ``make_split("shuffled[seed=1]")`` or
    ``make_split("shuffled", seed=1)``."""
    return SPLITS.make(spec, **params)


def resolve_split(
    split: str | Spec | Split | Sequence[Any], data: Dataset, n_clients: int | None
) -> tuple[ClientRows, str]:
    """Index arrays and a canonical description for a split name, object or explicit list."""
    if isinstance(split, (str, Spec, Split)):
        s = make_split(split)
        if isinstance(s, ExplicitSplit):
            return s(data, n_clients), s.name
        if n_clients is None:
            raise ValueError(
                f"n_clients is required with split {s.name!r} (it is implied only by an explicit "
                "list of index arrays)"
            )
        return s(data, n_clients), s.name
    if isinstance(split, (Sequence, np.ndarray)):
        e = ExplicitSplit(list(split))
        return e(data, n_clients), e.name
    raise TypeError(
        "split must be a split name such as 'contiguous' or 'dirichlet[alpha=0.5]', a Split, or "
        f"a list of per-client index arrays; got {type(split).__name__}"
    )
