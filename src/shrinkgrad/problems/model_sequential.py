"""The fast path of model problems: a stack of ``Linear`` layers and activations, by hand.

For a ``torch.nn.Sequential`` of ``Linear`` layers and elementwise activations (the registered
``mlp``), h = σ_K ∘ L_K ∘ … ∘ σ_1 ∘ L_1 with L_k(a) = W_k a + b_k (σ_k the identity where no
activation follows), the gradient of client i's f_i = Σ_j w_ij ℓ(h(x; a_j), y_j) (w_ij = 1/m_i on
its rows, 0 on padding) is back-propagation written out (Rumelhart, Hinton & Williams 1986;
Goodfellow, Bengio & Courville, *Deep Learning*, §6.5.4), on the (m, width) matrices of the
client's rows, A_0 = X_i:

    forward:   Z_k = A_{k−1} W_kᵀ + b_k,   A_k = σ_k(Z_k)
    backward:  Δ_K = σ_K'(Z_K) ⊙ (w ⊙ ∂ℓ/∂h),   Δ_{k−1} = σ_{k−1}'(Z_{k−1}) ⊙ (Δ_k W_k)
    gradient:  ∇_{W_k} f_i = Δ_kᵀ A_{k−1},   ∇_{b_k} f_i = Σ_j Δ_k[j, :].

All clients at once: with x shared, each forward and backward product is one matrix product over
every row of every client (``addmm``/``mm`` on (n·m, width)); the per-client weight gradients
Δ_kᵀ A_{k−1} are one ``torch.bmm`` per layer over the client axis, into one contiguous buffer that
is copied into the layer's columns of the (n, d) result (in the flat ``parameters()`` layout each
client's W_k is a contiguous (out, in) block of its row): nothing is stacked, concatenated or
scattered. (The product is not written into the result directly because a kernel's rounding may
depend on the alignment of its output, and a row's alignment in the result depends on its index:
the restricted problems of a runner and the fused gradient-and-loss pass must round as the full
problem does.) A point per client (``client_grads_at``) makes the forward
and backward products batched (``baddbmm``/``bmm``) too. σ' is computed from σ's output with the
formulas torch's autograd uses (``threshold_backward``, ``tanh_backward``, ``sigmoid_backward``),
∂ℓ/∂h is :attr:`~shrinkgrad.problems.model_losses.ModelLoss.output_grad`.

:meth:`SequentialGrads.of` recognises such a module and returns None for anything else (other
layers, subclasses of ``Sequential`` with their own ``forward``, shared layers, buffers, forward
or backward hooks on the module or a layer or for all modules (:func:`has_hooks`: the passes
here call no module, so no hook), inputs that are not feature vectors, a loss without
``output_grad``); those models use the generic
``vmap(grad)`` path of :mod:`~shrinkgrad.problems.model`. Both paths compute the same function;
the tests check this path against a per-client autograd loop and against the generic path
(float64, 1e-10).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from .model_losses import ModelLoss

__all__ = ["ACTIVATIONS", "Activation", "SequentialGrads", "has_hooks"]


@dataclasses.dataclass(frozen=True)
class Activation:
    """An elementwise σ, both in place: ``forward_(z)`` overwrites z with σ(z), ``backward_(g,
    a)`` overwrites g with g ⊙ σ'(z) computed from a = σ(z) (autograd's formula)."""

    forward_: Callable[[torch.Tensor], torch.Tensor]
    backward_: Callable[[torch.Tensor, torch.Tensor], object]


def _relu_backward_(g: torch.Tensor, a: torch.Tensor) -> object:
    return torch.ops.aten.threshold_backward.grad_input(g, a, 0, grad_input=g)


def _tanh_backward_(g: torch.Tensor, a: torch.Tensor) -> object:
    return torch.ops.aten.tanh_backward.grad_input(g, a, grad_input=g)


def _sigmoid_backward_(g: torch.Tensor, a: torch.Tensor) -> object:
    return torch.ops.aten.sigmoid_backward.grad_input(g, a, grad_input=g)


#: the activations of the fast path, by module type (others use the generic path); in place, so
#: a layer costs two fresh (rows, width) buffers (Z_k = A_k and Δ_k): large fresh allocations
#: are page-faulted on first touch (docs/platform-notes.md)
ACTIVATIONS: dict[type[torch.nn.Module], Activation] = {
    torch.nn.ReLU: Activation(torch.relu_, _relu_backward_),
    torch.nn.Tanh: Activation(torch.tanh_, _tanh_backward_),
    torch.nn.Sigmoid: Activation(torch.sigmoid_, _sigmoid_backward_),
}
#: layers that are the identity in eval mode
_IDENTITIES = (torch.nn.Identity, torch.nn.Dropout)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One L_k (and the σ_k after it): its weight at ``weight`` in x, its bias at ``bias``."""

    n_out: int
    n_in: int
    weight: int
    bias: int | None
    act: Activation | None


#: the hooks ``Module.__call__`` runs around ``forward`` (and autograd runs around its backward):
#: per module, and global (``torch.nn.modules.module.register_module_forward_hook`` and kin)
_MODULE_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule has a forward, forward-pre, backward or backward-pre
    hook (``register_forward_hook`` and kin), or such a hook is registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and kin). A hook can change
    what a module computes, and the fast path does not call modules (stop 35's audit)."""
    from torch.nn.modules import module as module_mod

    if any(getattr(module_mod, name, None) for name in _GLOBAL_HOOKS):
        return True
    return any(getattr(m, name, None) for m in module.modules() for name in _MODULE_HOOKS)


class SequentialGrads:
    """The per-client losses and gradients of a Linear/activation stack (module docstring).

    The call signatures are those of the generic path's vmapped functions: ``x`` is (d,) (shared)
    or (n, d) (a point per client), ``X`` (n, m, p), ``y`` (n, m, …), ``w`` (n, m).
    """

    def __init__(self, layers: Sequence[_Layer], loss: ModelLoss, d: int) -> None:
        assert loss.output_grad is not None
        self.layers = tuple(layers)
        self.loss = loss
        self._dloss = loss.output_grad
        self.d = d
        self._local = threading.local()  # per thread: the weight gradients' scratch buffers

    @classmethod
    def of(
        cls, module: torch.nn.Module, loss: ModelLoss, sample_shape: Sequence[int] | None
    ) -> SequentialGrads | None:
        """The fast path for ``module``, or None when it is not a plain Linear/activation stack
        on feature vectors (then the generic path applies)."""
        if loss.output_grad is None or type(module) is not torch.nn.Sequential:
            return None
        if has_hooks(module):
            return None  # the passes below are by hand: they would not run the hooks
        if sample_shape is None or len(sample_shape) != 1 or list(module.buffers()):
            return None
        layers: list[_Layer] = []
        expected: list[torch.Tensor] = []
        offset = 0
        for child in module:  # what Sequential.forward runs (children() drops repeats)
            if type(child) is torch.nn.Linear:
                w, b = child.weight, child.bias
                expected += [w] if b is None else [w, b]
                bias = None if b is None else offset + w.numel()
                layers.append(_Layer(w.shape[0], w.shape[1], offset, bias, None))
                offset += w.numel() + (0 if b is None else b.numel())
            elif type(child) in ACTIVATIONS and layers and layers[-1].act is None:
                layers[-1] = dataclasses.replace(layers[-1], act=ACTIVATIONS[type(child)])
            elif type(child) not in _IDENTITIES:
                return None
        params = list(module.parameters())
        if (
            not layers
            or len(params) != len(expected)
            or any(p is not q for p, q in zip(params, expected, strict=True))
            or layers[0].n_in != int(sample_shape[0])
        ):
            return None  # shared layers, or inputs that do not fit (the generic path says why)
        return cls(layers, loss, offset)

    # -- the passes -------------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, X: torch.Tensor) -> list[torch.Tensor]:
        """A_0 = X, A_1, …, A_K, each (n, m, width)."""
        n, m = X.shape[0], X.shape[1]
        acts = [X]
        a = X
        for L in self.layers:
            W = _weight(x, L)
            if x.ndim == 2:
                Wt = W.transpose(1, 2)
                z = (
                    torch.bmm(a, Wt)
                    if L.bias is None
                    else torch.baddbmm(_bias(x, L)[:, None], a, Wt)
                )
            else:
                flat = a.reshape(n * m, L.n_in)
                z2 = flat @ W.t() if L.bias is None else torch.addmm(_bias(x, L), flat, W.t())
                z = z2.view(n, m, L.n_out)
            a = z if L.act is None else L.act.forward_(z)
            acts.append(a)
        return acts

    def _losses(self, out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n, m = w.shape
        per = self.loss.per_sample(out.reshape(n * m, -1), y.reshape(n * m, *y.shape[2:]))
        return (w * per.view(n, m)).sum(dim=1)

    def losses(
        self, x: torch.Tensor, X: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """(n,): f_i."""
        return self._losses(self._forward(x.contiguous(), X)[-1], y, w)

    def grads(
        self,
        x: torch.Tensor,
        X: torch.Tensor,
        y: torch.Tensor,
        w: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        with_loss: bool = False,
    ) -> torch.Tensor:
        """(n, d): row i is ∇f_i (and f_i in a last column with ``with_loss``), written into
        ``out`` when given (any (n, d[+1]) tensor whose rows have unit column stride)."""
        n, m = w.shape
        x = x.contiguous()  # the products round by their operands' layout: the same for every x
        acts = self._forward(x, X)
        h = acts[-1]
        flat_y = y.reshape(n * m, *y.shape[2:])
        delta = self._dloss(h.reshape(n * m, -1), flat_y).view(h.shape) * w[:, :, None]
        res = out
        if res is None:
            res = torch.empty((n, self.d + int(with_loss)), dtype=h.dtype, device=h.device)
        for k in range(len(self.layers) - 1, -1, -1):
            L = self.layers[k]
            if L.act is not None:
                L.act.backward_(delta, acts[k + 1])
            # into a contiguous buffer (kept, :meth:`_scratch`), then copied: a kernel's rounding
            # may depend on the alignment of its output, which for a row of ``res`` depends on
            # the row's index
            size = L.n_out * L.n_in
            dW = torch.bmm(
                delta.transpose(1, 2), acts[k], out=self._scratch((n, L.n_out, L.n_in), h)
            )
            res[:, L.weight : L.weight + size].copy_(dW.view(n, size))
            if L.bias is not None:
                res[:, L.bias : L.bias + L.n_out].copy_(delta.sum(dim=1))
            if k > 0:
                W = _weight(x, L)
                delta = torch.bmm(delta, W) if x.ndim == 2 else delta @ W
        if with_loss:
            res[:, self.d] = self._losses(h, y, w)
        return res

    def _scratch(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``shape`` kept for the next call (one per shape, dtype and device, per
        thread). The weight gradients of all clients grow with n (61 MiB at n = 1000 on a9a),
        and a fresh allocation that large is page-faulted on every call
        (docs/platform-notes.md); a kept one is 64-byte aligned as a fresh one is, so the
        products round the same."""
        bufs: dict[tuple[object, ...], torch.Tensor] = self._local.__dict__.setdefault("bufs", {})
        key = (shape, like.dtype, like.device)
        buf = bufs.get(key)
        if buf is None:
            buf = bufs[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def grads_and_losses(
        self,
        x: torch.Tensor,
        X: torch.Tensor,
        y: torch.Tensor,
        w: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(n, d + 1): the gradients and, in the last column, the losses."""
        return self.grads(x, X, y, w, out=out, with_loss=True)


def _weight(x: torch.Tensor, L: _Layer) -> torch.Tensor:
    """W_k as a view of x: (out, in), or (n, out, in) for a point per client."""
    size = L.n_out * L.n_in
    if x.ndim == 2:
        return x[:, L.weight : L.weight + size].view(x.shape[0], L.n_out, L.n_in)
    return x[L.weight : L.weight + size].view(L.n_out, L.n_in)


def _bias(x: torch.Tensor, L: _Layer) -> torch.Tensor:
    assert L.bias is not None
    return x[..., L.bias : L.bias + L.n_out]
