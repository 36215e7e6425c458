"""An audit of the compressors' error paths, bit counts and documented floating-point claims
(docs/compressors.md): low-rank factors that overflow their dtype, Bernoulli's realised and
paper bits, the 16-bit final rounding below the normal range, scaled_sign's rounding margin
and QSGD's level clamp in float32. Every expected value is computed here from the formulas
(exact rationals, numpy's correctly rounded float32 arithmetic), not read from the code."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from compressor_examples import ALL

from shrinkgrad import Keys, make_compressor
from shrinkgrad.compressors import base

HALF = [torch.bfloat16, torch.float16]
#: unit round-off and smallest subnormal of the 16-bit dtypes
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}
LOW_RANK = ["rank_k[r=1]", "power_sgd[rank=1]", "power_sgd[rank=1,shared=true]"]


def _keys(n: int, seed: int = 7, round: int = 1) -> Keys:
    return Keys.derive(seed, round=round, client=np.arange(n))


# --------------------------------------------------------------------------------------------
# 1. low-rank factors beyond their dtype's range
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", LOW_RANK)
def test_float16_factor_overflow_names_the_factor_not_the_output(spec: str) -> None:
    """An 8 × 8 view of entries 30000: every entry and C(x) (= x, a rank-one matrix) fit
    float16, but σ₁ = 8·30000 = 240000 > 65504, and the factors (U_rΣ_r, PowerSGD's Q = MᵀP̂
    and the shared mode's P = MQ) reach σ₁. The error names the factor, float16 and bfloat16 as
    the fix, in C(x), encode and step; before, it said that a compressed value exceeded float16
    (the shared mode: that a factor overflowed float32)."""
    x = torch.full((64,), 30000.0, dtype=torch.float16)
    m = x.double().reshape(8, 8)
    sigma1 = float(torch.linalg.svdvals(m)[0])
    fmax = torch.finfo(torch.float16).max
    assert sigma1 == pytest.approx(240000.0) and sigma1 > fmax
    c = make_compressor(spec)
    keys = Keys.derive(3, round=0, client=0)
    y32 = c(x.float(), keys)  # the float32 result: finite and within float16's range
    assert bool(torch.isfinite(y32).all()) and float(y32.abs().max()) <= fmax
    assert torch.allclose(c(x.bfloat16(), keys).float(), x.float(), rtol=2**-7)
    want = r"low-rank factor .* overflows torch\.float16's range .*bfloat16"
    with pytest.raises(ValueError, match=want):
        c(x, keys)
    with pytest.raises(ValueError, match=want):
        c.encode(x, keys)
    if c.stateful:
        rows = x[None]
        state = c.init_state(rows, _keys(1))  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match=want):
            c.step(rows, _keys(1), state)  # type: ignore[attr-defined]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype,v", [(torch.float32, 3e38), (torch.float64, 1e308)])
def test_power_sgd_step_never_returns_inf(shared: bool, dtype: torch.dtype, v: float) -> None:
    """EF21/EF call ``step``: for finite rows whose Q = MᵀP̂ exceeds the dtype (the 8 × 8
    all-v view has Q = √8·v·(1, …, 1) > max), step returned an inf/NaN C(x) and next Q without
    an error; it now raises the factor-overflow error, as C(x) does."""
    assert math.sqrt(8) * v > torch.finfo(dtype).max
    c = make_compressor(f"power_sgd[rank=1{',shared=true' if shared else ''}]")
    x = torch.full((2, 64), v, dtype=dtype)
    keys = _keys(2)
    state = c.init_state(x, keys)  # type: ignore[attr-defined]
    want = rf"low-rank factor .* overflows {dtype}'s range"
    with pytest.raises(ValueError, match=want):
        c.step(x, keys, state)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=want):
        c(x, keys)


def test_no_compressor_returns_inf_or_nan_for_finite_16_bit_input() -> None:
    """Every registered example on finite 16-bit inputs at the edges of the range (the largest
    value, mixed signs, a spike, quarters of the maximum, the smallest normal and subnormal
    values): a finite output or a ValueError, never a silent inf/NaN."""
    for dtype in HALF:
        fi = torch.finfo(dtype)
        rows = []
        for v in (fi.max, fi.max / 4, fi.max / 64, fi.tiny, float(TINY[dtype])):
            rows.append(torch.full((20,), v))
        alt = torch.full((20,), fi.max)
        alt[::2] *= -1
        spike = torch.zeros(20)
        spike[3] = fi.max
        rows += [alt, spike, torch.linspace(-1, 1, 20) * fi.max]
        for spec in ALL:
            c = make_compressor(spec)
            for x in rows:
                xh = x.to(dtype)
                assert bool(torch.isfinite(xh).all())
                try:
                    y = c(xh, Keys.derive(1, round=2, client=0))
                except ValueError:
                    continue
                assert bool(torch.isfinite(y).all()), (spec, dtype, x[:3].tolist())


# --------------------------------------------------------------------------------------------
# 2. Bernoulli: realised wire bits, the papers' expected count
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
def test_bernoulli_message_bits_are_the_payload(dtype: torch.dtype) -> None:
    """message_bits(C(x)) = 32 + n(w + ⌈log₂ d⌉), n the payload's own 32-bit count field (the
    kept non-zeros), w the value width; the payload has ⌈bits/8⌉ bytes; x has zeros and a −0.0
    (kept zeros are not sent)."""
    c = make_compressor("bernoulli[p=0.3]")
    d, width = 97, torch.finfo(dtype).bits
    for t in range(30):
        x = torch.randn(d, generator=torch.Generator().manual_seed(t)).to(dtype)
        x[::7] = 0.0
        x[3] = -0.0
        keys = Keys.derive(5, round=t, client=0)
        y = c(x, keys)
        payload = c.encode(x, keys)
        n = int.from_bytes(bytes(payload[:4].tolist()), "little")
        assert n == int(torch.count_nonzero(y))
        bits = 32 + n * (width + math.ceil(math.log2(d)))
        assert float(c.message_bits(y)) == bits
        assert payload.numel() == -(-bits // 8)


def test_bernoulli_paper_bits_is_the_expected_count_of_sent_floats() -> None:
    """paper_bits = 32·p·d (16 for 16-bit values), the expectation of the papers' 32 bits per
    sent float over the keep draws (within 6 standard errors of the realised mean), the same
    for every message."""
    p, d, n = 0.3, 97, 4000
    c = make_compressor(f"bernoulli[p={p}]")
    assert c.paper_bits(d) == pytest.approx(32 * p * d)
    assert c.paper_bits(d, torch.bfloat16) == pytest.approx(16 * p * d)
    x = torch.randn(d, generator=torch.Generator().manual_seed(1)) + 5.0  # no zeros
    assert bool((x != 0).all())
    sent = 32.0 * torch.count_nonzero(c(x.expand(n, d).contiguous(), _keys(n)), dim=-1).double()
    se = float(sent.std()) / math.sqrt(n)
    assert abs(float(sent.mean()) - c.paper_bits(d)) <= 6 * se


# --------------------------------------------------------------------------------------------
# 3a. the 16-bit final rounding below the normal range
# --------------------------------------------------------------------------------------------
def test_float16_rounding_bias_below_the_normal_range() -> None:
    """qsgd[s=2] of x = (3, 4)·2⁻²⁴ in float16: ‖x‖ = 5·2⁻²⁴, σ = 2.5·2⁻²⁴, coordinate 0 is σ
    (prob. 0.8, r = 1.2) or 2σ; σ rounds to 2·2⁻²⁴ (a tie, to even). E C(x)₀ = 2.6·2⁻²⁴, a bias
    of 0.4·2⁻²⁴: more than u·|C(x)₀| (the old claim) and at most η/2 = 2⁻²⁵ (the doc's bound)."""
    t = 2.0**-24
    x = torch.tensor([3 * t, 4 * t], dtype=torch.float16)
    sigma = 2.5 * t
    lo, hi = (float(torch.tensor(v).to(torch.float16)) for v in (sigma, 2 * sigma))
    assert (lo, hi) == (2 * t, 5 * t)
    mean = 0.8 * lo + 0.2 * hi
    bias = abs(mean - 3 * t)
    u, eta = UNIT[torch.float16], TINY[torch.float16]
    assert u * hi < bias <= eta / 2
    n = 20000
    y = make_compressor("qsgd[s=2]")(x.expand(n, 2).contiguous(), _keys(n))[:, 0].double()
    assert set(y.tolist()) == {lo, hi}
    assert abs(float(y.mean()) - mean) <= 6 * float(y.std()) / math.sqrt(n)


@pytest.mark.parametrize("spec", [s for s in ALL if not s.startswith(("rank_k", "power_sgd"))])
@pytest.mark.parametrize("dtype", HALF)
def test_16_bit_rounding_moves_outputs_by_at_most_u_or_half_a_subnormal(
    spec: str, dtype: torch.dtype
) -> None:
    """|C(x)_j − C(x.float())_j| ≤ max(u|C(x.float())_j|, η/2) on inputs whose outputs straddle
    the bottom of the normal range (the documented bound of the final rounding)."""
    c = make_compressor(spec)
    g = torch.Generator().manual_seed(4)
    scale = 2.0**-18 if dtype == torch.float16 else 2.0**-124
    x = (torch.randn(16, 20, generator=g) * scale).to(dtype)
    keys = _keys(16)
    y, y32 = c(x, keys).double(), c(x.float(), keys).double()
    bound = torch.clamp(UNIT[dtype] * y32.abs(), min=TINY[dtype] / 2)
    assert bool(((y - y32).abs() <= bound).all())


# --------------------------------------------------------------------------------------------
# 3b. scaled_sign: the rounding of m = ‖x‖₁/d
# --------------------------------------------------------------------------------------------
def _sign_audit(x: torch.Tensor) -> tuple[Fraction, Fraction, Fraction, Fraction, Fraction]:
    """(excess over ‖x‖² − ‖x‖₁²/d, m, m̃, ‖x‖₁, ‖x‖²) of scaled_sign on x, exactly."""
    y = make_compressor("scaled_sign")(x)
    xs = [Fraction(v) for v in x.double().tolist()]
    ys = [Fraction(v) for v in y.double().tolist()]
    d = len(xs)
    n1 = sum((abs(a) for a in xs), Fraction(0))
    n2 = sum((a * a for a in xs), Fraction(0))
    err = sum(((a - b) ** 2 for a, b in zip(xs, ys, strict=True)), Fraction(0))
    mt = {abs(b) for b in ys}
    assert len(mt) == 1
    return err - (n2 - n1 * n1 / d), n1 / d, mt.pop(), n1, n2


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
def test_scaled_sign_excess_is_d_times_the_rounding_of_m_squared(
    kernels: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exactly ‖C(x) − x‖² = ‖x‖² − ‖x‖₁²/d + d(m̃ − m)², with |m̃ − m| ≤ (u + (d + 1)2⁻⁵³)·m
    (u: 2⁻²⁴, 2⁻⁵³, and 2⁻⁸ or 2⁻¹¹ plus 2⁻²⁴ for the twice-rounded 16-bit m) for a normal
    m; near-equal magnitudes make ‖x‖₁²/d ≈ ‖x‖², where the margin matters."""
    monkeypatch.setattr(base, "KERNELS", kernels)
    u = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}.get(dtype)
    if u is None:
        u = UNIT[dtype] + 2.0**-24
    rng = np.random.default_rng(11)
    for _ in range(40):
        d = int(rng.integers(2, 1500))
        mag = 1 + rng.random(d) * rng.choice([1e-3, 1e-9, 1.0])
        x = torch.tensor(mag * rng.choice([-1.0, 1.0], d)).to(dtype)
        excess, m, mt, n1, _ = _sign_audit(x)
        assert excess == d * (mt - m) ** 2
        margin = Fraction((u + (d + 1) * 2.0**-53) * (1 + u))
        assert abs(mt - m) <= margin * m
        assert excess <= margin**2 * n1 * n1 / d


def test_scaled_sign_float64_margin_exceeds_u_squared() -> None:
    """The old wording (an excess ≤ u²‖x‖²) fails in float64: the float64 sum's error (up to
    (d − 1)·2⁻⁵³) dominates the final rounding; the (d + 1)²u²‖x‖² of test_constants holds."""
    u = Fraction(1, 2**53)
    worst = Fraction(0)
    rng = np.random.default_rng(0)
    for _ in range(60):
        d = int(rng.integers(500, 3000))
        x = torch.tensor((1 + rng.random(d) * 1e-3) * rng.choice([-1.0, 1.0], d))
        excess, _, _, _, n2 = _sign_audit(x)
        assert excess <= (d + 1) ** 2 * u * u * n2
        worst = max(worst, excess / (u * u * n2))
    assert worst > 1


@pytest.mark.parametrize("dtype,v", [(torch.float32, 2.0**-149), (torch.float16, 2.0**-24)])
def test_scaled_sign_subnormal_m_rounds_to_zero(dtype: torch.dtype, v: float) -> None:
    """x = (η, 0), η the smallest subnormal: m = η/2, a tie that rounds to 0, so C(x) = 0 and
    ‖C(x) − x‖² = ‖x‖² > (1 − 1/d)‖x‖²: the documented exception, an absolute rounding of m."""
    x = torch.tensor([v, 0.0], dtype=dtype)
    excess, m, mt, _, _ = _sign_audit(x)
    assert mt == 0 and m == Fraction(v) / 2
    assert excess == 2 * m * m  # d(m̃ − m)² with m̃ = 0


# --------------------------------------------------------------------------------------------
# 3c. QSGD's level clamp in float32
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_qsgd_float32_clamp_engages_and_stays_within_two_roundings(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x = e₁ ∈ R⁸ (‖x‖ = 1 exactly): σ = fl32(1/s); where it rounds below 1/s, r₁ = fl32(1/σ)
    exceeds s and the level is clamped: the output is fl32(s·σ) for every key (no draw), within
    2u + 9·2⁻⁵³ of x₁ = 1 (u = 2⁻²⁴). s = 61 is such a case."""
    monkeypatch.setattr(base, "KERNELS", kernels)
    one = np.float32(1.0)
    clamped = []
    for s in range(1, 201):
        sigma = one / np.float32(s)
        if one / sigma > s:
            clamped.append((s, np.float32(sigma * np.float32(s))))
    assert 61 in dict(clamped)
    x = torch.zeros(64, 8)
    x[:, 0] = 1.0
    for s, want in clamped:
        y = make_compressor(f"qsgd[s={s}]")(x, _keys(64, seed=s))
        assert set(y[:, 0].tolist()) == {float(want)}
        assert float(want) < 1.0
        assert 1.0 - float(want) <= 2 * 2.0**-24 + 9 * 2.0**-53
