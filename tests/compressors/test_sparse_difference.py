"""Top-k of a difference selected without forming it (``TopK.sparse_difference``, the fused
kernels of the DDP hook's EF21 path): bit for bit ``C.sparse(a − b)`` on rows long enough for
the sampled path, including its rare branches (overflowing chunks, a misleading sample, ties),
batches, float64, the bfloat16 rounding of a 16-bit wire and non-finite differences."""

from __future__ import annotations

import pytest
import torch

from shrinkgrad import make_compressor
from shrinkgrad.compressors import _kernels as K
from shrinkgrad.compressors import basic

D = 1 << 17  # long enough for the sampled path (d >= 2^16 and 16·k <= d)
K_ = D // 100


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints.get(t.dtype, torch.int16))


def _pair(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    b = (0.5 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)
    return a, b


def _check(a: torch.Tensor, b: torch.Tensor, k: int = K_, dtype: torch.dtype | None = None) -> None:
    c = make_compressor(f"top_k[k={k}]")
    x = a - b if dtype is None else (a - b).to(dtype)
    want = c.sparse(x)
    # C.sparse's values come from its selection (no gather of x): they are x at its indices
    assert torch.equal(_bits(want[1]), _bits(x.gather(-1, want[0])))
    got = c.sparse_difference(a, b, dtype=dtype)
    assert torch.equal(got[0], want[0])
    assert got[1].dtype == want[1].dtype and torch.equal(_bits(got[1]), _bits(want[1]))


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of the fused candidate kernel (so a test knows the fused path ran)."""
    calls: list[int] = []
    kernel = K.topk_candidates_diff

    def counting(*args: object) -> None:
        calls.append(1)
        kernel(*args)

    monkeypatch.setattr(K, "topk_candidates_diff", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_rows(dtype: torch.dtype, fused_calls: list[int]) -> None:
    a, b = _pair(dtype)
    _check(a, b)
    _check(a.view(2, -1), b.view(2, -1), k=K_ // 2)  # a batch of two rows
    assert fused_calls


def test_clustered_large_entries_overflow_chunk_slots(fused_calls: list[int]) -> None:
    # the large entries of a weight gradient come in whole rows: chunks with more candidates
    # than their slots are scanned again, from the recomputed difference
    a, b = _pair()
    a[: 3 * K.CHUNK] *= 50.0
    _check(a, b)
    assert fused_calls


def test_a_partial_last_mask_word_is_selected_from(fused_calls: list[int]) -> None:
    # the candidates of a chunk are a bitmask of 64 entries a word: a row whose length is no
    # multiple of 64 ends in a partial word, here holding the largest entries and then a NaN
    g = torch.Generator().manual_seed(3)
    d = D + 37
    a = torch.randn(d, generator=g)
    b = 0.5 * torch.randn(d, generator=g)
    a[-37:] = 100.0 + torch.arange(37.0)
    c = make_compressor(f"top_k[k={K_}]")
    x = a - b
    idx, _ = c.sparse(x)
    want = torch.topk(x.abs(), K_).indices.sort().values  # (no ties: continuous values)
    assert torch.equal(idx, want) and (idx[-37:] == torch.arange(d - 37, d)).all()
    _check(a, b)
    _check(torch.stack([a, a.flip(0)]), torch.stack([b, b.flip(0)]))  # rows at odd offsets
    assert fused_calls
    a[-1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        c.sparse_difference(a, b)
    with pytest.raises(ValueError, match="non-finite"):
        c.sparse(a - b)


def test_ties_go_to_the_lower_index() -> None:
    a, b = _pair()
    _check((4 * a).round(), (4 * b).round())  # many equal magnitudes at the k-th


def test_misleading_sample_falls_back_to_the_whole_difference(fused_calls: list[int]) -> None:
    # fewer than k non-zeros in a − b: the sample's threshold keeps too few candidates
    a, _ = _pair()
    b2 = a.clone()
    b2[::257] += 1.0
    _check(a, b2)
    _check(a, a.clone())  # a zero difference: the k lowest indices, all +0
    assert fused_calls


def test_bfloat16_rounding_matches_torch() -> None:
    # the difference rounded to bfloat16 (a 16-bit wire) inside the kernel: ties to even,
    # subnormal and tiny values, exactly representable ones
    a, b = _pair()
    _check(a, b, dtype=torch.bfloat16)
    half_ulp = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 2.0**-130, -(2.0**-140), 3.0])
    a[: half_ulp.numel() * 4 : 4] = 100.0 * half_ulp  # among the largest: kept
    _check(a, b, dtype=torch.bfloat16)
    _check(1e-39 * a, 1e-39 * b, dtype=torch.bfloat16)  # subnormal differences
    _check(a, b, dtype=torch.float16)  # no fused rounding: formed, then rounded by torch


def test_non_finite_differences_are_refused() -> None:
    c = make_compressor(f"top_k[k={K_}]")
    a, b = _pair()
    a[12345] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        c.sparse_difference(a, b)
    a, b = _pair()
    a[777], b[777] = 3e38, -3e38  # finite a and b, an infinite difference
    with pytest.raises(ValueError, match="non-finite"):
        c.sparse_difference(a, b)
    a[777], b[777] = 3.3e38, -1e37  # finite in float32, infinite once rounded to bfloat16
    with pytest.raises(ValueError, match="non-finite"):
        c.sparse_difference(a, b, dtype=torch.bfloat16)


def test_the_fused_path_applies_to_float_rows_on_cpu_only() -> None:
    a, b = _pair()
    assert basic._diff_rounding(a, b, None) == K.ROUND_NONE
    assert basic._diff_rounding(a, b, torch.bfloat16) == K.ROUND_BF16
    assert basic._diff_rounding(a, b, torch.float16) is None
    assert basic._diff_rounding(a, b.double(), None) is None
    assert basic._diff_rounding(a.view(2, 2, -1), b.view(2, 2, -1), None) is None


@pytest.mark.parametrize("threshold_bits", [0x3F80, 0x3F81])  # last bfloat16 bit even, odd
def test_bfloat16_midpoints_at_the_threshold_round_to_even(threshold_bits: int) -> None:
    # the fused flag pass compares |a − b| with the midpoint below the bfloat16 threshold:
    # exact midpoints there must go the way torch rounds them (ties to even)
    a, b = _pair()
    a, b = 0.25 * a, torch.zeros_like(b)
    mid = torch.tensor([(threshold_bits << 16) - 0x8000], dtype=torch.int32).view(torch.float32)
    above = torch.tensor([(threshold_bits << 16) + 0x8000], dtype=torch.int32).view(torch.float32)
    a[1::97] = mid  # ≈ 1350 entries exactly at the midpoint below the threshold
    a[2::97] = above  # and at the midpoint above it
    a[3::199] = 8.0
    for k in (K_ // 2, K_, 2 * K_):
        _check(a, b, k=k, dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------
# a bfloat16 minuend read in place (the DDP hook's bfloat16 gradient against EF21's float32 g_i)
# --------------------------------------------------------------------------------------------
def _special_bf16(seed: int) -> torch.Tensor:
    """bfloat16 values over the whole exponent range, with signed zeros and subnormals."""
    g = torch.Generator().manual_seed(seed)
    pat = torch.randint(0, 1 << 16, (D,), generator=g, dtype=torch.int32)
    x = pat.to(torch.int16).view(torch.bfloat16)
    x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=torch.bfloat16))  # finite only
    scale = torch.randn(D, generator=g).abs().to(torch.bfloat16)
    # mostly ordinary gradients, a few entries from the full range (subnormals, huge, ±0)
    keep = torch.rand(D, generator=g) < 0.01
    return torch.where(keep, x, scale * torch.randn(D, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("rounding", [None, torch.bfloat16], ids=["float32", "bf16-wire"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_bfloat16_minuend_gives_the_bits_of_its_float32_copy(
    seed: int, rounding: torch.dtype | None
) -> None:
    a = _special_bf16(seed)
    b = 0.5 * torch.randn(D, generator=torch.Generator().manual_seed(seed + 9))
    c = make_compressor(f"top_k[k={K_}]")
    want = c.sparse_difference(a.float(), b, dtype=rounding)
    got = c.sparse_difference(a, b, dtype=rounding)
    assert torch.equal(got[0], want[0])
    assert got[1].dtype == want[1].dtype and torch.equal(_bits(got[1]), _bits(want[1]))
    # and both are the selection from the formed difference
    _check(a.float(), b, dtype=rounding)


def test_a_bfloat16_minuend_with_a_non_finite_entry_is_an_error() -> None:
    a = _special_bf16(3)
    a[D // 3] = float("inf")
    b = torch.zeros(D)
    with pytest.raises(ValueError, match="non-finite"):
        make_compressor(f"top_k[k={K_}]").sparse_difference(a, b)


def test_the_bfloat16_widening_is_exact() -> None:
    """``_kernels.load`` of every bfloat16 pattern (inside the compiled a − b): a − 0 is each
    finite value's float32 bit for bit (signed zeros, subnormals), NaN stays NaN."""
    pats = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    out = torch.empty(1 << 16, dtype=torch.float32)
    K._sub_block(pats.numpy().view("uint16"), torch.zeros(1 << 16).numpy(), out.numpy())
    want = pats.view(torch.bfloat16).float()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int32)[~nan], want.view(torch.int32)[~nan])


def test_converting_changed_entries_gives_the_dense_conversion() -> None:
    """``_kernels.bf16_at``: the bfloat16 of a float32 vector at given (repeated, run-ordered)
    positions, the rest untouched, equals torch's conversion there (ties to even, overflow to
    inf, subnormals; NaN to a NaN)."""
    g = torch.Generator().manual_seed(4)
    n = 3 * (1 << 15) + 17
    src = torch.randn(n, generator=g) * torch.logspace(-40, 38, n).float()
    src[5] = float("nan")
    src[6] = 3.3961e38  # rounds to inf in bfloat16
    ties = torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)
    src[7:9] = ties  # exact ties: to even
    runs = [torch.sort(torch.randperm(n, generator=g)[: n // 10]).values for _ in range(3)]
    idx = torch.cat([*runs, torch.tensor([5, 6, 7, 8])])
    for order in (idx, idx.flip(0)):  # a few runs (block-wise) and many runs (in order)
        out = torch.full((n,), 7.0, dtype=torch.bfloat16)
        assert K.bf16_at(
            out.view(torch.int16).numpy().view("uint16"),
            src.view(torch.int32).numpy().view("uint32"),
            order.numpy(),
        )
        want = torch.full((n,), 7.0, dtype=torch.bfloat16)
        want[idx] = src[idx].to(torch.bfloat16)
        # NaN stays NaN (its payload is torch's choice: 0xFFFF vectorized, 0x7FC0 scalar)
        nan = want.isnan()
        assert torch.equal(out.isnan(), nan) and int(nan.sum()) == 1
        assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert not K.bf16_at(
        out.view(torch.int16).numpy().view("uint16"),
        src.view(torch.int32).numpy().view("uint32"),
        torch.tensor([n]).numpy(),
    )


def test_a_sparse_replace_in_bfloat16_is_index_fill_then_index_add() -> None:
    """``_kernels.sparse_replace_bf16`` (the hook's sparse directions into a bfloat16 output)
    gives the bits of torch's ``index_fill_(0)`` then ``index_add_`` on the bfloat16 tensor:
    one addition in float32 per entry, rounded each time, repeated indices in order."""
    g = torch.Generator().manual_seed(6)
    n = 50_000
    out = (torch.randn(n, generator=g) * 3).to(torch.bfloat16)
    old = torch.randperm(n, generator=g)[:3000]
    idx = torch.cat([torch.sort(torch.randperm(n, generator=g)[:2000]).values for _ in range(4)])
    idx = torch.cat([idx, old[:50], torch.tensor([7, 7, 7])])
    vals = (torch.randn(idx.numel(), generator=g) * torch.logspace(-3, 3, idx.numel())).to(
        torch.bfloat16
    )
    want = out.clone().index_fill_(0, old, 0.0).index_add_(0, idx, vals)
    got = out.clone()
    assert K.sparse_replace_bf16(
        got.view(torch.int16).numpy().view("uint16"),
        old.numpy(),
        idx.numpy(),
        vals.view(torch.int16).numpy().view("uint16"),
    )
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    once = out.clone().index_fill_(0, old, 0.0).float().index_add_(0, idx, vals.float())
    assert not torch.equal(once.to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
    assert not K.sparse_replace_bf16(
        got.view(torch.int16).numpy().view("uint16"),
        old.numpy(),
        torch.tensor([n]).numpy(),
        vals[:1].view(torch.int16).numpy().view("uint16"),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_sparse_replace_of_distinct_indices_stores(dtype: torch.dtype) -> None:
    """``_kernels.sparse_replace(..., distinct=True)`` (the hook's shared-seed directions,
    whose indices are one index set) stores 0 + v where the default reads the 0 and adds v:
    on an output that is zero outside ``old``, the same bits for distinct indices, −0,
    subnormals and values that overlap ``old`` included; an index outside the output is
    refused in bfloat16."""
    g = torch.Generator().manual_seed(7)
    n = 40_000
    old = torch.randperm(n, generator=g)[:2500]
    idx = torch.cat([old[:300], torch.randperm(n, generator=g)[:2500]]).unique()
    idx = idx[torch.randperm(idx.numel(), generator=g)]  # distinct, in no order
    vals = (torch.randn(idx.numel(), generator=g, dtype=torch.float64) * 1e-3).to(dtype)
    vals[:5] = torch.tensor([-0.0, 0.0, 1e-41, -1e-41, 3.0e38], dtype=torch.float64).to(dtype)
    base = torch.zeros(n, dtype=dtype)
    base[old] = torch.randn(old.numel(), generator=g, dtype=torch.float64).to(dtype)
    want, got = base.clone(), base.clone()
    if dtype == torch.bfloat16:
        pats = K.bf16_patterns
        assert K.sparse_replace_bf16(pats(want), old.numpy(), idx.numpy(), pats(vals))
        assert K.sparse_replace_bf16(pats(got), old.numpy(), idx.numpy(), pats(vals), True)
        assert not K.sparse_replace_bf16(
            pats(base.clone()), old.numpy(), torch.tensor([n]).numpy(), pats(vals[:1]), True
        )
    else:
        K.sparse_replace(want.numpy(), old.numpy(), idx.numpy(), vals.numpy())
        K.sparse_replace(got.numpy(), old.numpy(), idx.numpy(), vals.numpy(), True)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    assert torch.equal(got.view(bits[dtype]), want.view(bits[dtype]))
    assert bool((got.view(bits[dtype])[idx[:1]] == 0).all())  # −0 became +0, as 0 + (−0)
