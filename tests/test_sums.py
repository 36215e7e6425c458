"""The per-round reductions (shrinkgrad._sums) against in-order Python sums and torch."""

from __future__ import annotations

import math

import pytest
import torch

from shrinkgrad._sums import all_finite, mean_value, row_values, squared_norm


def _mean(t: torch.Tensor) -> float:
    acc = 0.0
    for v in t.tolist():
        acc += v
    return acc / t.numel()


def _squares(t: torch.Tensor) -> float:
    acc = 0.0
    for v in t.tolist():
        acc += v * v
    return acc


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 7, 124, 1000])
def test_the_reductions_are_float64_sums_in_index_order(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    g = (torch.randn(n, generator=gen) * 1e3).to(dtype)
    up, paper, down = (torch.rand(n, generator=gen, dtype=torch.float64) * 1e6 for _ in range(3))
    assert mean_value(g) == _mean(g) and squared_norm(g) == _squares(g)
    assert row_values(g, up, paper, down) == (_squares(g), _mean(up), _mean(paper), _mean(down))
    strided = torch.stack([g, -g], dim=1)[:, 0]  # a non-contiguous view of the same values
    assert mean_value(strided) == _mean(g) and squared_norm(strided) == _squares(g)


def test_tensors_numpy_cannot_view_take_the_torch_reductions() -> None:
    g = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    assert squared_norm(g) == 25.0 and mean_value(g) == 3.5
    h = torch.tensor([1.5, 2.5], dtype=torch.bfloat16)
    assert squared_norm(h) == 8.5 and mean_value(h) == 2.0
    assert math.isnan(mean_value(torch.zeros(0, dtype=torch.float64)))


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
