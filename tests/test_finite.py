"""The per-round finiteness test (shrinkgrad._finite.all_finite) against torch.isfinite."""

from __future__ import annotations

import pytest
import torch

from shrinkgrad._finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_all_finite_agrees_with_torch_on_every_layout(
    dtype: torch.dtype, bad: float | None
) -> None:
    gen = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 124, 1000):
        base = torch.randn(n, 3, generator=gen).to(dtype)
        if bad is not None and n:
            base[int(torch.randint(n, (1,), generator=gen)), 1] = bad
        for x in (base, base.T, base[:, 1], base[::2], base.reshape(-1)):
            assert all_finite(x) == bool(torch.isfinite(x).all()), (n, x.shape, x.stride())
    x = torch.tensor([1.0, bad if bad is not None else 2.0], dtype=dtype, requires_grad=True)
    assert all_finite(x) == (bad is None)  # the torch path (numpy cannot take it)


def test_all_finite_of_large_finite_values_and_integers() -> None:
    x = torch.full((10,), 1.7e308, dtype=torch.float64)  # their sum overflows; they are finite
    assert all_finite(x)
    assert all_finite(torch.arange(5))
    assert not all_finite(torch.tensor([3.4e38, float("inf")], dtype=torch.float32))
