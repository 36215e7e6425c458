"""Transforms of compressors: ``scaled(C)`` and ``compose(C1, C2)``, with derived constants.

``scaled(Q)`` ([K18]/[EF21] conversion; methods.md §2)
    For unbiased Q with constant ω, C = Q/(1+ω) is contractive with α = 1/(1+ω): with
    c = 1/(1+ω), E‖cQ(x) − x‖² = c²E‖Q(x)‖² − 2c‖x‖² + ‖x‖² ≤ c²(1+ω)‖x‖² − 2c‖x‖² + ‖x‖²
    = (1 − c)‖x‖². Same message as Q. ``scaled(rand_k[k])`` is exactly ``rand_k_scaled[k]``.

``compose(C1, C2)``: apply C1, then C2 to the result
    *Sparse mode* — C1 is a fixed-size sparsifier (``top_k``, ``rand_k``, ``rand_k_scaled``):
    C2 acts on the k values C1 sends (a vector of R^k), so its constants are taken at dimension
    D = k, and the message is C1's indices followed by C2's message of the k values (e.g.
    ``compose(top_k[k=10], qsgd[s=4])`` sends k⌈log₂ d⌉ + 32 + k(1 + ⌈log₂ 5⌉) bits). Otherwise
    *dense mode*: C2 acts on C1(x) ∈ R^d (D = d) and the message is C2's. Writing y = C1(x)
    and z = C2(y), C2's draw is independent of C1's given y, and (derived here, checked by the
    Monte-Carlo tests):

    1. C1, C2 unbiased: E z = x and E‖z − x‖² = E‖z − y‖² + E‖y − x‖² ≤ ω2 E‖y‖² + ω1‖x‖²
       = ((1+ω1)(1+ω2) − 1)‖x‖²: unbiased with ω = (1+ω1)(1+ω2) − 1.
    2. C1 a projection (y = x ⊙ mask: Top-k, scaled rand-k) in sparse mode: z − y lives on the
       kept set and y − x off it, so E‖z − x‖² = E‖z − y‖² + ‖x‖² − E‖y‖² ≤ ‖x‖² − a2 E‖y‖²
       with a2 = α2 (C2 contractive) or a2 = 1 − ω2 (C2 unbiased, needs ω2 < 1); and
       E‖y‖² = ‖x‖² − E‖y − x‖² ≥ α1‖x‖²: contractive with α = α1·a2.
    3. C1 unbiased, C2 contractive: Minkowski in L², ‖z − x‖ ≤ ‖z − y‖ + ‖y − x‖ with
       E‖z − y‖² ≤ (1 − α2)(1 + ω1)‖x‖²: α = 1 − (√((1−α2)(1+ω1)) + √ω1)².
    4. C1 contractive, C2 unbiased: the cross term vanishes (E[z | y] = y), and
       E‖y‖² ≤ (1 + √(1−α1))²‖x‖²: α = α1 − ω2 (1 + √(1−α1))².
    5. both contractive (C1 not a projection): Minkowski,
       α = 1 − (√(1−α2)(1 + √(1−α1)) + √(1−α1))².

    When the resulting α is not positive the combination has no valid constant and a
    ValueError says so (``compose(C1, scaled(C2))`` usually fixes it: rule 2 with a2 = 1/(1+ω2)
    is the Qsparse bound of Basu et al. 2019, Lemma 1).
"""

from __future__ import annotations

import math

import torch

from ..rng import Keys
from ._wire import BitReader, BitWriter
from .base import COMPRESSORS, Compressor, Kind, Sparsifier

__all__ = ["Compose", "Scaled"]

FIRST = "compose.first"
SECOND = "compose.second"


def _fold(keys: Keys | None, tag: str, c: Compressor) -> Keys | None:
    return None if c.deterministic or keys is None else keys.fold(tag)


@COMPRESSORS.register("scaled")
class Scaled(Compressor):
    """scaled(C) = C/(1+ω): an unbiased compressor turned contractive with α = 1/(1+ω)."""

    kind = "contractive"
    constant_formula = "α = 1/(1 + ω_C)"
    bits_formula = "bits of C"
    kind_text = "contractive (C unbiased)"
    collective_text = "as C"

    def __init__(self, inner: Compressor) -> None:
        if not isinstance(inner, Compressor):
            raise TypeError(f"scaled() takes a compressor, got {type(inner).__name__}")
        if inner.kind != "unbiased":
            raise ValueError(
                f"scaled() converts an unbiased compressor (ω) into a contractive one; "
                f"{inner.name} is already contractive (α = alpha(d)): use it directly"
            )
        self.inner = inner
        exact = getattr(inner, "scaled_form", None)
        self.exact: Compressor | None = exact() if callable(exact) else None
        if self.exact is not None:  # its errors name what the user wrote, not a class
            self.exact.spec = f"scaled({inner.name})"
        self.deterministic = inner.deterministic
        self.positively_homogeneous = inner.positively_homogeneous
        #: a shared-seed sparsifier stays one: every rank keeps the same k indices, so the
        #: k scaled values are summable (the DDP hook's values path, a ring's all-reduce)
        self.shared_seed = bool(getattr(inner, "shared_seed", False))
        self.collective = inner.collective
        self.variable_size = inner.variable_size
        self.sparse_message = (self.exact or inner).sparse_message
        self.sparse_batches = (self.exact or inner).sparse_batches
        self.projection = self.exact.projection if self.exact is not None else False

    def _factor(self, d: int) -> float:
        return 1.0 / (1.0 + self.inner.omega(d))

    def alpha(self, d: int) -> float:
        return self.exact.alpha(d) if self.exact is not None else self._factor(d)

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return self.inner.bits(d, dtype)

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return self.inner.paper_bits(d, dtype)

    def _bits_for_nnz(self, nnz: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        return self.inner._bits_for_nnz(nnz, d, dtype)

    def sparse_k(self, d: int) -> int | None:
        return self.exact.sparse_k(d) if self.exact is not None else self.inner.sparse_k(d)

    def index_bits(self, d: int) -> int:
        return self.inner.index_bits(d)

    def _c(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self._factor(x.shape[-1]), dtype=x.dtype, device=x.device)

    def _select(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exact is not None:
            return self.exact._select(x, keys)
        idx, vals = self.inner._select(x, keys)
        return idx, vals * self._c(x)

    def _sparse(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exact is not None:
            return self.exact._sparse(x, keys)
        idx, vals = self.inner._sparse(x, keys)
        return idx, vals.mul_(self._c(x))

    def _encode_indices(self, w: BitWriter, idx: torch.Tensor, d: int) -> None:
        src = self.exact if self.exact is not None else self.inner
        src._encode_indices(w, idx, d)  # type: ignore[attr-defined]

    def _decode_indices(self, r: BitReader, d: int, keys: Keys | None) -> torch.Tensor:
        src = self.exact if self.exact is not None else self.inner
        return src._decode_indices(r, d, keys)  # type: ignore[attr-defined, no-any-return]

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        if self.exact is not None:
            return self.exact._apply(x, keys, out)
        y = self.inner._apply(x, keys, out)
        return y.mul_(self._c(x))

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        (self.exact or self.inner)._encode_fields(w, x, keys)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.exact is not None:
            return self.exact._decode_fields(r, d, dtype, keys, out)
        y = self.inner._decode_fields(r, d, dtype, keys, out)
        return y.mul_(torch.tensor(self._factor(d), dtype=dtype, device=y.device))

    def _decode_pairs(
        self, r: BitReader, d: int, dtype: torch.dtype, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.exact is not None:
            return self.exact._decode_pairs(r, d, dtype, keys)
        pairs = self.inner._decode_pairs(r, d, dtype, keys)
        if pairs is None:
            return None
        idx, vals = pairs
        return idx, vals.mul_(torch.tensor(self._factor(d), dtype=dtype, device=vals.device))


@COMPRESSORS.register("compose")
class Compose(Compressor):
    """compose(C1, C2): C2 applied to the output of C1 (to its k values when C1 is a
    fixed-size sparsifier); constants derived in the module docstring."""

    constant_formula = (
        "U∘U: ω=(1+ω1)(1+ω2)−1; projection∘C2: α=α1·(α2 or 1−ω2); "
        "otherwise Minkowski bounds (see docs)"
    )
    bits_formula = "C1 indices + bits of C2 on the k kept values (sparse C1), else bits of C2"
    kind_text = "unbiased if both are, else contractive"
    collective_text = "allgather (sparse C1), else as C2"

    def __init__(self, first: Compressor, second: Compressor) -> None:
        for c in (first, second):
            if not isinstance(c, Compressor):
                raise TypeError(f"compose() takes two compressors, got {type(c).__name__}")
            if c.stateful:
                raise ValueError(
                    f"compose() takes stateless compressors; {c.name} keeps state between rounds "
                    "(use it on its own, with ef21 or ef)"
                )
            if getattr(c, "shared_seed", False):
                raise ValueError(
                    f"compose() takes no shared-seed compressor; {c.name} draws one set of "
                    "coordinates for all clients, sent as k summable values, which a composed "
                    "message is not: use it without shared_seed inside compose (its indices are "
                    "then sent), or on its own"
                )
        self.first = first
        self.second = second
        self.k: int | None = _sparsifier_k(first)
        both_unbiased = first.kind == "unbiased" and second.kind == "unbiased"
        self.kind: Kind = "unbiased" if both_unbiased else "contractive"
        self.deterministic = first.deterministic and second.deterministic
        self.positively_homogeneous = first.positively_homogeneous and second.positively_homogeneous
        self.variable_size = second.variable_size
        sparse = self.k is not None
        self.collective = "allgather" if sparse else second.collective
        self.sparse_message = sparse
        self.sparse_batches = sparse
        if self.k is not None and not both_unbiased and first.projection:
            self._projection_factor()  # fail early: the constant of C2 at D = k is known now

    # -- constants ------------------------------------------------------------------------------
    def _inner_d(self, d: int) -> int:
        if self.k is None:
            return d
        return self.first.sparse_k(d) or d

    def _where(self) -> str:
        return f"in {self.name or 'compose(...)'}"

    def _c2(self, d: int) -> tuple[str, float]:
        dd = self._inner_d(d)
        try:
            if self.second.kind == "unbiased":
                return "unbiased", self.second.omega(dd)
            return "contractive", self.second.alpha(dd)
        except ValueError as e:
            mode = f"acting on the {dd} values kept by {self.first.name}" if self.k else ""
            raise ValueError(f"{self._where()}: {self.second.name} {mode}: {e}") from None

    def _projection_factor(self) -> float:
        assert self.k is not None
        kind2, c2 = self._c2(self.k)
        if kind2 == "contractive":
            return c2
        if c2 >= 1.0:
            raise ValueError(
                f"compose({self.first.name}, {self.second.name}) has no valid constant: "
                f"{self.second.name} on the {self.k} kept values has ω = {c2:.4g} >= 1, so the "
                f"composition need not contract; use compose({self.first.name}, "
                f"scaled({self.second.name})) (α = α1/(1+ω2)) or more levels"
            )
        return 1.0 - c2

    def _constant(self, d: int) -> float:
        f, s = self.first, self.second
        kind2, c2 = self._c2(d)
        if self.kind == "unbiased":
            return (1.0 + f.omega(d)) * (1.0 + c2) - 1.0
        if f.projection and self.k is not None:
            return f.alpha(d) * self._projection_factor()
        if f.kind == "unbiased":
            w1 = f.omega(d)
            alpha = 1.0 - (math.sqrt((1.0 - c2) * (1.0 + w1)) + math.sqrt(w1)) ** 2
        elif kind2 == "unbiased":
            a1 = f.alpha(d)
            alpha = a1 - c2 * (1.0 + math.sqrt(1.0 - a1)) ** 2
        else:
            r1 = math.sqrt(1.0 - f.alpha(d))
            alpha = 1.0 - (math.sqrt(1.0 - c2) * (1.0 + r1) + r1) ** 2
        if alpha <= 0.0:
            hint = (
                f"compose(scaled({f.name}), {s.name})"
                if f.kind == "unbiased"
                else (
                    f"compose({f.name}, scaled({s.name}))"
                    if kind2 == "unbiased"
                    else "a gentler C2"
                )
            )
            raise ValueError(
                f"compose({f.name}, {s.name}) has no valid constant at d={d}: the derived bound "
                f"gives α = {alpha:.4g} <= 0 (see shrinkgrad.compressors.transforms); try {hint}"
            )
        return alpha

    def omega(self, d: int) -> float:
        if self.kind != "unbiased":
            return super().omega(d)
        return self._constant(d)

    def alpha(self, d: int) -> float:
        if self.kind == "unbiased":
            return 1.0 / (1.0 + self._constant(d))
        return self._constant(d)

    # -- bits -----------------------------------------------------------------------------------
    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        if self.k is not None:
            return self.first.index_bits(d) + self.second.bits(self._inner_d(d), dtype)
        return self.second.bits(d, dtype)

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return self.second.paper_bits(self._inner_d(d), dtype)

    def index_bits(self, d: int) -> int:
        if self.k is not None:
            return self.first.index_bits(d)
        return self.second.index_bits(d)

    def _bits_for_nnz(self, nnz: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        if self.k is not None:
            return self.first.index_bits(d) + self.second._bits_for_nnz(
                nnz, self._inner_d(d), dtype
            )
        return self.second._bits_for_nnz(nnz, d, dtype)

    # -- application ----------------------------------------------------------------------------
    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        k1 = _fold(keys, FIRST, self.first)
        k2 = _fold(keys, SECOND, self.second)
        if self.k is not None:
            self._c2(x.shape[-1])  # clear error if C2 cannot act on k values
            idx, vals = self.first._select(x, k1)
            z = self.second(vals, k2)
            res = torch.zeros_like(x) if out is None else out.zero_()
            return res.scatter_(-1, idx, z)
        y = self.first(x, k1)
        return self.second(y, k2, out=out)

    def _sparse(self, x: torch.Tensor, keys: Keys | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse mode: C1's indices and C2 applied to the k values they carry."""
        self._c2(x.shape[-1])
        idx, vals = self.first._select(x, _fold(keys, FIRST, self.first))
        return idx, self.second(vals, _fold(keys, SECOND, self.second))

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        k1 = _fold(keys, FIRST, self.first)
        k2 = _fold(keys, SECOND, self.second)
        if self.k is not None:
            idx, vals = self.first._select(x, k1)
            self.first._encode_indices(w, idx, x.shape[-1])  # type: ignore[attr-defined]
            self.second._encode_fields(w, vals, k2)
        else:
            self.second._encode_fields(w, self.first(x, k1), k2)

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.k is not None:
            return super()._decode_fields(r, d, dtype, keys, out)
        return self.second._decode_fields(r, d, dtype, _fold(keys, SECOND, self.second), out)

    def _decode_pairs(
        self, r: BitReader, d: int, dtype: torch.dtype, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.k is None:
            return None
        k1 = _fold(keys, FIRST, self.first)
        k2 = _fold(keys, SECOND, self.second)
        idx = self.first._decode_indices(r, d, k1).reshape(-1)  # type: ignore[attr-defined]
        return idx, self.second._decode_fields(r, idx.numel(), dtype, k2, None)


def _sparsifier_k(c: Compressor) -> int | None:
    """k of a fixed-size sparsifier (a :class:`Sparsifier`, possibly scaled), else None."""
    if isinstance(c, Scaled):
        c = c.exact if c.exact is not None else c.inner
    k = getattr(c, "k", None)
    return k if isinstance(c, Sparsifier) and isinstance(k, int) else None
