"""The per-client update rules of error feedback and client momentum, written once.

The client steps of :mod:`shrinkgrad.methods` call these; every runtime runs those client steps
(the DDP hook too, through :mod:`shrinkgrad.distributed.hooks`), so the arithmetic of a client's
memory exists once. ``compress`` is whatever the client step passes to apply C (``cfg.compress``:
the simulator's keyed call, the hook's encode-into-the-wire-buffer-and-decode).

The rules work on any shape (a group of clients on a leading axis) and either return new tensors
(the functional style of the methods) or update the state in place (``inplace=True``: runtimes
that own their state, ``Config.inplace``, such as the hook with its preallocated multi-megabyte
buffers). Both forms compute the same operations, so they give the same bits.

A compressed vector is a dense tensor or, where a runtime hands one out (the DDP hook's sparse
path, for methods that declare ``Method.sparse_messages``), a :class:`SparseMessage`: C(p)
given by its kept entries, added to the state by an ``index_add_`` at O(k) instead of a dense
pass. The rules below take either form and give the same values (at the kept positions
x_j ± c_j, elsewhere x_j itself instead of x_j ± 0). A runtime that keeps a bfloat16 copy of a
state tensor (the DDP hook's output of a bfloat16 model) may hand :func:`add_message` a
:class:`Mirror`, which the sparse addition then writes in its pass, with the same sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch.autograd.graph import increment_version

from ..compressors import _kernels as K

__all__ = [
    "LowRankMessage",
    "Mirror",
    "SparseMessage",
    "add_message",
    "divide_message",
    "ef21_update",
    "ef_update",
    "momentum_update",
]


class SparseMessage(NamedTuple):
    """A compressed vector of shape ``shape`` given by its kept entries: ``values`` at the flat
    positions ``indices`` (int64), zeros elsewhere (Top-k's and rand-k's messages).

    One client's message has distinct indices; an aggregate of several clients' messages (the
    hook's Σ_i w_i c_i) may repeat an index, and its values then add up. ``distinct`` says that
    ``indices`` are known to be distinct (False: unknown); the hook's shared-seed aggregates,
    whose ranks share one index set, are, and the output then stores each value instead of
    adding it to a zero (the same values, no read of the entry). The DDP hook builds
    these (its sparse path), for methods whose client and server parts merely add C(p) to their
    state or pass it on (``Method.sparse_messages``); so do the simulator and the runner for
    EF21's messages, as batches of shape (m, d) whose reduction ``methods.base.weighted_sum``
    adds the pairs (``Config.sparse_batches``).
    """

    indices: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]
    distinct: bool = False

    def dense(self) -> torch.Tensor:
        """The dense vector (for checks and fallbacks; O(d))."""
        out = torch.zeros(self.shape, dtype=self.values.dtype, device=self.values.device)
        out.view(-1).index_add_(0, self.indices, self.values)
        return out


class LowRankMessage(NamedTuple):
    """A compressed vector of shape ``shape`` given by a low-rank compressor's factors: the
    d entries of the m × n matrix ``left`` ``right``ᵀ (m n = d, no padding), with ``add``, the
    compressor's ``x += α left rightᵀ`` on a flat contiguous x of d entries (PowerSGD's
    :meth:`~shrinkgrad.compressors.PowerSGD.add_outputs`: the bits of forming the product and
    adding it). Only the DDP hook builds these (its factor path, for methods with
    ``sparse_messages``), so that EF21's g_i + P̂ Q_iᵀ and g + P̂ Q̄ᵀ are one pass over g each,
    without a dense C(p)."""

    left: torch.Tensor
    right: torch.Tensor
    shape: tuple[int, ...]
    add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

    def dense(self) -> torch.Tensor:
        """The dense vector (for fallbacks; O(d))."""
        out = torch.zeros(self.shape, dtype=self.left.dtype, device=self.left.device)
        self.add(out.view(-1), self.left, self.right, 1.0)
        return out


#: what a compressor call hands back: a dense tensor or, from the hook, a SparseMessage or
#: a LowRankMessage
Compressed = torch.Tensor | SparseMessage | LowRankMessage
Compress = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(eq=False)
class Mirror:
    """A request, from a runtime, to keep ``target`` — a bfloat16 vector of x's numel — equal
    to the bfloat16 conversion of a float32 state tensor x at the entries an in-place sparse
    addition to x touches, written while the addition has them in cache.

    The DDP hook asks for it (``Config.mirror``) for the state tensor of a bfloat16 model's
    method whose direction D is that state (EF21's g, DDP's bfloat16 output): the update
    g^{t+1} = g^t + Σ_i w_i c_i then also writes bfloat16(g^{t+1}_j) into the output at the
    aggregate's n·k entries, in one pass instead of two. Whoever writes the mirror sets
    ``written`` to the flat positions it wrote (repeats allowed); ``None``: nothing was
    written, and the runtime converts as it would without the mirror."""

    target: torch.Tensor
    written: torch.Tensor | None = None


def add_message(
    x: torch.Tensor,
    c: Compressed,
    *,
    inplace: bool = False,
    alpha: float = 1.0,
    mirror: Mirror | None = None,
) -> torch.Tensor:
    """x + α·c, with c dense, a :class:`SparseMessage` (then an O(k) ``index_add_``; α = ±1
    gives x_j ± c_j exactly) or a :class:`LowRankMessage` (its ``add``: one pass over x, the
    bits of x ± c for α = ±1). ``inplace`` updates ``x`` (contiguous) and returns it.

    ``mirror``: for an in-place sparse addition into a float32 x by the CPU kernel (α = ±1),
    the fused :func:`~shrinkgrad.compressors._kernels.sparse_add_bf16_at` also writes
    bfloat16(x_j) into ``mirror.target`` at the message's entries and sets ``mirror.written``
    to ``c.indices``: x gets the same bits as without it. In every other case the mirror is
    left alone (``written`` stays None), so that its runtime can always fall back."""
    if isinstance(c, LowRankMessage):
        if alpha not in (1.0, -1.0):
            c = c.dense()
        else:
            y = x if inplace else x.clone()
            c.add(y.view(-1), c.left, c.right, alpha)
            increment_version(y)  # written through numpy: tell torch (and the oracle's stamps)
            return y
    if isinstance(c, SparseMessage):
        y = x if inplace else x.clone()
        flat = y.view(-1)
        if abs(alpha) == 1.0 and _kernel_ready(flat, c):
            # numba's serial loop: index_add_'s values (and order) at a fraction of its cost
            pats = _mirror_patterns(mirror, flat) if inplace else None
            if pats is not None:  # the same additions, and the bfloat16 of each touched entry
                ok = K.sparse_add_bf16_at(
                    flat.numpy(), c.indices.numpy(), c.values.numpy(), alpha < 0, pats
                )
            else:
                ok = K.sparse_add(flat.numpy(), c.indices.numpy(), c.values.numpy(), alpha < 0)
            if not ok:
                raise IndexError(f"a sparse message has an index outside [0, {flat.numel()})")
            if pats is not None:
                assert mirror is not None
                mirror.written = c.indices
            increment_version(y)  # written through numpy: tell torch (and the oracle's stamps)
            return y
        flat.index_add_(0, c.indices, c.values, alpha=alpha)
        return y
    if alpha == 1.0:
        return x.add_(c) if inplace else x + c
    if alpha == -1.0:
        return x.sub_(c) if inplace else x - c
    return x.add_(c, alpha=alpha) if inplace else x + alpha * c


def _mirror_patterns(mirror: Mirror | None, flat: torch.Tensor) -> np.ndarray | None:
    """The bit patterns (uint16) of ``mirror``'s target when the fused kernel can write it
    for ``flat`` (float32; a contiguous bfloat16 CPU vector of the same numel), else None."""
    if mirror is None:
        return None
    t = mirror.target
    if (
        flat.dtype != torch.float32
        or t.dtype != torch.bfloat16
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or t.requires_grad
        or t.numel() != flat.numel()
    ):
        return None
    return K.bf16_patterns(t)


def _kernel_ready(flat: torch.Tensor, c: SparseMessage) -> bool:
    """Whether :func:`~shrinkgrad.compressors._kernels.sparse_add` may do ``flat[c] += c``."""
    return kernel_ready(c.indices, flat, c.values)


def kernel_ready(indices: torch.Tensor, *floats: torch.Tensor) -> bool:
    """Whether numba kernels may work on these tensors through numpy: CPU, contiguous, int64
    ``indices``, ``floats`` of one dtype (float32/float64) without autograd."""
    dt = floats[0].dtype
    return (
        indices.dtype == torch.int64
        and indices.device.type == "cpu"
        and indices.is_contiguous()
        and dt in (torch.float32, torch.float64)
        and all(
            t.dtype == dt and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
            for t in floats
        )
    )


def divide_message(c: Compressed, s: float) -> Compressed:
    """c / s (a new message), dense or sparse; a low-rank message is formed densely first
    (or returned as it is for s = 1: c / 1 = c)."""
    if isinstance(c, LowRankMessage):
        return c if s == 1.0 else c.dense() / s
    if isinstance(c, SparseMessage):
        return SparseMessage(c.indices, c.values / s, c.shape)
    return c / s


def ef21_update(
    g: torch.Tensor,
    target: torch.Tensor,
    compress: Compress,
    *,
    inplace: bool = False,
    scratch: torch.Tensor | None = None,
    sparse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EF21's client update: c = C(target − g); g ← g + c. Returns ``(c, new g)``.

    [EF21] Alg. 1 step 2 with ``target`` = ∇f_i(x^{t+1}); [EFR] Alg. 2 (EF21-W) with
    ``target`` = ∇f_i(x^{t+1}) / (n w_i). The client sends c; the server adds Σ_i w_i c_i to g.
    With ``inplace=True`` the new g is ``g`` itself, updated in place; ``scratch`` (g's shape
    and dtype) receives target − g instead of a new tensor.

    g + C(target − g) is the shifted compressor C_g(target) (Shulgin & Richtárik, UAI 2022):
    when ``compress`` offers its shifted form (``compress.shifted(target, g)``, the simulator's
    :meth:`~shrinkgrad.methods.base.StatefulCompress.shifted`), the functional form asks it,
    so that a compressor with a fused pass (Top-1 on CPU) computes the three operations in one,
    with the same bits. Otherwise a ``compress`` with a ``difference(a, b)`` attribute (the
    DDP hook's) is asked for C(target − g): it may select from the difference without forming
    it (None: it cannot, and target − g is formed).

    ``sparse=True``: the caller takes c as a :class:`SparseMessage` (it only sends c and adds
    it to state), which the shifted form then may return
    (:meth:`~shrinkgrad.methods.base.StatefulCompress.shifted`).
    """
    shifted = getattr(compress, "shifted", None)
    if shifted is not None and not inplace:
        both = shifted(target, g, sparse=True) if sparse else shifted(target, g)
        if both is not None:
            c_new: torch.Tensor = both[0]  # or a SparseMessage (``sparse``), as from the hook
            return c_new, both[1]
    fused = getattr(compress, "difference", None)
    c = fused(target, g) if fused is not None else None
    if c is None:
        diff = target - g if scratch is None else torch.sub(target, g, out=scratch)
        c = compress(diff)
    return c, add_message(g, c, inplace=inplace)


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
    return v, add_message(p, v, inplace=inplace, alpha=-1.0)


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
