"""16-bit inputs (bfloat16, float16): float32 arithmetic, the output rounded once to the input
dtype, values sent in 16 bits, norms and scales in float32 (the contract suite runs every
compressor in both dtypes; these are the definitions and the numbers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from compressor_examples import ALL, D

from shrinkgrad import Keys, make_compressor, make_method, make_problem

HALF = [torch.bfloat16, torch.float16]
#: unit round-off of the 16-bit dtypes (round to nearest)
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("spec", [s for s in ALL if not s.startswith(("rank_k", "power_sgd"))])
@pytest.mark.parametrize("dtype", HALF)
def test_half_input_is_the_float32_result_rounded_once(spec: str, dtype: torch.dtype) -> None:
    """C(x) for 16-bit x is exactly C(x.float()) rounded to the dtype (norms, thresholds and
    draws in float32: the same draws as for the float32 copy)."""
    c = make_compressor(spec)
    x = _x((3, D), dtype, seed=1)
    keys = Keys.derive(2, client=np.arange(3))
    assert torch.equal(c(x, keys), c(x.float(), keys).to(dtype))


@pytest.mark.parametrize("spec", ["rank_k[r=2]", "power_sgd[rank=2]"])
@pytest.mark.parametrize("dtype", HALF)
def test_low_rank_half_rounds_its_factors(spec: str, dtype: torch.dtype) -> None:
    """Low-rank messages carry 16-bit factors: C(x) is the float32 product of the factors
    rounded to the dtype, rounded once more; within the dtype's precision of float32's."""
    c = make_compressor(spec)
    x = _x((2, 400), dtype, seed=3)
    keys = Keys.derive(1, client=np.arange(2))
    y = c(x, keys)
    y32 = c(x.float(), keys)
    assert y.dtype == dtype
    tol = 8 * UNIT[dtype] * float(x.float().abs().max()) * math.sqrt(400)
    assert float((y.float() - y32).abs().max()) <= tol


@pytest.mark.parametrize(
    "spec,d,bits",
    [
        ("identity", 100, 16 * 100),
        ("top_k[k=3]", 100, 3 * (16 + 7)),
        ("rand_k[k=3]", 100, 3 * (16 + 7)),
        ("rand_k[k=3,shared_seed=true]", 100, 3 * 16),
        ("bernoulli[p=0.25]", 128, 32 + 0.25 * 128 * (16 + 7)),
        ("lazy_bernoulli[p=0.25]", 128, 1 + 0.25 * 128 * 16),
        ("qsgd[s=4]", 100, 32 + 100 * 4),  # the norm stays float32
        ("ternary", 100, 32 + 200),
        ("natural", 100, 900),  # float32 exponent codes
        ("natural_dithering[s=8,norm=inf]", 100, 32 + 100 * 5),
        ("scaled_sign", 100, 132),
        ("rank_k[r=2]", 100, 16 * 2 * 20),
        ("compose(top_k[k=10],qsgd[s=4])", 1000, 10 * 10 + 32 + 10 * 4),
    ],
)
def test_bits_with_16_bit_values(spec: str, d: int, bits: float) -> None:
    for dtype in HALF:
        assert make_compressor(spec).bits(d, dtype) == pytest.approx(bits, rel=1e-15)


def test_paper_bits_take_the_wire_dtype() -> None:
    """The papers' 32 bits per sent float become 16 for a 16-bit wire; float64 stays at 32
    (the papers' codes send float32); norms and codes are counted as before."""
    assert make_compressor("identity").paper_bits(10, torch.bfloat16) == 160
    assert make_compressor("identity").paper_bits(10, torch.float64) == 320
    assert make_compressor("top_k[k=2]").paper_bits(10, torch.float16) == 32
    assert make_compressor("qsgd[s=4]").paper_bits(10, torch.float16) == 32 + 40
    problem = make_problem("logistic_regression[dataset=australian_scale,n_clients=4]")
    cfg = make_method("ef21").bind(problem, "top_k[k=2]", 0.1, wire_dtype=torch.bfloat16).cfg
    c = torch.zeros(4, problem.d, dtype=torch.float64)
    t = cfg.compressed_traffic(c)
    assert torch.equal(t.up, torch.full((4,), 2.0 * (16 + 4), dtype=torch.float64))
    assert torch.equal(t.up_paper, torch.full((4,), 32.0, dtype=torch.float64))
    assert torch.equal(
        cfg.dense_traffic(4).up_paper, torch.full((4,), 16.0 * 14, dtype=torch.float64)
    )


@pytest.mark.parametrize("spec", ["rand_k[k=2]", "bernoulli[p=0.5]", "natural", "qsgd[s=1]"])
def test_float16_range_errors_are_clear(spec: str) -> None:
    """A compressed value beyond float16's 65504 (rand_k's d/k·x_j, natural rounding 6e4 up to
    2¹⁶, QSGD's norm-sized levels) is a one-line error, never inf."""
    c = make_compressor(spec)
    x = torch.full((20,), 6.0e4, dtype=torch.float16)
    keys = Keys.derive(0)
    with pytest.raises(ValueError, match=r"exceeds the torch.float16 range \(6.55e\+04\)"):
        c(x, keys)
    with pytest.raises(ValueError, match=r"exceeds the torch\.float16 range"):
        c.encode(x, keys)
    y = c(x.to(torch.bfloat16), keys)  # bfloat16 has float32's range
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("shared", ["false", "true"])
def test_bfloat16_rounding_past_its_range_is_clear(shared: str) -> None:
    """rand_k's d/k·x_j with d/k = 7/4 and x_j = 1.9407e38 (a bfloat16) is the finite float32
    3.3962e38, which rounds to bfloat16 inf (its largest number is 3.3895e38): the dense
    result and the sparse form (the DDP hook's path, checked on the bit patterns) refuse it
    in one line; one kept entry of that size among normal ones is enough."""
    c = make_compressor(f"rand_k[k=4,shared_seed={shared}]")
    keys = Keys.derive(0)
    big = 1.940672873845977e38
    x = torch.full((7,), big).to(torch.bfloat16)
    assert float(x[0]) == big and bool(torch.isfinite(x.float() * (7 / 4)).all())
    with pytest.raises(ValueError, match=r"exceeds the torch\.bfloat16 range"):
        c(x, keys)
    with pytest.raises(ValueError, match=r"exceeds the torch\.bfloat16 range"):
        c.sparse(x, keys)
    x = torch.ones(7, dtype=torch.bfloat16)
    idx, vals = c.sparse(x, keys)
    assert torch.equal(vals, torch.full((4,), 1.75, dtype=torch.bfloat16))
    x[idx[1]] = big
    with pytest.raises(ValueError, match=r"exceeds the torch\.bfloat16 range"):
        c.sparse(x, keys)


@pytest.mark.parametrize(
    "spec", ["qsgd[s=4]", "rand_k[k=5]", "natural", "ternary", "lazy_bernoulli[p=0.5]"]
)
@pytest.mark.parametrize("dtype", HALF)
def test_half_monte_carlo_unbiased_up_to_the_final_rounding(spec: str, dtype: torch.dtype) -> None:
    """E C(x) = x up to the one rounding to the dtype (≤ u·|C(x)_j| per coordinate), and the
    variance bound holds for the 16-bit input."""
    c = make_compressor(spec)
    n = 20_000
    x = _x((D,), dtype, seed=4)
    x64 = x.double()
    y = c(x.expand(n, -1).contiguous(), Keys.derive(8, client=np.arange(n))).double()
    mean, se = y.mean(0), y.std(0) / math.sqrt(n)
    bias = UNIT[dtype] * y.abs().amax(0)
    assert bool(((mean - x64).abs() <= 6 * se + bias + 1e-12).all())
    err = ((y - x64) ** 2).sum(-1)
    slack = 6 * float(err.std()) / math.sqrt(n) + 4 * UNIT[dtype] * float((y**2).sum(-1).mean())
    assert float(err.mean()) <= c.omega(D) * float((x64**2).sum()) + slack
