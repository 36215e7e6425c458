"""Identity and Top-k: the two deterministic compressors every method's exact tests rely on."""

from __future__ import annotations

import numba
import numpy as np
import torch

from .. import _buffers as buffers
from ..rng import Keys
from . import _kernels as K
from ._wire import BitReader, BitWriter, float_width, paper_width
from .base import (
    COMPRESSORS,
    Compressor,
    Sparsifier,
    _check_positive_int,
    _emit,
    _log2ceil,
    _out_rows,
    _require_finite,
    _rows,
    _use_numba,
    non_finite_error,
    take,
)

__all__ = ["Identity", "TopK", "topk_indices_torch"]


def _no_rows(x2: np.ndarray) -> np.ndarray:
    """The empty second operand of the Top-k kernels (no difference)."""
    return np.empty((0, x2.shape[1]), dtype=x2.dtype)


def _diff_rounding(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None) -> int | None:
    """The kernels' rounding mode for Top-k of a − b rounded to ``dtype``, or None when the
    fused kernels do not apply (they take CPU float32/float64 rows of the same shape, or a
    bfloat16 ``a`` with a float32 ``b``, and round to bfloat16 from float32 only)."""
    if not (_use_numba(b) and b.device == a.device and b.shape == a.shape and b.ndim <= 2):
        return None
    if b.dtype not in (torch.float32, torch.float64):
        return None
    if a.dtype != b.dtype and not (a.dtype == torch.bfloat16 and b.dtype == torch.float32):
        return None
    if dtype is None or dtype == b.dtype:
        return int(K.ROUND_NONE)
    if dtype == torch.bfloat16 and b.dtype == torch.float32:
        return int(K.ROUND_BF16)
    return None


def _minuend_rows(a: torch.Tensor) -> np.ndarray:
    """:func:`_rows` of the minuend of a fused difference; a bfloat16 tensor as its bit
    patterns (uint16), which the kernels widen to float32 exactly (``_kernels.load``)."""
    if a.dtype == torch.bfloat16:
        return _rows(a.contiguous().view(torch.int16)).view(np.uint16)
    return _rows(a)


@COMPRESSORS.register("identity")
class Identity(Compressor):
    """C(x) = x: ω = 0, α = 1, 32·d bits. Turns every method into its uncompressed parent."""

    kind = "unbiased"
    deterministic = True
    positively_homogeneous = True
    collective = "allreduce"
    constant_formula = "ω = 0 (α = 1)"
    bits_formula = "32·d"

    def omega(self, d: int) -> float:
        return 0.0

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(d * float_width(dtype))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(paper_width(dtype) * d)

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        if _use_numba(x):  # one pass: copy and check finite (not a finiteness pass, then a copy)
            res, o2, copy = _out_rows(x, out)
            utype = np.uint32 if x.dtype == torch.float32 else np.uint64
            xu = _rows(x).view(utype)
            ou = o2.view(utype)
            if K.run(K.copy_rows, xu, xu, ou) != K.OK:
                raise non_finite_error(self.name)
            return _emit(res, out) if copy else res
        _require_finite(x, self.name)
        if out is None:
            return x.clone()
        return out.copy_(x)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        _require_finite(x, self.name)
        w.add_values(x)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        return r.read_values(d, dtype, out)


def topk_indices_torch(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending, shape ``(..., k)``) of the k largest |x_j| of every row.

    Ties at the k-th largest magnitude go to the lowest indices, so the selection is a function
    of ``x`` alone (``torch.topk`` leaves ties unspecified). Reference twin of the numba kernel.
    """
    a = x.abs()
    kth = torch.topk(a, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    gt = a > kth
    need = k - gt.sum(dim=-1, keepdim=True)
    eq = a == kth
    keep = gt | (eq & (eq.cumsum(dim=-1) <= need))
    return keep.nonzero()[:, -1].reshape(*x.shape[:-1], k)


#: rows from which :meth:`TopK.shifted` spreads its rows over numba threads (below, one serial
#: pass costs less than waking a second thread)
SHIFTED_THREADED_ROWS = 2 * K.SHIFTED_BLOCK


def _shifted_top1(
    x2: np.ndarray,
    h2: np.ndarray,
    c2: np.ndarray,
    g2: np.ndarray,
    flat: np.ndarray | None = None,
    vals: np.ndarray | None = None,
) -> int:
    """:func:`~shrinkgrad.compressors._kernels.shifted_top1_rows`, over :func:`K.threads`
    numba threads when there are enough rows (the same bits: rows are independent); with
    ``flat`` and ``vals`` (one entry per row) and an empty ``c2``, its sparse form."""
    n, d = x2.shape
    buf = np.empty(((n + K.SHIFTED_BLOCK - 1) // K.SHIFTED_BLOCK, d), dtype=x2.dtype)
    bu = buf.view(np.uint32 if x2.dtype == np.float32 else np.uint64)
    if flat is None or vals is None:
        flat, vals = _NO_FLAT, np.empty(0, dtype=x2.dtype)
    t = K.threads()
    if t > 1 and n >= SHIFTED_THREADED_ROWS:
        numba.set_num_threads(min(t, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
        return int(K.shifted_top1_rows_threads(x2, h2, buf, bu, c2, g2, flat, vals))
    return int(K.shifted_top1_rows(x2, h2, buf, bu, c2, g2, flat, vals))


_NO_FLAT = np.empty(0, dtype=np.int64)


@COMPRESSORS.register("top_k")
class TopK(Sparsifier):
    """Top-k ([EF21] Def. 1 example): keep the k entries of largest |x_j|, zero the rest.

    Contractive with α = k/d ([EF21] Lemma 1: the dropped d − k entries are the smallest, so
    their share of ‖x‖² is at most (d − k)/d), deterministic and positively homogeneous; ties
    are broken towards the lower index. Message: k indices of ⌈log₂ d⌉ bits, then k values.

    CPU fast path (long rows): a threshold from a strided sample of 4096 magnitudes, one pass
    collecting the candidates above it, exact selection among them (``np.partition``) with
    tie trimming; it falls back to selecting among all d entries when the sample misleads
    (ties, adversarial layouts), so the result is always the exact Top-k.
    """

    kind = "contractive"
    deterministic = True
    positively_homogeneous = True
    collective = "allgather"
    projection = True
    sparse_message = True
    constant_formula = "α = k/d"
    bits_formula = "k·(32 + ⌈log₂ d⌉)"

    def __init__(self, k: int) -> None:
        self.k = _check_positive_int(k, "k (the number of kept coordinates)", "top_k")

    def _k(self, d: int) -> int:
        if self.k > d:
            raise ValueError(
                f"top_k[k={self.k}] cannot keep more than d={d} coordinates; use k in [1, {d}]"
            )
        return self.k

    def alpha(self, d: int) -> float:
        return self._k(d) / d

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(self._k(d) * (float_width(dtype) + _log2ceil(d)))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(paper_width(dtype) * self._k(d))

    def index_bits(self, d: int) -> int:
        return self._k(d) * _log2ceil(d)

    def _indices(self, x: torch.Tensor) -> torch.Tensor:
        return self._indices_values(x)[0]

    def _indices_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kept indices, and their values where the selection holds them (the kernels'
        sampled path; else None)."""
        k = self._k(x.shape[-1])
        if _use_numba(x):
            ii, kept = self._topk_numba(x, k, None)
            idx = torch.from_numpy(ii).reshape(*x.shape[:-1], k)
            return idx, None if kept is None else torch.from_numpy(kept).reshape(idx.shape)
        _require_finite(x, self.name)
        return topk_indices_torch(x, k), None

    def _topk_numba(
        self, x: torch.Tensor, k: int, o2: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Indices (rows, k) by the kernels, and with the sampling plan the kept values
        (rows, k), which the exact selection reads anyway (so :meth:`_select` needs no gather
        of x at the indices: 2 ms of random reads for k = 42 k of a 4.2 M-entry row); short rows
        (no sampling plan) give None there and also write the dense result into ``o2`` when
        given (one fused pass)."""
        x2 = _rows(x)
        n, d = x2.shape
        idx = np.empty((n, k), dtype=np.int64)
        kept: np.ndarray | None = None
        plan = K.topk_plan(d, k)
        if plan is None:  # one selection per row
            dense = o2 if o2 is not None else np.empty((0, d), dtype=x2.dtype)
            if k == 1:
                utype = np.uint32 if x2.dtype == np.float32 else np.uint64
                status = K.top1_rows(x2.view(utype), idx, dense.view(utype))
            elif x2.dtype == np.float32 and d >= K.TOPK_HIST_MIN and k > K.TOPK_INSERT_K:
                status = K.topk_rows_hist(x2.view(np.uint32), k, idx, dense.view(np.uint32))
            else:
                status = K.topk_rows(x2, k, idx, dense)
        else:  # threshold from a sample, candidates in parallel chunks, exact selection
            rank, slots = plan
            tau = np.empty(n, dtype=x2.dtype)
            K.topk_thresholds(x2, rank, tau)
            utype = np.uint32 if x2.dtype == np.float32 else np.uint64
            xu = x2.view(utype)
            # τ's pattern, at most that of inf (every inf/nan is a candidate, and checked) and
            # at least 1 (zeros are never candidates: a row with fewer than k non-zeros takes
            # the fallback of topk_select)
            inf_bits = np.array(np.inf, dtype=x2.dtype).view(utype)
            tb = np.clip(np.abs(tau).view(utype), 1, inf_bits)
            nch = -(-d // K.CHUNK)
            cand = np.empty((n, nch * slots), dtype=np.uint16)
            craw = np.empty((n, nch * slots), dtype=utype)
            counts = np.empty((n, nch), dtype=np.int64)
            status = K.run(K.topk_candidates, xu, xu, tb, slots, cand, craw, counts)
            if status == K.OK:
                vals = np.empty((n, k), dtype=utype)
                starts = np.empty((n, nch + 1), dtype=np.int64)
                status = K.topk_select(
                    x2, xu, k, tb, slots, cand, craw, counts, idx, vals, starts, _no_rows(x2), 0
                )
                if status == K.OK and o2 is not None:  # zero each chunk, write its kept entries
                    ou = o2.view(utype)
                    K.run(K.topk_write, ou, ou, idx, vals, starts)
                kept = vals.view(x2.dtype)
        if status != K.OK:
            raise non_finite_error(self.name)
        return idx, kept

    def _select(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        idx, vals = self._indices_values(x)
        return idx, take(x, idx) if vals is None else vals

    def _fast_shifted(self, x: torch.Tensor, h: torch.Tensor) -> bool:
        """Whether :func:`_shifted_top1` computes the shifted Top-k of ``x`` and ``h``."""
        return (
            self.k == 1
            and _use_numba(x)
            and x.dtype in (torch.float32, torch.float64)
            and isinstance(h, torch.Tensor)
            and h.shape == x.shape
            and h.dtype == x.dtype
            and h.device == x.device
            and x.ndim >= 1
            and x.shape[-1] > 0
        )

    def shifted(
        self, x: torch.Tensor, h: torch.Tensor, keys: Keys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Compressor.shifted`; for k = 1 on CPU one pass over x and h
        (:func:`~shrinkgrad.compressors._kernels.shifted_top1_rows`, the same bits)."""
        if not self._fast_shifted(x, h):
            return super().shifted(x, h, keys)
        x2, h2 = _rows(x), _rows(h)
        d = x2.shape[1]
        c = buffers.empty_tensor(tuple(x.shape), x.dtype)  # recycled at federated scale
        g = buffers.empty_tensor(tuple(x.shape), x.dtype)
        c2, g2 = c.view(-1, d).numpy(), g.view(-1, d).numpy()
        if _shifted_top1(x2, h2, c2, g2) != K.OK:
            raise non_finite_error(self.name)
        return c, g

    def shifted_sparse(
        self, x: torch.Tensor, h: torch.Tensor, keys: Keys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`Compressor.shifted_sparse`; for k = 1 on CPU the one pass of :meth:`shifted`
        writing the kept entries instead of a dense c (the same values)."""
        if not self._fast_shifted(x, h):
            return super().shifted_sparse(x, h, keys)
        x2, h2 = _rows(x), _rows(h)
        n, d = x2.shape
        g = buffers.empty_tensor(tuple(x.shape), x.dtype)  # recycled at federated scale
        flat = torch.empty(n, dtype=torch.int64)
        vals = torch.empty(n, dtype=x.dtype)
        none = np.empty((0, d), dtype=x2.dtype)
        status = _shifted_top1(x2, h2, none, g.view(-1, d).numpy(), flat.numpy(), vals.numpy())
        if status != K.OK:
            raise non_finite_error(self.name)
        return flat, vals, g

    def sparse_difference(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        keys: Keys | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of a − b (rounded to ``dtype``: bfloat16 from float32, or none) selected from
        the difference chunk by chunk, while each chunk of a and b is in cache: the sampled
        threshold, the candidate pass and the exact selection of :meth:`_topk_numba` on the
        difference's patterns, whose kept patterns are the values (no gather). ``a`` may be
        bfloat16 with a float32 ``b`` (a 16-bit gradient and EF21's float32 g_i): its entries
        are widened to float32 as they are read (exact: a bfloat16 is the top half of a
        float32), so the result is that of ``a.float() − b`` without the float32 copy. Falls
        back to forming a − b where that path does not apply (short rows, other devices and
        dtypes; a float16 ``a`` is promoted by torch)."""
        rnd = _diff_rounding(a, b, dtype)
        if rnd is None:
            return super().sparse_difference(a, b, keys, dtype=dtype)
        d = a.shape[-1]
        k = self._k(d)
        plan = K.topk_plan(d, k)
        if plan is None:
            return super().sparse_difference(a, b, keys, dtype=dtype)
        a2, b2 = _minuend_rows(a), _rows(b)
        n = a2.shape[0]
        rank, slots = plan
        utype = np.uint32 if b2.dtype == np.float32 else np.uint64
        tau = np.empty(n, dtype=b2.dtype)
        inf_bits = np.array(np.inf, dtype=b2.dtype).view(utype)
        K.topk_thresholds_diff(a2, b2, rnd, rank, tau, inf_bits.reshape(1))
        tb = np.clip(np.abs(tau).view(utype), 1, inf_bits)
        nch = -(-d // K.CHUNK)
        cand = np.empty((n, nch * slots), dtype=np.uint16)
        craw = np.empty((n, nch * slots), dtype=utype)
        counts = np.empty((n, nch), dtype=np.int64)
        status = K.run(K.topk_candidates_diff, a2, a2, b2, rnd, tb, slots, cand, craw, counts)
        idx = np.empty((n, k), dtype=np.int64)
        vals = np.empty((n, k), dtype=utype)
        if status == K.OK:
            starts = np.empty((n, nch + 1), dtype=np.int64)
            xu = b2.view(utype)  # (the patterns' type and shape: the rows are recomputed)
            status = K.topk_select(
                a2, xu, k, tb, slots, cand, craw, counts, idx, vals, starts, b2, rnd
            )
        if status != K.OK:
            raise non_finite_error(self.name)
        shape = (*a.shape[:-1], k)
        values = torch.from_numpy(vals.view(b2.dtype)).reshape(shape)
        if dtype is not None and dtype != values.dtype:
            values = values.to(dtype)  # exact: the patterns are rounded to dtype already
        return torch.from_numpy(idx).reshape(shape), values

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        if _use_numba(x):
            res, o2, copy = _out_rows(x, out)
            self._topk_numba(x, self._k(x.shape[-1]), o2)
            return _emit(res, out) if copy else res
        idx = self._indices(x)
        res = torch.zeros_like(x) if out is None else out.zero_()
        return res.scatter_(-1, idx, x.gather(-1, idx))
