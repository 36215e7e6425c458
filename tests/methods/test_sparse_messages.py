"""``rules.add_message`` with a :class:`SparseMessage`: x ± c in O(k) by numba's serial loop on
CPU float tensors, with exactly the values of ``index_add_`` (repeated indices of an aggregate
adding up in index order), and the torch path everywhere else."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shrinkgrad.methods.rules import Mirror, SparseMessage, add_message


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _message(d: int, k: int, dtype: torch.dtype, seed: int) -> SparseMessage:
    gen = torch.Generator().manual_seed(seed)
    # an aggregate of 3 messages: indices repeat, in no particular order
    idx = torch.cat([torch.randperm(d, generator=gen)[:k] for _ in range(3)])
    vals = torch.randn(idx.numel(), dtype=dtype, generator=gen) * 1e3
    return SparseMessage(idx, vals, (d,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [1.0, -1.0, 0.5])
@pytest.mark.parametrize("inplace", [False, True])
def test_add_message_equals_index_add_bit_for_bit(
    dtype: torch.dtype, alpha: float, inplace: bool
) -> None:
    d = 1000
    c = _message(d, 300, dtype, seed=3)
    x = torch.randn(d, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ref = x.clone().index_add_(0, c.indices, c.values, alpha=alpha)
    arg = x.clone()
    out = add_message(arg, c, inplace=inplace, alpha=alpha)
    assert torch.equal(_bits(out), _bits(ref))
    assert (out.data_ptr() == arg.data_ptr()) == inplace
    if not inplace:
        assert torch.equal(arg, x)  # the input is left alone


def test_add_message_of_a_shaped_tensor_and_the_torch_fallbacks() -> None:
    x = torch.randn(4, 5, dtype=torch.float64)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    c = SparseMessage(torch.tensor([0, 19, 7, 7]), vals, (4, 5))
    out = add_message(x, c)
    ref = x.clone()
    ref.view(-1)[0] += 1.0
    ref.view(-1)[19] += 2.0
    ref.view(-1)[7] += 3.0
    ref.view(-1)[7] += 4.0
    assert torch.equal(out, ref)
    # values of another dtype, int32 indices: the torch path, the same result
    x32 = torch.randn(10, dtype=torch.float32)
    c32 = SparseMessage(torch.tensor([1, 1, 3], dtype=torch.int32), torch.ones(3), (10,))
    assert torch.equal(add_message(x32, c32), x32.clone().index_add_(0, c32.indices, c32.values))


def test_add_message_refuses_an_index_outside_the_vector() -> None:
    x = torch.zeros(10, dtype=torch.float64)
    bad = SparseMessage(torch.tensor([3, 10]), torch.tensor([1.0, 1.0], dtype=torch.float64), (10,))
    with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
        add_message(x, bad, inplace=True)
    assert torch.equal(x, torch.zeros(10, dtype=torch.float64))  # untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [1.0, -1.0])
@pytest.mark.parametrize("layout", ["same", "overlapping", "one", "many"])
def test_sorted_runs_are_added_block_by_block_with_index_add_bits(
    dtype: torch.dtype, alpha: float, layout: str
) -> None:
    """The hook's aggregate (n ranks' ascending Top-k lists one after the other) is added block
    by block of x (``_kernels.sparse_add``'s run path), which must keep every index's additions
    in message order: the bits of index_add_. Lists that are all equal (every index in every
    run), that overlap partly (with indices on block boundaries and the last entry), one list
    alone, and more runs than the run path takes (the loop in order)."""
    from shrinkgrad.compressors import _kernels as K

    d = 3 * K.ADD_BLOCK + 17
    gen = torch.Generator().manual_seed(11)
    base = torch.randperm(d, generator=gen)[: d // 50].sort().values
    edges = torch.tensor([0, K.ADD_BLOCK - 1, K.ADD_BLOCK, 2 * K.ADD_BLOCK, d - 1])
    if layout == "same":
        lists = [base] * 4
    elif layout == "overlapping":
        lists = [torch.cat([base[i::2], edges]).unique() for i in range(2)] + [
            torch.randperm(d, generator=gen)[: d // 40].sort().values,
            edges,
        ]
    elif layout == "one":
        lists = [base]
    else:  # unsorted pieces: more runs than ADD_MAX_RUNS
        lists = [torch.randperm(d, generator=gen)[:3] for _ in range(K.ADD_MAX_RUNS + 5)]
    idx = torch.cat(lists)
    # magnitudes far apart, so that any other order of the additions changes the rounding
    vals = torch.randn(idx.numel(), dtype=dtype, generator=gen) * 10.0 ** torch.randint(
        -6, 7, (idx.numel(),), generator=gen
    ).to(dtype)
    x = torch.randn(d, dtype=dtype, generator=gen)
    ref = x.clone().index_add_(0, idx, vals, alpha=alpha)
    out = add_message(x, SparseMessage(idx, vals, (d,)), alpha=alpha)
    assert torch.equal(_bits(out), _bits(ref))
    if layout == "same":  # (a sanity check of the test: the order matters for these values)
        rev = x.clone().index_add_(0, idx.flip(0), vals.flip(0), alpha=alpha)
        assert not torch.equal(_bits(rev), _bits(ref))


def _aggregate(d: int, runs: int, seed: int) -> SparseMessage:
    """The hook's aggregate: ``runs`` ascending Top-k lists one after the other (repeats)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.cat(
        [torch.randperm(d, generator=gen)[: d // 20].sort().values for _ in range(runs)]
    )
    return SparseMessage(idx, torch.randn(idx.numel(), generator=gen), (d,))


@pytest.mark.parametrize("alpha", [1.0, -1.0])
def test_a_mirror_gets_the_bfloat16_of_the_touched_entries_and_x_its_bits(alpha: float) -> None:
    """``add_message(..., mirror=)`` on the fused path (in place, float32, the CPU kernel):
    x the bits of the addition without a mirror, the mirror's target bfloat16(x) at the
    message's entries and untouched elsewhere, ``written`` the message's indices."""
    d = 50_000
    c = _aggregate(d, 4, seed=5)
    x = torch.randn(d, generator=torch.Generator().manual_seed(6))
    before = (x * 3).to(torch.bfloat16)  # not x's conversion: untouched entries must stay so
    plain = add_message(x.clone(), c, inplace=True, alpha=alpha)
    mirror = Mirror(before.clone())
    y = x.clone()
    out = add_message(y, c, inplace=True, alpha=alpha, mirror=mirror)
    assert out.data_ptr() == y.data_ptr()
    assert torch.equal(_bits(out), _bits(plain))
    assert mirror.written is c.indices
    want = before.clone()
    want[c.indices] = plain[c.indices].to(torch.bfloat16)
    assert torch.equal(mirror.target.view(torch.int16), want.view(torch.int16))


def test_a_mirror_is_left_alone_off_the_fused_path() -> None:
    """Out of place, float64, a scaled addition, a dense or a torch-path message, a target that
    is no bfloat16 vector of x's size: the addition as without a mirror, and ``written``
    None with the target untouched (the caller converts as before)."""
    d = 2000
    c = _aggregate(d, 3, seed=8)
    c64 = SparseMessage(c.indices, c.values.double(), c.shape)
    c32 = SparseMessage(c.indices.int(), c.values, c.shape)  # int32 indices: the torch path
    x = torch.randn(d, generator=torch.Generator().manual_seed(9))
    half = torch.zeros(d, dtype=torch.bfloat16)
    cases: list[tuple[torch.Tensor, Any, dict[str, Any], torch.Tensor]] = [
        (x, c, {"inplace": False}, half),
        (x.double(), c64, {"inplace": True}, half),
        (x, c, {"inplace": True, "alpha": 0.5}, half),
        (x, c.dense(), {"inplace": True}, half),
        (x, c32, {"inplace": True}, half),
        (x, c, {"inplace": True}, torch.zeros(d - 1, dtype=torch.bfloat16)),
        (x, c, {"inplace": True}, torch.zeros(d, dtype=torch.float16)),
    ]
    for base, msg, kw, target in cases:
        mirror = Mirror(target.clone())
        got = add_message(base.clone(), msg, mirror=mirror, **kw)
        want = add_message(base.clone(), msg, **kw)
        assert torch.equal(_bits(got), _bits(want)), kw
        assert mirror.written is None, kw
        assert torch.equal(mirror.target, target), kw
