"""The declared constants hold: exactly (rational arithmetic) for deterministic compressors on
adversarial inputs, and by Monte-Carlo with sample-size-derived tolerances for random ones.

Monte-Carlo tolerances: with N independent draws (N client keys in one batched call), a sample
mean is compared with its target within 6 standard errors, the standard error estimated from
the sample itself; the keys are fixed, so the tests are deterministic (never flaky), and a 6σ
miss would be a one-in-10⁹ event for a correct implementation while any real error in a
constant of the size that matters (≥ 1%) is many standard errors.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from compressor_examples import ALL, D
from hypothesis import given
from hypothesis import strategies as st

from shrinkgrad import Keys, make_compressor
from shrinkgrad.compressors import Compressor

N_MC = 20_000


# --------------------------------------------------------------------------------------------
# deterministic compressors: exact bound on adversarial inputs
# --------------------------------------------------------------------------------------------
def _adversarial(dtype: torch.dtype) -> list[list[float]]:
    big, small = (1e30, 1e-30) if dtype == torch.float32 else (1e300, 1e-300)
    return [
        [1.0],
        [-3.5],
        [0.0],
        [1.0, 1.0, 1.0, 1.0],  # all equal (ties everywhere)
        [2.0, -2.0, 2.0, -2.0, 1.0, 1.0],
        [0.0] * 7 + [5.0],  # one spike
        [0.0, -0.0, 0.0, 0.0, 0.0],
        [big, small, -small, small],
        [big, -big, big],
        [small] * 5,
        [1e30, 1e-30, 1.0, -1e-30, 3.0],
        [1.0, 1e-20, 1e-20],  # near-spike: the tight case of scaled_sign
        [float(v) for v in np.linspace(-1, 1, 21)],
    ]


def _fr(t: torch.Tensor) -> list[Fraction]:
    return [Fraction(v) for v in t.to(torch.float64).tolist()]


def _check_exact_bound(c: Compressor, x: torch.Tensor) -> None:
    d = x.shape[-1]
    try:
        alpha = c.alpha(d)
    except ValueError:
        return  # k > d: the compressor refuses this d (tested separately)
    y = c(x)
    xs, ys = _fr(x), _fr(y)
    err = sum(((b - a) ** 2 for a, b in zip(xs, ys, strict=True)), Fraction(0))
    norm2 = sum((a * a for a in xs), Fraction(0))
    # α as the rational it denotes (k/d, 1/d, products of those): a float 0.2 is not 1/5
    exact_alpha = Fraction(alpha).limit_denominator(10**6)
    assert abs(float(exact_alpha) - alpha) <= 1e-15 * alpha
    bound = (1 - exact_alpha) * norm2
    selection = all(b == 0 or b == a for a, b in zip(xs, ys, strict=True))
    if selection:
        # outputs are input entries or zeros: no rounding anywhere, the bound is exact
        assert err <= bound, (c.name, x.tolist(), y.tolist())
    else:
        # one scalar (e.g. ‖x‖₁/d) is rounded to the dtype: at most (d+1)²u²‖x‖² extra
        u = Fraction(2) ** (-24 if x.dtype == torch.float32 else -53)
        assert err <= bound + (d + 1) ** 2 * u * u * norm2, (c.name, x.tolist(), y.tolist())


_F30 = float(np.float32(1e30))
# rank_k's SVD rounds at every step (not only one scalar): its bound is tested to round-off in
# test_lowrank.py
DETERMINISTIC = [s for s in ALL if make_compressor(s).deterministic and not s.startswith("rank_k")]


def test_deterministic_examples_exist() -> None:
    assert {"identity", "top_k[k=1]", "top_k[k=3]", "scaled_sign"} <= set(DETERMINISTIC)


@pytest.mark.parametrize("spec", DETERMINISTIC)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deterministic_bound_exact_on_adversarial_inputs(spec: str, dtype: torch.dtype) -> None:
    c = make_compressor(spec)
    for values in _adversarial(dtype):
        _check_exact_bound(c, torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("spec", DETERMINISTIC)
@given(
    values=st.lists(
        st.floats(allow_nan=False, allow_infinity=False, width=32, min_value=-_F30, max_value=_F30),
        min_size=1,
        max_size=24,
    )
)
def test_deterministic_bound_exact_property(spec: str, values: list[float]) -> None:
    _check_exact_bound(make_compressor(spec), torch.tensor(values, dtype=torch.float32))


def test_exact_tightness_of_top_k_and_scaled_sign() -> None:
    # Top-k is tight on all-equal vectors, scaled sign on a single spike: the constants cannot
    # be improved, so a test of "≤" with a wrong, larger α would fail here.
    x = torch.ones(10, dtype=torch.float64)
    y = make_compressor("top_k[k=3]")(x)
    assert float(((y - x) ** 2).sum()) == (1 - 3 / 10) * 10
    s = torch.zeros(8, dtype=torch.float64)
    s[2] = 4.0
    y = make_compressor("scaled_sign")(s)
    assert float(((y - s) ** 2).sum()) == pytest.approx((1 - 1 / 8) * 16, rel=1e-15)


# --------------------------------------------------------------------------------------------
# random compressors: Monte-Carlo
# --------------------------------------------------------------------------------------------
RANDOM = [s for s in ALL if not make_compressor(s).deterministic]


def _draws(c: Compressor, x: torch.Tensor, n: int = N_MC, seed: int = 2024) -> torch.Tensor:
    keys = Keys.derive(seed, round=1, client=np.arange(n))
    return c(x.expand(n, -1).contiguous(), keys).to(torch.float64)


def _mc_x(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(D, generator=g, dtype=torch.float64)
    x[3] = 0.0
    x[5] = 4.0  # a dominant entry
    return x


def _mean_and_se(v: torch.Tensor) -> tuple[float, float]:
    return float(v.mean()), float(v.std()) / math.sqrt(v.numel())


@pytest.mark.parametrize("spec", RANDOM)
def test_monte_carlo_unbiased_and_bound(spec: str) -> None:
    c = make_compressor(spec)
    x = _mc_x()
    y = _draws(c, x)
    err = ((y - x) ** 2).sum(dim=-1)
    m, se = _mean_and_se(err)
    norm2 = float((x**2).sum())
    if c.kind == "unbiased":
        mean = y.mean(dim=0)
        se_j = y.std(dim=0) / math.sqrt(y.shape[0])
        assert bool(((mean - x).abs() <= 6 * se_j + 1e-12 * x.abs().max()).all()), (mean, x)
        assert m <= c.omega(D) * norm2 + 6 * se
    elif c.constant_known:
        assert m <= (1 - c.alpha(D)) * norm2 + 6 * se
    else:  # power_sgd: a projection, never an expansion, but no α to check
        assert bool((err <= norm2 * (1 + 1e-6)).all())


def _exact_variance(spec: str, x: torch.Tensor) -> float:
    """E‖C(x) − x‖² computed independently from the definition of each operator."""
    d = x.numel()
    a = x.abs()
    n2 = float((x**2).sum())
    if spec.startswith("rand_k[k=3]"):
        return (d / 3 - 1) * n2
    if spec.startswith("bernoulli"):
        return (1 / 0.3 - 1) * n2
    if spec.startswith("lazy_bernoulli"):
        return (1 / 0.4 - 1) * n2
    if spec in ("ternary", "standard_dithering[s=1,norm=inf]"):
        return float(a.sum() * a.max()) - n2
    if spec.startswith("standard_dithering") and "norm=inf" in spec:
        s = int(spec.split("s=")[1].split(",")[0])
        step = float(a.max()) / s
        f = a / step - (a / step).floor()
        return float((step**2 * f * (1 - f)).sum())
    if spec.startswith("qsgd"):
        s = int(spec[7:-1])
        step = math.sqrt(n2) / s
        r = a / step
        f = r - r.floor()
        return float((step**2 * f * (1 - f)).sum())
    if spec == "natural":
        lo = 2.0 ** torch.floor(torch.log2(a.clamp_min(1e-300)))
        return float(torch.where(a > 0, (a - lo) * (2 * lo - a), 0.0).sum())
    if spec.startswith("natural_dithering"):
        s = int(spec.split("s=")[1].split(",")[0].rstrip("]"))
        u = a / (float(a.max()) if "norm=inf" in spec else math.sqrt(n2))
        low = 2.0 ** (1 - s)
        lo = torch.where(u < low, 0.0, 2.0 ** torch.floor(torch.log2(u.clamp_min(1e-300))))
        hi = torch.where(u < low, low, 2 * lo)
        scale2 = float(a.max()) ** 2 if "norm=inf" in spec else n2
        return float(scale2 * ((u - lo) * (hi - u)).sum())
    raise KeyError(spec)


EXACT = [
    "rand_k[k=3]",
    "bernoulli[p=0.3]",
    "lazy_bernoulli[p=0.4]",
    "ternary",
    "standard_dithering[s=1,norm=inf]",
    "standard_dithering[s=3,norm=inf]",
    "natural_dithering[s=3,norm=inf]",
    "qsgd[s=1]",
    "qsgd[s=4]",
    "natural",
    "natural_dithering[s=2]",
    "natural_dithering[s=5]",
]


@pytest.mark.parametrize("spec", EXACT)
def test_monte_carlo_variance_equals_exact_value(spec: str) -> None:
    c = make_compressor(spec)
    x = _mc_x(seed=3)
    y = _draws(c, x, seed=77)
    m, se = _mean_and_se(((y - x) ** 2).sum(dim=-1))
    exact = _exact_variance(spec, x)
    assert abs(m - exact) <= 6 * se + 1e-12, (m, exact, se)
    assert exact <= c.omega(D) * float((x**2).sum()) * (1 + 1e-12)


def test_tight_inputs_attain_the_constants() -> None:
    # rand-k: ω = d/k − 1 for every x; natural: ω(x) → 1/8 at |x_j| = (4/3)·2^e;
    # ternary: the exact formula at a skewed vector.
    x = torch.tensor([4 / 3 * 2.0**e for e in range(-5, 15)], dtype=torch.float64)
    x[::2] *= -1
    exact = _exact_variance("natural", x) / float((x**2).sum())
    assert exact == pytest.approx(1 / 8, rel=1e-6)
    c = make_compressor("natural")
    y = _draws(c, x, seed=5)
    m, se = _mean_and_se(((y - x) ** 2).sum(dim=-1) / (x**2).sum())
    assert abs(m - 1 / 8) <= 6 * se + 1e-6
    t = torch.tensor([10.0] + [0.5] * 19, dtype=torch.float64)
    yt = _draws(make_compressor("ternary"), t, seed=6)
    m, se = _mean_and_se(((yt - t) ** 2).sum(dim=-1) / (t**2).sum())
    from shrinkgrad.compressors import Ternary

    assert abs(m - float(Ternary.omega_of(t))) <= 6 * se
    assert float(Ternary.omega_of(t)) == pytest.approx(19.5 * 10 / 104.75 - 1)


def test_rand_k_inclusion_probabilities_are_uniform() -> None:
    d, k, n = 13, 4, 40_000
    c = make_compressor(f"rand_k_scaled[k={k}]")
    y = c(torch.ones(n, d), Keys.derive(3, client=np.arange(n)))
    kept = (y != 0).to(torch.float64)
    assert bool((kept.sum(dim=1) == k).all())  # exactly k distinct indices per row
    p = kept.mean(dim=0)
    sd = math.sqrt(k / d * (1 - k / d) / n)
    assert bool(((p - k / d).abs() <= 6 * sd).all()), p
    # pairs are spread too (the Feistel permutation mixes; a rotation alone would not)
    pair = (kept[:, 0] * kept[:, 1]).mean()
    target = k * (k - 1) / (d * (d - 1))
    assert abs(float(pair) - target) <= 6 * math.sqrt(target / n)


@pytest.mark.parametrize("frac", [0.0, 1 / 256, 0.3, 0.5, 255.5 / 256, 1 - 2**-40])
def test_draw_rule_probability(frac: float) -> None:
    from shrinkgrad.compressors._random import draw_up

    n = 200_000
    up = draw_up(torch.full((1, n), frac, dtype=torch.float64), Keys.derive(9))
    m = float(up.to(torch.float64).mean())
    assert abs(m - frac) <= 6 * math.sqrt(max(frac * (1 - frac), 1e-12) / n) + 1e-12
