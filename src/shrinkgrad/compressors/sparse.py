"""Random sparsifiers: rand-k (unbiased and scaled), its block-stratified variant strat-k, and
Bernoulli sparsification.

rand-k index sets
-----------------
Row r keeps S_r = {(π_r(i) + ρ_r) mod d : i = 0, …, k−1}, where

* π_r is a keyed pseudo-random permutation of [0, d): a 4-round Feistel network on the
  mixed-radix domain Z_nb × Z_{2^m} (m = ⌊b/2⌋ for b = ⌈log₂ d⌉, nb = ⌈d / 2^m⌉; round value
  ``mix32(half ⊕ key_t)``, added modulo nb to the left half, XORed into the right half),
  restricted to [0, d) by cycle walking (re-apply until the value is < d). The domain nb·2^m
  exceeds d by less than 2^m ≈ √d, so fewer than 1/nb of the draws walk at all (on a
  power-of-two domain up to half of them: d just above a power of two, a DDP bucket's size);
* ρ_r is uniform on [0, d) (rejection sampling of 32-bit words: exactly uniform unless all
  :data:`ROT_TRIES` = 8 words are rejected, probability (d/2³²)⁸ < 10⁻²⁰ for d ≤ 10⁷).

The k indices are distinct because π_r is a bijection, and P(j ∈ S_r) = k/d *exactly* for every j
because of the uniform rotation ρ_r alone — which is all that unbiasedness and ω = d/k − 1 need:
E‖C(x) − x‖² = Σ_j x_j² (P(j∈S)(d/k − 1)² + (1 − P(j∈S))) = (d/k − 1)‖x‖² involves only the
inclusion probabilities. The set as a whole is close to, not exactly, a uniform k-subset: the
Feistel network and the rotation reach only part of the orderings, and for small d pair
inclusions deviate measurably (d = 8, k = 3: 0.80–1.09× k(k−1)/(d(d−1)); docs/compressors.md,
tests/test_rng_audit.py). Cost O(k) per row (never ``randperm``, which is
unusably slow on CPU), computable index by index on any device.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from numpy.typing import DTypeLike

from ..rng import MASK32, Keys, bits32_torch, mix32_torch
from . import _kernels as K
from . import _strat_kernels as SK
from ._random import EXTRA, draw_up, kernel_keys
from ._wire import BitReader, BitWriter, float_width, paper_width
from .base import (
    COMPRESSORS,
    Compressor,
    Kind,
    Sparsifier,
    _check_positive_int,
    _emit,
    _keys_rows,
    _log2ceil,
    _out_rows,
    _require_finite,
    _rows,
    _use_numba,
    non_finite_error,
    take,
)

__all__ = [
    "Bernoulli",
    "LazyBernoulli",
    "RandK",
    "RandKScaled",
    "StratK",
    "randk_domain",
    "randk_indices_torch",
    "strat_bounds",
    "strat_indices_torch",
]

#: fold tag of the rand-k permutation keys
RANDK_TAG = "rand_k"
#: 32-bit words tried for the uniform rotation (rejection probability < d/2³² each)
ROT_TRIES = 8


def randk_domain(d: int) -> tuple[int, int, int, int]:
    """(m, mask_lo, hmask, nb) of the Feistel domain of [0, d): values v = (l, r), l = v >> m in
    Z_nb, r = v & mask_lo in Z_{2^m}, with b = ⌈log₂ d⌉, m = ⌊b/2⌋, nb = ⌈d / 2^m⌉ and
    hmask = 2^(b−m) − 1 (< 2·nb: a round value masked by it needs one subtraction of nb). The
    domain nb·2^m exceeds d by less than 2^m ≈ √d, so cycle walking is rare (a power-of-two
    domain walks up to half the draws: d just above a power of two)."""
    m = _log2ceil(d) // 2
    return m, (1 << m) - 1, (1 << (_log2ceil(d) - m)) - 1, (d + (1 << m) - 1) >> m


def _feistel(
    v: torch.Tensor, m: int, mask_lo: int, hmask: int, nb: int, rk: list[torch.Tensor]
) -> torch.Tensor:
    """``K._feistel`` on ``int64`` tensors: the left half adds round values modulo nb, the right
    half XORs them."""
    left = v >> m
    right = v & mask_lo
    for t in (0, 2):
        f = mix32_torch(right ^ rk[t]) & hmask
        left = left + torch.where(f >= nb, f - nb, f)
        left = torch.where(left >= nb, left - nb, left)
        right = right ^ (mix32_torch(left ^ rk[t + 1]) & mask_lo)
    return (left << m) | right


def randk_indices_torch(keys: Keys, d: int, k: int) -> torch.Tensor:
    """The rand-k index sets of every row key (shape ``(*keys.shape, k)``), torch reference.

    ``keys`` are the already folded permutation keys (``row_keys.fold("rand_k")``).
    """
    m, mask_lo, hmask, nb = randk_domain(d)
    words = keys.bits32(4 + ROT_TRIES)
    rk = [words[..., t : t + 1] for t in range(4)]
    w = words[..., 4:]
    limit = 2**32 - (2**32 % d)
    accepted = w < limit
    first = torch.where(
        accepted.any(dim=-1),
        accepted.to(torch.int64).argmax(dim=-1),
        torch.full_like(w[..., 0], ROT_TRIES - 1),
    )
    rot = w.gather(-1, first[..., None]) % d
    i = torch.arange(k, device=keys.device, dtype=torch.int64).expand(*keys.shape, k)
    y = _feistel(i, m, mask_lo, hmask, nb, rk)
    while True:
        over = y >= d
        if not bool(over.any()):
            break
        y = torch.where(over, _feistel(y, m, mask_lo, hmask, nb, rk), y)
    return (y + rot) % d


def _raise_for(status: int, name: str, dtype: torch.dtype) -> None:
    """The kernels' status as the compressor's error: a non-finite input, or a kept value
    scaled beyond ``dtype``'s range (nothing for OK)."""
    if status == K.NON_FINITE:
        raise non_finite_error(name)
    if status == K.OVERFLOW:
        raise _overflow_error(name, dtype)


class _KeyedGather(Sparsifier):
    """A random sparsifier whose kept values are read by one checking kernel pass,
    :meth:`_gather` (rand-k's and strat-k's), also from a bfloat16 bucket's bit patterns."""

    def _gather(
        self, x: torch.Tensor, keys: Keys, src: torch.Tensor, view: type | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of ``x`` (float32/float64, or bfloat16 read as the patterns
        ``src`` viewed as ``view``)."""
        raise NotImplementedError

    def _select_torch(self, x: torch.Tensor, keys: Keys) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_select` off the kernels (torch ops, any device)."""
        raise NotImplementedError

    def _select(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        assert keys is not None
        if _use_numba(x):  # no dense output: one pass checks x and reads the kept values
            return self._gather(x, keys, x, None)
        _require_finite(x, self.name)
        return self._select_torch(x, keys)

    @staticmethod
    def _source(src: torch.Tensor, view: type | None) -> tuple[np.ndarray, Any]:
        """(rows of ``src`` as the kernels read them, the values' numpy dtype): bfloat16 bit
        patterns (``view``) give float32 values."""
        x2 = _rows(src)
        if view is not None:
            return x2.view(view), np.float32
        return x2, x2.dtype.type

    def _sparse_bf16(
        self, x: torch.Tensor, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel path of :meth:`_select` on the bit patterns of a bfloat16 ``x``: the
        check and the gather read 2 bytes an entry, widening the kept values to float32 exactly
        before scaling them in float32 — the values of ``_select(x.float(), keys)``."""
        if not _use_numba(x):
            return None
        assert keys is not None
        return self._gather(x, keys, x.contiguous().view(torch.int16), np.uint16)


class _RandKBase(_KeyedGather):
    collective = "allgather"
    positively_homogeneous = True
    sparse_message = True
    _scaled: bool = True

    def __init__(self, k: int, shared_seed: bool = False) -> None:
        self.k = _check_positive_int(k, "k (the number of kept coordinates)", self._family)
        self.shared_seed = bool(shared_seed)

    @property
    def _family(self) -> str:
        return "rand_k" if self._scaled else "rand_k_scaled"

    def _k(self, d: int) -> int:
        if self.k > d:
            raise ValueError(
                f"{self._family}[k={self.k}] cannot keep more than d={d} coordinates; use k in "
                f"[1, {d}]"
            )
        return self.k

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(self._k(d) * float_width(dtype) + self.index_bits(d))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(paper_width(dtype) * self._k(d))

    def index_bits(self, d: int) -> int:
        return 0 if self.shared_seed else self._k(d) * _log2ceil(d)

    def _scale(self, d: int) -> float:
        return d / self._k(d) if self._scaled else 1.0

    def _idx(self, keys: Keys, d: int, numba: bool) -> torch.Tensor:
        k = self._k(d)
        pk = keys.fold(RANDK_TAG)
        if numba:
            lo, hi = _keys_rows(pk)
            idx = np.empty((lo.shape[0], k), dtype=np.int64)
            dom = randk_domain(d)
            if d <= 1 << 32:  # vectorized uint32 Feistel, blocks of indices on the threads
                K.run(K.randk_block, idx, lo, hi, d, ROT_TRIES, idx, dom)
            else:
                K.randk_indices(lo, hi, d, k, ROT_TRIES, idx, dom)
            return torch.from_numpy(idx).reshape(*keys.shape, k)
        return randk_indices_torch(pk, d, k)

    def _select_torch(self, x: torch.Tensor, keys: Keys) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        idx = self._idx(keys, d, False)
        vals = take(x, idx)
        if self._scaled:
            vals = vals * torch.tensor(self._scale(d), dtype=x.dtype, device=x.device)
            if not bool(torch.isfinite(vals).all()):
                raise _overflow_error(self.name, x.dtype)
        return idx, vals

    def _gather(
        self, x: torch.Tensor, keys: Keys, src: torch.Tensor, view: type | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept values of ``x`` (float32/float64, or bfloat16 read as the patterns ``src``
        viewed as ``view``) by one checking pass of the kernels (:func:`K.sparse_gather`)."""
        d = x.shape[-1]
        idx = self._idx(keys, d, True)
        ik = idx.reshape(-1, self._k(d)).numpy()
        x2, vdtype = self._source(src, view)
        order = np.empty_like(ik)
        starts = np.empty((ik.shape[0], -(-d // K.CHUNK) + 1), dtype=np.int64)
        K.bucket_by_chunk(ik, order, starts, True)
        out = np.empty(ik.shape, dtype=vdtype)
        sc = np.array([self._scale(d)], dtype=vdtype)
        status = K.run(K.sparse_gather, x2, x2, order, starts, sc, out)
        _raise_for(status, self.name, torch.float32 if view is not None else x.dtype)
        return idx, torch.from_numpy(out).reshape(idx.shape)

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        assert keys is not None
        d = x.shape[-1]
        if _use_numba(x):
            ik = self._idx(keys, d, True).reshape(-1, self._k(d)).numpy()
            res, o2, copy = _out_rows(x, out)
            sc = np.array([self._scale(d)], dtype=o2.dtype)
            x2 = _rows(x)
            # the kept indices sorted by chunk, so that one pass per chunk zeroes it, checks x
            # finite and writes the chunk's kept values while both are in cache
            order = np.empty_like(ik)
            starts = np.empty((ik.shape[0], -(-d // K.CHUNK) + 1), dtype=np.int64)
            K.bucket_by_chunk(ik, order, starts)
            status = K.run(K.sparse_rows, x2, x2, order, starts, sc, o2)
            _raise_for(status, self.name, x.dtype)
            return _emit(res, out) if copy else res
        idx, vals = self._select(x, keys)
        res = torch.zeros_like(x) if out is None else out.zero_()
        return res.scatter_(-1, idx, vals)

    def _encode_indices(self, w: BitWriter, idx: torch.Tensor, d: int) -> None:
        if not self.shared_seed:  # with a shared seed the receiver redraws the indices
            super()._encode_indices(w, idx, d)

    def _packed_width(self, d: int) -> int | None:
        return None if self.shared_seed else super()._packed_width(d)

    def _decode_indices(self, r: BitReader, d: int, keys: Keys | None) -> torch.Tensor:
        if self.shared_seed:
            assert keys is not None
            return self._idx(keys.to(r.device), d, r.fast)
        return super()._decode_indices(r, d, keys)


def _check_probability(p: float, name: str, what: str) -> float:
    """``p`` as a float in (0, 1], or an error naming the parameter and its range."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} needs a number p ({what}), got {p!r}")
    if not (0.0 < float(p) <= 1.0):
        raise ValueError(f"{name} needs p ({what}) in (0, 1], got p={p}")
    return float(p)


def _overflow_error(name: str, dtype: torch.dtype) -> ValueError:
    return ValueError(
        f"{name}: a compressed value overflows {dtype} (|x_j| times the scaling exceeds "
        f"{torch.finfo(dtype).max:.3g}); rescale the input or compress float64 tensors"
    )


@COMPRESSORS.register("rand_k")
class RandK(_RandKBase):
    """Unbiased random-k sparsification ([K18] §2; methods.md §2): keep k coordinates drawn
    without replacement and scale them by d/k.

    E C(x) = x and E‖C(x) − x‖² = Σ_j x_j² (d/k − 1) = (d/k − 1)‖x‖², so ω = d/k − 1 exactly
    for every x. Message: k values of 32 bits plus k indices of ⌈log₂ d⌉ bits, or only the values
    with ``shared_seed=true`` (the receiver regenerates the indices from the shared key).
    ``scaled(rand_k[k=…])`` is exactly ``rand_k_scaled[k=…]``.
    """

    kind = "unbiased"
    constant_formula = "ω = d/k − 1"
    bits_formula = "k·(32 + ⌈log₂ d⌉); 32·k with shared_seed=true"

    def omega(self, d: int) -> float:
        return d / self._k(d) - 1.0

    def scaled_form(self) -> Compressor:
        """C/(1 + ω) computed exactly: the same selection without the d/k scaling."""
        return RandKScaled(self.k, self.shared_seed)


@COMPRESSORS.register("rand_k_scaled")
class RandKScaled(_RandKBase):
    """Scaled rand-k = (k/d)·rand-k: keep k random coordinates unscaled (contractive).

    E‖C(x) − x‖² = (1 − k/d)‖x‖² exactly, so α = k/d (methods.md §2; = 1/(1 + ω) of rand-k).
    Same indices, bits and wire format as ``rand_k`` with the same keys.
    """

    kind = "contractive"
    projection = True
    _scaled = False
    constant_formula = "α = k/d"
    bits_formula = "k·(32 + ⌈log₂ d⌉); 32·k with shared_seed=true"

    def alpha(self, d: int) -> float:
        return self._k(d) / d


# --------------------------------------------------------------------------------------------
# strat-k: one coordinate drawn in each of k blocks
# --------------------------------------------------------------------------------------------
#: fold tag of the strat-k draw keys
STRATK_TAG = "strat_k"


@functools.lru_cache(maxsize=64)
def strat_bounds(d: int, k: int) -> np.ndarray:
    """The k + 1 bounds ⌊b·d/k⌋ (b = 0, …, k) of strat-k's blocks B_b = [⌊b·d/k⌋,
    ⌊(b+1)·d/k⌋) of [0, d), as a read-only ``int64`` array (cached: the wire format and the
    torch path use them every call)."""
    b = np.arange(k + 1, dtype=np.int64)
    out = (b * d) // k
    out.flags.writeable = False
    return out


def strat_indices_torch(keys: Keys, d: int, k: int) -> torch.Tensor:
    """strat-k's kept index of every block for every row key (shape ``(*keys.shape, k)``,
    ascending), torch reference of :func:`._strat_kernels.strat_draw` (the rule is stated in
    :mod:`._strat_kernels`: Lemire's multiply-shift with rejection, exactly uniform on each
    block unless all :data:`~._strat_kernels.TRIES` words of a block are rejected).

    ``keys`` are the already folded draw keys (``row_keys.fold("strat_k")``).
    """
    dev = keys.device
    b = torch.arange(k, device=dev, dtype=torch.int64)
    lo = b * d // k
    s = (b + 1) * d // k - lo
    m = keys.bits32(k) * s  # < 2³²·2³¹: exact in int64
    t = (2**32 - s) % s  # 2³² mod s
    bad = (m & MASK32) < t
    if bool(bad.any()):  # (rare: probability < s/2³² per block)
        k2 = keys.fold(EXTRA)
        for tr in range(1, SK.TRIES):
            cnt = (b * SK.TRIES + tr) & MASK32
            m2 = bits32_torch(k2.lo[..., None], k2.hi[..., None], cnt) * s
            m = torch.where(bad, m2, m)
            bad = bad & ((m2 & MASK32) < t)
            if not bool(bad.any()):
                break
    return lo + (m >> 32)


@COMPRESSORS.register("strat_k")
class StratK(_KeyedGather):
    """Block-stratified random sparsification: the stratified variant of the unbiased random
    sparsifier rand-k ([K18] §2, Khirirat et al. 2018; methods.md §2). [0, d) is cut into k
    blocks B_b = [⌊b·d/k⌋, ⌊(b+1)·d/k⌋) of ⌊d/k⌋ or ⌈d/k⌉ entries; block b keeps one index j_b
    drawn uniformly in B_b (independently across blocks), with the value |B_b|·x_{j_b}:

        C(x) = Σ_b |B_b| x_{j_b} e_{j_b}.

    Unbiased: E C(x)_j = P(j_b = j)·|B_b| x_j = x_j. Second moment: E‖C(x)‖² = Σ_b E |B_b|²
    x_{j_b}² = Σ_b |B_b| Σ_{j ∈ B_b} x_j² = Σ_j |B(j)| x_j² (B(j): the block of j), so
    E‖C(x) − x‖² = Σ_j (|B(j)| − 1) x_j² ≤ (⌈d/k⌉ − 1)‖x‖², with equality for x supported on
    a largest block: ω = ⌈d/k⌉ − 1, tight (rand-k's d/k − 1 when k divides d, less than 1
    above it otherwise). It is not rand-k: two entries of one block are never kept together,
    so its k-subsets are not uniform, and ω is its own.

    Its indices come out sorted with no permutation to draw, and a block's kept value is read
    while the finiteness check of the input streams over that block (one pass, the fused CPU
    kernel :func:`._strat_kernels.strat_gather`). Draws: :mod:`._strat_kernels` (keys
    ``keys.fold("strat_k")``; Lemire's multiply-shift with rejection, exactly uniform per
    block). Message: k offsets j_b − ⌊b·d/k⌋ of ⌈log₂⌈d/k⌉⌉ bits each (the block is the
    position of the field in the message), then the k values; with ``shared_seed=true`` only
    the values (every client of a round draws the same blocks' indices from the shared key, as
    ``rand_k[shared_seed=true]``: the DDP hook all-reduces the k values).
    """

    kind: Kind = "unbiased"
    collective = "allgather"
    positively_homogeneous = True
    sparse_message = True
    constant_formula = "ω = ⌈d/k⌉ − 1"
    bits_formula = "k·(32 + ⌈log₂⌈d/k⌉⌉); 32·k with shared_seed=true"

    def __init__(self, k: int, shared_seed: bool = False) -> None:
        self.k = _check_positive_int(
            k, "k (the number of blocks, one coordinate kept in each)", "strat_k"
        )
        self.shared_seed = bool(shared_seed)

    def _k(self, d: int) -> int:
        k = self.k
        if k > d:
            raise ValueError(
                f"strat_k[k={k}] cannot keep more than d={d} coordinates; use k in [1, {d}]"
            )
        if -(-d // k) > 1 << 31 or d * k >= 1 << 62:
            # blocks of at most 2³¹ entries need k ≥ ⌈d/2³¹⌉; the int64 block bounds b·d need
            # d·k < 2⁶², so k ≤ ⌊(2⁶² − 1)/d⌋: "a larger k" is no advice for the second bound
            lo, hi = -(-d // (1 << 31)), min(d, ((1 << 62) - 1) // d)
            fix = f"use k in [{lo}, {hi}]" if lo <= hi else "no k fits a vector this long"
            raise ValueError(
                f"strat_k[k={k}] at d={d}: blocks of ⌈d/k⌉ = {-(-d // k)} entries and d·k = "
                f"{d * k} (at most 2³¹ entries a block, and d·k < 2⁶²); {fix}"
            )
        return k

    def _width(self, d: int) -> int:
        """⌈log₂⌈d/k⌉⌉: the bits of one offset within its block."""
        return _log2ceil(-(-d // self._k(d)))

    def omega(self, d: int) -> float:
        return float(-(-d // self._k(d)) - 1)

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(self._k(d) * float_width(dtype) + self.index_bits(d))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(paper_width(dtype) * self._k(d))

    def index_bits(self, d: int) -> int:
        return 0 if self.shared_seed else self._k(d) * self._width(d)

    # -- draws ----------------------------------------------------------------------------------
    @staticmethod
    def _kernel_keys(keys: Keys) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, lo₂, hi₂) of the draw keys K = keys.fold("strat_k") and K₂ =
        K.fold("extra"), flat ``uint64`` arrays (one key: Python ints, µs)."""
        pk = keys.fold(STRATK_TAG)
        lo, hi = _keys_rows(pk)
        lo2, hi2 = _keys_rows(pk.fold(EXTRA))
        return lo, hi, lo2, hi2

    def _idx(self, keys: Keys, d: int, numba: bool) -> torch.Tensor:
        k = self._k(d)
        if numba:
            lo, hi, lo2, hi2 = self._kernel_keys(keys)
            idx = np.empty((lo.shape[0], k), dtype=np.int64)
            SK.strat_draw(lo, hi, lo2, hi2, d, idx)
            return torch.from_numpy(idx).reshape(*keys.shape, k)
        return strat_indices_torch(keys.fold(STRATK_TAG), d, k)

    def _scale(self, d: int, dtype: DTypeLike | torch.dtype) -> np.ndarray:
        """The factor of a kept value in a block of ⌊d/k⌋ and of ⌊d/k⌋ + 1 entries, in the
        values' dtype (numpy's or torch's, rounded once): the block sizes themselves. Both
        paths take their factors from here, so they scale by the same numbers."""
        if isinstance(dtype, torch.dtype):
            dtype = torch.empty(0, dtype=dtype).numpy().dtype.type
        q = d // self._k(d)
        return np.array([q, q + 1], dtype=dtype)

    def _factors(self, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """:meth:`_scale`'s factor of every block (shape (k,)), in ``dtype``."""
        big = np.diff(strat_bounds(d, self._k(d))) > d // self._k(d)
        return torch.from_numpy(self._scale(d, dtype)[big.astype(np.int64)]).to(device)

    def scaled_form(self) -> Compressor:
        """C/(1 + ω) computed exactly: the same draws, each kept value scaled by
        |B_b|/⌈d/k⌉ rounded once (:class:`_StratKScaled`)."""
        return _StratKScaled(self.k, self.shared_seed)

    # -- application ----------------------------------------------------------------------------
    def _select_torch(self, x: torch.Tensor, keys: Keys) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        idx = self._idx(keys, d, False)
        vals = take(x, idx) * self._factors(d, x.dtype, x.device)
        if not bool(torch.isfinite(vals).all()):
            raise _overflow_error(self.name, x.dtype)
        return idx, vals

    def _gather(
        self, x: torch.Tensor, keys: Keys, src: torch.Tensor, view: type | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of ``x`` (float32/float64, or bfloat16 read as the patterns
        ``src`` viewed as ``view``) by the fused kernel :func:`SK.strat_gather` (one pass:
        check, draw, gather)."""
        d = x.shape[-1]
        k = self._k(d)
        x2, vdtype = self._source(src, view)
        lo, hi, lo2, hi2 = self._kernel_keys(keys)
        out = np.empty((x2.shape[0], k), dtype=vdtype)
        idx = np.empty((x2.shape[0], k), dtype=np.int64)
        sc = self._scale(d, vdtype)
        status = K.run(SK.strat_gather, x2, x2, lo, hi, lo2, hi2, sc, idx, out)
        _raise_for(status, self.name, torch.float32 if view is not None else x.dtype)
        shape = (*x.shape[:-1], k)
        return torch.from_numpy(idx).reshape(shape), torch.from_numpy(out).reshape(shape)

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        assert keys is not None
        d = x.shape[-1]
        if _use_numba(x):
            k = self._k(d)
            res, o2, copy = _out_rows(x, out)
            lo, hi, lo2, hi2 = self._kernel_keys(keys)
            x2 = _rows(x)
            sc = self._scale(d, o2.dtype)
            status = K.run(SK.strat_rows, x2, x2, k, lo, hi, lo2, hi2, sc, o2)
            _raise_for(status, self.name, x.dtype)
            return _emit(res, out) if copy else res
        idx, vals = self._select(x, keys)
        res = torch.zeros_like(x) if out is None else out.zero_()
        return res.scatter_(-1, idx, vals)

    # -- wire format: offsets within the blocks -------------------------------------------------
    def _offsets(self, idx: np.ndarray, d: int) -> np.ndarray:
        """j_b − ⌊b·d/k⌋ of k indices (one per block, in block order), checked."""
        bounds = strat_bounds(d, self._k(d))
        off: np.ndarray = idx - bounds[:-1]
        if idx.shape[-1] != bounds.size - 1 or bool(((off < 0) | (off >= np.diff(bounds))).any()):
            raise ValueError(
                f"{self.name}: a message carries one index per block, in block order (the "
                "sparse form's indices)"
            )
        return off

    def _positions(self, off: np.ndarray, d: int) -> None:
        """Offsets read from a message (rows of k) → indices, in place; a corrupt offset (past
        its block) is refused."""
        bounds = strat_bounds(d, self._k(d))
        if bool((off >= np.diff(bounds)).any()):
            raise ValueError(
                f"corrupt payload: {self.name} read an offset past its block for d={d}; was it "
                "encoded with the same compressor and d?"
            )
        off += bounds[:-1]

    def _encode_indices(self, w: BitWriter, idx: torch.Tensor, d: int) -> None:
        if not self.shared_seed:  # with a shared seed the receiver redraws the indices
            off = self._offsets(idx.detach().reshape(-1).cpu().numpy(), d)
            w.add(torch.from_numpy(off).to(idx.device), self._width(d))

    def _index_fields(self, idx: np.ndarray, d: int) -> np.ndarray:
        return self._offsets(idx, d)

    def _index_positions(self, fields: np.ndarray, d: int) -> None:
        self._positions(fields, d)

    def _packed_width(self, d: int) -> int | None:
        return None if self.shared_seed else self._width(d)

    def _decode_indices(self, r: BitReader, d: int, keys: Keys | None) -> torch.Tensor:
        if self.shared_seed:
            assert keys is not None
            return self._idx(keys.to(r.device), d, r.fast)
        off = r.read(self._k(d), self._width(d))
        pos = off.cpu().numpy().copy()
        self._positions(pos, d)
        return torch.from_numpy(pos).to(off.device)


class _StratKScaled(StratK):
    """``scaled(strat_k[k])`` = strat_k/(1 + ω) = strat_k/⌈d/k⌉, exactly (its ``scaled_form``):
    the same draws and message layout, a kept value x_{j_b}·(|B_b|/⌈d/k⌉) with the factor
    rounded once to the values' dtype (1 in the largest blocks: their values are sent as they
    are). Contractive with α = 1/(1 + ω) = 1/⌈d/k⌉ (the conversion of methods.md §2), tight:
    on x supported on a largest block, E‖C(x) − x‖² = (1 − 1/⌈d/k⌉)‖x‖². Not registered: it is
    reached as ``scaled(strat_k[...])``, whose scaled values would otherwise be rounded twice
    on a 16-bit wire (once when sent, once after the scaling)."""

    kind = "contractive"

    def omega(self, d: int) -> float:
        return Compressor.omega(self, d)

    def alpha(self, d: int) -> float:
        return 1.0 / -(-d // self._k(d))

    def _scale(self, d: int, dtype: DTypeLike | torch.dtype) -> np.ndarray:
        # |B_b|/⌈d/k⌉ from the exact integer sizes (those of super()._scale are already
        # rounded to the dtype: ⌊d/k⌋ > 2²⁴ is no float32 integer, and a largest block's
        # factor would then miss 1); the float64 quotient is rounded to the dtype once more,
        # which is one rounding for sizes below 2²⁴ (53 ≥ 2·24 bits: double rounding of a
        # quotient is then innocuous)
        dt = super()._scale(d, dtype).dtype
        q = d // self._k(d)
        m = -(-d // self._k(d))
        return np.array([q / m, (q + 1) / m], dtype=dt)


@COMPRESSORS.register("bernoulli")
class Bernoulli(Compressor):
    """Bernoulli sparsification: keep each coordinate independently with probability p and
    scale it by 1/p (methods.md §2).

    Unbiased with E‖C(x) − x‖² = (1/p − 1)‖x‖², so ω = 1/p − 1 exactly. The message is random:
    a 32-bit count, then (index of ⌈log₂ d⌉ bits, value) for every kept non-zero coordinate;
    :meth:`message_bits` counts the actual message, ``bits(d)`` is its expectation for inputs
    without zero coordinates (an upper bound otherwise). The keep decisions use the same
    8-bit-first draw rule as the quantizers (P(keep) = p to 2⁻⁷²).
    """

    kind = "unbiased"
    collective = "allgather"
    positively_homogeneous = True
    variable_size = True
    sparse_message = True
    constant_formula = "ω = 1/p − 1"
    bits_formula = "32 + p·d·(32 + ⌈log₂ d⌉) expected (message_bits counts the actual size)"

    def __init__(self, p: float) -> None:
        self.p = _check_probability(p, "bernoulli", "the keep probability")

    def omega(self, d: int) -> float:
        return 1.0 / self.p - 1.0

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return 32.0 + self.p * d * (float_width(dtype) + _log2ceil(d))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return paper_width(dtype) * self.p * d

    def _bits_for_nnz(self, nnz: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        return 32.0 + nnz.to(torch.float64) * (float_width(dtype) + _log2ceil(d))

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        assert keys is not None
        if _use_numba(x):
            res, o2, copy = _out_rows(x, out)
            sc = np.array([1.0 / self.p], dtype=o2.dtype)
            lo, hi, lo2, hi2 = kernel_keys(keys)
            x2 = _rows(x)
            status = K.run(K.bernoulli_rows, x2, x2, self.p, sc, lo, hi, lo2, hi2, o2)
            _raise_for(status, self.name, x.dtype)
            return _emit(res, out) if copy else res
        _require_finite(x, self.name)
        keep = draw_up(torch.full(x.shape, self.p, dtype=torch.float64, device=x.device), keys)
        # + 0.0 turns a kept −0.0 into +0.0, as the kernel does (the message omits kept zeros)
        vals = x * torch.tensor(1.0 / self.p, dtype=x.dtype, device=x.device) + 0.0
        res = torch.where(keep, vals, torch.zeros_like(x))
        if not bool(torch.isfinite(res).all()):
            raise _overflow_error(self.name, x.dtype)
        return _emit(res, out)

    def _sparse(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept non-zero (index, value) pairs of one vector, in index order; on CPU a
        counting pass and a filling pass over the same draws (no dense output)."""
        assert keys is not None
        if x.ndim != 1:
            raise ValueError(
                f"{self.name}: its messages have a random size, so the sparse form takes one "
                f"vector of shape (d,), got shape {tuple(x.shape)}"
            )
        if not _use_numba(x):
            y = self._apply(x, keys, None)
            idx = y.nonzero().reshape(-1)
            return idx, y[idx]
        x2 = _rows(x)
        sc = np.array([1.0 / self.p], dtype=x2.dtype)
        lo, hi, lo2, hi2 = kernel_keys(keys)
        nch = -(-x2.shape[1] // K.CHUNK)
        counts = np.zeros(nch, dtype=np.int64)
        starts = np.zeros(nch, dtype=np.int64)
        none_i = np.empty(0, dtype=np.int64)
        none_v = np.empty(0, dtype=x2.dtype)
        args = (x2, self.p, sc, lo, hi, lo2, hi2, counts, starts)
        status = K.run(K.bernoulli_pairs, x2, *args, none_i, none_v, False)
        _raise_for(status, self.name, x.dtype)
        starts[1:] = np.cumsum(counts)[:-1]
        idx_np = np.empty(int(counts.sum()), dtype=np.int64)
        vals_np = np.empty(idx_np.size, dtype=x2.dtype)
        K.run(K.bernoulli_pairs, x2, *args, idx_np, vals_np, True)
        return torch.from_numpy(idx_np), torch.from_numpy(vals_np)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        idx, vals = self._sparse(x, keys)
        w.add(torch.tensor([idx.numel()]), 32)
        w.add(idx, _log2ceil(x.shape[-1]))
        w.add_values(vals)

    def _decode_pairs(
        self, r: BitReader, d: int, dtype: torch.dtype, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(r.read(1, 32)[0])
        idx = r.read(n, _log2ceil(d))
        return idx, r.read_values(n, dtype)


@COMPRESSORS.register("lazy_bernoulli")
class LazyBernoulli(Compressor):
    """Lazy (whole-vector) Bernoulli compression (FL_PyTorch's ``LAZY_COMPRESSOR``, the
    "Bernoulli" of Burlachenko et al. 2021): C(x) = x/p with probability p, else 0, one draw
    per vector.

    Unbiased, and E‖C(x) − x‖² = p‖x/p − x‖² + (1 − p)‖x‖² = (1/p − 1)‖x‖², so ω = 1/p − 1
    exactly, the ω of per-coordinate ``bernoulli[p]``; but a different operator (all or
    nothing) with different bits: the message is a flag bit, then, when the vector is sent,
    its d values (x/p). A zero vector is never sent (C(0) = 0). :meth:`message_bits` counts the
    actual message; ``bits(d)`` = 1 + p·d·32 is its expectation for non-zero inputs.
    """

    kind = "unbiased"
    collective = "allgather"
    positively_homogeneous = True
    variable_size = True
    constant_formula = "ω = 1/p − 1"
    bits_formula = "1 flag bit + 32·d with probability p (expected 1 + 32·p·d)"

    def __init__(self, p: float) -> None:
        self.p = _check_probability(p, "lazy_bernoulli", "the send probability")

    def omega(self, d: int) -> float:
        return 1.0 / self.p - 1.0

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return 1.0 + self.p * d * float_width(dtype)

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return paper_width(dtype) * self.p * d

    def _bits_for_nnz(self, nnz: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        return 1.0 + (nnz > 0).to(torch.float64) * (d * float_width(dtype))

    def _fire(self, x: torch.Tensor, keys: Keys) -> torch.Tensor:
        """The keyed coin of every row (P = p, the library's draw rule), shape x.shape[:-1]."""
        frac = torch.full((*x.shape[:-1], 1), self.p, dtype=torch.float64, device=x.device)
        return draw_up(frac, keys)[..., 0]

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        """x/p (+0 for signed zeros, so that a sent zero vector equals an unsent one) on the
        rows whose coin fires, 0 elsewhere; every x checked finite."""
        assert keys is not None
        fire = self._fire(x, keys)
        if _use_numba(x):
            res, o2, copy = _out_rows(x, out)
            sc = np.array([1.0 / self.p], dtype=o2.dtype)
            x2 = _rows(x)
            f = fire.reshape(-1).numpy().astype(np.uint8)
            status = K.run(K.lazy_rows, x2, x2, f, sc, o2)
            _raise_for(status, self.name, x.dtype)
            return _emit(res, out) if copy else res
        _require_finite(x, self.name)
        vals = x * torch.tensor(1.0 / self.p, dtype=x.dtype, device=x.device) + 0.0
        res = torch.where(fire[..., None], vals, torch.zeros_like(x))
        if not bool(torch.isfinite(res).all()):
            raise _overflow_error(self.name, x.dtype)
        return _emit(res, out)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        y = self._apply(x, keys, None)
        sent = bool((y != 0).any())  # fired, and x is not the zero vector
        w.add(torch.tensor([int(sent)]), 1)
        if sent:
            w.add_values(y)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if int(r.read(1, 1)[0]):
            return r.read_values(d, dtype, out)
        return torch.zeros(d, dtype=dtype, device=r.device) if out is None else out.zero_()
