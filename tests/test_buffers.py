"""Recycled large arrays (shrinkgrad._buffers): never reused while a view lives; no result
changes when every per-round array comes from the pool."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from shrinkgrad import _buffers as B
from shrinkgrad import simulate
from shrinkgrad.problems import logistic_regression


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(B, "POOL_MIN_BYTES", 1024)
    monkeypatch.setattr(B, "_free", {})


def test_memory_returns_only_when_its_last_view_dies(small_pool: None) -> None:
    a = B.empty((100, 10), np.float64)
    address = a.ctypes.data
    views = [a[3:][::2], torch.from_numpy(a)[5], torch.from_numpy(a).view(-1, 5).numpy()]
    del a
    gc.collect()
    while views:
        assert B.pooled_bytes() == 0  # something still sees the memory
        views.pop(0)
    assert B.pooled_bytes() == 8000
    b = B.empty((10, 100), np.float64)  # the same size: the same memory, handed out again
    assert b.ctypes.data == address and B.pooled_bytes() == 0
    assert b.flags.writeable and b.flags.c_contiguous and b.shape == (10, 100)


def test_small_arrays_are_not_pooled_and_the_pool_is_bounded(small_pool: None) -> None:
    s = B.empty((10,), np.float64)
    del s
    assert B.pooled_bytes() == 0
    held = [B.empty((64, 4), np.float32) for _ in range(B.POOL_KEEP + 3)]
    del held
    assert B.pooled_bytes() == B.POOL_KEEP * 64 * 4 * 4
    t = B.empty_tensor((64, 4), torch.float32)
    assert t.dtype == torch.float32 and B.pooled_bytes() == (B.POOL_KEEP - 1) * 1024
    with pytest.raises(TypeError, match="float32 or float64"):
        B.empty_tensor((4,), torch.int64)


def test_a_run_from_recycled_memory_is_the_same_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """EF21 + Top-1 with every (n, d) array of the pass and the shifted compressor from the
    pool (stale contents each round) gives the iterates and the table of a fresh-memory run."""
    p = logistic_regression("a1a", n_clients=40)
    args = (p, "ef21", "top_k[k=1]", "theory")
    fresh = simulate(*args, rounds=15, log_every=1)
    monkeypatch.setattr(B, "POOL_MIN_BYTES", 1)
    monkeypatch.setattr(B, "_free", {})
    pooled = simulate(*args, rounds=15, log_every=1)
    assert B.pooled_bytes() > 0  # the pool was used
    assert torch.equal(pooled.x, fresh.x)
    cols = ["grad_norm_sq", "loss", "bits_up"]
    assert pooled.table[cols].equals(fresh.table[cols])
