"""The compressor abstraction: an operator that carries its maths.

A compressor ``C`` maps a tensor of shape ``(..., d)`` to a tensor of the same shape and dtype,
row by row (the leading axes are clients, buckets, ...). It declares

* ``kind``: ``"unbiased"`` — E[C(x)] = x and E‖C(x) − x‖² ≤ ω‖x‖² ([K18] Def. 1, where ω is
  called β) — or ``"contractive"`` — E‖C(x) − x‖² ≤ (1 − α)‖x‖², α ∈ (0, 1] ([EF21] Def. 1);
* ``omega(d)`` / ``alpha(d)``: the constants as functions of the dimension. An unbiased compressor
  also reports ``alpha(d) = 1/(1 + ω)``, the constant of its scaled version C/(1 + ω)
  (methods.md §2, "Conversion");
* ``bits(d)``: the exact size in bits of one encoded message (values, indices, norms, scales), and
  ``paper_bits(d)``: the papers' convention (32 bits per sent float, indices free);
* ``collective``: ``"allreduce"`` when the compressed results of several ranks can be summed as
  dense tensors, ``"allgather"`` when the payload is sparse or packed.

Randomness is explicit: ``C(x, keys)`` takes one :class:`~shrinkgrad.rng.Keys` per row, so a draw
is a function of (seed, round, client) only. ``C.compress(x, seed=...)`` is the convenience form.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar, Literal

import torch

from ..registry import Registry
from ..rng import Keys

__all__ = ["COMPRESSORS", "Collective", "Compressor", "Kind", "make_compressor"]

Kind = Literal["unbiased", "contractive"]
Collective = Literal["allreduce", "allgather"]

FLOAT_DTYPES = (torch.float32, torch.float64)


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

    def paper_bits(self, d: int) -> float:
        """The papers' convention: 32 bits per transmitted float, indices and signs free."""
        raise NotImplementedError

    def message_bits(self, compressed: torch.Tensor) -> torch.Tensor:
        """Bits of the message behind each row of an already compressed tensor, shape ``(...)``.

        Equal to :meth:`bits` for fixed-size messages; compressors whose message size is random
        (Bernoulli sparsification) override it to count the actual message.
        """
        d = compressed.shape[-1]
        return torch.full(
            compressed.shape[:-1], float(self.bits(d, compressed.dtype)), dtype=torch.float64
        )

    # -- application ----------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, keys: Keys | None = None) -> torch.Tensor:
        """Compress every row of ``x`` (shape ``(..., d)``) with the per-row ``keys``."""
        self._check_input(x)
        if not self.deterministic:
            if keys is None:
                raise ValueError(
                    f"{self.name} is random and needs keys: call C(x, Keys.derive(seed, round=t, "
                    "client=i)) or C.compress(x, seed=...)"
                )
            keys = keys.expand(x.shape[:-1])
            if keys.device != x.device:
                keys = keys.to(x.device)
        return self._apply(x, keys)

    def compress(
        self,
        x: torch.Tensor,
        seed: int = 0,
        *,
        round: int = 0,  # noqa: A002 - the papers' word
        client: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        """Convenience form: keys derived from ``(seed, round, client)``.

        For a batch ``x`` of shape ``(n, d)`` pass ``client=torch.arange(n)`` to give each row its
        own client key (a scalar ``client`` gives every row the same key).
        """
        keys = None if self.deterministic else Keys.derive(seed, round=round, client=client)
        return self(x, keys)

    @abc.abstractmethod
    def _apply(self, x: torch.Tensor, keys: Keys | None) -> torch.Tensor:
        """Compress validated input; ``keys`` already has shape ``x.shape[:-1]`` (or is None)."""

    # -- wire format ----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, keys: Keys | None = None) -> torch.Tensor:
        """Encode one vector ``x`` (shape ``(d,)``) as a ``uint8`` payload of ⌈bits(d)/8⌉ bytes.

        ``decode(encode(x, keys), ...)`` equals ``self(x, keys)`` exactly.
        """
        raise NotImplementedError(f"{self.name} has no wire format yet")

    def decode(
        self, payload: torch.Tensor, d: int, dtype: torch.dtype, keys: Keys | None = None
    ) -> torch.Tensor:
        """Inverse of :meth:`encode`: the dense compressed vector of length ``d``."""
        raise NotImplementedError(f"{self.name} has no wire format yet")

    # -- helpers --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec or type(self).__name__

    def __repr__(self) -> str:
        return f"<compressor {self.name}: {self.kind}>"

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name} compresses torch tensors, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{self.name} compresses float32 or float64 tensors, got {x.dtype}; convert with "
                "x.float() or x.double()"
            )
        if x.ndim == 0 or x.shape[-1] == 0:
            raise ValueError(
                f"{self.name} compresses vectors along the last axis; got shape {tuple(x.shape)}"
            )


def _log2ceil(d: int) -> int:
    """⌈log₂ d⌉ bits to address one of d positions (0 for d = 1)."""
    return max(0, math.ceil(math.log2(d))) if d > 1 else 0


COMPRESSORS: Registry[Compressor] = Registry("compressor", base=Compressor)
Compressor.__registry__ = COMPRESSORS


def make_compressor(spec: str | Compressor) -> Compressor:
    """Build a compressor from its name, e.g. ``make_compressor("qsgd[s=4]")``."""
    return COMPRESSORS.make(spec)
