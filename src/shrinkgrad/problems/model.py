"""Neural networks as problems: n clients of a torch model, the clients on one tensor axis.

:func:`model_problem` turns any ``torch.nn.Module`` h(x; a) and a dataset split over n clients
into the objective of the rest of shrinkgrad (methods.md §1, the [EF21] convention)

    f_i(x) = (1/m_i) Σ_{j ∈ client i} ℓ(h(x; a_j), y_j),        f(x) = (1/n) Σ_i f_i(x),

with ℓ one of :data:`~shrinkgrad.problems.model_losses.LOSSES`. The iterate x is the flat vector
of the model's parameters in ``model.parameters()`` order, the
:func:`torch.nn.utils.parameters_to_vector` convention, so anyone can check a gradient with plain
autograd.

Every oracle is **one batched evaluation**: the clients' samples are padded to one length
(:mod:`~shrinkgrad.problems.model_data`; padded rows have weight 0) and the per-client function
(x, X_i, y_i, w_i) ↦ Σ_j w_ij ℓ(h(x; X_ij), y_ij) is evaluated with
:func:`torch.func.functional_call` under :func:`torch.func.vmap` over the client axis:
``vmap(grad(f_i))`` gives all n gradients at once (x shared: ``client_grads``; one point per
client: ``client_grads_at``), ``vmap(jvp(grad(f_i)))`` the clients' Hessian-vector products
(:meth:`ModelProblem.client_hvps`, used by :func:`~shrinkgrad.problems.estimate_smoothness`).
There is no Python loop over clients; ``batch_size`` only bounds the rows of one batched call
(then the clients are evaluated in a few chunks).

A plain ``Sequential`` of ``Linear`` layers and elementwise activations (the registered ``mlp``)
takes a faster route to the same gradients (:mod:`~shrinkgrad.problems.model_sequential`):
back-propagation by hand, one matrix product per layer over all rows and one ``bmm`` per layer
for the clients' weight gradients, written straight into the (n, d) result
(:attr:`ModelProblem.evaluation` says which route a problem takes; Hessian-vector products
always use ``vmap``).

The model is copied, cast to ``dtype``/``device`` and evaluated in ``eval()`` mode, so f is a
deterministic function of x (dropout off; normalisation layers use their running statistics,
which stay fixed). L and L_i are unknown (``None``; design.md principle 14): numeric step sizes
work for every method, and :func:`~shrinkgrad.problems.estimate_smoothness` estimates local
constants that :meth:`~shrinkgrad.problems.Problem.with_constants` can put on the problem.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import math
import os
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad, grad_and_value, jvp, vmap
from torch.nn.modules import module as torch_module

from .._sums import mean_value
from ..registry import Spec
from ..rng import Keys, bits32_torch
from .base import Problem, digest_arrays
from .datasets import Dataset
from .linear import as_device, as_dtype
from .model_data import (
    ClientBatch,
    ClientGroup,
    HeldOut,
    PreparedData,
    TestArg,
    prepare_data,
)
from .model_losses import LOSSES, ModelLoss, make_loss
from .model_sequential import _GLOBAL_HOOKS, _MODULE_HOOKS, SequentialGrads
from .splits import Split

__all__ = ["ModelProblem", "model_problem"]

#: ``model_problem(evaluation=)``: ``"auto"`` (the fast path where it applies) or ``"vmap"``
EVALUATIONS = ("auto", "vmap")


class _Functional:
    """f_i(x) = Σ_j w_j ℓ(h(x; X_j), y_j) of one client, as a pure function of the flat x, and
    its vmapped transforms (built once, shared by a problem's restrictions and copies)."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss: ModelLoss,
        sample_shape: Sequence[int] | None = None,
        evaluation: str = "auto",
    ) -> None:
        self.module = module
        self.loss = loss
        self.sample_shape = None if sample_shape is None else tuple(sample_shape)
        named = list(module.named_parameters())
        self.names = [k for k, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.buffers = {k: b for k, b in module.named_buffers()}
        self.d = sum(self.sizes)
        fx = self.client_loss
        self.losses_shared: Callable[..., torch.Tensor] = vmap(fx, in_dims=(None, 0, 0, 0))
        self.grads_shared: Callable[..., torch.Tensor] = vmap(grad(fx), in_dims=(None, 0, 0, 0))
        self.grads_each: Callable[..., torch.Tensor] = vmap(grad(fx), in_dims=(0, 0, 0, 0))
        self.grads_and_losses = vmap(grad_and_value(fx), in_dims=(None, 0, 0, 0))
        self.grads_and_losses_flat: Callable[..., torch.Tensor] = self._grads_and_losses_flat
        self.hvps = vmap(self._hvp, in_dims=(None, 0, 0, 0, 0))
        #: the hand-written path of a Linear/activation stack (None: the vmap path above)
        self.fast = (
            SequentialGrads.of(module, loss, self.sample_shape) if evaluation == "auto" else None
        )
        if self.fast is not None:  # one implementation per oracle: the fast one replaces vmap
            self.losses_shared = self.fast.losses
            self.grads_shared = self.grads_each = self.fast.grads
            self.grads_and_losses_flat = self.fast.grads_and_losses

    def width(self, extra: int = 0) -> int | None:
        """The columns of a gradient oracle's output when it writes into a preallocated (n, ·)
        result (the fast path), else None (the generic path returns its own)."""
        return None if self.fast is None else self.d + extra

    def _grads_and_losses_flat(
        self, x: torch.Tensor, X: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """(m, d + 1): each client's gradient and, in the last column, its loss."""
        g, v = self.grads_and_losses(x, X, y, w)
        return torch.cat([g, v[:, None].to(g.dtype)], dim=1)

    def params(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x as the model's named parameters (views of x)."""
        views = torch.split(x, self.sizes)
        return {k: v.view(s) for k, v, s in zip(self.names, views, self.shapes, strict=True)}

    def forward(self, x: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(self.module, (self.params(x), self.buffers), (X,))
        return out

    def client_loss(
        self, x: torch.Tensor, X: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        return (w * self.loss.per_sample(self.forward(x, X), y)).sum()

    def _hvp(
        self, x: torch.Tensor, v: torch.Tensor, X: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        g = grad(self.client_loss)
        tangent: torch.Tensor = jvp(lambda z: g(z, X, y, w), (x,), (v,))[1]
        return tangent


@dataclasses.dataclass(frozen=True)
class _Group:
    """Clients of similar size evaluated together (:class:`~.model_data.ClientGroup`), and the
    layout of their batched calls: ``layout_n`` clients in the full problem's group, this
    problem's at ``slots`` of it (None: all of them, in order)."""

    batch: ClientBatch
    members: torch.Tensor
    layout_n: int
    slots: torch.Tensor | None = None

    @classmethod
    def of(cls, g: ClientGroup) -> _Group:
        return cls(g.batch, g.members, g.batch.n)


class ModelProblem(Problem):
    """f = (1/n) Σ f_i with f_i the mean loss of a torch model on client i's samples.

    Built by :func:`model_problem` (or the registered ``mlp[...]`` / ``cnn[...]``); see the module
    docstring for the definition and the batched evaluation. Beyond :class:`Problem`:
    ``client_hvps`` / ``hvp`` (Hessian-vector products), ``held_out(x)`` (``test_loss`` and, for
    the classification losses, ``test_accuracy`` on the rows kept back), ``parts`` (each client's
    rows of ``data``), ``input_shape`` (of one sample), ``module`` (the evaluated copy of the
    model), ``loss_kind``, ``evaluation``, ``n_test``, ``to()``.
    """

    fresh_grads = True  # every oracle returns the new output of a batched evaluation
    name = "model"

    def __init__(
        self,
        functional: _Functional,
        prepared: PreparedData,
        x0: torch.Tensor,
        *,
        batch_size: int | None,
        name: str,
    ) -> None:
        self._fn = functional
        self._groups = [_Group.of(g) for g in prepared.groups]
        test = prepared.test
        if test is not None and test.rows is None:
            # an own (X, y) pair may still be the caller's memory (a float64 CPU tensor is not
            # copied on the way): the problem keeps its own copy, as it does of the clients' rows
            test = HeldOut(test.X.clone(), test.y.clone(), None)
        self._test = test
        self._x0 = x0
        self.parts = prepared.parts
        self.dataset = prepared.dataset
        self.split = prepared.split
        self.n_classes = prepared.n_classes
        self.name = name
        self.batch_size = _check_batch_size(batch_size)
        self.n = len(prepared.parts)
        self.d = functional.d
        self.dtype = x0.dtype
        self.device = x0.device
        self.client_sizes: torch.Tensor = torch.tensor([p.size for p in self.parts])
        #: the shape of one sample as the model receives it
        self.input_shape: tuple[int, ...] = tuple(self._groups[0].batch.X.shape[2:])
        self.n_samples = int(self.client_sizes.sum())
        self.f_lower = 0.0  # every loss here is ≥ 0
        self.held_out_columns = functional.loss.held_out_columns if self._test is not None else ()
        self._data_digest: str | None = None  # data_digest(), computed on first use
        #: what ``_data_digest`` was computed from (:meth:`data_digest`): recomputed when it changed
        self._digest_key: _DigestKey | None = None

    # -- what the problem is ----------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The evaluated copy of the model (eval mode, the problem's dtype and device)."""
        return self._fn.module

    @property
    def evaluation(self) -> str:
        """How the gradient oracles evaluate: ``"linear_stack"`` (a Sequential of Linear layers
        and activations, back-propagated by hand with per-layer batched products,
        :mod:`~shrinkgrad.problems.model_sequential`) or ``"vmap"`` (any module, ``vmap(grad)``).
        Both compute the same gradients (tested to 1e-12 in float64)."""
        return "vmap" if self._fn.fast is None else "linear_stack"

    @property
    def loss_kind(self) -> str:
        return self._fn.loss.name

    @property
    def n_test(self) -> int:
        """The number of held-out samples (0 without a held-out part)."""
        return 0 if self._test is None else self._test.size

    def x0(self) -> torch.Tensor:
        """The model's parameters as given (flat, parameters() order): the network's init."""
        return self._x0.clone()

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(
            {
                "split": self.split,
                "loss": self.loss_kind,
                "model": type(self.module).__name__,
                "n_samples": self.n_samples,
                "n_test": self.n_test,
                "dtype": str(self.dtype).replace("torch.", ""),
            }
        )
        spec = getattr(self, "spec", None)
        if spec:
            out["spec"] = spec
        return out

    def data_digest(self) -> str:
        """SHA-1 hex digest of what defines f beyond x and ``info()`` (:meth:`Problem.data_digest`):
        each client group's members, sizes, inputs and targets (padded as evaluated; so every
        client's samples, in order), the held-out inputs and targets (they define the held-out
        columns), the model's buffers (running statistics: not part of x⁰), its printed form
        (``repr``: the layers, activations and their settings) and, where torch's ``repr`` does
        not see them, the model's own code and settings (:func:`model_definition`): the code of
        every method of a module class defined outside torch and shrinkgrad (a custom
        ``forward``), the public attributes of such modules (``self.scale = 2.0``, a plain
        tensor), hooks, and a loss that is not the registered one of its name (a
        :class:`~.model_losses.ModelLoss` of your own: its functions' code). Hashed in the
        problem's dtype, which the fingerprint records too (a problem built in float32 and one
        moved there with :meth:`to` hold the same values); the device does not matter.

        Computed on first use and kept while nothing it was computed from changed: every hashed
        tensor is checked by identity and by its version counter (torch counts every in-place
        change: ``p.module[0].running_mean.add_(1)``), and the code and settings are read again
        (a few μs for a small model), so a problem changed after its first digest gets the
        digest of what it now is. Code a method calls outside its class (a module-level function)
        is not seen: give such a problem its own ``name`` when that code changes."""
        data: list[tuple[str, torch.Tensor | None]] = []
        for k, g in enumerate(self._groups):
            data += [
                (f"group{k}.members", g.members),
                (f"group{k}.sizes", g.batch.sizes),
                (f"group{k}.X", g.batch.X),
                (f"group{k}.y", g.batch.y),
            ]
        t = self._test
        data += [("test", None)] if t is None else [("test.X", t.X), ("test.y", t.y)]
        # the buffers as evaluated (functional_call's, taken when the problem was built)
        data += [(f"buffer.{k}", b) for k, b in self._fn.buffers.items()]
        # the architecture beyond its class name (info()'s "model"): the layers and their
        # settings as torch prints them, e.g. Tanh against ReLU between equal Linear layers;
        # then what repr does not show (only when there is some: a model of torch's layers
        # with a registered loss keeps the digest it had before these entries existed)
        definition, attributes = model_definition(self.module, self._fn.loss)
        key = _DigestKey.of([v for _, v in data + attributes], definition)
        digest: str | None = getattr(self, "_data_digest", None)
        cached: _DigestKey | None = getattr(self, "_digest_key", None)
        if digest is not None and cached is not None and cached.matches(key):
            return digest
        digest = digest_arrays([*data, *definition, *attributes])
        self._data_digest, self._digest_key = digest, key
        return digest

    def __repr__(self) -> str:
        consts = "L unknown" if self.L is None else f"L={self.L:.4g}"
        if self.constants_estimated:
            consts += " (estimated)"
        return (
            f"<problem {self.name} on {self.dataset or 'data'}: n={self.n} clients, d={self.d}, "
            f"N={self.n_samples} (+{self.n_test} held out), loss={self.loss_kind}, "
            f"split={self.split or '?'}, {consts}>"
        )

    # -- input checks (Problem's shared ones) ----------------------------------------------------
    def _point(self, x: torch.Tensor, what: str = "x") -> torch.Tensor:
        return self.check_point(x, what, hint=f"the model's {self.d} parameters")

    def _points(self, X: torch.Tensor) -> torch.Tensor:
        return self.check_points(X)

    # -- batched evaluation -----------------------------------------------------------------------
    def _calls(
        self, group: _Group, rows_per_client: int
    ) -> list[tuple[slice | torch.Tensor, torch.Tensor | None, int]]:
        """The batched calls of a group: (its clients in the call, their slots, the call's size).

        A group is evaluated in chunks of at most ``batch_size`` padded rows (one chunk without
        ``batch_size``). A restricted problem keeps the layout of the problem it was cut from:
        each call has the shape of the full problem's chunk, with this problem's clients in their
        original slots (the other slots hold copies), because batched kernels round differently
        for different shapes; so each client's rows are computed exactly as there.
        """
        n_layout = group.layout_n
        per = n_layout if self.batch_size is None else max(1, self.batch_size // rows_per_client)
        if group.slots is None:
            n = group.batch.n
            return [(slice(s, min(s + per, n)), None, 0) for s in range(0, n, per)]
        chunk = group.slots // per
        out: list[tuple[slice | torch.Tensor, torch.Tensor | None, int]] = []
        for k in torch.unique(chunk).tolist():
            own = torch.nonzero(chunk == k).reshape(-1)
            out.append((own, group.slots[own] - k * per, min(per, n_layout - k * per)))
        return out

    def _batched(
        self,
        fn: Callable[..., torch.Tensor],
        x: torch.Tensor,
        batches: list[ClientBatch] | None = None,
        *extra: torch.Tensor,
        width: int | None = None,
    ) -> torch.Tensor:
        """Rows i of ``fn(x_i, *extra_i, X_i, y_i, w_i)`` over the groups' batched calls.

        ``x`` is (d,) (shared) or (n, d) (a point per client); ``batches`` replace the groups'
        samples (minibatches), ``extra`` are further (n, …) per-client arguments. With ``width``
        (``fn`` then takes ``out=``) the (n, width) result is allocated once and every call of a
        group of consecutive clients writes its rows into it directly; other results are placed
        by one indexed copy.
        """
        per_client = x.ndim == 2
        data = [g.batch for g in self._groups] if batches is None else batches
        final = None
        if width is not None:
            final = torch.empty((self.n, width), dtype=self.dtype, device=self.device)
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (clients, their rows) to place
        for group, batch in zip(self._groups, data, strict=True):
            rows = group.members.to(self.device)
            mine = ((x[rows],) if per_client else ()) + tuple(e[rows] for e in extra)
            tensors = (*mine, batch.X, batch.y, batch.w)
            calls = self._calls(group, batch.m_pad)
            first = _first_if_consecutive(group.members)
            for own, slots, size in calls:
                if slots is None and len(calls) == 1:
                    args = list(tensors)
                elif slots is None:
                    # fresh (aligned) copies: kernels' rounding can depend on the alignment of
                    # their inputs, and a restricted problem's calls are fresh buffers too
                    args = [t[own].clone() for t in tensors]
                else:
                    args = [_place(t, own, slots, size) for t in tensors]
                call = tuple(args) if per_client else (x, *args)
                if final is not None and slots is None and first is not None:
                    assert isinstance(own, slice)
                    fn(*call, out=final[first + own.start : first + own.stop])
                    continue
                res = fn(*call)
                pieces.append((group.members[own], res if slots is None else res[slots]))
        if final is None:
            whole = len(pieces) == 1 and pieces[0][0].numel() == self.n
            if whole and _first_if_consecutive(pieces[0][0]) == 0:
                return pieces[0][1]  # one call for all clients in order: its own result
            first_res = pieces[0][1]
            final = torch.empty(
                (self.n, *first_res.shape[1:]), dtype=first_res.dtype, device=self.device
            )
        for members, res in pieces:
            final[members.to(self.device)] = res
        return final

    # -- oracles ----------------------------------------------------------------------------------
    def client_losses(self, x: torch.Tensor) -> torch.Tensor:
        """(n,): f_i(x)."""
        with torch.no_grad():
            return self._batched(self._fn.losses_shared, self._point(x))

    def loss(self, x: torch.Tensor) -> float:
        """f(x) = (1/n) Σ_i f_i(x) (in float64, the clients in order: ``shrinkgrad._sums``)."""
        return mean_value(self.client_losses(x))

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d): row i is ∇f_i(x), one batched ``vmap(grad)`` evaluation."""
        return self._batched(self._fn.grads_shared, self._point(x), width=self._fn.width())

    def client_grads_and_losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(client_grads(x), client_losses(x)) from one pass (the forward of the gradient)."""
        x = self._point(x)
        both = self._batched(self._fn.grads_and_losses_flat, x, width=self._fn.width(1))
        return both[:, : self.d].contiguous(), both[:, self.d].contiguous()

    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor:
        """(n, d): row i is ∇f_i(X[i]) (a point per client: stale gradients, the PS)."""
        return self._batched(self._fn.grads_each, self._points(X), width=self._fn.width())

    def client_stoch_grads(
        self, X: torch.Tensor, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> torch.Tensor:
        """Row i averages ∇ℓ over b_i of client i's m_i samples, without replacement.

        The draw is the linear problems' (docs/problems.md §5): sample j of client i (its j-th
        row) gets the keyed uniform ``keys[i]`` at counter j and the b_i smallest win, so client
        i's minibatch depends only on ``keys[i]``. ``X`` is (d,) or (n, d); b_i = m_i gives the
        exact gradients. The estimator is unbiased: E ĝ_i = ∇f_i.
        """
        shared = isinstance(X, torch.Tensor) and X.shape == (self.d,)
        x = self._point(X) if shared else self._points(X)
        b = self._batch_sizes(batch_sizes)
        if bool((b == self.client_sizes).all()):
            return self.client_grads(x) if shared else self.client_grads_at(x)
        keys = keys.expand((self.n,)).to(self.device)
        batches = [self._minibatch(g.batch, b[g.members], keys[g.members]) for g in self._groups]
        fn = self._fn.grads_shared if shared else self._fn.grads_each
        return self._batched(fn, x, batches, width=self._fn.width())

    def _minibatch(self, data: ClientBatch, b: torch.Tensor, keys: Keys) -> ClientBatch:
        """A group's minibatches: client i's b_i rows with the smallest keyed uniforms."""
        dev = self.device
        j = torch.arange(data.m_pad, device=dev)
        u = bits32_torch(keys.lo[:, None], keys.hi[:, None], j[None, :]).to(torch.float64)
        sizes = data.sizes.to(dev)
        u = u.masked_fill(j[None, :] >= sizes[:, None], math.inf)  # padding never wins
        b_max = int(b.max())
        sel = torch.argsort(u, dim=1, stable=True)[:, :b_max]
        rows = torch.arange(data.n, device=dev)[:, None]
        bd = b.to(dev)
        w = (torch.arange(b_max, device=dev)[None, :] < bd[:, None]).to(self.dtype)
        w = w / bd[:, None].to(self.dtype)
        return ClientBatch(data.X[rows, sel], data.y[rows, sel], w, b.clone())

    def _batch_sizes(self, batch_sizes: torch.Tensor | int) -> torch.Tensor:
        return self.check_batch_sizes(batch_sizes, self.client_sizes)

    def client_hvps(self, x: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        """(n, d): row i is ∇²f_i(x) V[i] (forward-over-reverse: ``jvp`` of ``grad``, vmapped).

        ``V`` is (n, d), or (d,) for the same direction at every client.
        """
        x = self._point(x)
        if not isinstance(V, torch.Tensor) or V.shape not in ((self.d,), (self.n, self.d)):
            raise ValueError(f"V must have shape ({self.n}, {self.d}) or ({self.d},)")
        V = self.check_finite(V.detach().to(device=self.device, dtype=self.dtype), "V")
        with warnings.catch_warnings():  # torch.func.jvp's internals call torch.jit.script
            warnings.filterwarnings("ignore", ".*torch.jit.script.*", DeprecationWarning)
            return self._batched(self._fn.hvps, x, None, V.expand(self.n, self.d))

    def hvp(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """∇²f(x) v = (1/n) Σ_i ∇²f_i(x) v."""
        return self.client_hvps(x, v).mean(dim=0)

    # -- held-out metrics -------------------------------------------------------------------------
    def held_out(self, x: torch.Tensor) -> dict[str, float]:
        """``test_loss`` (mean ℓ over the held-out samples) and, for cross-entropy and the
        logistic loss, ``test_accuracy`` (fraction predicted correctly) at x; {} without a
        held-out part."""
        if self._test is None:
            return {}
        x = self._point(x)
        t, loss = self._test, self._fn.loss
        step = t.size if self.batch_size is None else max(1, self.batch_size)
        total, correct = 0.0, 0
        with torch.no_grad():
            for s in range(0, t.size, step):
                out = self._fn.forward(x, t.X[s : s + step])
                y = t.y[s : s + step]
                total += float(loss.per_sample(out, y).double().sum())
                if loss.correct is not None:
                    correct += int(loss.correct(out, y).sum())
        metrics = {"test_loss": total / t.size}
        if loss.correct is not None:
            metrics["test_accuracy"] = correct / t.size
        return metrics

    # -- restriction and conversion ---------------------------------------------------------------
    def restrict(self, ids: torch.Tensor) -> ModelProblem:
        """The problem of the clients ``ids`` alone (:meth:`Problem.restrict`), exact to the bit.

        The result holds only these clients' samples, but evaluates them in this problem's
        batched layout (:meth:`_calls`): the rounding of batched kernels (matrix
        products, convolutions) depends on the batch's shape, so each evaluation has the shape of
        the full problem's chunk holding the clients. A call therefore costs up to one chunk of
        the full problem: set ``batch_size`` to bound it. Minibatch gradients are exact when the
        restricted clients' largest batch size is their chunk's (always with one b for all).
        ``L_i`` (when set) is restricted, ``L`` becomes unknown (that of the subset's average is
        not the full problem's); the held-out part is shared.
        """
        idx = torch.as_tensor(ids).detach().cpu().reshape(-1)
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"client ids must be integers, got {idx.dtype}")
        if idx.numel() == 0:
            raise ValueError("restrict needs at least one client id")
        if int(idx.min()) < 0 or int(idx.max()) >= self.n:
            raise ValueError(f"client ids must lie in [0, n={self.n})")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("client ids must be distinct")
        idx = idx.to(torch.int64)
        out = copy.copy(self)
        groups = []
        for g in self._groups:  # new client j is old client idx[j]; keep each group's layout
            where = torch.nonzero(torch.isin(idx, g.members)).reshape(-1)
            if where.numel() == 0:
                continue
            pos = torch.searchsorted(g.members, idx[where])  # positions within the group
            slots = pos if g.slots is None else g.slots[pos]
            groups.append(_Group(g.batch.subset(pos), where, g.layout_n, slots.clone()))
        out._groups = groups
        out.parts = [self.parts[i] for i in idx.tolist()]
        out.n = int(idx.numel())
        out.client_sizes = self.client_sizes[idx].clone()
        out.n_samples = int(out.client_sizes.sum())
        out.L = None
        out.L_i = None if self.L_i is None else self.L_i[idx].clone()
        out._data_digest = None  # other clients: another digest
        return out

    def to(
        self, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
    ) -> ModelProblem:
        """The same problem with its model and data in ``dtype`` on ``device``."""
        dt = self.dtype if dtype is None else as_dtype(dtype)
        dev = self.device if device is None else as_device(device)
        out = copy.copy(self)
        module = copy.deepcopy(self.module).to(device=dev, dtype=dt)
        fn = self._fn
        out._fn = _Functional(
            module, fn.loss, fn.sample_shape, "auto" if fn.fast is not None else "vmap"
        )
        out._groups = [dataclasses.replace(g, batch=g.batch.to(dt, dev)) for g in self._groups]
        out._test = None if self._test is None else self._test.to(dt, dev)
        out._x0 = self._x0.to(device=dev, dtype=dt)
        out.dtype, out.device = dt, dev
        if dt != self.dtype:  # the values are rounded to the new dtype; a move keeps them
            out._data_digest = None
        return out


def _first_if_consecutive(members: torch.Tensor) -> int | None:
    """The first of ``members`` (increasing) when they are consecutive integers, else None."""
    first, last = int(members[0]), int(members[-1])
    return first if last - first + 1 == members.numel() else None


def _place(
    t: torch.Tensor, own: slice | torch.Tensor, slots: torch.Tensor, size: int
) -> torch.Tensor:
    """A call's batch of ``size`` slots: rows ``own`` of ``t`` at ``slots``, copies elsewhere."""
    rows = t[own]
    buf = rows[:1].expand(size, *t.shape[1:]).clone()
    buf[slots.to(t.device)] = rows
    return buf


def _check_batch_size(batch_size: int | None) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size (the most samples of one batched evaluation) must be a positive integer "
            f"or None (all at once), got {batch_size!r}"
        )
    return batch_size


# --------------------------------------------------------------------------------------------
# what defines f beyond the data (ModelProblem.data_digest)
# --------------------------------------------------------------------------------------------
#: packages whose module classes are identified by torch's ``repr`` (their code is the installed
#: version's); the code of a module class from anywhere else is hashed (:func:`model_definition`)
_LIBRARY_MODULES = ("torch", "shrinkgrad")

#: how deep :func:`_describe` follows containers, closures and objects (cycles end there)
_DESCRIBE_DEPTH = 4


def _is_user_class(cls: type) -> bool:
    """Whether ``cls`` is defined outside torch and shrinkgrad (the user's code)."""
    module = str(getattr(cls, "__module__", "") or "")
    return module.split(".", 1)[0] not in _LIBRARY_MODULES


def _const_repr(value: Any) -> str:
    """A code constant as text that does not depend on the process (a frozenset's order does:
    string hashing is salted per process)."""
    if isinstance(value, frozenset):
        return "frozenset(" + ",".join(sorted(_const_repr(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(_const_repr(v) for v in value) + ")"
    return repr(value)


def _hash_code(code: types.CodeType, h: Any) -> None:
    """Feed ``code`` to ``h``: its bytecode, names and constants (nested code objects too), not
    its file name or line numbers (moving a class in its file keeps its digest)."""
    h.update(code.co_code)
    names = (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
    h.update(repr(names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _hash_code(c, h)
        else:
            h.update(_const_repr(c).encode())


def _describe_function(fn: types.FunctionType, depth: int) -> str:
    """A Python function: its qualified name and a hash of its code, defaults and closure."""
    h = hashlib.sha1()
    _hash_code(fn.__code__, h)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_describe(cell.cell_contents, depth - 1))
        except ValueError:  # a cell not filled yet
            cells.append("<empty>")
    parts = [_describe(fn.__defaults__, depth - 1), _describe(fn.__kwdefaults__, depth - 1), *cells]
    h.update("|".join(parts).encode())
    return f"{fn.__qualname__}:{h.hexdigest()}"


def _describe_class(cls: type, depth: int) -> str:
    """The code of every function defined in ``cls`` (methods, static and class methods,
    properties), by name."""
    out = []
    for name, attr in sorted(vars(cls).items()):
        fns = [attr.fget, attr.fset] if isinstance(attr, property) else [attr]
        fns = [f.__func__ if isinstance(f, (staticmethod, classmethod)) else f for f in fns]
        out += [
            f"{name}={_describe_function(f, depth)}"
            for f in fns
            if isinstance(f, types.FunctionType)
        ]
    return f"class {cls.__qualname__}{{{';'.join(out)}}}"


def _describe(value: Any, depth: int = _DESCRIBE_DEPTH) -> str:
    """``value`` as text that is the same in every process for the same definition: scalars
    and strings by ``repr``, containers item by item, functions by name and code
    (:func:`_describe_function`), arrays by a hash of their bytes, an object of a user class by
    its class's code and public attributes; anything else by its type's name."""
    if depth < 0:
        return "..."
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)):
        inner = ",".join(_describe(v, depth - 1) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, (set, frozenset)):
        return (
            f"{type(value).__name__}("
            + ",".join(sorted(_describe(v, depth - 1) for v in value))
            + ")"
        )
    if isinstance(value, dict):
        items = sorted((repr(k), _describe(v, depth - 1)) for k, v in value.items())
        return "dict(" + ",".join(f"{k}:{v}" for k, v in items) + ")"
    if isinstance(value, torch.Tensor | np.ndarray):
        return "array:" + digest_arrays([("value", value)])
    if isinstance(value, types.FunctionType):
        return _describe_function(value, depth)
    if isinstance(value, types.MethodType):
        return "method " + _describe(value.__func__, depth)
    if isinstance(value, functools.partial):
        args = _describe((value.func, value.args, value.keywords), depth - 1)
        return f"partial{args}"
    if isinstance(value, torch.nn.Module):
        return f"module {value!r}"
    cls = type(value)
    module = getattr(value, "__module__", None) or cls.__module__
    name = f"{module}.{getattr(value, '__qualname__', None) or cls.__qualname__}"
    if isinstance(value, type) or not _is_user_class(cls):
        return name  # a class, or a builtin such as torch.tanh: its name
    public = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    return f"{_describe_class(cls, depth - 1)}{_describe(public, depth - 1)}"


def model_definition(
    module: torch.nn.Module, loss: ModelLoss
) -> tuple[list[tuple[str, str]], list[tuple[str, torch.Tensor]]]:
    """What defines a model problem's f beyond its data and parameters: labelled text entries
    and the tensors among the modules' attributes (:meth:`ModelProblem.data_digest`).

    The first entry is ``repr(module)`` (torch's layers show their settings there). The others
    exist only where they say something ``repr`` does not: for each module class defined
    outside torch and shrinkgrad, the code of its methods (``forward`` and what it calls on
    ``self``; :func:`_describe_class`) and the public attributes of its instances (a number, a
    string, a function; tensors are returned apart, to be hashed with the data); the hooks of
    any module (forward, backward and their pre-hooks) and those registered for all modules;
    the loss when it is not the registered loss of its name (its formula and the code of its
    functions).
    """
    definition = [("module", repr(module))]
    attributes: list[tuple[str, torch.Tensor]] = []
    classes: dict[type, str] = {}
    for path, m in module.named_modules():
        where = path or "<root>"
        for cls in type(m).__mro__:
            if cls is torch.nn.Module or not issubclass(cls, torch.nn.Module):
                continue
            if _is_user_class(cls) and cls not in classes:
                classes[cls] = _describe_class(cls, _DESCRIBE_DEPTH)
        if _is_user_class(type(m)):
            settings: list[str] = []
            for k, v in sorted(vars(m).items()):
                if k.startswith("_") or k == "training":
                    continue
                if isinstance(v, torch.Tensor):
                    attributes.append((f"module.{where}.{k}", v))
                else:
                    settings.append(f"{k}={_describe(v)}")
            if settings:
                definition.append((f"module.{where}.settings", ";".join(settings)))
        hooks = {name: list(getattr(m, name, {}).values()) for name in _MODULE_HOOKS}
        if any(hooks.values()):
            definition.append((f"module.{where}.hooks", _describe(hooks)))
    definition += [(f"code.{cls.__qualname__}", text) for cls, text in classes.items()]
    every = {name: list(getattr(torch_module, name, {}).values()) for name in _GLOBAL_HOOKS}
    if any(every.values()):  # hooks registered for all modules
        definition.append(("hooks", _describe(every)))
    if LOSSES.get(loss.name) is not loss:
        fields = {f.name: getattr(loss, f.name) for f in dataclasses.fields(loss)}
        definition.append(("loss", _describe(fields)))
    return definition, attributes


def _version(t: torch.Tensor | None) -> int | None:
    """The version counter of ``t`` (bumped by every in-place change), None when it has none
    (an inference-mode tensor)."""
    if t is None:
        return -1
    try:
        return int(t._version)
    except RuntimeError:
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class _DigestKey:
    """What a model problem's digest was computed from: the hashed tensors (by identity) with
    their version counters, and the text entries of :func:`model_definition` (compared by
    :meth:`matches`: ``==`` on tuples of tensors would compare their entries)."""

    tensors: tuple[torch.Tensor | None, ...]
    versions: tuple[int | None, ...]
    definition: tuple[tuple[str, str], ...]

    @classmethod
    def of(
        cls, tensors: Sequence[torch.Tensor | None], definition: Sequence[tuple[str, str]]
    ) -> _DigestKey:
        return cls(tuple(tensors), tuple(_version(t) for t in tensors), tuple(definition))

    def matches(self, other: _DigestKey) -> bool:
        """Whether a digest computed from ``self`` is that of ``other`` (an untracked version
        counter never matches)."""
        return (
            len(self.tensors) == len(other.tensors)
            and all(a is b for a, b in zip(self.tensors, other.tensors, strict=True))
            and None not in self.versions
            and self.versions == other.versions
            and self.definition == other.definition
        )


# --------------------------------------------------------------------------------------------
# the factory
# --------------------------------------------------------------------------------------------
def model_problem(
    model: torch.nn.Module,
    data: str | os.PathLike[str] | Dataset | tuple[Any, Any],
    *,
    n_clients: int | None = None,
    split: str | Spec | Split | Sequence[Any] = "contiguous",
    loss: str | ModelLoss = "cross_entropy",
    batch_size: int | None = None,
    seed: int = 0,
    test: TestArg = 0.2,
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    input_shape: Sequence[int] | None = None,
    name: str | None = None,
    evaluation: str = "auto",
) -> ModelProblem:
    """A torch model on a dataset split over clients, as a :class:`~shrinkgrad.problems.Problem`.

    ``model``: any ``torch.nn.Module`` mapping a batch of inputs (m, …) to outputs (m, …); it is
    copied (the original is not touched), cast to ``dtype``/``device`` and evaluated in eval
    mode; its current parameters are the starting point ``x0()``. ``data``: a bundled dataset
    name ("a9a", "digits", ...), a LIBSVM path, a :class:`~shrinkgrad.problems.Dataset`, or an
    ``(X, y)`` pair of arrays or tensors. ``split``/``n_clients``: a split name
    (``"contiguous"``, ``"by_label"``, ``"dirichlet[alpha=0.5]"``, ...) with the number of
    clients, or explicit per-client lists of rows of ``data`` (n implied). ``loss``:
    ``"cross_entropy"``, ``"logistic"`` or ``"mse"``. ``test``: the held-out part: a fraction
    (seeded by ``seed``; default 0.2), explicit row indices, an ``(X, y)`` pair, or ``None``/0.
    ``input_shape``: the shape one sample is given to the model in (e.g. ``(1, 8, 8)`` for a CNN
    on digits; default: as stored). ``batch_size``: the most samples one batched evaluation
    holds (memory; default all). ``evaluation``: ``"auto"`` (a Sequential of Linear layers and
    activations takes the hand-written back-propagation, any other module ``vmap(grad)``) or
    ``"vmap"`` (always the generic path: the same gradients to round-off, e.g. to check or time
    the fast one); :attr:`ModelProblem.evaluation` says which one a problem uses.

    Example::

        net = torch.nn.Sequential(torch.nn.Linear(123, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
        p = model_problem(net, "a9a", n_clients=20, split="by_label")
        G = p.client_grads(p.x0())            # (20, 8066), one vmap(grad) evaluation
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if evaluation not in EVALUATIONS:
        raise ValueError(
            f"evaluation must be one of {', '.join(map(repr, EVALUATIONS))}, got {evaluation!r}"
        )
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters: there is nothing to optimise")
    if any(not p.dtype.is_floating_point for p in params):
        raise TypeError("every parameter of the model must be a floating-point tensor")
    dt, dev = as_dtype(dtype), as_device(device)
    lf = make_loss(loss)
    prepared = prepare_data(
        data,
        loss=lf,
        n_clients=n_clients,
        split=split,
        test=test,
        seed=seed,
        input_shape=input_shape,
        dtype=dt,
        device=dev,
    )
    module = copy.deepcopy(model).to(device=dev, dtype=dt).eval()
    for pname, p in module.named_parameters():
        p.requires_grad_(False)
        if not bool(torch.isfinite(p).all()):  # x0 itself: no run could start from it
            raise ValueError(
                f"the model's parameter {pname!r} has non-finite entries (NaN or inf): x0 is "
                "the model's parameters; initialise them with finite values"
            )
    fn = _Functional(module, lf, tuple(prepared.groups[0].batch.X.shape[2:]), evaluation)
    x0 = torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()
    _check_forward(fn, x0, prepared.groups, input_shape, prepared.test)
    return ModelProblem(
        fn, prepared, x0, batch_size=batch_size, name=name or type(model).__name__.lower()
    )


def _check_forward(
    fn: _Functional,
    x0: torch.Tensor,
    groups: Sequence[ClientGroup],
    input_shape: Sequence[int] | None,
    test: HeldOut | None = None,
) -> None:
    """Run the model on two samples: a clear error when it does not fit the data or the loss
    (the held-out labels included: a class beyond the model's outputs would fail every
    ``held_out`` evaluation later)."""
    X, y = groups[0].batch.X[0, :2], groups[0].batch.y[0, :2]
    try:
        with torch.no_grad():
            out = fn.forward(x0, X)
    except Exception as e:  # the user's model: any error means "does not fit the data"
        hint = "" if input_shape is not None else "; image data may need input_shape=(C, H, W)"
        raise ValueError(
            f"the model fails on a batch of inputs of shape {tuple(X.shape)}: "
            f"{type(e).__name__}: {e}{hint}"
        ) from None
    why = fn.loss.check_output(tuple(out.shape), tuple(y.shape))
    if why is not None:
        raise ValueError(f"the model's output does not fit the loss: {why}")
    if fn.loss.name == "cross_entropy" and not y.dtype.is_floating_point:
        classes = max(int(g.batch.y.max()) for g in groups) + 1
        if out.shape[1] < classes:
            raise ValueError(
                f"the model has {out.shape[1]} outputs but the labels have {classes} classes"
            )
        if test is not None and test.size and not test.y.dtype.is_floating_point:
            lo, hi = int(test.y.min()), int(test.y.max())
            if lo < 0 or hi >= out.shape[1]:
                raise ValueError(
                    f"the held-out labels run from {lo} to {hi}, but the model's {out.shape[1]} "
                    f"outputs are the classes 0..{out.shape[1] - 1}: give test labels in that "
                    "range (or a model with more outputs)"
                )
