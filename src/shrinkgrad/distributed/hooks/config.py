"""The hook's configuration: argument checks, the method (and its deprecated aliases), the
compressor of every tensor size, and the keys of the random draws.

Nothing here runs per step except :meth:`Settings.keys` and the cached lookups of
:meth:`Settings.compressor_for`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ...compressors import COMPRESSORS, Compressor
from ...compressors.ratio import ratio_spec, with_k
from ...methods.base import Constants, Method, UnknownConstantError, make_method
from ...methods.ef21 import EF21
from ...methods.ef21_sgdm import EF21SGDM, ClientMomentum
from ...rng import Keys, KeyStream

__all__ = [
    "ALIASES",
    "GRANULARITIES",
    "HALF",
    "STATE_DTYPES",
    "STREAM",
    "SUMMATIONS",
    "ErrorFeedback",
    "Granularity",
    "Mode",
    "Settings",
    "StateDtype",
    "Summation",
    "factor_refusal",
    "gathers_sums",
    "granularity_refusal",
    "resolve_method",
]

#: the deprecated ``error_feedback=`` names and the methods they stand for
ErrorFeedback = Literal["none", "ef", "ef21", "ef21_w"]
ALIASES: dict[str, str] = {
    "none": "dcgd[biased=true]",
    "ef": "ef",
    "ef21": "ef21",
    "ef21_w": "ef21_w",
}
#: stream of the hooks' keyed draws (see :mod:`shrinkgrad.rng`)
STREAM = "ddp_hook"
#: how compressed messages travel (see :attr:`Settings.collective`)
Mode = Literal["allreduce", "values", "allgather", "factors"]
#: 16-bit gradient dtypes (their values travel in 16 bits; the method computes in float32 unless
#: ``state_dtype="gradient"``)
HALF = (torch.bfloat16, torch.float16)
#: where the method states of 16-bit gradients are kept (``CompressionState(state_dtype=...)``)
StateDtype = Literal["float32", "gradient"]
STATE_DTYPES: tuple[StateDtype, ...] = ("float32", "gradient")
#: the unit of compression (``CompressionState(granularity=...)``): every parameter's gradient
#: (GRANULARITIES[0], GRACE's unit) or every DDP bucket as one flat vector
Granularity = Literal["tensor", "bucket"]
GRANULARITIES: tuple[Granularity, ...] = ("tensor", "bucket")
#: how the summed paths (``allreduce``, ``values``, ``factors``) add the ranks' messages
#: (``CompressionState(summation=...)``): ``"reduce"``, one all-reduce in the values' dtype;
#: ``"gather"``, an all-gather of the values and their sum in the method's dtype, in rank order;
#: ``"auto"``, gather where a 16-bit sum would make a float32 state drift (:meth:`Settings.gathers`)
Summation = Literal["auto", "gather", "reduce"]
SUMMATIONS: tuple[Summation, ...] = ("auto", "gather", "reduce")

_IDENTITY = COMPRESSORS.make("identity")


def gathers_sums(
    summation: str, dtype: torch.dtype, wdtype: torch.dtype, method: Method[Any, Any]
) -> bool:
    """:meth:`Settings.gathers` as a function of its parts (the network model prices the
    hook's collectives with it): ``summation`` ``"gather"``, or ``"auto"`` with 16-bit values
    ``dtype``, a float32 method ``wdtype`` and a method that declares
    :attr:`~shrinkgrad.methods.Method.accumulates_aggregates`."""
    if summation != "auto":
        return summation == "gather"
    return dtype in HALF and wdtype == torch.float32 and bool(method.accumulates_aggregates)


def _dtypes(C: Compressor) -> tuple[torch.dtype, ...]:
    """The input (and wire value) dtypes compressor ``C`` takes."""
    dtypes = getattr(C, "dtypes", None)
    if callable(dtypes):
        return tuple(dtypes())
    return (torch.float32, torch.float64)


def factor_refusal(C: Compressor, weights: torch.Tensor | None = None) -> str | None:
    """Why the hook cannot run ``C`` (None when it can). A compressor whose messages travel as
    an all-reduce of low-rank factors (``collective == "allreduce_factors"``) runs in the hook
    in its shared-basis mode (``power_sgd[rank=r,shared=true]``: PowerSGD's Alg. 1, one P̂ for
    all ranks; per-client PowerSGD's factors, each rank's own, would not add up), with equal
    weights (the shared Q is the mean of the ranks' Q_i; a weighted method would need a second
    Q all-reduce)."""
    if C.collective != "allreduce_factors":
        return None
    r = getattr(C, "r", 4)
    if not getattr(C, "shared", False):
        return (
            f"{C.name} is per-client PowerSGD (each rank its own basis P̂, whose factors do not "
            f"add up); the DDP hook runs PowerSGD's shared basis: use "
            f"power_sgd[rank={r},shared=true] (or rank_k[r={r}], its factors all-gathered)"
        )
    if weights is not None:
        return (
            f"{C.name} shares one Q, the mean of the ranks' Q_i, and the hook does not run it with "
            "weighted methods (ef21_w); use method='ef21' or 'ef'"
        )
    return None


def granularity_refusal(C: Compressor, granularity: str) -> str | None:
    """Why the hook cannot compress with ``C`` at ``granularity`` (None when it can): an
    unknown granularity, or a low-rank compressor (it acts on each parameter's matrix view,
    ``for_shape``) for whole buckets."""
    if granularity not in GRANULARITIES:
        return (
            f"granularity must be one of {', '.join(GRANULARITIES)} (the unit of compression: "
            f"every parameter's gradient, or every DDP bucket as one vector), got {granularity!r}"
        )
    if granularity == "bucket" and callable(getattr(C, "for_shape", None)):
        return (
            f"granularity='bucket' compresses every DDP bucket as one flat vector, and {C.name} "
            "acts on each parameter's matrix view; use granularity='tensor' (the default) with "
            "low-rank compressors"
        )
    return None


def _check_int(name: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def resolve_method(
    method: str | Method[Any, Any] | None,
    error_feedback: str | None,
    momentum: float,
    warmup_steps: int,
) -> Method[Any, Any]:
    """The method the hook runs, from ``method=``, the deprecated ``error_feedback=`` and
    ``momentum=`` (docs/distributed.md, "methods"); raises for a method that cannot run in a hook.

    * ``error_feedback`` ``"none"``/``"ef"``/``"ef21"``/``"ef21_w"`` → ``dcgd[biased=true]`` (any
      compressor, no memory), ``ef``, ``ef21``, ``ef21_w`` (with a DeprecationWarning); with
      ``warmup_steps=0`` EF21's memory started at zero, so the alias is then ``init=zero``;
    * ``momentum=β`` > 0: plain EF21 becomes ``ef21_sgdm[beta=β]``, any other method gets the same
      client momentum in front (:class:`~shrinkgrad.methods.ClientMomentum`).
    """
    if error_feedback is not None:
        if method is not None:
            raise ValueError(
                f"give method= or the deprecated error_feedback=, not both (got method={method!r}, "
                f"error_feedback={error_feedback!r})"
            )
        if error_feedback not in ALIASES:
            raise ValueError(
                f"error_feedback must be one of {', '.join(ALIASES)}, got {error_feedback!r}"
            )
        spec = ALIASES[error_feedback]
        if error_feedback in ("ef21", "ef21_w") and warmup_steps == 0:
            spec += "[init=zero]"
        warnings.warn(
            f"CompressionState(error_feedback={error_feedback!r}) is deprecated; use "
            f"method={spec!r}",
            DeprecationWarning,
            stacklevel=4,
        )
        method = spec
    m = make_method("dcgd[biased=true]" if method is None else method)
    if momentum > 0.0:
        if isinstance(m, ClientMomentum):
            raise ValueError(
                f"momentum={momentum:g} and method {m.name!r} both put a momentum on the clients; "
                "drop momentum= (ef21_sgdm[beta=...] is EF21 with client momentum)"
            )
        if type(m) is EF21 and not (m.weighted or m.partial or m.batch is not None):
            m = EF21SGDM(beta=momentum, init=m.init)
        else:
            m = ClientMomentum(m, momentum)
    m.check_runtime("hook")
    return m


@dataclasses.dataclass
class Settings:
    """The validated configuration of a :class:`~shrinkgrad.distributed.CompressionState`."""

    method: Method[Any, Any]
    template: str | Compressor
    ratio: float | None
    weights: torch.Tensor | None  # the ranks' weights as given (float64), or None
    seed: int
    warmup_steps: int
    min_numel: int
    world_size: int
    rank: int
    state_dtype: StateDtype = "float32"
    granularity: Granularity = "tensor"
    summation: Summation = "auto"
    _compressors: dict[tuple[int, tuple[int, ...], torch.dtype], Compressor | None] = (
        dataclasses.field(default_factory=dict)
    )
    #: the key stream of every client id drawn from (the seed's part of the chain, once)
    _streams: dict[int, KeyStream] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        compressor: str | Compressor,
        *,
        method: str | Method[Any, Any] | None,
        error_feedback: str | None,
        ratio: float | None,
        weights: Sequence[float] | torch.Tensor | None,
        seed: int,
        warmup_steps: int,
        momentum: float,
        min_numel: int,
        world_size: int,
        rank: int,
        state_dtype: str = "float32",
        granularity: str = "tensor",
        summation: str = "auto",
    ) -> Settings:
        seed = _check_int("seed", seed)
        if summation not in SUMMATIONS:
            raise ValueError(
                f"summation must be one of {', '.join(SUMMATIONS)} (how the ranks' summable "
                f"messages are added), got {summation!r}"
            )
        if granularity not in GRANULARITIES:
            raise ValueError(granularity_refusal(_IDENTITY, granularity))
        if state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"state_dtype must be one of {', '.join(STATE_DTYPES)} (where the method states of "
                f"16-bit gradients are kept), got {state_dtype!r}"
            )
        warmup_steps = _check_int("warmup_steps", warmup_steps)
        min_numel = _check_int("min_numel", min_numel)
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, (int, float))
            or not (0.0 <= float(momentum) < 1.0)
        ):
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if ratio is not None and (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 0.0 < float(ratio) <= 1.0
        ):
            raise ValueError(f"ratio must be a number in (0, 1] (e.g. 0.01 for 1%), got {ratio!r}")
        m = resolve_method(method, error_feedback, float(momentum), warmup_steps)
        out = cls(
            method=m,
            template=compressor,
            ratio=None if ratio is None else float(ratio),
            weights=None,
            seed=seed,
            warmup_steps=warmup_steps,
            min_numel=min_numel,
            world_size=world_size,
            rank=rank,
            state_dtype=state_dtype,
            granularity=granularity,
            summation=summation,
        )
        out.weights = out._check_weights(weights)
        C = out.build_compressor(None if ratio is None else 1)  # validates the name
        refusal = None if C is None else factor_refusal(C, out.weights)
        if refusal is not None:
            raise ValueError(refusal)
        refusal = None if C is None else granularity_refusal(C, granularity)
        if refusal is not None:
            raise ValueError(refusal)
        out.check_pairing()
        return out

    def check_pairing(self) -> None:
        """Refuse a method that cannot run with the compressor (EF21 with an unbiased rand_k,
        DCGD with Top-k, ...) when the state is built: the method is bound once, as every
        compressed tensor is bound later (:meth:`~shrinkgrad.methods.Method.bind`), for the
        smallest compressed size (``min_numel``) or, where the compressor cannot take that
        many entries (``top_k[k=5000]``), 2²⁰ — so a model whose tensors are all below
        ``min_numel`` is not spared the check. A compressor too large for both sizes is left to
        the tensors' own check."""
        for d in dict.fromkeys((max(self.min_numel, 1), 1 << 20)):
            try:
                C = self.compressor_for(d)
            except ValueError:
                continue
            if C is not None:
                try:
                    self.method.bind(self.constants(d), C, stepsize=1.0, seed=self.seed)
                except ValueError as e:
                    raise ValueError(f"{e}{self._ratio_hint(C)}") from None
            return

    def _ratio_hint(self, C: Compressor) -> str:
        """With ``ratio=``, what the method's refusal of an unbiased sparsifier means here: its
        advice names a fixed k, and the contractive form takes the ratio too — rand_k_scaled
        for rand_k, ``scaled(...)`` of the compressor as given otherwise (both keep a shared
        seed's values-only all-reduce)."""
        if self.ratio is None or C.kind != "unbiased":
            return ""
        text = self.template.spec if isinstance(self.template, Compressor) else self.template
        if C.name.startswith("rand_k["):
            shared = "[shared_seed=true]" if "shared_seed=true" in C.name else ""
            name = f"rand_k_scaled{shared}"
        else:
            name = f"scaled({text})"
        return f" (with ratio=: CompressionState({name!r}, ratio={self.ratio:g}))"

    # -- the ranks' weights ----------------------------------------------------------------------
    def _check_weights(self, weights: Sequence[float] | torch.Tensor | None) -> torch.Tensor | None:
        """The weights as given, checked against what the method needs (EF21-W's L_i)."""
        n, name = self.world_size, self.method.name
        w = None
        if weights is not None:
            w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1).cpu()
            if w.numel() != n:
                raise ValueError(
                    f"weights needs one entry per rank (world size {n}), got {w.numel()}"
                )
            if not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
                raise ValueError(f"weights must be finite and > 0, got {w.tolist()}")
        try:
            self.method.client_weights(Constants(n, 1))
        except UnknownConstantError:
            if w is None:
                raise ValueError(
                    f"method {name!r} needs weights: one positive number per rank, e.g. the ranks' "
                    "smoothness constants L_i ([EFR] Alg. 2: w_i = L_i / Σ_j L_j)"
                ) from None
            return w
        if w is not None:
            raise ValueError(
                f"weights are the ranks' weights of a weighted method (method='ef21_w'); method "
                f"{name!r} does not use them"
            )
        return None

    def constants(self, numel: int) -> Constants:
        """The constants a tensor of ``numel`` entries is bound with: n = world size, d = numel,
        L unknown, and the weights as the ranks' L_i (EF21-W normalises them itself)."""
        return Constants(self.world_size, numel, None, self.weights)

    # -- compressors ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The compressor's name as used in result tables (``top_k[ratio=0.01]`` style)."""
        C = self.build_compressor(None)
        base = C.name if C is not None else str(self.template)
        return f"{base}[ratio={self.ratio:g}]" if self.ratio is not None else base

    def build_compressor(self, k: int | None) -> Compressor | None:
        """The compressor, with ``k`` substituted when a ratio is used (None: not yet known)."""
        if self.ratio is None:
            return COMPRESSORS.make(self.template)
        text = self.template.spec if isinstance(self.template, Compressor) else self.template
        if not text:
            raise ValueError(
                "ratio needs the compressor by name (e.g. 'top_k' or 'rand_k[shared_seed=true]')"
            )
        spec = ratio_spec(str(text), self.ratio)
        if k is None:
            return None
        return COMPRESSORS.make(with_k(spec, k))

    def compressor_for(
        self, numel: int, shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float32
    ) -> Compressor | None:
        """The compressor of a tensor with ``numel`` entries whose gradients are ``dtype``
        (None: sent uncompressed). A compressor must take the wire's dtype (the gradients'):
        one that does not is refused with the dtypes it takes. A low-rank compressor is bound
        to the tensor's matrix view (``for_shape``: (shape[0], prod(shape[1:])), as torch's
        PowerSGD hook views a parameter; the flat rule for vectors)."""
        key = (numel, tuple(shape), dtype)
        if key in self._compressors:
            return self._compressors[key]
        C: Compressor | None = None
        if numel >= max(self.min_numel, 1):
            if self.ratio is not None:
                C = self.build_compressor(min(numel, max(1, math.ceil(self.ratio * numel))))
            else:
                C = self.build_compressor(None)
            assert C is not None
            for_shape = getattr(C, "for_shape", None)
            if callable(for_shape) and len(shape) >= 2 and math.prod(shape) == numel:
                C = for_shape(shape)
                assert isinstance(C, Compressor)
            takes = _dtypes(C)
            if dtype not in takes:
                names = ", ".join(str(t).removeprefix("torch.") for t in takes)
                raise TypeError(
                    f"{C.name} does not take {str(dtype).removeprefix('torch.')} values (it "
                    f"takes {names}), and the hook sends a tensor's values in its gradient's "
                    f"dtype; use a compressor that does (the dtypes of shrinkgrad list "
                    f"compressors), or min_numel > {numel} to send such tensors uncompressed"
                )
            try:
                C.bits(numel)
            except ValueError as e:
                raise ValueError(
                    f"cannot compress a tensor of {numel} entries with {C.name}: {e}; use ratio=, "
                    f"or min_numel > {numel} to send such tensors uncompressed"
                ) from None
        self._compressors[key] = C
        return C

    @staticmethod
    def identity() -> Compressor:
        """The compressor of uncompressed tensors and of the warm-up iterations."""
        return _IDENTITY

    @property
    def collective(self) -> Mode:
        """How compressed messages travel: ``allreduce`` (dense results, summable), ``values``
        (shared-seed sparsifiers: the k values, summable), ``factors`` (PowerSGD's shared
        basis: P, then Q, all-reduced) or ``allgather`` (packed payloads)."""
        C = self.build_compressor(None if self.ratio is None else 1)
        assert C is not None
        if C.collective == "allreduce":
            return "allreduce"
        if C.collective == "allreduce_factors":
            return "factors"
        if getattr(C, "shared_seed", False):
            return "values"
        return "allgather"

    def gathers(self, dtype: torch.dtype, wdtype: torch.dtype) -> bool:
        """Whether the summed paths all-gather the ranks' values (``dtype``, the gradients')
        and add them in ``wdtype`` (the method's), instead of one all-reduce in ``dtype``.

        ``summation="auto"`` gathers where a 16-bit sum would break the method: 16-bit values,
        a float32 method state, and a method whose server integrates the aggregates
        (:attr:`~shrinkgrad.methods.Method.accumulates_aggregates`: EF21, DIANA). Its clients
        add their own (16-bit) message to their state, so the server's sum must be the exact
        sum of those same values: an all-reduce in 16 bits rounds it, once per round, and EF21's
        g drifts from (1/n) Σ g_i as a random walk. Every rank still sends its message's
        16-bit values (the bytes counted are the same); what grows is what each rank
        receives: n − 1 messages instead of a ring all-reduce's ≈ 2(n − 1)/n.
        """
        return gathers_sums(self.summation, dtype, wdtype, self.method)

    # -- keys --------------------------------------------------------------------------------------
    def keys(self, C: Compressor, uid: int, rank: int, iteration: int) -> Keys | None:
        """The keys of ``rank``'s draw for tensor ``uid`` at ``iteration`` (None: deterministic).

        ``Keys.derive(seed, round=iteration, client=rank, stream="ddp_hook").fold(uid)``, with
        client 0 on every rank for ``shared_seed`` compressors.
        """
        if C.deterministic:
            return None
        client = 0 if getattr(C, "shared_seed", False) else rank
        stream = self._streams.get(client)
        if stream is None:  # Keys.derive's chain up to the round, computed once per client
            stream = self._streams[client] = KeyStream(self.seed, client, stream=STREAM)
        return stream.at(iteration).fold(uid)

    def describe(self) -> dict[str, Any]:
        """What a checkpoint must match (:mod:`.memory`)."""
        template = self.template.spec if isinstance(self.template, Compressor) else self.template
        return {
            "compressor": str(template),
            "ratio": self.ratio,
            "method": self.method.name,
            "weights": None if self.weights is None else self.weights.tolist(),
            "seed": self.seed,
            "warmup_steps": self.warmup_steps,
            "min_numel": self.min_numel,
            "world_size": self.world_size,
            "rank": self.rank,
            "state_dtype": self.state_dtype,
            "granularity": self.granularity,
            "summation": self.summation,
        }
