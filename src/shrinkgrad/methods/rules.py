"""The per-client update rules of error feedback and client momentum, written once.

The client steps of :mod:`shrinkgrad.methods` call these; every runtime runs those client steps
(the DDP hook too, through :mod:`shrinkgrad.distributed.hooks`), so the arithmetic of a client's
memory exists once. ``compress`` is whatever the client step passes to apply C (``cfg.compress``:
the simulator's keyed call, the hook's encode-into-the-wire-buffer-and-decode).

The rules work on any shape (a group of clients on a leading axis) and either return new tensors
(the functional style of the methods) or update the state in place (``inplace=True``: runtimes
that own their state, ``Config.inplace``, such as the hook with its preallocated multi-megabyte
buffers). Both forms compute the same operations, so they give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ef21_update", "ef_update", "momentum_update"]

Compress = Callable[[torch.Tensor], torch.Tensor]


def ef21_update(
    g: torch.Tensor,
    target: torch.Tensor,
    compress: Compress,
    *,
    inplace: bool = False,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EF21's client update: c = C(target − g); g ← g + c. Returns ``(c, new g)``.

    [EF21] Alg. 1 step 2 with ``target`` = ∇f_i(x^{t+1}); [EFR] Alg. 2 (EF21-W) with
    ``target`` = ∇f_i(x^{t+1}) / (n w_i). The client sends c; the server adds Σ_i w_i c_i to g.
    With ``inplace=True`` the new g is ``g`` itself, updated in place; ``scratch`` (g's shape
    and dtype) receives target − g instead of a new tensor.
    """
    diff = target - g if scratch is None else torch.sub(target, g, out=scratch)
    c = compress(diff)
    return c, (g.add_(c) if inplace else g + c)


def ef_update(
    e: torch.Tensor,
    update: torch.Tensor,
    compress: Compress,
    *,
    inplace: bool = False,
    step: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classic error feedback's client update ([S14]): p = e + s·u; v = C(p); e ← p − v.

    In the method of methods.md §3, s·u = γ∇f_i(x^t) (``update`` = γ∇f_i and ``step`` 1, or
    ``update`` = ∇f_i and ``step`` = γ). Returns ``(v, new e)``; the client sends v and the server
    subtracts (1/n) Σ_i v_i. With ``inplace=True`` the new e is ``e`` itself (and ``update`` is
    only read).
    """
    if inplace:
        p = e.add_(update, alpha=step) if step != 1.0 else e.add_(update)
    else:
        p = e + (update if step == 1.0 else step * update)
    v = compress(p)
    return v, (p.sub_(v) if inplace else p - v)


def momentum_update(
    v: torch.Tensor, grad: torch.Tensor, beta: float, *, inplace: bool = False
) -> torch.Tensor:
    """Client momentum: v ← β v + (1 − β) ∇ (Polyak's heavy ball as a moving average).

    [FTR23] Alg. 1 (EF21-SGDM) line v_i^{t+1} = (1 − η) v_i^t + η ∇f_i(x^{t+1}, ξ_i^{t+1}) with
    η = 1 − β. Returns the new v (``v`` itself with ``inplace=True``); both forms compute
    ``v·β`` and then add ``(1 − β)·grad``, so they agree bit for bit.
    """
    if inplace:
        return v.mul_(beta).add_(grad, alpha=1.0 - beta)
    return torch.add(v * beta, grad, alpha=1.0 - beta)
