"""The compressor abstraction: an operator that carries its maths.

A compressor ``C`` maps a tensor of shape ``(..., d)`` to a tensor of the same shape and dtype,
row by row (the leading axes are clients, buckets, ...). It declares

* ``kind``: ``"unbiased"`` — E[C(x)] = x and E‖C(x) − x‖² ≤ ω‖x‖² ([K18] Def. 1, where ω is
  called β) — or ``"contractive"`` — E‖C(x) − x‖² ≤ (1 − α)‖x‖², α ∈ (0, 1] ([EF21] Def. 1);
* ``omega(d)`` / ``alpha(d)``: the constants as functions of the dimension. An unbiased compressor
  also reports ``alpha(d) = 1/(1 + ω)``, the constant of its scaled version C/(1 + ω)
  (methods.md §2, "Conversion");
* ``bits(d, dtype)``: the exact size in bits of one encoded message (values, indices, norms,
  scales) whose values travel in ``dtype`` (16-bit values count 16 bits; per-message scalars
  such as norms stay float32 for 16-bit inputs), and ``paper_bits(d, dtype)``: the papers'
  convention (32 bits per sent float, 16 for a 16-bit wire, indices free);
* ``collective``: ``"allreduce"`` when the compressed results of several ranks can be summed as
  dense tensors, ``"allgather"`` when the payload is sparse or packed.

Randomness is explicit: ``C(x, keys)`` takes one :class:`~shrinkgrad.rng.Keys` per row, so a draw
is a function of (seed, round, client) only. ``C.compress(x, seed=...)`` is the convenience form:
a random compressor needs the seed (a fixed default would repeat one "random" draw on every
call), and the rows of a batch are clients 0, 1, … (each its own draw) unless ``client=`` says
otherwise. ``C(x, keys, out=buf)`` writes into a preallocated tensor.

Dtypes: float32 and float64 inputs are compressed in their own precision; bfloat16 and float16
inputs (:attr:`Compressor.half_precision`) in float32 arithmetic (norms, thresholds, SVDs),
with the output rounded to the input dtype once at the end, and their message carries the
values in 16 bits. Constant functions (``omega``, ``alpha``, ``bits``, ...) check their ``d``.

Stateful compressors (``stateful = True``: PowerSGD's previous Q) keep explicit state between
calls: ``init_state`` / ``step`` (:mod:`.lowrank`); the methods that carry it (EF21, EF) keep
it in their client state, so that checkpoints stay exact. ``C(x, keys)`` of such a compressor
is its first step from the keyed initial state.

Wire format: ``encode(x, keys)`` gives a ``uint8`` payload of exactly ⌈bits/8⌉ bytes (a sequence of
bit fields, :mod:`._wire`) and ``decode(payload, d, dtype, keys)`` the dense compressed vector,
bit-identical to ``C(x, keys)``; both take ``out=`` (a preallocated payload buffer / vector).
Sparse messages (:attr:`Compressor.sparse_message`) have a sparse form ``C.sparse(x, keys) ->
(indices, values)`` that never builds the dense compressed tensor (the wire format encodes from
it), and can be read back as (index, value) pairs (``decode_sparse``). Fixed-size sparsifiers
(``sparse_k(d)`` not None) also expose their chosen indices and values (``_select``) and index
fields, which ``compose`` uses.

Implementations: a torch path (any device) defines every operator; on CPU numba kernels
(:mod:`._kernels`; for the wire format :mod:`._wire` and :mod:`._codec`) compute the same
output faster (see :data:`KERNELS`).
"""

from __future__ import annotations

import abc
import functools
import os
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from ..registry import Registry
from ..rng import Keys
from ._wire import (
    HALF_DTYPES,
    WIRE_DTYPES,
    BitReader,
    BitWriter,
    pack_pairs,
    unpack_pairs,
    value_range_error,
)

__all__ = [
    "COMPRESSORS",
    "Collective",
    "Compressor",
    "ConstantUnknownError",
    "Kind",
    "Sparsifier",
    "check_dimension",
    "make_compressor",
]

#: Which implementation runs on CPU tensors: "auto" and "numba" (the numba kernels) or "torch"
#: (always the reference path). The environment variable ``SHRINKGRAD_KERNELS`` sets the
#: initial value.
KERNELS: str = os.environ.get("SHRINKGRAD_KERNELS", "auto")

Kind = Literal["unbiased", "contractive"]
#: "allreduce": dense results summable; "allgather": packed or sparse payloads;
#: "allreduce_factors": low-rank factors summed stage by stage (PowerSGD, :mod:`.lowrank`)
Collective = Literal["allreduce", "allgather", "allreduce_factors"]

#: the dtypes compressors compute in (16-bit inputs are computed in float32)
FLOAT_DTYPES = (torch.float32, torch.float64)


class ConstantUnknownError(ValueError):
    """A compressor has no worst-case constant (PowerSGD's α): the unknown constant is a state
    (design.md principle 14): numeric step sizes work, ``"theory"`` refuses with this message
    unless the constant is given explicitly."""


def check_dimension(d: object, where: str) -> int:
    """``d`` as an int, or a one-line error saying what is wrong with it (``alpha(-3)``)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        raise TypeError(f"{where}: d is the vector length, a positive integer; got {d!r}")
    if d < 1:
        raise ValueError(f"{where}: d is the vector length, a positive integer; got {d}")
    return int(d)


#: the methods whose first argument is the dimension d (validated for every compressor)
_D_METHODS = ("omega", "alpha", "bits", "paper_bits", "index_bits", "sparse_k")


def _checking_d(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Compressor, d: object, *args: Any, **kwargs: Any) -> Any:
        return fn(self, check_dimension(d, f"{self.name}.{name}(d)"), *args, **kwargs)

    wrapper._checks_d = True  # type: ignore[attr-defined]
    return wrapper


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(t).removeprefix("torch.") for t in dtypes)


class Compressor(abc.ABC):
    """Base class of every compression operator (see the module docstring for the contract).

    Subclasses implement :meth:`_apply` (and usually :meth:`encode` / :meth:`decode`), set the
    class attributes, and define :meth:`omega` (unbiased) or :meth:`alpha` (contractive).
    """

    __registry__: ClassVar[Registry[Compressor]]

    #: canonical name, e.g. ``"qsgd[s=4]"``; set by the registry when built from a name
    spec: str = ""
    kind: Kind = "contractive"
    #: True when the output is a function of ``x`` alone (no keys needed)
    deterministic: bool = False
    #: True when C(t·x) = t·C(x) for every t > 0 with the same randomness (Top-k, rand-k, ...)
    positively_homogeneous: bool = False
    collective: Collective = "allgather"
    #: human-readable formulas shown by ``shrinkgrad list compressors``
    constant_formula: ClassVar[str] = ""
    bits_formula: ClassVar[str] = ""
    #: True when C(x) = x ⊙ m for a (possibly random) 0/1 mask m with a fixed number of ones
    #: (Top-k, scaled rand-k): then ‖C(x)‖² + ‖C(x) − x‖² = ‖x‖², which ``compose`` uses
    projection: bool = False
    #: True when the message size depends on the draw (Bernoulli): see :meth:`message_bits`
    variable_size: bool = False
    #: True when bfloat16/float16 inputs work (float32 arithmetic, output in the input dtype)
    half_precision: ClassVar[bool] = True
    #: True when the compressor keeps state between calls (:mod:`.lowrank`: PowerSGD's Q)
    stateful: ClassVar[bool] = False
    #: False when the compressor has no worst-case constant (``alpha`` raises
    #: :class:`ConstantUnknownError`): numeric step sizes work, theory step sizes refuse
    constant_known: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _D_METHODS:
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, "_checks_d", False):
                setattr(cls, name, _checking_d(fn, name))

    @classmethod
    def dtypes(cls) -> tuple[torch.dtype, ...]:
        """The input dtypes this compressor takes."""
        return WIRE_DTYPES if cls.half_precision else FLOAT_DTYPES

    # -- constants ------------------------------------------------------------------------------
    def omega(self, d: int) -> float:
        """ω with E‖C(x) − x‖² ≤ ω‖x‖² for every x ∈ R^d (unbiased compressors only)."""
        raise TypeError(
            f"{self.name} is a contractive (biased) compressor: it has no ω; use alpha(d), or an "
            "unbiased compressor such as rand_k[k=...] or qsgd[s=...]"
        )

    def alpha(self, d: int) -> float:
        """α with E‖C(x) − x‖² ≤ (1 − α)‖x‖²; for an unbiased C, the α = 1/(1+ω) of C/(1+ω)."""
        if self.kind == "unbiased":
            return 1.0 / (1.0 + self.omega(d))
        raise NotImplementedError(f"{type(self).__name__} must define alpha(d)")

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        """Size in bits of one encoded message of a ``d``-vector whose values are sent in ``dtype``.

        Exact for fixed-size messages; the expectation when the size is random (use
        :meth:`message_bits` for the size of actual messages).
        """
        raise NotImplementedError

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        """The papers' convention: 32 bits per transmitted float (16 when the values travel in
        a 16-bit ``dtype``), indices free, the bits of signs and levels counted (methods.md
        §2). A random-size message (Bernoulli) counts its *expected* number of floats (p·d),
        the same every round; the authors' code counts the floats actually sent (FL_PyTorch's
        lazy compressor: d or 0), so a run's ``bits_up_paper`` is that count's expectation
        (docs/compressors.md, the paper-bits paragraph); :meth:`message_bits` is exact."""
        raise NotImplementedError

    def message_bits(self, compressed: torch.Tensor) -> torch.Tensor:
        """Bits of the message behind each row of an already compressed tensor, shape ``(...)``.

        Equal to :meth:`bits` for fixed-size messages; compressors whose message size is random
        (Bernoulli sparsification) count the actual message from the number of non-zeros.
        """
        d = compressed.shape[-1]
        if self.variable_size:
            nnz = torch.count_nonzero(compressed, dim=-1)
            return self._bits_for_nnz(nnz, d, compressed.dtype)
        return torch.full(
            compressed.shape[:-1],
            float(self.bits(d, compressed.dtype)),
            dtype=torch.float64,
            device=compressed.device,
        )

    def _bits_for_nnz(self, nnz: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        """Message size of a variable-size compressor given the non-zeros of each row."""
        raise NotImplementedError

    # -- sparse structure (used by compose) -----------------------------------------------------
    def sparse_k(self, d: int) -> int | None:
        """k when every message carries exactly k chosen coordinates (Top-k, rand-k), else None."""
        return None

    def index_bits(self, d: int) -> int:
        """Bits a message spends on *which* coordinates it carries (0 for dense messages)."""
        return 0

    # -- application ----------------------------------------------------------------------------
    def __call__(
        self, x: torch.Tensor, keys: Keys | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compress every row of ``x`` (shape ``(..., d)``) with the per-row ``keys``.

        ``out`` (same shape, dtype and device as ``x``, not overlapping it) receives the result
        and is returned: hot loops preallocate it once (fresh multi-megabyte tensors page-fault
        on first touch). Raises ``TypeError`` for non-float input and ``ValueError`` for
        non-finite input.
        """
        self._check_input(x)
        keys = self._prepare_keys(x, keys)
        if out is not None:
            self._check_out(x, out)
        if x.dtype in HALF_DTYPES:
            y = self._to_half(self._apply_half(x.float(), keys, x.dtype), x.dtype)
            return y if out is None else out.copy_(y)
        return self._apply(x, keys, out)

    def _apply_half(self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype) -> torch.Tensor:
        """The float32 result for a 16-bit input (``x``: its exact float32 copy), which the
        caller rounds to the input dtype once. Compressors whose message rounds intermediate
        values (low-rank factors) override this."""
        return self._apply(x, keys, None)

    def _to_half(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = y.to(dtype)
        if not _all_finite(h):
            raise ValueError(f"{self.name}: {value_range_error(dtype)}")
        return h

    def _prepare_keys(self, x: torch.Tensor, keys: Keys | None) -> Keys | None:
        if self.deterministic:
            return None
        if keys is None:
            raise ValueError(
                f"{self.name} is random and needs keys: call C(x, Keys.derive(seed, round=t, "
                "client=i)) or C.compress(x, seed=...)"
            )
        if not isinstance(keys, Keys):
            raise TypeError(
                f"keys must be shrinkgrad.rng.Keys (e.g. Keys.derive(seed, round=t, client=i)), "
                f"got {type(keys).__name__}"
            )
        keys = keys.expand(x.shape[:-1])
        if keys.device != x.device:
            keys = keys.to(x.device)
        return keys

    def _check_out(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch tensor, got {type(out).__name__}")
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"out must match the input: shape {tuple(x.shape)}, {x.dtype} on {x.device}; got "
                f"shape {tuple(out.shape)}, {out.dtype} on {out.device}"
            )
        if out.data_ptr() == x.data_ptr() and x.numel() > 0:
            raise ValueError(
                "out must not be the input tensor itself (compression is not in place)"
            )

    def compress(
        self,
        x: torch.Tensor,
        seed: int | None = None,
        *,
        round: int = 0,
        client: int | torch.Tensor | np.ndarray | None = None,
    ) -> torch.Tensor:
        """Convenience form: keys derived from ``(seed, round, client)``.

        A random compressor needs ``seed`` (a ValueError otherwise: a silent default would give
        the same "random" draw on every call); the same ``(seed, round, client)`` always gives
        the same draw, so vary ``round`` between calls. The rows of a batch ``x`` of shape
        ``(n, d)`` (or ``(..., d)``) are clients 0, 1, …, each with its own draw, unless
        ``client`` gives their ids (a scalar ``client`` gives every row the same key).
        """
        if self.deterministic:
            return self(x)
        if seed is None:
            raise ValueError(
                f"{self.name} is random: compress(x, seed=...) needs a seed (the same seed, round "
                "and client give the same draw, so vary round= between calls), or call "
                "C(x, Keys.derive(seed, round=t, client=i))"
            )
        if client is None:
            rows = x.shape[:-1] if isinstance(x, torch.Tensor) else ()
            client = np.arange(int(np.prod(rows)), dtype=np.int64).reshape(rows) if rows else 0
        return self(x, Keys.derive(seed, round=round, client=client))

    # -- shifted form ---------------------------------------------------------------------------
    def shifted(
        self, x: torch.Tensor, h: torch.Tensor, keys: Keys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, h + c)`` with c = C(x − h, keys): the message and the value of the shifted
        compressor C_h(x) = h + C(x − h) (Shulgin & Richtárik, "Shifted compression framework:
        generalizations and improvements", UAI 2022). EF21's client update
        g_i ← g_i + C(∇f_i − g_i) is C_{g_i}(∇f_i) (:func:`shrinkgrad.methods.rules.ef21_update`).

        This default computes ``x − h``, ``C(·, keys)`` and ``h + c``; a compressor may fuse
        the three into one pass (Top-1 on CPU) when it gives the same bits. Non-finite x − h is
        the ValueError of ``C`` itself.
        """
        if not isinstance(h, torch.Tensor) or h.shape != x.shape or h.dtype != x.dtype:
            raise ValueError(
                f"{self.name}.shifted: the shift h must match x (shape {tuple(x.shape)}, "
                f"{x.dtype}), got {type(h).__name__} {tuple(getattr(h, 'shape', ()))}"
            )
        c = self(x - h, keys)
        return c, h + c

    def shifted_sparse(
        self, x: torch.Tensor, h: torch.Tensor, keys: Keys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`shifted` with the message in its sparse form: ``(flat, values, h + c)``, the
        kept entries of c = C(x − h, keys) at their flat positions (r·d + j for row r of the
        batch, int64, row by row) and h + c, which differs from h at those positions only
        (there h_j + c_j; elsewhere h_j itself, not h_j + 0, which differs in the sign of a
        zero only). Compressors whose :meth:`sparse` takes batches only (``sparse_batches``:
        the same number of pairs in every row): the simulator's reduction of EF21's Top-k
        messages then reads m·k pairs instead of an (m, d) tensor
        (``methods.base.weighted_sum``). This default selects by :meth:`sparse` on x − h;
        Top-1 on CPU fuses the pass."""
        if not self.sparse_batches:
            raise TypeError(
                f"{self.name}: shifted_sparse needs a sparse form of batches (sparse_batches: "
                "top_k, rand_k and their compositions)"
            )
        if not isinstance(h, torch.Tensor) or h.shape != x.shape or h.dtype != x.dtype:
            raise ValueError(
                f"{self.name}.shifted_sparse: the shift h must match x (shape "
                f"{tuple(x.shape)}, {x.dtype}), got {type(h).__name__}"
            )
        idx, vals = self.sparse(x - h, keys)
        d = x.shape[-1]
        rows = x.numel() // d if d else 0
        offsets = torch.arange(rows, device=x.device).mul_(d).unsqueeze(1)
        flat = idx.reshape(rows, -1).add(offsets).reshape(-1)
        vals = vals.reshape(-1)
        g = h.clone()
        g.view(-1).index_add_(0, flat, vals)
        return flat, vals, g

    # -- sparse form ----------------------------------------------------------------------------
    def sparse(
        self, x: torch.Tensor, keys: Keys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of the message of ``x`` (sparse messages only), without ever
        building the dense compressed tensor: scattering ``values`` at ``indices`` into zeros
        gives ``C(x, keys)`` bit for bit. Fixed-size sparsifiers take a batch ``(..., d)`` and
        return ``(..., k)`` int64 indices and values; random-size ones (Bernoulli) one vector.
        The wire format encodes from this form.
        """
        if not self.sparse_message:
            raise TypeError(
                f"{self.name} sends dense messages: it has no sparse form; use C(x, keys)"
            )
        self._check_input(x)
        keys = self._prepare_keys(x, keys)
        if x.dtype in HALF_DTYPES:
            got = self._sparse_bf16(x, keys) if x.dtype == torch.bfloat16 else None
            idx, vals = self._sparse(x.float(), keys) if got is None else got
            return idx, self._to_half(vals, x.dtype)
        return self._sparse(x, keys)

    def _sparse(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sparse form of validated input (default: the fixed-size selection)."""
        return self._select(x, keys)

    def _sparse_bf16(
        self, x: torch.Tensor, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``_sparse(x.float(), keys)`` of a bfloat16 ``x`` read in place (no float32 copy of
        it), bit for bit, or None where a compressor has no such path (default)."""
        return None

    def sparse_difference(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        keys: Keys | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sparse(x, keys)`` of x = a − b, rounded to ``dtype`` when given (a 16-bit wire:
        the values then come in that dtype), bit for bit, for callers that do not need
        x itself (EF21's C(∇f_i − g_i)). This default forms x; Top-k on CPU selects from the
        difference chunk by chunk instead (one read of a and b, no d-sized write)."""
        x = a - b
        if dtype is not None and dtype != x.dtype:
            x = x.to(dtype)
        return self.sparse(x, keys)

    @abc.abstractmethod
    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        """Compress validated input; ``keys`` already has shape ``x.shape[:-1]`` (or is None).

        Writes into ``out`` and returns it when given, else returns a new tensor.
        """

    def _select(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed-size sparsifiers: the chosen indices and the values sent, each ``(..., k)``."""
        raise NotImplementedError(f"{self.name} is not a fixed-size sparsifier")

    # -- wire format ----------------------------------------------------------------------------
    #: True when the message is a list of (index, value) pairs (Top-k, rand-k, Bernoulli, a
    #: composition whose first stage is one): :meth:`decode_sparse` then returns them
    sparse_message: bool = False
    #: True when :meth:`sparse` takes batches (every message carries the same number of pairs)
    sparse_batches: bool = False

    def encode(
        self, x: torch.Tensor, keys: Keys | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Encode one vector ``x`` (shape ``(d,)``) as a ``uint8`` payload of ⌈bits(d)/8⌉ bytes.

        ``decode(encode(x, keys), d, x.dtype, keys)`` equals ``self(x, keys)`` exactly. The
        layout is a sequence of bit fields (see :mod:`shrinkgrad.compressors._wire`); on CPU
        numba kernels compute and pack the fields in one pass. ``out`` (a contiguous ``uint8``
        vector on x's device with at least as many bytes as the message) receives the payload
        at its start; the returned payload is then that leading slice of ``out``.
        """
        self._check_input(x)
        if x.ndim != 1:
            raise ValueError(f"encode takes one vector of shape (d,), got shape {tuple(x.shape)}")
        keys = self._prepare_keys(x, keys)
        value_dtype = None
        if x.dtype in HALF_DTYPES:  # float32 arithmetic, values sent in the 16-bit dtype
            self(x, keys)  # one extra pass: a value beyond the 16-bit range is an error here
            value_dtype, x = x.dtype, x.float()
        if out is not None and (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.uint8
            or out.ndim != 1
            or not out.is_contiguous()
            or out.device != x.device
        ):
            raise ValueError(f"out must be a contiguous uint8 vector on {x.device}")
        w = BitWriter(x.device, fast=_fast_wire(x.device), value_dtype=value_dtype)
        self._encode_fields(w, x, keys)
        return w.to_bytes(out)

    #: True when :meth:`encode_pairs` writes the message from its sparse form
    encodes_pairs: bool = False

    def encode_pairs(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        d: int,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The payload of the message whose sparse form is ``(indices, values)`` (one vector's,
        as :meth:`sparse` returned them for an input of length ``d``): ``encode(x, keys)`` bit
        for bit when ``(indices, values) = sparse(x, keys)``, without x. The values travel in
        their own dtype (16-bit values for a 16-bit input). ``out`` as for :meth:`encode`."""
        raise TypeError(f"{self.name} encodes from its input only: use encode()")

    def decode(
        self,
        payload: torch.Tensor,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inverse of :meth:`encode`: the dense compressed vector of length ``d``.

        ``out`` (shape ``(d,)``, ``dtype``, on the payload's device) receives the result and is
        returned: hot loops preallocate it once.
        """
        keys = self._check_decode(payload, d, dtype, keys)
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch tensor, got {type(out).__name__}")
            if out.shape != (d,) or out.dtype != dtype or out.device != payload.device:
                raise ValueError(
                    f"out must be a vector of shape ({d},), {dtype} on {payload.device}; got "
                    f"shape {tuple(out.shape)}, {out.dtype} on {out.device}"
                )
        if dtype in HALF_DTYPES:  # decoded in float32, rounded to the dtype once
            r = BitReader(payload, fast=_fast_wire(payload.device), value_dtype=dtype)
            res = self._to_half(self._decode_fields(r, d, torch.float32, keys, None), dtype)
            return res if out is None else out.copy_(res)
        r = BitReader(payload, fast=_fast_wire(payload.device))
        res = self._decode_fields(r, d, dtype, keys, out)
        if out is not None and res is not out:
            out.copy_(res)
            return out
        return res

    def decode_sparse(
        self, payload: torch.Tensor, d: int, dtype: torch.dtype, keys: Keys | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of a sparse message (:attr:`sparse_message`): ``decode`` gives
        ``values`` at the (distinct, ``int64``) ``indices`` and zeros elsewhere. Summing many
        messages this way costs O(k) each instead of O(d)."""
        if not self.sparse_message:
            raise TypeError(f"{self.name} sends dense messages: use decode()")
        keys = self._check_decode(payload, d, dtype, keys)
        half = dtype in HALF_DTYPES
        r = BitReader(payload, fast=_fast_wire(payload.device), value_dtype=dtype if half else None)
        if half and self.verbatim_pairs:
            # the sent 16-bit values themselves: nothing is rounded, so nothing can leave the
            # dtype's range (as for float32 messages, whose decoding checks nothing either)
            pairs = self._decode_pairs(r, d, dtype, keys)
            assert pairs is not None
            return pairs
        pairs = self._decode_pairs(r, d, torch.float32 if half else dtype, keys)
        assert pairs is not None
        return (pairs[0], self._to_half(pairs[1], dtype)) if half else pairs

    def decode_sparse_many(
        self,
        buf: torch.Tensor,
        spans: list[tuple[int, int]],
        d: int,
        dtype: torch.dtype,
        weights: list[float],
        keys: list[Keys | None],
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs of several sparse messages of this compressor that lie in one byte buffer
        (a DDP hook's all-gather: message j at bytes ``buf[start_j : start_j + size_j]`` of
        ``spans``, encoded with ``keys[j]`` for ``dtype`` vectors of length d), every value
        converted to ``out_dtype`` and multiplied by ``weights[j]``, concatenated in message
        order: ``(cat_j idx_j, cat_j w_j · vals_j)``, the pairs of Σ_j w_j C_j. This default
        decodes them one by one (:meth:`decode_sparse`), except where the messages have a
        fixed-size sparsifier's layout (:meth:`_packed_width`) and are float32 or bfloat16
        decoded into float32 on CPU: then one kernel call reads all of them
        (:func:`~._wire.unpack_pairs`), with the same values."""
        width = self._packed_width(d)
        if (
            width is not None
            and _fast_wire(buf.device)
            and out_dtype == torch.float32
            and dtype in (torch.float32, torch.bfloat16)
            and buf.dtype == torch.uint8
            and buf.is_contiguous()
            and spans
        ):
            self._check_decode(buf[:0], d, dtype, keys[0] if keys else None)
            k = self.sparse_k(d)
            assert k is not None
            half = dtype == torch.bfloat16
            need = (k * width + k * (16 if half else 32) + 7) // 8
            for start, size in spans:
                if size < need or start < 0 or start + size > buf.numel():
                    raise ValueError(
                        f"payload too short: {self.name} needs at least {need} bytes for d={d}, "
                        f"has {size}; was it encoded with the same compressor and d?"
                    )
            idx = torch.empty(len(spans) * k, dtype=torch.int64)
            vals = torch.empty(len(spans) * k, dtype=torch.float32)
            starts = np.array([start for start, _ in spans], dtype=np.int64)
            w32 = np.array(weights, dtype=np.float32)
            unpack_pairs(buf.numpy(), starts, k, width, half, w32, idx.numpy(), vals.numpy())
            self._index_positions(idx.numpy().reshape(len(spans), k), d)
            return idx, vals
        idx_list: list[torch.Tensor] = []
        val_list: list[torch.Tensor] = []
        for (start, size), w, kj in zip(spans, weights, keys, strict=True):
            idx, vals = self.decode_sparse(buf[start : start + size], d, dtype, kj)
            vals = vals.to(out_dtype) if vals.dtype != out_dtype else vals.clone()
            idx_list.append(idx)
            val_list.append(vals.mul_(w))
        if len(idx_list) == 1:
            return idx_list[0], val_list[0]
        return torch.cat(idx_list), torch.cat(val_list)

    def _packed_width(self, d: int) -> int | None:
        """Bits of each index when a message is k indices of that many bits followed by its k
        values and nothing else (a fixed-size sparsifier's layout, :class:`Sparsifier`), else
        None (this default)."""
        return None

    def _index_fields(self, idx: np.ndarray, d: int) -> np.ndarray:
        """The k index fields of that layout for the k indices ``idx`` (``int64``): the indices
        themselves (this default), or what a compressor sends instead (strat_k: the offsets
        within the blocks)."""
        return idx

    def _index_positions(self, fields: np.ndarray, d: int) -> None:
        """The inverse of :meth:`_index_fields` on rows of k fields read from messages, in
        place (this default: nothing to do)."""
        return None

    #: True when :meth:`_decode_pairs` returns the sent value fields as they are (no
    #: arithmetic on them): a 16-bit message's values are then decoded in their own dtype,
    #: which is what the float32 decoding rounded back to (Top-k, rand-k)
    verbatim_pairs: bool = False

    def _check_decode(
        self, payload: torch.Tensor, d: int, dtype: torch.dtype, keys: Keys | None
    ) -> Keys | None:
        if dtype not in self.dtypes():
            raise TypeError(
                f"{self.name} decodes {_dtype_names(self.dtypes())} vectors, got {dtype}"
            )
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"decode needs the vector length d >= 1, got {d!r}")
        if self.deterministic:
            return None
        if keys is None:
            raise ValueError(f"{self.name} is random: decode needs the keys used by encode")
        return keys.expand(()).to(payload.device)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        raise NotImplementedError(f"{self.name} has no wire format")

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The dense vector of the message read from ``r``; written into ``out`` (and ``out``
        returned) when given and convenient, else a new tensor (``decode`` copies it)."""
        pairs = self._decode_pairs(r, d, dtype, keys)
        if pairs is None:
            raise NotImplementedError(f"{self.name} has no wire format")
        idx, vals = pairs
        res = torch.zeros(d, dtype=dtype, device=r.device) if out is None else out.zero_()
        return res.scatter_(0, idx, vals)

    def _decode_pairs(
        self, r: BitReader, d: int, dtype: torch.dtype, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sparse messages: (indices, values) read from ``r``; None for dense messages."""
        return None

    # -- helpers --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec or type(self).__name__

    def __repr__(self) -> str:
        return f"<compressor {self.name}: {self.kind}>"

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name} compresses torch tensors, got {type(x).__name__}")
        if x.dtype not in self.dtypes():
            raise TypeError(
                f"{self.name} compresses {_dtype_names(self.dtypes())} tensors, got {x.dtype}; "
                "convert with x.float()"
            )
        if x.ndim == 0 or x.shape[-1] == 0:
            raise ValueError(
                f"{self.name} compresses vectors along the last axis; got shape {tuple(x.shape)}"
            )


class Sparsifier(Compressor):
    """A fixed-size sparsifier (Top-k, rand-k): each message is k chosen coordinates.

    Subclasses define :meth:`_select` (the indices and the values sent) and ``_k(d)``; the wire
    format is shared: k indices of ⌈log₂ d⌉ bits, then the k values (rand-k with a shared seed
    overrides the index part, which the receiver redraws).
    """

    sparse_batches = True

    def _k(self, d: int) -> int:
        raise NotImplementedError

    def sparse_k(self, d: int) -> int:
        return self._k(d)

    def _encode_indices(self, w: BitWriter, idx: torch.Tensor, d: int) -> None:
        w.add(idx, _log2ceil(d))

    def _decode_indices(self, r: BitReader, d: int, keys: Keys | None) -> torch.Tensor:
        return r.read(self._k(d), _log2ceil(d))

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        idx, vals = self._select(x, keys)
        self._encode_indices(w, idx, x.shape[-1])
        w.add_values(vals)

    encodes_pairs = True

    def encode_pairs(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        d: int,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k = self._k(d)
        if indices.numel() != k or values.numel() != k:
            raise ValueError(
                f"{self.name} sends {k} (index, value) pairs for d={d}, got {indices.numel()} "
                f"indices and {values.numel()} values"
            )
        device = values.device
        if out is not None and (
            out.dtype != torch.uint8 or out.ndim != 1 or not out.is_contiguous()
        ):
            raise ValueError(f"out must be a contiguous uint8 vector on {device}")
        width = self._packed_width(d)
        if (
            width is not None
            and _fast_wire(device)
            and indices.device.type == "cpu"
            and values.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            # one kernel call (_wire.pack_pairs): the bytes of the BitWriter below
            vwidth = 32 if values.dtype == torch.float32 else 16
            nbytes = (k * (width + vwidth) + 7) // 8
            if out is not None and out.numel() < nbytes:
                raise ValueError(f"out has {out.numel()} bytes, the message needs {nbytes}")
            payload = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
            flat = values.detach().reshape(-1).contiguous()
            ints = torch.int32 if vwidth == 32 else torch.int16
            words = flat.view(ints).numpy().view(np.uint32 if vwidth == 32 else np.uint16)
            ix = indices.detach().reshape(-1).to(torch.int64).contiguous().numpy()
            pack_pairs(self._index_fields(ix, d), words, width, vwidth, payload.numpy())
            return payload
        w = BitWriter(device, fast=_fast_wire(device))
        self._encode_indices(w, indices.reshape(-1), d)
        w.add_float(values.reshape(-1))
        return w.to_bytes(out)

    def _packed_width(self, d: int) -> int | None:
        # ⌈log₂ d⌉ bits an index (rand-k with a shared seed sends none: it answers None)
        return _log2ceil(d)

    #: (the values are read as they were sent: :meth:`_decode_pairs` below)
    verbatim_pairs = True

    def _decode_pairs(
        self, r: BitReader, d: int, dtype: torch.dtype, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self._decode_indices(r, d, keys).reshape(-1)
        return idx, r.read_values(idx.numel(), dtype)


def _log2ceil(d: int) -> int:
    """⌈log₂ d⌉ bits to address one of d positions (0 for d = 1)."""
    return (int(d) - 1).bit_length() if d > 1 else 0


def _all_finite(h: torch.Tensor) -> bool:
    """Whether every entry of ``h`` is finite. A bfloat16 CPU tensor is checked on its bit
    patterns by the kernels' own finiteness pass (``_kernels.check_rows``: one read of 2 bytes
    an entry, no mask written): ``torch.isfinite(h).all()`` on bfloat16 costs ≈ 54 µs for the
    15 k values of a rand-k message, the pass ≈ 6–10 µs."""
    if h.dtype == torch.bfloat16 and _use_numba(h) and h.is_contiguous():
        from . import _kernels as K

        pats = K.bf16_patterns(h.reshape(1, -1))
        return K.run(K.check_rows, pats, pats) == K.OK
    return bool(torch.isfinite(h).all())


def _use_numba(x: torch.Tensor) -> bool:
    """Whether the CPU numba kernels should handle ``x`` (see :data:`KERNELS`): every CPU tensor
    unless KERNELS is "torch". They beat the torch path on the simulator's small batches too
    ((1000, 123), (20, 14)), where torch's many small integer ops dominate: Top-k of a
    (1000, 123) batch, k = 1, takes 0.16 ms in the kernel against 0.4 ms for a bare
    ``torch.topk`` and 1.6 ms for the torch path with its tie rule."""
    return x.device.type == "cpu" and KERNELS != "torch"


def _fast_wire(device: torch.device) -> bool:
    """Whether the wire format uses the numba packer and codecs (CPU, unless KERNELS="torch")."""
    return device.type == "cpu" and KERNELS != "torch"


def _dense_out(out: torch.Tensor | None, d: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU vector for a decoder to write into: ``out`` itself when it is one."""
    if out is not None and out.is_contiguous():
        return out
    return torch.empty(d, dtype=dtype)


def _rows(x: torch.Tensor) -> np.ndarray:
    """``x`` as a C-contiguous 2-D numpy array ``(rows, d)`` (zero-copy when possible)."""
    return np.ascontiguousarray(x.detach().reshape(-1, x.shape[-1]).numpy())


def _out_rows(x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, np.ndarray, bool]:
    """An output tensor for a numba kernel, its 2-D numpy view and whether to copy back.

    The kernel writes straight into ``out`` when it is contiguous; otherwise into a scratch
    tensor that is copied into ``out`` afterwards.
    """
    if out is not None and out.is_contiguous():
        return out, out.view(-1, x.shape[-1]).numpy(), False
    res = torch.empty(x.shape, dtype=x.dtype)
    return res, res.view(-1, x.shape[-1]).numpy(), out is not None


def _keys_rows(keys: Keys) -> tuple[np.ndarray, np.ndarray]:
    """Row keys as two flat ``uint64`` arrays for the numba kernels."""
    one = keys.scalar()
    if one is not None:  # one key (the DDP hook's): µs
        return np.array([one[0]], dtype=np.uint64), np.array([one[1]], dtype=np.uint64)
    lo, hi = keys.numpy()
    return lo.reshape(-1).astype(np.uint64), hi.reshape(-1).astype(np.uint64)


def _emit(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return ``result``, or copy it into ``out`` and return ``out``."""
    if out is None:
        return result
    out.copy_(result)
    return out


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x.gather(-1, idx)`` for index sets of shape (..., k): on CPU one numpy fancy index
    (single-threaded: torch's ``gather`` is ~15× slower for 10⁵ indices into 10⁷ entries, and a
    small multi-threaded torch op right after a numba kernel waits for torch's OpenMP threads,
    tens of ms on a loaded 2-core machine); elsewhere one flat ``index_select``."""
    d = x.shape[-1]
    if x.device.type == "cpu":
        rows = _rows(x)
        ii = idx.reshape(rows.shape[0], idx.shape[-1]).numpy()  # (an empty batch has 0 rows)
        return torch.from_numpy(np.take_along_axis(rows, ii, axis=1)).reshape(idx.shape)
    if x.ndim == 1:
        return x.index_select(0, idx)
    rows_t = x.reshape(-1, d)
    base = torch.arange(rows_t.shape[0], device=x.device, dtype=torch.int64)[:, None] * d
    flat = (idx.reshape(rows_t.shape[0], idx.shape[-1]) + base).reshape(-1)
    return rows_t.reshape(-1).index_select(0, flat).reshape(idx.shape)


def non_finite_error(name: str) -> ValueError:
    return ValueError(
        f"{name} got a non-finite input (inf or nan): compressors need finite vectors; check the "
        "gradients (e.g. torch.isfinite(x).all()) or lower the step size"
    )


def _require_finite(x: torch.Tensor, name: str) -> None:
    """The torch path's check: a finite sum proves every entry finite (inf/nan propagate);
    only when the sum is not finite (possibly a mere overflow) is ``isfinite`` consulted."""
    if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise non_finite_error(name)


def _check_positive_int(value: int, what: str, name: str, upper: int | None = None) -> int:
    """Validate an integer parameter, naming it and its allowed range."""
    rng = f"in [1, {upper}]" if upper is not None else ">= 1"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} needs an integer {what}, got {value!r}")
    if value < 1 or (upper is not None and value > upper):
        raise ValueError(f"{name} needs {what} {rng}, got {value}")
    return int(value)


for _name in _D_METHODS:  # the base class's own defaults check d too
    setattr(Compressor, _name, _checking_d(getattr(Compressor, _name), _name))

COMPRESSORS: Registry[Compressor] = Registry("compressor", base=Compressor)
Compressor.__registry__ = COMPRESSORS


def make_compressor(spec: str | Compressor, **params: Any) -> Compressor:
    """Build a compressor from its name, e.g. ``make_compressor("qsgd[s=4]")`` or
    ``make_compressor("qsgd", s=4)``."""
    return COMPRESSORS.make(spec, **params)
