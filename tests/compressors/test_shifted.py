"""The shifted form C_h(x) = h + C(x − h) (Shulgin & Richtárik, UAI 2022) of the compressors.

``Compressor.shifted(x, h, keys)`` returns (C(x − h), h + C(x − h)); Top-1's fused CPU pass
must give exactly the bits of the three separate operations (EF21's trajectories depend on it),
including signed zeros, and refuse non-finite input like C itself.
"""

from __future__ import annotations

import pytest
import torch

from shrinkgrad import Keys, make_compressor
from shrinkgrad.compressors.base import Compressor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(200, 123), (7, 1), (3, 5), (2, 3, 8), (5,)])
def test_fused_top1_equals_the_separate_operations(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    C = make_compressor("top_k[k=1]")
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, dtype=dtype, generator=gen)
    h = torch.randn(*shape, dtype=dtype, generator=gen)
    x[..., 0] = h[..., 0]  # a zero difference
    h[..., -1] = -0.0  # h + 0 must turn −0 into +0, as torch's add does
    x[..., -1] = 0.0
    if shape[-1] > 2:
        x[..., 1] = h[..., 1] + 2.0  # a tie in |x − h| (with index 2): the lower index wins
        x[..., 2] = h[..., 2] - 2.0
    c, g = C.shifted(x, h)
    ref = C(x - h)
    assert torch.equal(_bits(c), _bits(ref))
    assert torch.equal(_bits(g), _bits(h + ref))
    c0, g0 = Compressor.shifted(C, x, h)  # the default: the same operations written out
    assert torch.equal(_bits(c), _bits(c0)) and torch.equal(_bits(g), _bits(g0))


@pytest.mark.parametrize("spec", ["top_k[k=1]", "top_k[k=3]", "rand_k[k=2]", "identity"])
def test_shifted_is_h_plus_the_compressed_difference(spec: str) -> None:
    C = make_compressor(spec)
    gen = torch.Generator().manual_seed(1)
    x, h = (
        torch.randn(6, 10, generator=gen, dtype=torch.float64),
        torch.randn(6, 10, generator=gen, dtype=torch.float64),
    )
    keys = None if C.deterministic else Keys.derive(0, round=3, client=torch.arange(6).numpy())
    c, g = C.shifted(x, h, keys)
    assert torch.equal(c, C(x - h, keys)) and torch.equal(g, h + c)


def test_shifted_refuses_non_finite_input_and_a_mismatched_shift() -> None:
    C = make_compressor("top_k[k=1]")
    x, h = torch.zeros(4, 6, dtype=torch.float64), torch.zeros(4, 6, dtype=torch.float64)
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        C.shifted(x, h)
    with pytest.raises(ValueError, match="the shift h must match x"):
        C.shifted(torch.zeros(4, 6), torch.zeros(4, 5))


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_top1_on_threads_gives_the_serial_bits_and_finds_a_late_nan(
    threads: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shrinkgrad.compressors import _kernels as K
    from shrinkgrad.compressors import basic

    calls = {"threads": 0}
    threaded = K.shifted_top1_rows_threads

    def counted(*args: object) -> int:
        calls["threads"] += 1
        return int(threaded(*args))

    monkeypatch.setattr(K, "shifted_top1_rows_threads", counted)
    monkeypatch.setenv("SHRINKGRAD_THREADS", threads)
    C = make_compressor("top_k[k=1]")
    n = basic.SHIFTED_THREADED_ROWS + 3 * K.SHIFTED_BLOCK + 17  # a partial last block
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 123, dtype=dtype, generator=gen)
    h = torch.randn(n, 123, dtype=dtype, generator=gen)
    h[:, -1] = -0.0
    x[:, -1] = 0.0
    c, g = C.shifted(x, h)
    ref = C(x - h)
    assert torch.equal(_bits(c), _bits(ref)) and torch.equal(_bits(g), _bits(h + ref))
    x[n - 2, 5] = float("inf")  # in the last block only
    with pytest.raises(ValueError, match="non-finite"):
        C.shifted(x, h)
    assert calls["threads"] == (2 if threads == "2" else 0)


def _sparse_reference(
    C: Compressor, x: torch.Tensor, h: torch.Tensor, keys: Keys | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat positions, values, h with the values added there), written out from C.sparse."""
    idx, vals = C.sparse(x - h, keys)
    d = x.shape[-1]
    rows = x.numel() // d
    flat = [r * d + int(j) for r in range(rows) for j in idx.reshape(rows, -1)[r]]
    g = h.clone().reshape(-1)
    for f, v in zip(flat, vals.reshape(-1).tolist(), strict=True):
        g[f] = g[f] + v
    return torch.tensor(flat), vals.reshape(-1), g.reshape(h.shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(200, 123), (7, 1), (3, 5), (2, 3, 8)])
def test_sparse_shifted_top1_keeps_the_entries_of_the_dense_form(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """The fused pass's sparse form: the kept entries of C(x − h) at flat positions r·d + j,
    and h changed at those positions only (h_j itself elsewhere: −0 stays −0, unlike h + 0)."""
    C = make_compressor("top_k[k=1]")
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x = torch.randn(*shape, dtype=dtype, generator=gen)
    h = torch.randn(*shape, dtype=dtype, generator=gen)
    h[..., -1] = -0.0
    x[..., -1] = 0.0
    if shape[-1] > 2:
        x[..., 1] = h[..., 1] + 2.0  # a tie: the lower index wins, as in the dense form
        x[..., 2] = h[..., 2] - 2.0
    flat, vals, g = C.shifted_sparse(x, h)
    ref_flat, ref_vals, ref_g = _sparse_reference(C, x, h, None)
    assert torch.equal(flat, ref_flat)
    assert torch.equal(_bits(vals), _bits(ref_vals)) and torch.equal(_bits(g), _bits(ref_g))
    dense = torch.zeros(x.numel(), dtype=dtype).index_add_(0, flat, vals).reshape(shape)
    assert torch.equal(_bits(dense), _bits(C.shifted(x, h)[0]))  # the dense message's bits
    # the default (no fused pass) gives the same
    f0, v0, g0 = Compressor.shifted_sparse(C, x, h)
    assert torch.equal(f0, flat) and torch.equal(_bits(v0), _bits(vals))
    assert torch.equal(_bits(g0), _bits(g))


@pytest.mark.parametrize("spec", ["top_k[k=3]", "rand_k[k=2]", "rand_k[k=2,shared_seed=true]"])
def test_sparse_shifted_form_of_other_fixed_size_sparsifiers(spec: str) -> None:
    C = make_compressor(spec)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    h = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    keys = None if C.deterministic else Keys.derive(0, round=3, client=torch.arange(6).numpy())
    flat, vals, g = C.shifted_sparse(x, h, keys)
    ref_flat, ref_vals, ref_g = _sparse_reference(C, x, h, keys)
    assert torch.equal(flat, ref_flat) and torch.equal(vals, ref_vals) and torch.equal(g, ref_g)
    dense = torch.zeros(60, dtype=torch.float64).index_add_(0, flat, vals).reshape(6, 10)
    assert torch.equal(dense, C(x - h, keys))


def test_sparse_shifted_form_refuses_dense_and_random_size_messages_and_non_finite_input() -> None:
    x, h = torch.zeros(4, 6, dtype=torch.float64), torch.zeros(4, 6, dtype=torch.float64)
    for spec in ("identity", "bernoulli[p=0.5]"):
        with pytest.raises(TypeError, match="sparse form of batches"):
            make_compressor(spec).shifted_sparse(x, h)
    x[1, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        make_compressor("top_k[k=1]").shifted_sparse(x, h)
