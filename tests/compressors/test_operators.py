"""Operator-specific facts: selections, bit formulas, derived constants, errors, kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shrinkgrad import Keys, SpecError, make_compressor
from shrinkgrad.compressors import _kernels as K
from shrinkgrad.compressors import base
from shrinkgrad.compressors._random import kernel_keys
from shrinkgrad.compressors.basic import topk_indices_torch
from shrinkgrad.compressors.quantize import l2_norms, round_levels_torch
from shrinkgrad.rng import bits32_numpy
from shrinkgrad.rng_numba import bits32_array, fill_words


# --------------------------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------------------------
def _topk_reference(x: np.ndarray, k: int) -> np.ndarray:
    """Independent reference: stable sort by (−|x_j|, j), first k indices, ascending."""
    order = sorted(range(x.size), key=lambda j: (-abs(float(x[j])), j))
    return np.sort(np.array(order[:k], dtype=np.int64))


def test_top_k_ties_go_to_lower_indices() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.0])
    y = make_compressor("top_k[k=4]")(x)
    assert y.tolist() == [0.0, -3.0, 2.0, 3.0, -2.0, 0.0, 0.0]


@pytest.mark.parametrize("d", [5, 20_000, 70_000])
@pytest.mark.parametrize(
    "case", ["randn", "ties", "all_equal", "zeros_mostly", "spikes_at_end", "sorted", "outer"]
)
def test_top_k_numba_and_torch_equal_the_reference(
    d: int, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    if case == "randn":
        x = rng.standard_normal(d)
    elif case == "ties":
        x = rng.integers(-3, 4, d).astype(np.float64)
    elif case == "all_equal":
        x = np.full(d, 2.5)
    elif case == "zeros_mostly":
        x = np.zeros(d)
        x[rng.integers(0, d, 3)] = 1.0
    elif case == "sorted":  # every candidate in the last chunk: its slots overflow
        x = np.arange(d, dtype=np.float64) - d / 3
    elif case == "outer":  # a weight gradient u vᵀ, flattened: large entries in whole rows
        cols = 2000 if d % 2000 == 0 else d
        u = rng.standard_normal(d // cols) ** 3
        x = np.outer(u, rng.standard_normal(cols)).reshape(-1)
    else:  # the strided sample sees none of the large values
        x = rng.standard_normal(d) * 1e-3
        x[-min(d, 500) :] = 10.0 + rng.standard_normal(min(d, 500))
    k = max(1, d // 100)
    ref = _topk_reference(x, k)
    xt = torch.from_numpy(x).float()
    ref = _topk_reference(xt.numpy(), k)
    for mode in ("torch", "numba"):
        monkeypatch.setattr(base, "KERNELS", mode)
        c = make_compressor(f"top_k[k={k}]")
        idx, vals = c._select(xt, None)
        assert idx.tolist() == ref.tolist(), mode
        y = c(xt)
        assert torch.equal(y.nonzero().reshape(-1), torch.from_numpy(ref)) or bool(
            (vals == 0).any()
        )
        assert torch.equal(y[idx], xt[idx])


def _special_rows(d: int) -> np.ndarray:
    """float32 rows that stress an integer selection on the patterns: signed zeros, subnormals
    and their negatives, exact ties at the k-th magnitude, one bucket holding everything."""
    rng = np.random.default_rng(8)
    rows = [
        rng.standard_normal(d),
        np.where(rng.random(d) < 0.5, -0.0, 0.0),  # every magnitude 0: the first k kept
        rng.choice([-1e-40, 1e-40, -1e-45, 0.0, 3e-39], d),  # subnormals
        rng.integers(-2, 3, d) * 0.5,  # a handful of magnitudes, many ties
        np.full(d, -7.25),
        1.0 + rng.random(d) * 2**-10,  # all in one histogram bucket
        rng.standard_normal(d) * np.exp(rng.standard_normal(d) * 6),  # many exponents
    ]
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("d", [K.TOPK_HIST_MIN, 5000, 40_000])
@pytest.mark.parametrize("frac", [0.001, 0.01, 0.3, 1.0])
def test_top_k_histogram_rows_equal_the_quickselect_rows(d: int, frac: float) -> None:
    """topk_rows_hist (float32 rows of 4 k–64 k entries) gives topk_rows' indices and dense
    output bit for bit on rows of ties, signed zeros, subnormals and one-bucket values, and
    the independent reference; inf or nan anywhere is NON_FINITE."""
    x = _special_rows(d)
    n = x.shape[0]
    k = max(K.TOPK_INSERT_K + 1, min(d, int(frac * d)))
    want, got = np.empty((n, k), np.int64), np.empty((n, k), np.int64)
    out_w = np.full((n, d), 9.0, np.float32)
    out_g = np.full((n, d), 9.0, np.float32)
    assert K.topk_rows(x, k, want, out_w) == K.OK
    assert K.topk_rows_hist(x.view(np.uint32), k, got, out_g.view(np.uint32)) == K.OK
    assert np.array_equal(got, want)
    assert np.array_equal(out_g.view(np.uint32), out_w.view(np.uint32))  # −0 kept as −0
    for r in (0, 3, 6):
        assert got[r].tolist() == _topk_reference(x[r], k).tolist()
    for pos in (0, d // 2, d - 1):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[n - 1, pos] = bad
            none = np.empty((0, d), np.uint32)
            assert K.topk_rows_hist(y.view(np.uint32), k, got, none) == K.NON_FINITE


def test_top_k_indices_torch_batched() -> None:
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0], [5.0, 0.0, -5.0, 1.0]])
    assert topk_indices_torch(x, 2).tolist() == [[1, 2], [0, 2]]


# --------------------------------------------------------------------------------------------
# rand-k
# --------------------------------------------------------------------------------------------
def test_scaled_rand_k_is_rand_k_scaled_exactly() -> None:
    x = torch.randn(6, 30, dtype=torch.float32)
    keys = Keys.derive(4, client=np.arange(6))
    a = make_compressor("scaled(rand_k[k=7])")
    b = make_compressor("rand_k_scaled[k=7]")
    u = make_compressor("rand_k[k=7]")
    assert torch.equal(a(x, keys), b(x, keys))
    assert a.alpha(30) == b.alpha(30) == 7 / 30
    # same support as the unbiased one, values without the d/k factor
    yu = u(x, keys)
    assert torch.equal(yu != 0, b(x, keys) != 0)
    assert torch.equal(yu, b(x, keys) * torch.tensor(30 / 7, dtype=torch.float32))


@pytest.mark.parametrize(
    "d,k",
    [
        (1, 1),
        (2, 1),
        (7, 7),
        (1000, 13),
        (65537, 300),
        (65537, 65537),
        (1 << 16, 40_000),
        (100_003, 40_000),
        ((1 << 23) + 16, 20_000),
        ((1 << 32) + 7, 300),
    ],
)
def test_rand_k_indices_distinct_in_range_and_paths_agree(d: int, k: int) -> None:
    """The torch twin, the scalar kernel and the block kernel (vectorized uint32 Feistel, blocks
    of 16384 indices on the threads; d ≤ 2³² only) agree, also where values walk (d = 65537 with
    k = d: the whole permutation; 2^23 + 16: a DDP bucket's size just above a power of two)."""
    from shrinkgrad.compressors.sparse import (
        RANDK_TAG,
        ROT_TRIES,
        randk_domain,
        randk_indices_torch,
    )

    keys = Keys.derive(8, round=2, client=np.arange(5)).fold(RANDK_TAG)
    t = randk_indices_torch(keys, d, k)
    lo, hi = (a.astype(np.uint64) for a in keys.numpy())
    dom = randk_domain(d)
    idx = np.empty((5, k), dtype=np.int64)
    K.randk_indices(lo, hi, d, k, ROT_TRIES, idx, dom)
    assert np.array_equal(t.numpy(), idx)
    if d <= 1 << 32:
        blocks = np.empty((5, k), dtype=np.int64)
        K.run(K.randk_block, blocks, lo, hi, d, ROT_TRIES, blocks, dom)
        assert np.array_equal(blocks, idx)
    for row in idx:
        assert len(set(row.tolist())) == k and row.min() >= 0 and row.max() < d


@pytest.mark.parametrize("d", [1, 2, 3, 5, 1000, 65536, 65537, 100_003, (1 << 23) + 16, 1 << 32])
def test_the_rand_k_feistel_domain_covers_d_with_less_than_its_root_to_spare(d: int) -> None:
    """The mixed-radix domain Z_nb × Z_{2^m} holds [0, d) and exceeds it by less than 2^m ≤
    √(2d) values: cycle walking is rare for every d, not only for powers of two (a
    power-of-two domain exceeds 2^23 + 16 by 2^23 − 16, almost half of it). The round value
    masked by hmask is < 2·nb, so one subtraction of nb brings it into Z_nb."""
    from shrinkgrad.compressors.sparse import randk_domain

    m, mask_lo, hmask, nb = randk_domain(d)
    assert mask_lo == (1 << m) - 1
    size = nb << m
    assert d <= size < d + (1 << m)
    assert (1 << m) ** 2 <= 2 * d or d == 1
    assert hmask + 1 <= 2 * nb
    assert size <= 1 << 32 or d > 1 << 32  # the block kernel's uint32 arithmetic holds it


@pytest.mark.parametrize("spec", ["rand_k[k=5000]", "rand_k_scaled[k=5000]"])
def test_rand_k_kernel_over_several_chunks(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept values written chunk by chunk (indices bucketed by chunk) equal the torch path;
    a non-finite entry in a late chunk and an overflowing kept value are still reported."""
    d = 3 * K.CHUNK + 5
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(3))
    keys = Keys.derive(4, round=1, client=np.arange(2))
    c = make_compressor(spec)
    monkeypatch.setattr(base, "KERNELS", "torch")
    ref = c(x, keys)
    monkeypatch.setattr(base, "KERNELS", "numba")
    assert torch.equal(c(x, keys), ref)
    assert int((ref != 0).sum()) == 2 * 5000
    bad = x.clone()
    bad[1, d - 2] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        c(bad, keys)
    if spec.startswith("rand_k["):
        big = x.clone()
        big[0, int(ref[0].nonzero()[-1])] = 1e38  # times d/k = 9.8: beyond float32
        with pytest.raises(ValueError, match="overflows"):
            c(big, keys)


def test_rand_k_bits_with_and_without_shared_seed() -> None:
    assert make_compressor("rand_k[k=5]").bits(1000) == 5 * (32 + 10)
    assert make_compressor("rand_k[k=5,shared_seed=true]").bits(1000) == 5 * 32
    assert make_compressor("rand_k[k=5]").bits(1024, torch.float64) == 5 * (64 + 10)
    assert make_compressor("rand_k[k=5]").paper_bits(1000) == 160


# --------------------------------------------------------------------------------------------
# bit formulas (the wire sizes are checked against these in the contract suite)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,d,bits",
    [
        ("identity", 100, 3200),
        ("top_k[k=3]", 100, 3 * (32 + 7)),
        ("qsgd[s=4]", 100, 32 + 100 * (1 + 3)),
        ("qsgd[s=1]", 100, 32 + 100 * 2),
        ("qsgd[s=3]", 100, 32 + 100 * 3),
        ("ternary", 100, 32 + 200),
        ("standard_dithering[s=1,norm=inf]", 100, 32 + 200),
        ("standard_dithering[s=16,norm=inf]", 100, 32 + 100 * 6),
        ("lazy_bernoulli[p=0.25]", 128, 1 + 0.25 * 128 * 32),
        ("rank_k[r=2]", 10**4, 32 * 2 * 200),
        ("rank_k[r=2,rows=50]", 10**4, 32 * 2 * 250),
        ("power_sgd[rank=4]", 4096, 32 * 4 * 128),
        ("natural", 100, 900),
        ("natural_dithering[s=8]", 100, 32 + 100 * (1 + 4)),
        ("scaled_sign", 100, 132),
        ("bernoulli[p=0.25]", 128, 32 + 0.25 * 128 * (32 + 7)),
        ("compose(top_k[k=10],qsgd[s=4])", 1000, 10 * 10 + 32 + 10 * 4),
        ("compose(rand_k[k=10],natural)", 1000, 10 * 10 + 90),
        ("compose(natural,qsgd[s=4])", 100, 32 + 100 * 4),
        ("scaled(qsgd[s=4])", 100, 32 + 100 * 4),
    ],
)
def test_bit_formulas(spec: str, d: int, bits: float) -> None:
    assert make_compressor(spec).bits(d) == pytest.approx(bits, rel=1e-15)


@pytest.mark.parametrize(
    "spec,d,bits",
    [
        ("ternary", 100, 32 + 200),  # TernGrad's 2 bits per element (Wen et al. §3), as qsgd[s=1]
        ("qsgd[s=1]", 100, 32 + 200),
        ("scaled_sign", 100, 32 + 100),
        ("lazy_bernoulli[p=0.25]", 128, 32 * 0.25 * 128),
        ("bernoulli[p=0.25]", 128, 32 * 0.25 * 128),
        ("rank_k[r=2]", 10**4, 32 * 2 * 200),
    ],
)
def test_paper_bits_formulas(spec: str, d: int, bits: float) -> None:
    """12.5: paper_bits says what the docs say (ternary: 32 + 2d, computed and documented)."""
    assert make_compressor(spec).paper_bits(d) == pytest.approx(bits, rel=1e-15)


def test_lazy_bernoulli_is_all_or_nothing() -> None:
    """The whole vector ÷ p with probability p, else 0 (one draw per row); the message is a
    flag bit and, when sent, d values; a zero vector is never sent."""
    c = make_compressor("lazy_bernoulli[p=0.3]")
    n, d = 4000, 16
    x = torch.randn(d, dtype=torch.float32)
    y = c(x.expand(n, d).contiguous(), Keys.derive(1, client=np.arange(n)))
    sent = (y != 0).any(dim=1)
    scaled = x * torch.tensor(1 / 0.3, dtype=torch.float32)
    assert bool((y[sent] == scaled).all()) and bool((y[~sent] == 0).all())
    frac = float(sent.double().mean())
    assert abs(frac - 0.3) <= 6 * math.sqrt(0.3 * 0.7 / n)
    bits = c.message_bits(y)
    assert torch.equal(bits, torch.where(sent, 1.0 + 32 * d, 1.0).double())
    assert c.omega(d) == make_compressor("bernoulli[p=0.3]").omega(d) == pytest.approx(1 / 0.3 - 1)
    k = Keys.derive(1, client=int(sent.to(torch.int64).argmax()))
    assert c.encode(x, k).numel() == math.ceil((1 + 32 * d) / 8)
    assert c.encode(torch.zeros(d), k).numel() == 1 and bool((c(torch.zeros(d), k) == 0).all())


def test_bernoulli_message_bits_count_the_actual_message() -> None:
    c = make_compressor("bernoulli[p=0.5]")
    x = torch.randn(3, 64)
    y = c(x, Keys.derive(2, client=np.arange(3)))
    nnz = (y != 0).sum(dim=1).to(torch.float64)
    assert torch.equal(c.message_bits(y), 32 + nnz * (32 + 6))


# --------------------------------------------------------------------------------------------
# constants of the transforms
# --------------------------------------------------------------------------------------------
def test_compose_constants_follow_the_derived_rules() -> None:
    d = 100
    qs = make_compressor("qsgd[s=4]")
    c = make_compressor("compose(top_k[k=10],qsgd[s=4])")
    assert c.kind == "contractive"
    assert c.alpha(d) == pytest.approx(0.1 * (1 - qs.omega(10)))
    c = make_compressor("compose(top_k[k=10],scaled(qsgd[s=2]))")
    assert c.alpha(d) == pytest.approx(0.1 / (1 + make_compressor("qsgd[s=2]").omega(10)))
    c = make_compressor("compose(rand_k[k=10],natural)")
    assert c.kind == "unbiased"
    assert c.omega(d) == pytest.approx((1 + 9) * (1 + 1 / 8) - 1)
    c = make_compressor("compose(natural,qsgd[s=8])")
    assert c.omega(d) == pytest.approx(1.125 * (1 + qs_omega(8, d)) - 1)
    c = make_compressor("compose(natural,top_k[k=90])")
    assert c.alpha(d) == pytest.approx(1 - (math.sqrt(0.1 * 1.125) + math.sqrt(0.125)) ** 2)
    c = make_compressor("compose(identity,top_k[k=10])")
    assert c.alpha(d) == pytest.approx(0.1)
    c = make_compressor("compose(identity,qsgd[s=4])")
    assert c.omega(d) == pytest.approx(qs.omega(d))


def qs_omega(s: int, d: int) -> float:
    return min(d / s**2, math.sqrt(d) / s)


def test_compose_without_a_valid_constant_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no valid constant.*scaled\(qsgd\[s=1\]\)"):
        make_compressor("compose(top_k[k=100],qsgd[s=1])")
    with pytest.raises(ValueError, match="no valid constant at d=100"):
        make_compressor("compose(scaled_sign,qsgd[s=1])").alpha(100)
    with pytest.raises(ValueError, match="no valid constant"):
        make_compressor("compose(rand_k[k=5],top_k[k=1])").alpha(100)
    with pytest.raises(ValueError, match=r"acting on the 5 values kept by top_k\[k=5\]"):
        make_compressor("compose(top_k[k=5],rand_k[k=6])")(torch.randn(100), Keys.derive(1))


@pytest.mark.parametrize(
    "spec",
    [
        "compose(rand_k[k=10,shared_seed=true],qsgd[s=4])",
        "compose(scaled(rand_k[k=10,shared_seed=true]),natural)",
        "compose(natural,rand_k[k=10,shared_seed=true])",
    ],
)
def test_compose_refuses_a_shared_seed_part(spec: str) -> None:
    """A shared seed means one draw for all clients, sent as k summable values (no indices);
    inside compose the draws were each client's own while the bits counted no indices."""
    with pytest.raises(ValueError, match="compose\\(\\) takes no shared-seed compressor"):
        make_compressor(spec)


def test_scaled_needs_an_unbiased_compressor() -> None:
    with pytest.raises(ValueError, match="already contractive"):
        make_compressor("scaled(top_k[k=1])")
    c = make_compressor("scaled(qsgd[s=2])")
    assert c.alpha(16) == pytest.approx(1 / (1 + min(16 / 4, 4 / 2)))


# --------------------------------------------------------------------------------------------
# bad parameters and inputs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,pattern",
    [
        ("top_k[k=0]", r"top_k needs k \(the number of kept coordinates\) >= 1, got 0"),
        ("rand_k[k=-2]", r"rand_k needs k .* got -2"),
        ("qsgd[s=0]", r"qsgd needs s \(the number of levels\) in \[1, 16777216\], got 0"),
        ("natural_dithering[s=99]", r"s \(the number of levels\) in \[1, 62\]"),
        ("bernoulli[p=0]", r"p \(the keep probability\) in \(0, 1\], got p=0"),
        ("bernoulli[p=1.5]", r"in \(0, 1\]"),
        ("lazy_bernoulli[p=0]", r"p \(the send probability\) in \(0, 1\], got p=0"),
        ("standard_dithering[s=0]", r"standard_dithering needs s \(the number of levels\)"),
        ("standard_dithering[s=2,norm=1]", r"needs norm=2 or norm=inf"),
        ("power_sgd[rank=0]", r"power_sgd needs the rank >= 1, got 0"),
        ("power_sgd[rank=2,alpha=2]", r"alpha in \(0, 1\]"),
        ("rank_k[r=1,rows=-1]", r"rows \(the matrix view\) >= 1"),
        ("top_k[k=1.5]", r"'k' must be an integer"),
        ("qsgd[levels=3]", r"no parameter 'levels'; allowed: s \(int, required\)"),
        ("qsgd", r"needs parameter 's'"),
        ("topk[k=1]", r"unknown compressor 'topk'.*did you mean 'top_k'"),
        ("compose(top_k[k=1])", r"takes 2 component argument"),
    ],
)
def test_bad_parameters_name_the_parameter_and_range(spec: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        make_compressor(spec)


def test_k_larger_than_d_is_refused_at_call_time() -> None:
    for spec in ("top_k[k=5]", "rand_k[k=5]", "rand_k_scaled[k=5]"):
        c = make_compressor(spec)
        with pytest.raises(
            ValueError, match=r"cannot keep more than d=4 coordinates; use k in \[1, 4\]"
        ):
            c(torch.ones(4), Keys.derive(0))
        with pytest.raises(ValueError, match="d=4"):
            c.alpha(4)


def test_spec_errors_are_value_errors() -> None:
    with pytest.raises(SpecError):
        make_compressor("nope")


def test_overflow_is_a_clear_error_not_inf() -> None:
    big = torch.full((8,), 3e38, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"overflows torch\.float32"):
        make_compressor("rand_k[k=2]")(big, Keys.derive(1))
    with pytest.raises(ValueError, match=r"exceeds the torch\.float32 range"):
        make_compressor("qsgd[s=2]")(big, Keys.derive(1))
    with pytest.raises(ValueError, match="rounding up to the next power of two overflows"):
        make_compressor("natural")(big, Keys.derive(1))
    # the same values in float64 are fine
    y = make_compressor("qsgd[s=2]")(big.double(), Keys.derive(1))
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("scale", [1e300, 1e-300, 1e-320])
@pytest.mark.parametrize("spec", ["qsgd[s=4]", "natural_dithering[s=3]", "scaled_sign", "ternary"])
def test_float64_extremes_keep_their_scale(scale: float, spec: str) -> None:
    # Σx² over/underflows float64 here; the max-rescaled norm keeps the output meaningful.
    x = torch.tensor([3.0, -4.0, 0.0, 1.0], dtype=torch.float64) * scale
    c = make_compressor(spec)
    y = c(x, Keys.derive(3))
    assert bool(torch.isfinite(y).all()) and bool((y != 0).any())
    assert float(y.abs().max()) <= float(x.abs().sum()) * (1 + 1e-12) + 1e-323


def test_l2_norms_round_up_and_handle_extremes() -> None:
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-30, 1e-30]], dtype=torch.float32)
    n = l2_norms(x)
    assert n[0] == 5.0 and n[1] == 0.0
    assert float(n[2]) >= math.sqrt(2) * float(torch.tensor(1e-30))
    big = torch.tensor([1e200, 1e200], dtype=torch.float64)
    assert float(l2_norms(big)) == pytest.approx(math.sqrt(2) * 1e200, rel=1e-15)


# --------------------------------------------------------------------------------------------
# kernels and keyed randomness
# --------------------------------------------------------------------------------------------
def test_numba_bits32_equals_numpy() -> None:
    lo = np.array([0, 1, 2**32 - 1, 123456789], dtype=np.uint32)
    hi = np.array([0, 2**31, 7, 987654321], dtype=np.uint32)
    got = bits32_array(lo.astype(np.uint64), hi.astype(np.uint64), 2**32 - 50, 100)
    j = (np.arange(100, dtype=np.uint64) + np.uint64(2**32 - 50)).astype(np.uint32)
    want = bits32_numpy(lo[:, None], hi[:, None], j[None, :])
    assert np.array_equal(got, want.astype(np.uint64))
    # the vectorizable uint32 twin used by the kernels
    block = np.empty(100, dtype=np.uint32)
    fill_words(np.uint64(lo[2]), np.uint64(hi[2]), 7, block)
    assert np.array_equal(block, bits32_numpy(lo[2], hi[2], np.arange(7, 107, dtype=np.uint32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rounding_kernel_equals_torch_given_the_same_scale(dtype: torch.dtype) -> None:
    x = torch.randn(3, 1001, dtype=dtype)
    x[0, :10] = 0.0
    keys = Keys.derive(12, client=np.arange(3))
    scale = l2_norms(x) / torch.tensor(4.0, dtype=dtype)
    ref, _ = round_levels_torch(x, scale, 4, keys)
    out = torch.empty_like(x)
    lo, hi, lo2, hi2 = kernel_keys(keys)
    x2 = x.numpy()
    K.run(K.round_rows, x2, x2, scale.numpy(), 4, lo, hi, lo2, hi2, out.numpy())
    assert torch.equal(out, ref)


def test_norm_kernel_matches_float64_sum() -> None:
    x = torch.randn(2, 50_001, dtype=torch.float32)
    part = np.empty((2, -(-50_001 // K.CHUNK)))
    assert K.run(K.row_stats, x.numpy(), x.numpy(), 0, part) == K.OK
    ref = (x.double() ** 2).sum(dim=1).numpy()
    assert np.allclose(part.sum(axis=1), ref, rtol=1e-13, atol=0)
    x[1, 40_000] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        l2_norms(x, numba=True)


@pytest.mark.parametrize(
    "spec", ["qsgd[s=3]", "ternary", "natural", "bernoulli[p=0.2]", "rand_k[k=700]", "top_k[k=9]"]
)
def test_kernel_output_does_not_depend_on_the_thread_count(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(2, 3 * K.CHUNK + 5)
    keys = Keys.derive(3, client=np.arange(2))
    c = make_compressor(spec)
    monkeypatch.setattr(base, "KERNELS", "numba")
    monkeypatch.setenv("SHRINKGRAD_THREADS", "1")
    one = c(x, keys)
    monkeypatch.setenv("SHRINKGRAD_THREADS", "3")
    assert torch.equal(c(x, keys), one)
    monkeypatch.setattr(base, "KERNELS", "torch")
    assert torch.equal(c(x, keys), one)


def test_kernel_threads_work_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent's thread pool does not survive fork(); the child must build its own.
    import multiprocessing as mp

    monkeypatch.setenv("SHRINKGRAD_THREADS", "2")
    x = torch.randn(2, 3 * K.CHUNK)
    c = make_compressor("qsgd[s=4]")
    ref = c(x, Keys.derive(1, client=np.arange(2)))  # creates the pool in this process
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child() -> None:
        y = c(x, Keys.derive(1, client=np.arange(2)))
        q.put(bool(torch.equal(y, ref)))

    p = ctx.Process(target=child)
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive, "the forked child hung in the kernel thread pool"
    assert q.get(timeout=5) is True


def test_list_compressors_cli_prints_every_compressor() -> None:
    from click.testing import CliRunner

    from shrinkgrad.cli import cli
    from shrinkgrad.compressors import COMPRESSORS

    result = CliRunner().invoke(cli, ["list", "compressors"])
    assert result.exit_code == 0, result.output
    for name in COMPRESSORS.names():
        assert name in result.output
    import io

    from rich.console import Console

    from shrinkgrad.cli.listing import LISTINGS

    wide = io.StringIO()
    LISTINGS["compressors"](Console(width=600, file=wide))  # no wrapping inside the cells
    formulas = ("d/k − 1", "min(d/s², √d/s)", "1/(1 + ω_C)", "32 + d·(1 + ⌈log₂(s+1)⌉)")
    for formula in (*formulas, "(√d − 1)/2", "α = r/min(m, n)", "f32 f64 bf16 f16"):
        assert formula in wide.getvalue()


# --------------------------------------------------------------------------------------------
# fast paths of long rows: sampled Top-k, fused identity, interleaved sums of squares
# --------------------------------------------------------------------------------------------
def _long_rows(dtype: torch.dtype) -> torch.Tensor:
    """Three rows of 6 chunks and a bit: ties at the k-th magnitude on chunk boundaries, one
    chunk with more candidates than its slots, and a plain Gaussian row."""
    d = 6 * K.CHUNK + 77
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, d)) * 0.1
    big = rng.choice(d, 1500, replace=False)
    x[0, big] = 5.0 * np.sign(rng.standard_normal(1500))
    edges = np.concatenate([np.arange(c * K.CHUNK - 60, c * K.CHUNK + 60) for c in range(1, 7)])
    edges = np.setdiff1d(edges[edges < d], big)
    x[0, edges] = np.where(np.arange(edges.size) % 2, 2.5, -2.5)  # 2.5 is the k-th magnitude
    x[1, 2 * K.CHUNK : 3 * K.CHUNK] = 3.0 + rng.random(K.CHUNK)  # every top entry in chunk 2
    x[1, 3 * K.CHUNK + 5] = 3.5  # and one outside it
    x[2] = rng.standard_normal(d)
    return torch.from_numpy(x).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_sampled_path_across_chunks(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The threshold path (d ≥ 65536): exactly k kept, ties at the k-th magnitude on chunk
    boundaries to the lowest indices, a chunk whose candidates overflow its slots (rescanned),
    batched rows, 1 or 3 threads, numba equal to torch and to an independent reference."""
    x = _long_rows(dtype)
    k = 2000
    assert K.topk_plan(x.shape[1], k) is not None
    refs = [_topk_reference(row.numpy(), k) for row in x]
    assert sum(float(abs(x[0, j])) == 2.5 for j in refs[0]) == 500  # ties split by index
    c = make_compressor(f"top_k[k={k}]")
    results = []
    for mode, threads in (("numba", "1"), ("numba", "3"), ("torch", "1")):
        monkeypatch.setattr(base, "KERNELS", mode)
        monkeypatch.setenv("SHRINKGRAD_THREADS", threads)
        idx, vals = c._select(x, None)
        for r in range(3):
            assert idx[r].tolist() == refs[r].tolist(), (mode, threads, r)
        # the selection's own values, bit for bit (no gather of x on the sampled path)
        assert torch.equal(vals.view(torch.uint8), x.gather(1, idx).view(torch.uint8))
        out = torch.full_like(x, 7.0)
        y = c(x, out=out)
        results.append(y)
        assert int((y != 0).sum()) == 3 * k
        assert torch.equal(y.gather(1, idx), x.gather(1, idx))
    assert all(torch.equal(results[0], y) for y in results[1:])


@pytest.mark.parametrize("spec", ["top_k[k=2000]", "identity", "qsgd[s=4]", "rand_k[k=100]"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_anywhere_in_a_long_row_raises(spec: str, dtype: torch.dtype) -> None:
    """The fused passes check every coordinate: the first, a chunk boundary, the last chunk's
    last entry, inside a chunk whose Top-k candidates overflow their slots."""
    c = make_compressor(spec)
    keys = Keys.derive(2, client=np.arange(3))
    d = 6 * K.CHUNK + 77
    for pos in (0, K.CHUNK - 1, K.CHUNK, d - 1, 2 * K.CHUNK + 100):
        for bad in (math.nan, math.inf, -math.inf):
            x = _long_rows(dtype)
            x[1, pos] = bad
            with pytest.raises(ValueError, match="non-finite"):
                c(x, keys, out=torch.empty_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_non_finite_anywhere_in_a_long_row_stops_the_sparse_form(dtype: torch.dtype) -> None:
    """rand-k's sparse form (the hook's path, which reads x only in its finiteness pass and at
    the kept entries) refuses an inf or nan at any coordinate, kept or not, also in bfloat16."""
    c = make_compressor("rand_k[k=100,shared_seed=true]")
    keys = Keys.derive(2, client=0)
    d = 6 * K.CHUNK + 77
    x = torch.randn(d, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    c.sparse(x, keys)  # finite: no error
    kept = set(c.sparse(x, keys)[0].tolist())
    for pos in (0, K.CHUNK - 1, K.CHUNK, d - 1, 2 * K.CHUNK + 100):
        assert pos not in kept  # (the check, not the gather, has to see it)
        for bad in (math.nan, -math.nan, math.inf, -math.inf):
            y = x.clone()
            y[pos] = bad
            with pytest.raises(ValueError, match="non-finite"):
                c.sparse(y, keys)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_check_block_flags_exactly_the_non_finite_patterns(dtype: type) -> None:
    """The finiteness check on bit patterns agrees with isfinite on the edge values: the
    largest finite magnitude, the smallest subnormal, ±0, ±inf, nans of either sign and with
    any payload (uint16: bfloat16 patterns, read as the float32 they widen to)."""
    width = 8 * np.dtype(dtype).itemsize
    utype = {16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
    mant = {16: 7, 32: 23, 64: 52}[width]
    top = (1 << (width - 1)) - 1  # all bits but the sign
    exp = top ^ ((1 << mant) - 1)
    edges = [0, 1, exp - 1, exp, exp + 1, top, 1 << (width - 1), (1 << (width - 1)) | exp]
    rng = np.random.default_rng(0)
    base_ = rng.integers(0, exp, size=257, dtype=np.uint64).astype(utype)  # finite magnitudes
    for e in edges:
        for pos in (0, 128, 256):
            u = base_.copy()
            u[pos] = utype(e)
            if dtype is np.uint16:
                wide = (u.astype(np.uint32) << np.uint32(16)).view(np.float32)
                xs = u
            else:
                wide = xs = u.view(dtype)
            assert K._check_block(xs) == (not bool(np.isfinite(wide).all())), (hex(e), pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_kernel_copies_every_bit(dtype: torch.dtype) -> None:
    x = _long_rows(dtype)
    x[0, :3] = torch.tensor([-0.0, 1e-40, -1e-45], dtype=torch.float64).to(dtype)
    c = make_compressor("identity")
    y = c(x, out=torch.empty_like(x))
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(c(x[1]).view(torch.uint8), x[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 2 * K.CHUNK), (2, 5 * K.CHUNK + 3), (1, 4 * K.CHUNK)])
def test_interleaved_sums_of_squares_equal_the_chunk_sums_bit_for_bit(
    dtype: type, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """row_stats sums four full chunks per loop (groups may span rows): each partial must be
    exactly _sumsq_block of its chunk, for any thread count; inf/nan propagate."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 4)).astype(dtype)
    n, d = shape
    nch = -(-d // K.CHUNK)
    chunks = [[x[r, c * K.CHUNK : (c + 1) * K.CHUNK] for c in range(nch)] for r in range(n)]
    want = np.array([[K._sumsq_block(xs) for xs in row] for row in chunks])
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("SHRINKGRAD_THREADS", threads)
        part = np.empty((n, nch))
        assert K.run(K.row_stats, x, x, 0, part) == K.OK
        assert np.array_equal(part, want)
    x[n - 1, K.CHUNK + 3] = np.nan
    x[0, 2] = np.inf
    part = np.empty((n, nch))
    K.run(K.row_stats, x, x, 0, part)
    assert np.isnan(part[n - 1, 1]) and (n == 1 or np.isinf(part[0, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_1_kernel_on_bit_patterns_equals_the_reference(dtype: torch.dtype) -> None:
    """top_k[k=1] on short rows compares IEEE patterns with the sign cleared: the first largest
    magnitude wins ties (also between −v and +v), −0 and +0 are equal, subnormals order
    correctly; the dense output keeps exactly that entry, bit for bit."""
    rng = np.random.default_rng(7)
    rows = [
        rng.standard_normal(123),
        np.array([0.0, -0.0, 0.0]),
        np.array([-0.0, 0.0, -0.0]),
        np.array([1e-320, -2e-320, 1e-321]) if dtype == torch.float64 else np.array([0.0]),
        np.array([1.0e-40, -3.0e-40, 2.0e-40]),
        np.array([2.5, -3.0, 3.0, -3.0]),
        np.array([-7.0]),
        np.round(rng.standard_normal(50) * 3),  # many exact ties
    ]
    c = make_compressor("top_k[k=1]")
    for row in rows:
        x = torch.from_numpy(row).to(dtype)
        j = int(_topk_reference(x.numpy(), 1)[0])
        want = torch.zeros_like(x)
        want[j] = x[j]
        y = c(x)
        assert torch.equal(y.view(torch.uint8), want.view(torch.uint8)), row
    batch = torch.from_numpy(rng.standard_normal((40, 123))).to(dtype)
    y = c(batch, out=torch.full_like(batch, 9.0))
    for r in range(40):
        j = int(_topk_reference(batch[r].numpy(), 1)[0])
        assert y[r].nonzero().flatten().tolist() == [j] and y[r, j] == batch[r, j]
    for bad in (math.nan, math.inf, -math.inf):
        batch[17, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            c(batch)
