"""Quantizers: standard dithering (QSGD, TernGrad), natural compression, natural dithering and
scaled sign.

The random ones round each |x_j| (relative to a per-row scale) to one of two neighbouring
levels, up with exactly the probability that makes the result unbiased, using the keyed draw
rule of :mod:`shrinkgrad.compressors._random` (8 random bits per coordinate, more only on ties).
Each has a torch reference path (any device) and, for long rows on CPU, a numba kernel that
produces bit-identical output from the same keys and the same row norm.

Row norms are accumulated in float64 and the ℓ₂ norm sent on the wire is rounded *up* to the
dtype, so that |x_j|/‖x‖ ≤ 1 after rounding; rows whose float64 sum of squares would overflow
or underflow (float64 inputs beyond ~1e±150) are recomputed with a max-rescaling.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..rng import Keys
from . import _codec as codec
from . import _kernels as K
from ._random import draw_up, kernel_keys, key_table
from ._wire import BitReader, BitWriter, scalar_width
from .base import (
    COMPRESSORS,
    Compressor,
    _check_positive_int,
    _dense_out,
    _emit,
    _log2ceil,
    _out_rows,
    _require_finite,
    _rows,
    _use_numba,
    non_finite_error,
)

__all__ = [
    "QSGD",
    "NaturalCompression",
    "NaturalDithering",
    "ScaledSign",
    "StandardDithering",
    "Ternary",
    "l2_norms",
    "linf_worst_case",
]


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------
def _row_stat(x: torch.Tensor, what: int, name: str, numba: bool) -> torch.Tensor:
    """Σx² (what=0), max|x| (1) or Σ|x| (2) per row in float64, checking that x is finite."""
    if numba:
        x2 = _rows(x)
        part = np.empty((x2.shape[0], -(-x2.shape[1] // K.CHUNK)), dtype=np.float64)
        K.run(K.row_stats, x2, x2, what, part)
        # chunk partials combined in a fixed order: independent of the number of threads
        res = part.max(axis=1) if what == 1 else part.sum(axis=1)
        if not np.isfinite(res).all():
            _require_finite(x, name)  # inf/nan entries, or a mere float64 overflow
        return torch.from_numpy(res).reshape(x.shape[:-1])
    if what == 1:  # order-free: torch's fused min/max pass
        lo, hi = torch.aminmax(x, dim=-1)
        m = torch.maximum(-lo, hi)
        if not bool(torch.isfinite(m).all()):
            raise non_finite_error(name)
        return m.to(torch.float64)
    _require_finite(x, name)
    x64 = x.to(torch.float64)
    if what == 0:
        return x64.square().sum(dim=-1)
    if what == 1:
        return x64.abs().amax(dim=-1)
    return x64.abs().sum(dim=-1)


def _norm_overflow(name: str, dtype: torch.dtype, what: str = "ℓ₂ norm") -> ValueError:
    return ValueError(
        f"{name}: the {what} of a row exceeds the {dtype} range ({torch.finfo(dtype).max:.3g}); "
        "rescale the input or compress float64 tensors"
    )


def l2_norms(x: torch.Tensor, name: str = "compressor", numba: bool = False) -> torch.Tensor:
    """‖x‖₂ of every row (shape ``x.shape[:-1]``) in x's dtype, rounded up (never below the
    float64 value); ValueError for non-finite input or a norm beyond the dtype's range."""
    ss = _row_stat(x, 0, name, numba)
    norm = ss.sqrt()
    odd = ~((ss > 2.0**-1000) & (ss < math.inf))
    if bool(odd.any()):  # zero rows and float64 extremes: rescale by the largest entry
        xo = x[odd].to(torch.float64)
        m = xo.abs().amax(dim=-1, keepdim=True)
        scaled = (xo / torch.where(m > 0, m, torch.ones_like(m))).square().sum(dim=-1)
        norm[odd] = m.squeeze(-1) * scaled.sqrt()
    nd = norm.to(x.dtype)
    if x.dtype != torch.float64:
        up = torch.nextafter(nd, torch.full_like(nd, math.inf))
        nd = torch.where(nd.to(torch.float64) < norm, up, nd)
    if not bool(torch.isfinite(nd).all()):
        raise _norm_overflow(name, x.dtype)
    return nd


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**e exactly, for exponents e in the dtype's normal range (built from the bit pattern)."""
    if dtype == torch.float32:
        return ((e.to(torch.int32) + 127).clamp(1, 254) << 23).view(torch.float32)
    return ((e.to(torch.int64) + 1023).clamp(1, 2046) << 52).view(torch.float64)


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    """1 where the sign bit of x is set (negative numbers and −0.0)."""
    return torch.signbit(x).to(torch.int64)


def _with_sign(v: torch.Tensor, sbit: torch.Tensor) -> torch.Tensor:
    return torch.copysign(v, torch.where(sbit.bool(), -1.0, 1.0).to(v.dtype))


def _bits_of(dtype: torch.dtype) -> tuple[type[np.unsignedinteger[Any]], int]:
    """(unsigned integer type of the dtype's width, mantissa bits)."""
    return (np.uint32, 23) if dtype == torch.float32 else (np.uint64, 52)


def _run(kernel: Callable[..., None], x2: np.ndarray, *args: object) -> int:
    """A wire codec over the chunks of one vector (``x2``: shape (1, d)); its status."""
    return K.run(kernel, x2, *args)


def _max_pow2(dtype: torch.dtype) -> float:
    """The largest power of two of the dtype (2^127 for float32, 2^1023 for float64)."""
    return 2.0 ** (127 if dtype == torch.float32 else 1023)


def _finish(name: str, status: int, dtype: torch.dtype) -> None:
    if status == K.NON_FINITE:
        raise non_finite_error(name)
    if status == K.OVERFLOW:
        raise ValueError(
            f"{name}: rounding up to the next power of two overflows {dtype} (|x_j| above "
            f"{_max_pow2(dtype):.3g}); rescale the input or use float64"
        )


def _check_norm(norm: float, name: str) -> float:
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or norm not in (2, math.inf):
        raise ValueError(
            f"{name} needs norm=2 or norm=inf (the vector norm that scales), got {norm!r}"
        )
    return float(norm)


def linf_worst_case(d: int, levels: Sequence[float]) -> tuple[float, float]:
    """(ω, t): the exact worst case of unbiased rounding of u_j = |x_j|/‖x‖_∞ to the grid
    0 = ℓ₀ < ℓ₁ < … < ℓ_K = 1, and the t at which x = (1, t, …, t) attains it.

    Derivation (docs/compressors.md, "ℓ∞ dithering"): rounding u ∈ [p, q] unbiasedly to p or q
    has variance v(u) = (u − p)(q − u), and the largest coordinate (u = 1, a level) none, so
    ω = sup over the other d − 1 values of Σ v(u_j) / (1 + Σ u_j²). This ratio is separable
    (Dinkelbach: its supremum λ maximizes Σ_j [v(u_j) − λu_j²] − λ coordinate by coordinate),
    so it is attained with all u_j equal to one t: ω = max_t (d−1)v(t)/(1 + (d−1)t²). On a
    piece [p, q] the stationary point solves (p+q)t² − 2(pq − c)t − (p+q)c = 0, c = 1/(d−1).
    """
    if d <= 1:
        return 0.0, 0.0
    c = 1.0 / (d - 1)
    best, best_t = 0.0, 0.0
    for p, q in itertools.pairwise(levels):
        b = p * q - c
        t = (b + math.sqrt(b * b + (p + q) ** 2 * c)) / (p + q)
        v = (t - p) * (q - t) / (c + t * t)
        if v > best:
            best, best_t = v, t
    return best, best_t


def _uniform_linf_omega(d: int, s: int) -> float:
    """ω of ℓ∞ standard dithering with s levels: (√(1 + (d − 1)/s²) − 1)/2, the closed form
    of :func:`linf_worst_case` on the uniform grid (the first piece is the worst)."""
    return math.expm1(0.5 * math.log1p((d - 1) / s**2)) / 2.0


# --------------------------------------------------------------------------------------------
# uniform levels: standard dithering (QSGD, TernGrad)
# --------------------------------------------------------------------------------------------
def round_levels_torch(
    x: torch.Tensor, scale: torch.Tensor, s: int, keys: Keys
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, levels): unbiased rounding of |x_j|/scale to {0, …, s} (twin of ``round_rows``)."""
    sc = scale[..., None]
    zero_row = sc == 0
    safe = torch.where(zero_row, torch.ones_like(sc), sc)
    r = x.abs() / safe
    fl = torch.floor(r)
    top = fl >= s
    frac = torch.where(top | zero_row, torch.zeros_like(r), r - fl)
    up = draw_up(frac, keys)
    lev = torch.where(top, torch.full_like(fl, float(s)), fl + up.to(x.dtype))
    lev = torch.where(zero_row, torch.zeros_like(lev), lev)
    return torch.copysign(sc * lev, x), lev


@COMPRESSORS.register("standard_dithering")
class StandardDithering(Compressor):
    """Standard dithering with s uniform levels (Alistarh et al. 2017, QSGD §3.1; FL_PyTorch's
    ``std.dithering:s:p``): C(x)_j = ‖x‖ · sign(x_j) · ξ_j/s, ξ_j the unbiased rounding of
    s|x_j|/‖x‖ to {0, …, s}, with the ℓ₂ norm (``norm=2``: exactly ``qsgd[s]``) or the ℓ∞
    norm (``norm=inf``; s = 1 is exactly ``ternary``, TernGrad).

    ω: for ℓ₂, min(d/s², √d/s) (Alistarh et al. Lemma 3.1, see :class:`QSGD`); for ℓ∞ the exact
    worst case (√(1 + (d − 1)/s²) − 1)/2 (derived in :func:`linf_worst_case`; attained at
    x = (1, t/s, …, t/s), t = √(a² + a) − a, a = s²/(d − 1)). FL_PyTorch states no ω for it
    (``w = 0``, a TODO). Message: the norm (32 bits) and, per coordinate, a sign bit and a level
    of ⌈log₂(s+1)⌉ bits.
    """

    kind = "unbiased"
    collective = "allgather"
    positively_homogeneous = True
    constant_formula = "ω = min(d/s², √d/s) (norm=2); (√(1 + (d−1)/s²) − 1)/2 (norm=inf, exact)"
    bits_formula = "32 + d·(1 + ⌈log₂(s+1)⌉)"
    s: int = 1
    norm: float = 2.0

    def __init__(self, s: int, norm: float = 2.0) -> None:
        self.s = _check_positive_int(s, "s (the number of levels)", "standard_dithering", 1 << 24)
        self.norm = _check_norm(norm, "standard_dithering")

    def omega(self, d: int) -> float:
        if self.norm == 2.0:
            return min(d / self.s**2, math.sqrt(d) / self.s)
        return _uniform_linf_omega(d, self.s)

    def _norm(self, x: torch.Tensor, numba: bool) -> torch.Tensor:
        """The per-row norm sent on the wire: ‖x‖₂ rounded up to the dtype, or ‖x‖_∞ (exact)."""
        if self.norm == 2.0:
            return l2_norms(x, self.name, numba)
        return _row_stat(x, 1, self.name, numba).to(x.dtype)

    def _scale_from_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The spacing of the levels: norm/s (computed in the dtype)."""
        return norm / torch.tensor(float(self.s), dtype=norm.dtype, device=norm.device)

    def _scale(self, x: torch.Tensor, numba: bool) -> torch.Tensor:
        return self._scale_from_norm(self._norm(x, numba))

    def _level_bits(self) -> int:
        return _log2ceil(self.s + 1)

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(scalar_width(dtype) + d * (1 + self._level_bits()))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(32 + d * (1 + self._level_bits()))

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        assert keys is not None
        numba = _use_numba(x)
        scale = self._scale(x, numba)
        if numba:
            res, o2, copy = _out_rows(x, out)
            lo, hi, lo2, hi2 = kernel_keys(keys)
            sc = scale.reshape(-1).numpy()
            x2 = _rows(x)
            K.run(K.round_rows, x2, x2, sc, self.s, lo, hi, lo2, hi2, o2)
            return _emit(res, out) if copy else res
        return _emit(round_levels_torch(x, scale, self.s, keys)[0], out)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        assert keys is not None
        norm = self._norm(x, _use_numba(x))  # the same norm as _apply computes
        scale = self._scale_from_norm(norm)
        w.add_float(norm.reshape(1))
        width = 1 + self._level_bits()
        if w.fast:  # levels computed and packed chunk by chunk
            x2 = _rows(x)
            args = (x2[0], scale.reshape(-1).numpy(), self.s, key_table(keys), width)
            w.add_block(x.shape[-1] * width, lambda p, b: _run(codec.round_encode, x2, *args, p, b))
            return
        _, lev = round_levels_torch(x, scale, self.s, keys)
        w.add((lev.to(torch.int64) << 1) | _sign_bits(x), width)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        norm = r.read_float(1, dtype)
        width = 1 + self._level_bits()
        scale = self._scale_from_norm(norm)
        if r.fast:
            src, b0 = r.block(d * width)
            res = _dense_out(out, d, dtype)
            o = res.numpy()
            _run(codec.round_decode, o[None], src, b0, width, scale.numpy(), o)
            return res
        code = r.read(d, width)
        return _with_sign(scale * (code >> 1).to(dtype), code & 1)


@COMPRESSORS.register("qsgd")
class QSGD(StandardDithering):
    """QSGD with s levels and the ℓ₂ norm (Alistarh et al. 2017; [K18] §2):
    C(x)_j = ‖x‖₂ · sign(x_j) · ξ_j/s, ξ_j ∈ {⌊s|x_j|/‖x‖⌋, ⌊·⌋ + 1} unbiased.

    ω = min(d/s², √d/s) (Alistarh et al. Lemma 3.1; methods.md §2): with σ = ‖x‖/s and f_j the
    fractional part of |x_j|/σ, the variance of coordinate j is σ² f_j(1 − f_j) ≤
    min(σ²/4, σ|x_j|); summed, ≤ min(d/(4s²), ‖x‖₁/(s‖x‖))·‖x‖² ≤ min(d/s², √d/s)·‖x‖² (the
    paper's constant drops the 1/4). Message: the norm (32 bits) and, per coordinate, a sign
    bit and a level of ⌈log₂(s+1)⌉ bits.

    The scale sent is ‖x‖ rounded up to the dtype; levels use σ = scale/s computed in the
    dtype, which can round below scale/s, so r_j = |x_j|/σ can exceed s (float32, x = e₁,
    s = 61): the level is then clamped to s and the coordinate sent as s·σ, within
    (2u + d·2⁻⁵³)|x_j| of |x_j| (u the unit round-off; docs/compressors.md, qsgd).
    """

    constant_formula = "ω = min(d/s², √d/s)"

    def __init__(self, s: int) -> None:
        self.s = _check_positive_int(s, "s (the number of levels)", "qsgd", upper=1 << 24)
        self.norm = 2.0


@COMPRESSORS.register("ternary")
class Ternary(StandardDithering):
    """TernGrad (Wen et al. 2017; [K18] §2): C(x)_j = ‖x‖_∞ · sign(x_j) · b_j,
    b_j ~ Bernoulli(|x_j|/‖x‖_∞); exactly ``standard_dithering[s=1,norm=inf]``.

    Unbiased with the exact variance Σ_j (‖x‖_∞|x_j| − x_j²), i.e.
    ω(x) = ‖x‖₁‖x‖_∞/‖x‖² − 1 (:meth:`omega_of`), whose exact worst case over R^d is
    **ω = (√d − 1)/2**, attained at x = (1, t, …, t), t = 1/(√d + 1) (the s = 1 case of
    :func:`linf_worst_case`; docs/compressors.md derives it). The bound √d − 1 of methods.md §2
    (‖x‖₁ ≤ √d‖x‖₂, ‖x‖_∞ ≤ ‖x‖₂) is about twice as large: the two inequalities are tight at
    different vectors. Message: ‖x‖_∞ (32 bits) and 2 bits (sign, level) per coordinate, as
    TernGrad packs them (Wen et al. §3: 2 bits per element) and as ``qsgd[s=1]`` counts.
    """

    constant_formula = "ω = (√d − 1)/2  (exact worst case of ‖x‖₁‖x‖_∞/‖x‖² − 1)"
    bits_formula = "32 + 2·d"

    def __init__(self) -> None:
        self.s = 1
        self.norm = math.inf

    @staticmethod
    def worst_case(d: int) -> torch.Tensor:
        """The float64 vector (1, t, …, t), t = 1/(√d + 1), where ω(x) = (√d − 1)/2."""
        x = torch.full((d,), 1.0 / (math.sqrt(d) + 1.0), dtype=torch.float64)
        x[0] = 1.0
        return x

    @staticmethod
    def omega_of(x: torch.Tensor) -> torch.Tensor:
        """The exact ω(x) = ‖x‖₁‖x‖_∞/‖x‖² − 1 of every row (float64), computed on x/‖x‖_∞ so
        that no square under- or overflows (0 for a zero row, which compresses exactly)."""
        a = x.to(torch.float64).abs()
        m = a.amax(-1, keepdim=True)
        u = a / torch.where(m > 0, m, torch.ones_like(m))
        sq = u.square().sum(-1)
        return torch.where(sq > 0, u.sum(-1) / torch.where(sq > 0, sq, 1.0) - 1.0, 0.0)


# --------------------------------------------------------------------------------------------
# natural compression and natural dithering
# --------------------------------------------------------------------------------------------
def _int_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(bit pattern as int64 in [0, 2^nbits), nbits, mantissa bits) of a float tensor."""
    if x.dtype == torch.float32:
        return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, 32, 23
    return x.view(torch.int64), 64, 52


def natural_torch(x: torch.Tensor, keys: Keys, name: str) -> torch.Tensor:
    """Natural compression of every coordinate on the bit patterns (twin of ``natural_rows``)."""
    bits, nbits, mant = _int_view(x)
    mag = bits & ((1 << (nbits - 1)) - 1)  # clears the sign bit (also for negative int64)
    e = mag >> mant
    m = mag & ((1 << mant) - 1)
    emax = (1 << (nbits - 1 - mant)) - 1
    if bool((e == emax).any()):
        raise non_finite_error(name)
    if bool(((e == emax - 1) & (m != 0)).any()):
        _finish(name, K.OVERFLOW, x.dtype)
    up = draw_up(m.to(torch.float64) * 2.0**-mant, keys)
    out_bits = (e + up.to(torch.int64)) << mant
    if x.dtype == torch.float32:
        mag_f = out_bits.to(torch.int32).view(torch.float32)
    else:
        mag_f = out_bits.view(torch.float64)
    return torch.copysign(mag_f, x)


@COMPRESSORS.register("natural")
class NaturalCompression(Compressor):
    """Natural compression (Horváth et al. 2019, "Natural compression for distributed deep
    learning", Thm 1): round |x_j| ∈ [2^e, 2^{e+1}) to 2^{e+1} with probability
    (|x_j| − 2^e)/2^e, else to 2^e; keep the sign.

    Unbiased; the variance of one coordinate t ∈ [a, 2a] is (t − a)(2a − t) ≤ t²/8 (maximum at
    t = 4a/3), so ω = 1/8. Message: per coordinate a sign bit and the 8-bit exponent (11 bits
    for float64): 9·d bits. Values below the smallest normal number 2^{-126} round to 0 or
    2^{-126} (unbiased; the 1/8 bound is stated for normal inputs); |x_j| above the largest
    power of two of the dtype raises ValueError (rounding up would overflow).
    """

    kind = "unbiased"
    collective = "allgather"
    positively_homogeneous = False
    constant_formula = "ω = 1/8 for normal inputs (more for subnormal x_j, below 2^-126)"
    bits_formula = "9·d (sign + 8-bit exponent; 12·d for float64)"

    def omega(self, d: int) -> float:
        return 0.125

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(d * (1 + self._exp_bits(dtype)))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return 9.0 * d

    @staticmethod
    def _exp_bits(dtype: torch.dtype) -> int:
        """Exponent bits: float32's 8 (also for 16-bit inputs, computed in float32), or 11."""
        return 11 if dtype == torch.float64 else 8

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        assert keys is not None
        if _use_numba(x):
            res, o2, copy = _out_rows(x, out)
            utype, mant = (np.uint32, 23) if x.dtype == torch.float32 else (np.uint64, 52)
            xu = _rows(x).view(utype)
            status = K.run(K.natural_rows, xu, xu, mant, key_table(keys), o2.view(utype))
            _finish(self.name, status, x.dtype)
            return _emit(res, out) if copy else res
        return _emit(natural_torch(x, keys, self.name), out)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        assert keys is not None
        eb = self._exp_bits(x.dtype)
        mant = torch.finfo(x.dtype).bits - 1 - eb
        if w.fast:  # exponents drawn and packed chunk by chunk
            x2 = _rows(x)
            xu = x2.view(np.uint32 if x.dtype == torch.float32 else np.uint64)
            args = (xu[0], mant, key_table(keys), 1 + eb)

            def write(p: np.ndarray, b: int) -> None:
                _finish(self.name, _run(codec.natural_encode, x2, *args, p, b), x.dtype)

            w.add_block(x.shape[-1] * (1 + eb), write)
            return
        y = natural_torch(x, keys, self.name)
        pattern = y.abs().view(torch.int32 if x.dtype == torch.float32 else torch.int64)
        code = (pattern.to(torch.int64) >> mant) & ((1 << eb) - 1)
        w.add((code << 1) | _sign_bits(y), 1 + eb)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        eb = self._exp_bits(dtype)
        mant = torch.finfo(dtype).bits - 1 - eb
        if r.fast:
            src, b0 = r.block(d * (1 + eb))
            res = _dense_out(out, d, dtype)
            o = res.numpy().view(np.uint32 if dtype == torch.float32 else np.uint64)
            _run(codec.natural_decode, o[None], src, b0, 1 + eb, mant, o)
            return res
        code = r.read(d, 1 + eb)
        mag = code >> 1
        if dtype == torch.float32:
            v = (mag << mant).to(torch.int32).view(torch.float32)
        else:
            v = (mag << mant).view(torch.float64)
        return _with_sign(v, code & 1)


def dither_torch(
    x: torch.Tensor, norm: torch.Tensor, s: int, keys: Keys
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, level code) of natural dithering (twin of ``dither_rows``); code 0 is zero and
    code c ≥ 1 the level 2^{c−s}."""
    nr = norm[..., None]
    zero_row = nr == 0
    safe = torch.where(zero_row, torch.ones_like(nr), nr)
    u = (x.abs() / safe).clamp_max(1.0)
    low = 2.0 ** (1 - s)
    small = u < low
    e = torch.frexp(u).exponent.to(torch.int64)
    a = torch.where(small, torch.zeros_like(u), _pow2(e - 1, x.dtype))
    b = torch.where(small, torch.full_like(u, low), a + a)
    safe_a = torch.where(small, torch.ones_like(a), a)
    frac = torch.where(small, u / low, u / safe_a - 1.0)
    frac = torch.where(zero_row, torch.zeros_like(frac), frac)
    up = draw_up(frac, keys)
    lev = torch.where(up, b, a)
    code_a = torch.where(small, torch.zeros_like(e), e - 1 + s)
    code = torch.where(up, code_a + 1, code_a)
    out = torch.copysign(nr * lev, x)
    out = torch.where(zero_row, torch.copysign(torch.zeros_like(x), x), out)
    code = torch.where(zero_row, torch.zeros_like(code), code)
    return out, code


@COMPRESSORS.register("natural_dithering")
class NaturalDithering(Compressor):
    """Natural dithering with s levels (Horváth et al. 2019, "Natural compression for
    distributed deep learning", §4; FL_PyTorch's ``nat.dithering:s:p``): u_j = |x_j|/‖x‖ is
    rounded, unbiasedly, to a neighbour in {0, 2^{1−s}, …, 1/2, 1}; C(x)_j = ‖x‖ · sign(x_j) ·
    level, with the ℓ₂ norm (``norm=2``, the default) or the ℓ∞ norm (``norm=inf``).

    Variance, ℓ₂ (derived here, checked by the Monte-Carlo tests): a coordinate in a binade
    [a, 2a] contributes ≤ u²/8 (as natural compression), one below L = 2^{1−s} contributes
    u(L − u) ≤ min(uL, L²/4); with Σu = ‖x‖₁/‖x‖ ≤ √d this gives
    ω = 1/8 + min(√d·2^{1−s}, d·2^{−2s}), a factor 4 tighter in the second term than
    Horváth et al. Thm 7 (1/8 + min(√d·2^{1−s}, d·2^{2−2s}) for p = 2; FL_PyTorch's
    1/8 + d^{1/r} 2^{1−s} min(1, d^{1/r} 2^{1−s}), r = min(p, 2), is the same bound).
    ℓ∞: the exact worst case over R^d, ω = max over the pieces of the level grid of
    :func:`linf_worst_case` (attained at x = (1, t, …, t)); Horváth et al.'s bound for p = ∞
    (r = 2) still holds but is loose. Message: the norm (32 bits) and per coordinate a sign
    bit and a level index of ⌈log₂(s+1)⌉ bits.
    """

    kind = "unbiased"
    collective = "allgather"
    positively_homogeneous = True
    constant_formula = (
        "ω = 1/8 + min(√d·2^(1−s), d·2^(−2s)) (norm=2); exact worst case (norm=inf, see docs)"
    )
    bits_formula = "32 + d·(1 + ⌈log₂(s+1)⌉)"

    def __init__(self, s: int, norm: float = 2.0) -> None:
        self.s = _check_positive_int(s, "s (the number of levels)", "natural_dithering", 62)
        self.norm = _check_norm(norm, "natural_dithering")

    def levels(self) -> list[float]:
        """The grid of |x_j|/‖x‖: 0, 2^{1−s}, …, 1/2, 1."""
        return [0.0] + [2.0 ** (e - self.s + 1) for e in range(self.s)]

    def omega(self, d: int) -> float:
        if self.norm == 2.0:
            return 0.125 + min(math.sqrt(d) * 2.0 ** (1 - self.s), d * 2.0 ** (-2 * self.s))
        return linf_worst_case(d, self.levels())[0]

    def _norm(self, x: torch.Tensor, numba: bool) -> torch.Tensor:
        if self.norm == 2.0:
            return l2_norms(x, self.name, numba)
        return _row_stat(x, 1, self.name, numba).to(x.dtype)

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(scalar_width(dtype) + d * (1 + _log2ceil(self.s + 1)))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(32 + d * (1 + _log2ceil(self.s + 1)))

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        assert keys is not None
        numba = _use_numba(x)
        norm = self._norm(x, numba)
        if numba:
            res, o2, copy = _out_rows(x, out)
            lo, hi, lo2, hi2 = kernel_keys(keys)
            x2 = _rows(x)
            nr = norm.reshape(-1).numpy()
            utype, mant = (np.uint32, 23) if x.dtype == torch.float32 else (np.uint64, 52)
            scratch = np.empty(0, dtype=utype)  # only its dtype matters
            K.run(K.dither_rows, x2, x2, nr, self.s, lo, hi, lo2, hi2, o2, scratch, mant)
            return _emit(res, out) if copy else res
        return _emit(dither_torch(x, norm, self.s, keys)[0], out)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        assert keys is not None
        norm = self._norm(x, _use_numba(x))  # the same norm as _apply computes
        w.add_float(norm.reshape(1))
        width = 1 + _log2ceil(self.s + 1)
        if w.fast:  # level codes drawn and packed chunk by chunk
            x2 = _rows(x)
            utype, mant = _bits_of(x.dtype)
            scratch = np.empty(0, dtype=utype)  # only its dtype matters
            args = (x2[0], norm.reshape(-1).numpy(), self.s, key_table(keys), scratch, mant, width)
            w.add_block(
                x.shape[-1] * width, lambda p, b: _run(codec.dither_encode, x2, *args, p, b)
            )
            return
        _, code = dither_torch(x, norm, self.s, keys)
        w.add((code << 1) | _sign_bits(x), width)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        norm = r.read_float(1, dtype)
        width = 1 + _log2ceil(self.s + 1)
        if r.fast:
            src, b0 = r.block(d * width)
            res = _dense_out(out, d, dtype)
            o = res.numpy()
            utype, mant = _bits_of(dtype)
            scratch = np.empty(0, dtype=utype)
            _run(
                codec.dither_decode, o[None], src, b0, width, norm.numpy(), self.s, scratch, mant, o
            )
            return res
        code = r.read(d, width)
        c = code >> 1
        lev = torch.where(
            c == 0, torch.zeros(d, dtype=dtype, device=c.device), _pow2(c - self.s, dtype)
        )
        return _with_sign(norm * lev, code & 1)


# --------------------------------------------------------------------------------------------
# scaled sign
# --------------------------------------------------------------------------------------------
@COMPRESSORS.register("scaled_sign")
class ScaledSign(Compressor):
    """Scaled sign (Karimireddy et al. 2019, "Error feedback fixes SignSGD", Lemma 8):
    C(x) = (‖x‖₁/d) · sign(x), the sign taken from the sign bit (so +0 maps to +‖x‖₁/d).

    Deterministic and contractive: ‖C(x) − x‖² = ‖x‖² − ‖x‖₁²/d, i.e.
    α(x) = ‖x‖₁²/(d‖x‖²) ≥ 1/d, the constant reported (tight for a single spike). The scale
    m = ‖x‖₁/d is computed in float64 (relative error ≤ d·2⁻⁵³) and rounded to the dtype, m̃;
    exactly ‖C(x) − x‖² = ‖x‖² − ‖x‖₁²/d + d(m̃ − m)², which exceeds the bound by at most
    (u + d·2⁻⁵³)²‖x‖₁²/d ≤ (u + d·2⁻⁵³)²‖x‖² to first order (u the unit round-off; in float64
    up to (d + 1)²u²‖x‖²) while m is a normal number; a subnormal m is rounded with an absolute
    error (x = (2⁻¹⁴⁹, 0) in float32 gives C(x) = 0). Message: the scale (32 bits) and one sign
    bit per coordinate.
    """

    kind = "contractive"
    deterministic = True
    positively_homogeneous = True
    collective = "allgather"
    constant_formula = "α = 1/d  (exactly ‖x‖₁²/(d‖x‖²))"
    bits_formula = "32 + d"

    def alpha(self, d: int) -> float:
        return 1.0 / d

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(scalar_width(dtype) + d)

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(32 + d)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        m = _row_stat(x, 2, self.name, _use_numba(x)) / d
        if not bool(torch.isfinite(m).all()):  # float64 sums beyond 1.8e308: average instead
            m = (x.to(torch.float64).abs() / d).sum(-1)
        return m.to(x.dtype)

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        m = self._scale(x)
        if out is None:
            return torch.copysign(m[..., None].expand_as(x), x)
        return torch.copysign(m[..., None].expand_as(x), x, out=out)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        w.add_float(self._scale(x).reshape(1))
        if w.fast:
            x2 = _rows(x)
            w.add_block(x.shape[-1], lambda p, b: _run(codec.sign_encode, x2, x2[0], p, b))
            return
        w.add(_sign_bits(x), 1)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        m = r.read_float(1, dtype)
        if r.fast:
            src, b0 = r.block(d)
            res = _dense_out(out, d, dtype)
            o = res.numpy()
            _run(codec.sign_decode, o[None], src, b0, m.numpy(), o)
            return res
        return _with_sign(m.expand(d).clone(), r.read(d, 1))
