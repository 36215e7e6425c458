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
