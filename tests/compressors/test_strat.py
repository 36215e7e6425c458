"""strat_k, the block-stratified sparsifier: its draw rule against an independent reference, the
per-block inclusion probabilities, the exact variance and its tight input, the bit formulas,
the scaled form, and the chunked kernels against the torch path."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from shrinkgrad import Keys, make_compressor
from shrinkgrad.compressors import _kernels as K
from shrinkgrad.compressors import _strat_kernels as SK
from shrinkgrad.compressors import base
from shrinkgrad.compressors._random import EXTRA
from shrinkgrad.compressors.sparse import STRATK_TAG, strat_bounds, strat_indices_torch
from shrinkgrad.rng import bits32_numpy


def _reference_draw(keys: Keys, d: int, k: int) -> np.ndarray:
    """The documented rule, scalar by scalar in Python integers: block b = [⌊bd/k⌋, ⌊(b+1)d/k⌋)
    of size s keeps ⌊w·s/2³²⌋ for the first word w = bits32(K, b) with (w·s mod 2³²) ≥ 2³² mod
    s, the later words being bits32(K.fold("extra"), TRIES·b + t), t = 1, …, TRIES − 1."""
    pk = keys.fold(STRATK_TAG)
    lo, hi = pk.numpy()
    lo2, hi2 = pk.fold(EXTRA).numpy()
    out = np.empty((lo.size, k), dtype=np.int64)
    for r in range(lo.size):
        for b in range(k):
            start, s = b * d // k, (b + 1) * d // k - b * d // k
            t = (1 << 32) % s
            w = int(bits32_numpy(lo[r], hi[r], np.uint32(b)))
            tries = 1
            while (w * s) % (1 << 32) < t and tries < SK.TRIES:
                w = int(bits32_numpy(lo2[r], hi2[r], np.uint32(SK.TRIES * b + tries)))
                tries += 1
            out[r, b] = start + (w * s >> 32)
    return out


@pytest.mark.parametrize(
    "d,k",
    [
        (1, 1),
        (20, 3),  # blocks of 6, 7, 7
        (1000, 7),
        (65537, 300),
        # blocks of 3·2²⁹ entries: 2³² mod s = 2³⁰, a quarter of the words are rejected, so
        # the redraw path runs (no x of this size is allocated: only the indices are drawn)
        (3 << 30, 2),
    ],
)
def test_draws_follow_the_documented_rule_on_every_path(d: int, k: int) -> None:
    keys = Keys.derive(5, round=3, client=np.arange(24))
    want = _reference_draw(keys, d, k)
    t = strat_indices_torch(keys.fold(STRATK_TAG), d, k)
    assert np.array_equal(t.numpy(), want)
    got = make_compressor(f"strat_k[k={k}]")._idx(keys, d, True)
    assert np.array_equal(got.numpy(), want)
    bounds = strat_bounds(d, k)
    assert bool(((want >= bounds[:-1]) & (want < bounds[1:])).all())  # one index per block


def test_the_redraw_path_is_exercised_by_the_large_block_case() -> None:
    """Guards the last case above: with s = 3·2²⁹ some first words are rejected."""
    d, k, s = 3 << 30, 2, 3 << 29
    lo, hi = Keys.derive(5, round=3, client=np.arange(24)).fold(STRATK_TAG).numpy()
    first = [int(bits32_numpy(lo[r], hi[r], np.uint32(b))) for r in range(24) for b in range(k)]
    assert d // k == s
    assert any((w * s) % (1 << 32) < (1 << 32) % s for w in first)


def test_each_index_is_kept_with_probability_one_over_its_block_size() -> None:
    """P(j kept) = 1/|B(j)| (blocks 6, 7, 7 of d = 20), exactly one index per block, and two
    entries of one block never together (that is what makes it not rand-k)."""
    d, k, n = 20, 3, 40_000
    c = make_compressor(f"strat_k[k={k}]")
    y = c(torch.ones(n, d, dtype=torch.float64), Keys.derive(3, client=np.arange(n)))
    kept = (y != 0).to(torch.float64)
    bounds = strat_bounds(d, k)
    sizes = np.diff(bounds)
    for b in range(k):
        blk = kept[:, bounds[b] : bounds[b + 1]]
        assert bool((blk.sum(dim=1) == 1).all())
        p = 1 / sizes[b]
        sd = math.sqrt(p * (1 - p) / n)
        assert bool(((blk.mean(dim=0) - p).abs() <= 6 * sd).all())
        # the kept value is |B_b|·x_j
        assert bool((y[:, bounds[b] : bounds[b + 1]].sum(dim=1) == sizes[b]).all())


def _exact_variance(x: torch.Tensor, k: int) -> float:
    """E‖C(x) − x‖² = Σ_j (|B(j)| − 1)·x_j², computed from the block sizes alone."""
    d = x.numel()
    sizes = np.diff(strat_bounds(d, k))
    per = torch.from_numpy(np.repeat(sizes - 1, sizes).astype(np.float64))
    return float((per * x.to(torch.float64) ** 2).sum())


@pytest.mark.parametrize("k", [3, 7, 20])
def test_monte_carlo_variance_equals_the_exact_value(k: int) -> None:
    d, n = 20, 20_000
    x = torch.randn(d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    c = make_compressor(f"strat_k[k={k}]")
    y = c(x.expand(n, -1).contiguous(), Keys.derive(11, round=2, client=np.arange(n)))
    err = ((y - x) ** 2).sum(dim=-1)
    m, se = float(err.mean()), float(err.std()) / math.sqrt(n)
    exact = _exact_variance(x, k)
    assert abs(m - exact) <= 6 * se + 1e-12
    sd = y.std(dim=0) / math.sqrt(n)  # 0 at k = d: strat_k is then the identity
    assert bool(((y.mean(dim=0) - x).abs() <= 6 * sd + 1e-12).all())
    assert exact <= c.omega(d) * float((x**2).sum()) * (1 + 1e-12)


def test_omega_is_attained_on_a_largest_block() -> None:
    d, k = 20, 3  # blocks 6, 7, 7: ω = ⌈20/3⌉ − 1 = 6
    c = make_compressor(f"strat_k[k={k}]")
    assert c.omega(d) == 6
    x = torch.zeros(d, dtype=torch.float64)
    x[13:20] = torch.arange(1.0, 8.0, dtype=torch.float64)  # the last block
    assert _exact_variance(x, k) == pytest.approx(6 * float((x**2).sum()), rel=1e-15)
    # and k | d gives rand-k's ω = d/k − 1
    assert make_compressor("strat_k[k=5]").omega(20) == make_compressor("rand_k[k=5]").omega(20)


def test_bit_formulas_count_offsets_within_the_blocks() -> None:
    c = make_compressor("strat_k[k=3]")
    assert c.bits(20) == 3 * (32 + 3)  # offsets in blocks of ≤ 7 entries: 3 bits
    assert c.bits(20, torch.bfloat16) == 3 * (16 + 3)
    assert c.paper_bits(20) == 3 * 32
    assert make_compressor("strat_k[k=3,shared_seed=true]").bits(20) == 3 * 32
    # fewer index bits than rand-k's ⌈log₂ d⌉ per index
    assert c.index_bits(10**6) < make_compressor("rand_k[k=3]").index_bits(10**6)
    x = torch.randn(20)
    msg = c.encode(x, Keys.derive(1))
    assert msg.numel() * 8 >= c.bits(20) > (msg.numel() - 1) * 8


def test_scaled_strat_k_is_strat_k_over_its_largest_block_exactly() -> None:
    x = torch.randn(6, 20, dtype=torch.float64)
    keys = Keys.derive(4, client=np.arange(6))
    u = make_compressor("strat_k[k=3]")
    a = make_compressor("scaled(strat_k[k=3])")
    assert a.alpha(20) == 1 / 7
    assert torch.equal(u(x, keys) != 0, a(x, keys) != 0)
    torch.testing.assert_close(a(x, keys) * 7, u(x, keys), rtol=1e-15, atol=0)


@pytest.mark.parametrize("spec", ["strat_k[k=5000]", "strat_k[k=7]", "scaled(strat_k[k=300])"])
def test_kernel_over_several_chunks_equals_the_torch_path(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks that straddle two chunks (k = 7: every block spans chunks; k = 5000: many blocks
    per chunk) are written once, by the chunk that holds the kept entry; a non-finite entry in
    a late chunk and an overflowing kept value are still reported."""
    d = 3 * K.CHUNK + 5
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(3))
    keys = Keys.derive(4, round=1, client=np.arange(2))
    c = make_compressor(spec)
    monkeypatch.setattr(base, "KERNELS", "torch")
    ref = c(x, keys)
    ref_i, ref_v = c.sparse(x, keys)
    monkeypatch.setattr(base, "KERNELS", "numba")
    assert torch.equal(c(x, keys), ref)
    got_i, got_v = c.sparse(x, keys)
    assert torch.equal(got_i, ref_i) and torch.equal(got_v, ref_v)
    kk = int(spec.split("k=")[1].split("]")[0])
    assert int((ref != 0).sum()) == 2 * kk
    bad = x.clone()
    bad[1, d - 2] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        c(bad, keys)
    if spec.startswith("strat_k"):
        big = x.clone()
        big[0, int(ref[0].nonzero()[-1])] = 1e38  # times the block size: beyond float32
        with pytest.raises(ValueError, match="overflows"):
            c(big, keys)


def test_a_corrupt_offset_is_refused() -> None:
    c = make_compressor("strat_k[k=3]")
    msg = c.encode(torch.randn(20), Keys.derive(1))
    bad = msg.clone()
    bad[0] = 0xFF  # the first offset field reads 7 in a block of 6 entries
    with pytest.raises(ValueError, match="corrupt payload"):
        c.decode(bad, 20, torch.float32, Keys.derive(1))


# --------------------------------------------------------------------------------------------
# audit findings (each test failed before its fix)
# --------------------------------------------------------------------------------------------
def test_scaled_factor_is_one_in_a_largest_block_beyond_float32_integers() -> None:
    """scaled(strat_k) sends a largest block's value as it is (factor |B_b|/⌈d/k⌉ = 1). The
    factors were computed from the block sizes already rounded to the dtype: ⌊d/k⌋ = 2²⁴ + 1
    is no float32 integer, so the factor came out 2²⁴/(2²⁴ + 1) = 0.99999994 and every kept
    float32 value was scaled down."""
    d = (1 << 24) + 1  # k = 1: one block of 2²⁴ + 1 entries, factor exactly 1
    x = torch.full((d,), 3.0)
    keys = Keys.derive(2)
    for kernels in ("numba", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base, "KERNELS", kernels)
            idx, vals = make_compressor("scaled(strat_k[k=1])").sparse(x, keys)
        assert vals.tolist() == [3.0], kernels
        assert make_compressor("strat_k[k=1]").sparse(x, keys)[0].tolist() == idx.tolist()
    # k = 2, d = 2²⁵ + 3: blocks of 2²⁴ + 1 and 2²⁴ + 2 entries (no input allocated)
    exact = make_compressor("scaled(strat_k[k=2])").exact
    assert exact is not None
    q, m = (1 << 24) + 1, (1 << 24) + 2
    for dt in (np.float32, np.float64):
        got = exact._scale((1 << 25) + 3, dt)
        assert got.tolist() == [float(dt(q / m)), 1.0]


def test_the_size_limit_error_names_the_valid_k() -> None:
    """d·k < 2⁶² bounds k from above: the refusal of a too large k said "use a larger k"."""
    d = 1 << 33
    with pytest.raises(ValueError, match=r"use k in \[4, 536870911\]"):
        make_compressor(f"strat_k[k={1 << 29}]").bits(d)
    assert make_compressor(f"strat_k[k={(1 << 29) - 1}]").bits(d) > 0
    assert make_compressor("strat_k[k=4]").omega(d) == (1 << 31) - 1
    with pytest.raises(ValueError, match=r"use k in \[4, 536870911\]"):
        make_compressor("strat_k[k=3]").bits(d)  # blocks of more than 2³¹ entries
    with pytest.raises(ValueError, match="no k fits"):
        make_compressor("strat_k[k=1]").bits(1 << 48)


def test_scaled_rand_k_errors_name_the_compressor_as_written() -> None:
    """scaled(rand_k)'s errors said "RandKScaled" (the class of its exact form): the name is
    now set by scaled() for every exact form."""
    spec = "scaled(rand_k[k=2])"
    c = make_compressor(spec)
    with pytest.raises(ValueError, match=rf"^{re.escape(spec)} got a non-finite"):
        c(torch.tensor([1.0, math.nan, 3.0]), Keys.derive(1))


def test_scaled_strat_k_errors_name_the_compressor_as_written() -> None:
    """The exact scaled form's errors said "_StratKScaled", a private class the user never
    wrote."""
    c = make_compressor("scaled(strat_k[k=2])")
    with pytest.raises(ValueError, match=r"^scaled\(strat_k\[k=2\]\) got a non-finite"):
        c(torch.tensor([1.0, math.nan, 3.0]), Keys.derive(1))
    msg = c.encode(torch.randn(20), Keys.derive(1))
    bad = msg.clone()
    bad[0] = 0xFF  # the first offset field reads 15 in a block of 10 entries
    with pytest.raises(ValueError, match=r"scaled\(strat_k\[k=2\]\) read an offset"):
        c.decode(bad, 20, torch.float32, Keys.derive(1))
