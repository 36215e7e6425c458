"""The per-client update rules of error feedback, shared by the simulator and the DDP hooks.

A client step of :mod:`shrinkgrad.methods` and a DDP communication hook of
:mod:`shrinkgrad.distributed` differ in where the gradient comes from (an oracle for a group of
clients vs. the bucket that backward just filled) and in how the message travels (a dense tensor
vs. an encoded payload), but the arithmetic of the client's memory is the same. It lives here,
once; ``compress`` is whatever the caller uses to apply C (the simulator's keyed
``cfg.compress``, the hook's encode-and-decode of the wire payload).

Both rules work on any shape (a group of clients on a leading axis, or one flat gradient) and
either return new tensors (the functional style of the methods) or update the state in place
(``inplace=True``: the hooks, which keep preallocated multi-megabyte buffers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ef21_update", "ef_update"]

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
    e: torch.Tensor, update: torch.Tensor, compress: Compress, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classic error feedback's client update ([S14]): p = e + u; v = C(p); e ← p − v.

    ``update`` is u = γ∇f_i(x^t) in the method of methods.md §3 (the learning-rate-free form
    u = ∇f_i, used by the DDP hooks, keeps e/γ instead of e). Returns ``(v, new e)``; the client
    sends v and the server subtracts (1/n) Σ_i v_i. With ``inplace=True`` the new e is ``e``
    itself.
    """
    p = e.add_(update) if inplace else e + update
    v = compress(p)
    return v, (p.sub_(v) if inplace else p - v)
