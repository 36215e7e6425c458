"""Numba CPU kernel of the low-rank compressors' product A Bᵀ (small inner dimension r).

The decompression of a rank-r message, P̂ Qᵀ ((m, r) @ (r, n), r ≪ m, n: PowerSGD's and the
DDP hook's dense pass, Vogels et al. 2019 Alg. 1 line "decompress"), is a matrix product whose
inner dimension is the rank. BLAS is far from the memory bound there (sgemm spends ~10 ms on a
2048 × 4 × 2048 float32 product, 2.7× a write of the 16 MB result on this CPU): its
packing and micro-kernel set-up are made for large inner dimensions. This kernel writes every
row of the result as a_{i0} b_0 and then, for k = 1 … r − 1, c ← fma(a_{ik}, b_k, c): the order
of sgemm's outer-product micro-kernels (one fused multiply-add chain over k per entry), so its
float32 result equals ``torch.mm`` bit for bit where torch's BLAS does that (tested:
``tests/compressors/test_lowrank_shared.py``); it reads A and Bᵀ once and writes C once, in
row blocks that stay in cache.

It is used for float32 CPU tensors with both sides m, n ≥ :data:`MIN_SIDE` (:func:`usable`);
float64 (whose dgemm takes another order here), thin products (torch's BLAS switches to other
kernels there) and other devices keep ``torch.mm``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba.extending import intrinsic

__all__ = ["MIN_SIDE", "add_product", "product_into", "usable"]


@intrinsic
def _fma(typingctx: Any, x: Any, y: Any, z: Any) -> Any:  # pragma: no cover - compiled
    """x·y + z rounded once (LLVM's ``llvm.fma``)."""
    sig = x(x, y, z)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ty = args[0].type
        fn = builder.module.declare_intrinsic("llvm.fma", [ty], ir.FunctionType(ty, [ty] * 3))
        return builder.call(fn, args)

    return sig, codegen


@njit(cache=True, inline="always")
def _row(a: np.ndarray, bt: np.ndarray, i: int, out: np.ndarray) -> None:  # pragma: no cover
    """out (n,) ← row i of a @ bt: a_{i0} bt_0, then out ← fma(a_{ik}, bt_k, out), k = 1 … r − 1."""
    r = a.shape[1]
    n = bt.shape[1]
    a0 = a[i, 0]
    b0 = bt[0]
    for j in range(n):
        out[j] = a0 * b0[j]
    for k in range(1, r):
        ak = a[i, k]
        bk = bt[k]
        for j in range(n):
            out[j] = _fma(ak, bk[j], out[j])  # type: ignore[call-arg]


@njit(cache=True, nogil=True)
def _product(a: np.ndarray, bt: np.ndarray, c: np.ndarray) -> None:  # pragma: no cover
    """c (m, n) ← a (m, r) @ bt (r, n), row by row (:func:`_row`)."""
    for i in range(a.shape[0]):
        _row(a, bt, i, c[i])


@njit(cache=True, nogil=True)
def _add_product(
    a: np.ndarray, bt: np.ndarray, c: np.ndarray, alpha: float, tmp: np.ndarray
) -> None:  # pragma: no cover - compiled
    """c (m, n) ← c + α (a @ bt), α = ±1: each row's product formed by :func:`_row` in ``tmp``
    (n, in cache), then added (subtracted): the bits of c ± (a @ bt), in one pass."""
    n = bt.shape[1]
    for i in range(a.shape[0]):
        _row(a, bt, i, tmp)
        row = c[i]
        if alpha == 1.0:
            for j in range(n):
                row[j] = row[j] + tmp[j]
        else:
            for j in range(n):
                row[j] = row[j] - tmp[j]


#: the smallest m and n the kernel is used for: below, torch's BLAS takes other kernels
#: (other orders) for a product this size, and the kernel would not give its bits
MIN_SIDE = 16


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`product_into` is used for a (m, r) @ b (n, r)ᵀ: float32 CPU tensors
    without autograd and m, n ≥ :data:`MIN_SIDE`."""
    return (
        min(a.shape[0], b.shape[0]) >= MIN_SIDE
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and a.device.type == "cpu"
        and b.device.type == "cpu"
        and not (a.requires_grad or b.requires_grad)
        and a.shape[-1] >= 1
    )


def product_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (m, n, contiguous) ← a (m, r) @ b (n, r)ᵀ, float32 on the CPU; returns ``out``."""
    bt = b.t().contiguous()  # (r, n): small
    _product(a.contiguous().numpy(), bt.numpy(), out.numpy())
    return out


def add_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    """``out`` (m, n, contiguous) ← out + α a (m, r) @ b (n, r)ᵀ for α = ±1, float32 CPU."""
    if alpha not in (1.0, -1.0):
        raise ValueError(f"add_product takes alpha = ±1, got {alpha}")
    bt = b.t().contiguous()
    tmp = np.empty(bt.shape[1], dtype=np.float32)
    _add_product(a.contiguous().numpy(), bt.numpy(), out.numpy(), float(alpha), tmp)
