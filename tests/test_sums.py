"""The logged row's reductions (shrinkgrad._sums) against in-order Python sums."""

from __future__ import annotations

import math

import pytest
import torch

from shrinkgrad._sums import mean_value, row_values, squared_norm


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
