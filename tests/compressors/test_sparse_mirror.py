"""``_kernels.sparse_add_bf16_at``: EF21's server sparse add into a float32 g that also writes
the bfloat16 of every touched entry into DDP's bfloat16 output, in one pass (the DDP hook's
fused mirror). It must give exactly the bits of the two passes it replaces —
``sparse_add`` (index_add_'s additions, in index order per entry) followed by ``bf16_at``
(torch's ``.to(torch.bfloat16)`` rounding) — on every layout of the indices the kernels
distinguish (one run, a few runs block by block, more runs than ``ADD_MAX_RUNS``), with
repeated indices (the mirror holds the conversion of the final sum), special values, and
refuse an index outside the vector without writing anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shrinkgrad.compressors import _kernels as K


def _pats(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _two_pass(
    x: torch.Tensor, m: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, negate: bool
) -> None:
    assert K.sparse_add(x.numpy(), idx.numpy(), vals.numpy(), negate)
    assert K.bf16_at(_pats(m), x.view(torch.int32).numpy().view(np.uint32), idx.numpy())


def _indices(layout: str, d: int, gen: torch.Generator) -> torch.Tensor:
    base = torch.randperm(d, generator=gen)[: d // 50].sort().values
    edges = torch.tensor([0, K.ADD_BLOCK - 1, K.ADD_BLOCK, 2 * K.ADD_BLOCK, d - 1])
    if layout == "same":  # every index in every run: 4 additions per entry
        lists = [base] * 4
    elif layout == "overlapping":  # partly shared, with block boundaries and the last entry
        lists = [torch.cat([base[i::2], edges]).unique() for i in range(2)] + [
            torch.randperm(d, generator=gen)[: d // 40].sort().values,
            edges,
        ]
    elif layout == "one":
        lists = [torch.cat([base, edges]).unique()]
    else:  # unsorted pieces: more runs than ADD_MAX_RUNS (the loop in order), with repeats
        lists = [torch.randperm(d, generator=gen)[:3] for _ in range(K.ADD_MAX_RUNS + 5)]
        lists += [edges, edges]
    return torch.cat(lists)


@pytest.mark.parametrize("negate", [False, True])
@pytest.mark.parametrize("layout", ["same", "overlapping", "one", "many"])
def test_the_fused_mirror_gives_the_bits_of_sparse_add_then_bf16_at(
    layout: str, negate: bool
) -> None:
    d = 3 * K.ADD_BLOCK + 17
    gen = torch.Generator().manual_seed(12)
    idx = _indices(layout, d, gen)
    # magnitudes far apart (any other order of the additions changes the rounding), exact
    # bfloat16 ties, values that round to inf in bfloat16, subnormals
    vals = (
        torch.randn(idx.numel(), generator=gen)
        * 10.0 ** torch.randint(-30, 30, (idx.numel(),), generator=gen).float()
    )
    x = torch.randn(d, generator=gen) * 10.0 ** torch.randint(-38, 38, (d,), generator=gen).float()
    x[idx[:8]] = torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)[
        torch.arange(8) % 2
    ]
    x[idx[8]] = 3.3961e38
    mirror = (torch.randn(d, generator=gen) * 5).to(torch.bfloat16)  # the previous conversion
    x0, x2, m2 = x.clone(), x.clone(), mirror.clone()
    _two_pass(x, mirror, idx, vals, negate)
    assert K.sparse_add_bf16_at(x2.numpy(), idx.numpy(), vals.numpy(), negate, _pats(m2))
    assert torch.equal(x2.view(torch.int32), x.view(torch.int32))
    assert torch.equal(m2.view(torch.int16), mirror.view(torch.int16))
    # and both are torch's: index_add_, then the conversion at the touched entries only
    ref = x0.index_add_(0, idx, vals, alpha=-1.0 if negate else 1.0)
    nan = ref.isnan()
    assert torch.equal(x2.isnan(), nan)
    assert torch.equal(x2.view(torch.int32)[~nan], ref.view(torch.int32)[~nan])
    untouched = torch.ones(d, dtype=torch.bool)
    untouched[idx] = False
    conv = x2[idx].to(torch.bfloat16)
    assert torch.equal(m2[idx].isnan(), conv.isnan())
    ok = ~conv.isnan()
    assert torch.equal(m2[idx][ok].view(torch.int16), conv[ok].view(torch.int16))
    assert not torch.equal(m2[untouched], x2[untouched].to(torch.bfloat16))  # left alone


def test_the_fused_mirror_of_special_values_is_torchs_conversion() -> None:
    """Signed zeros (+0 + −0 = +0, −0 + −0 = −0, 1 − 1 = +0), ∞ − ∞ = NaN, ∞ + 1 = ∞, NaN
    inputs, a sum that overflows in bfloat16 only, all at repeated indices of three runs: the
    float32 bits of index_add_ and the bfloat16 of each final sum (NaN as some NaN: torch's
    payload depends on its loop, the kernels write 0x7FC0)."""
    inf, nan = float("inf"), float("nan")
    d = K.ADD_BLOCK + 9
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, K.ADD_BLOCK + 8])
    x = torch.zeros(d)
    x[pos] = torch.tensor([0.0, -0.0, 1.0, inf, inf, nan, 3.0e38, -0.0])
    first = torch.tensor([-0.0, -0.0, -1.0, -inf, 1.0, 1.0, 3.0e38, -0.0])
    idx = torch.cat([pos, pos, pos])  # three runs, each index in each
    vals = torch.cat([first, -torch.zeros(8), -torch.zeros(8)])
    mirror = torch.full((d,), 7.0, dtype=torch.bfloat16)
    ref = x.clone().index_add_(0, idx, vals)
    m2 = mirror.clone()
    assert K.sparse_add_bf16_at(x.numpy(), idx.numpy(), vals.numpy(), False, _pats(m2))
    nan_f = ref.isnan()
    assert torch.equal(x.isnan(), nan_f)
    assert torch.equal(x.view(torch.int32)[~nan_f], ref.view(torch.int32)[~nan_f])
    want = mirror.clone()
    want[pos] = ref[pos].to(torch.bfloat16)
    nan_b = want.isnan()
    assert int(nan_b.sum()) == 2 and torch.equal(m2.isnan(), nan_b)
    assert torch.equal(m2.view(torch.int16)[~nan_b], want.view(torch.int16)[~nan_b])
    assert m2[0].item() == 0.0 and not m2[0].signbit()  # +0 + −0 = +0
    assert m2[1].signbit() and m2[K.ADD_BLOCK + 8].signbit()  # −0 + −0 = −0
    assert m2[6].item() == inf  # 6e38: finite in float32, inf in bfloat16


@pytest.mark.parametrize("bad", [-1, "n"])
@pytest.mark.parametrize("layout", ["one", "overlapping", "many"])
def test_an_index_outside_the_vector_writes_nothing(layout: str, bad: int | str) -> None:
    d = 2 * K.ADD_BLOCK + 5
    gen = torch.Generator().manual_seed(2)
    idx = _indices(layout, d, gen)
    idx[idx.numel() // 2] = d if bad == "n" else bad
    vals = torch.randn(idx.numel(), generator=gen)
    x = torch.randn(d, generator=gen)
    mirror = x.to(torch.bfloat16)
    x0, m0 = x.clone(), mirror.clone()
    assert not K.sparse_add_bf16_at(x.numpy(), idx.numpy(), vals.numpy(), False, _pats(mirror))
    assert torch.equal(x, x0) and torch.equal(mirror.view(torch.int16), m0.view(torch.int16))


def test_a_mirror_of_another_length_is_refused() -> None:
    x = torch.zeros(10)
    mirror = torch.zeros(9, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2])
    assert not K.sparse_add_bf16_at(
        x.numpy(), idx.numpy(), torch.ones(2).numpy(), False, _pats(mirror)
    )
    assert torch.equal(x, torch.zeros(10))
