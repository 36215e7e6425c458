"""``ratio=``: a compressor spec whose k is set per tensor, k = ⌈ratio·d⌉ (the DDP hook's
``CompressionState(ratio=)`` and the network model's ``hook_collectives(ratio=)``).

The k that ``ratio`` sets belongs to a compressor with a ``k`` parameter (top_k, rand_k,
rand_k_scaled, strat_k), or to the one inside ``scaled(...)`` — so the contractive form of an
unbiased sparsifier takes a ratio too: ``scaled(strat_k[shared_seed=true])`` with ``ratio=0.01``
is scaled(strat_k[k=⌈0.01·d⌉, shared_seed=true]) for every tensor of d entries.
"""

from __future__ import annotations

from ..registry import Spec, parse_spec
from .base import COMPRESSORS

__all__ = ["ratio_spec", "with_k"]


def _takes_k(spec: Spec) -> bool:
    return "k" in {p.name for p in COMPRESSORS.entry(spec.name).keyword}


def _k_part(spec: Spec) -> Spec | None:
    """The part of ``spec`` whose k a ratio sets: ``spec`` itself, or what ``scaled()`` wraps
    (None: there is no k to set)."""
    if _takes_k(spec):
        return spec
    if spec.name == "scaled" and len(spec.args) == 1:
        return _k_part(spec.args[0])
    return None


def ratio_spec(compressor: str | Spec, ratio: float) -> Spec:
    """``compressor`` parsed and checked for ``ratio=``: it has a k for the ratio to set, and does
    not fix one itself (a ValueError says which, and what to drop)."""
    spec = parse_spec(compressor)
    part = _k_part(spec)
    if part is None:
        raise ValueError(
            f"ratio={ratio:g} needs a compressor with a k parameter (top_k, rand_k, "
            f"rand_k_scaled, strat_k, or scaled() of one), got {str(spec)!r}; drop ratio for "
            "this compressor"
        )
    fixed = dict(part.params).get("k")
    if fixed is not None:
        raise ValueError(
            f"{str(spec)!r} fixes k={fixed} and ratio={ratio:g} sets k per tensor "
            "(k = ⌈ratio·d⌉): give one of them (drop ratio=, or k from the name)"
        )
    return spec


def with_k(spec: Spec, k: int) -> Spec:
    """``spec`` (checked by :func:`ratio_spec`) with ``k`` set where the ratio sets it."""
    if _takes_k(spec):
        return Spec(spec.name, (*spec.params, ("k", k)), spec.args)
    if spec.name == "scaled" and len(spec.args) == 1:
        return Spec(spec.name, spec.params, (with_k(spec.args[0], k),))
    raise ValueError(f"{str(spec)!r} has no k for a ratio to set")
