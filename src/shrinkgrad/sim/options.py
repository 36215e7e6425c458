"""The options of a run, as one typed object (design.md principle 16).

:class:`RunOptions` holds everything about *how* a run is carried out — rounds, logging, the
stopping rules (:class:`Divergence`, ``tol``), checkpoints, dtypes, the device, the progress bar
and the callback — as opposed to *what* is run (problem, method, compressor, step size, seed,
x⁰). :func:`~shrinkgrad.sim.simulate` and :func:`~shrinkgrad.distributed.run_distributed` accept
the same keywords and build one of these; the engine (:mod:`shrinkgrad.sim.engine`) only ever
sees the object. Every field is validated once, here, with a one-line error naming it.

:class:`Divergence` is the divergence rule of docs/simulator.md ("Status, divergence and
non-finite values"): a run is stopped as ``diverged`` when, at a logged round,

* ‖∇f(xᵗ)‖² > ``grad_factor`` · ‖∇f(x⁰)‖², or
* the loss rose by more than ``loss_factor`` times its initial distance to the problem's certified
  lower bound: f(xᵗ) − f_low > ``loss_factor`` · (f(x⁰) − f_low), with f_low = ``f_lower`` (or
  ``f_star``) of the problem; without a known bound, f(xᵗ) − f(x⁰) > ``loss_factor`` · |f(x⁰)|, or
* the iterate moved away from a known minimiser: ‖xᵗ − x*‖² > ``iterate_factor`` · ‖x⁰ − x*‖²
  (only when the problem knows x*: elsewhere ‖xᵗ‖ may legitimately grow without bound, e.g. a
  logistic loss on separable data, whose infimum is not attained).

The loss test is the one that sees saturating losses diverge: a logistic loss whose sigmoids
saturate has a bounded gradient (|φ'| ≤ 1), so ‖∇f‖² stays small while f grows linearly in ‖x‖
(issue 12.1: EF21 with γ = 10⁶ on w1a, f from 0.69 to 10⁵ with ‖∇f‖² ≈ 10⁻³).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..methods.base import State
from ..network.clock import network_of
from ..network.topology import Network

__all__ = [
    "Callback",
    "Divergence",
    "DivergenceReference",
    "RunOptions",
    "option_defaults",
    "options_of_call",
]

#: ``callback(round, state)`` after every logged row; a true return value stops the run
Callback = Callable[[int, State[Any, Any]], "bool | None"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "double": torch.float64}


def _factor(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number > 1 or None, got {value!r}")
    v = float(value)
    if not v > 1 or math.isnan(v):
        raise ValueError(f"{name} must be a number > 1 or None, got {value!r}")
    return v


@dataclasses.dataclass(frozen=True)
class DivergenceReference:
    """What the divergence tests compare against, fixed at round 0 of a run.

    ``gns0`` = ‖∇f(x⁰)‖², ``loss0`` = f(x⁰), ``f_lower`` the problem's certified lower bound on
    inf f (None when unknown), ``dist0_sq`` = ‖x⁰ − x*‖² (None when x* is unknown).

    A start within √eps (relative) of the bound — at the minimum, up to rounding — gives the
    loss and gradient tests no scale: they are skipped (f(x⁰) − f_low and ‖∇f(x⁰)‖² are then
    rounding noise, and any method that does not stay exactly at x* would "grow" by orders of
    magnitude). Non-finite values still stop such a run.
    """

    gns0: float
    loss0: float
    f_lower: float | None = None
    dist0_sq: float | None = None
    #: machine epsilon of the run's dtype (the rounding level of the loss)
    eps: float = float(np.finfo(np.float64).eps)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """When a run counts as diverged (module docstring); a factor of ``None`` turns its test off.

    Defaults: ``grad_factor=1e8`` (the simulator's original rule), ``loss_factor=1e2`` and
    ``iterate_factor=1e8``. The loss factor is far below the others because a diverging loss
    often grows only linearly in ‖x‖ (saturating losses), and because no ordinary run comes near
    it: over every run of the bundled reproductions the largest f(xᵗ) − f_low at a logged round
    is at most ~10× its initial value (docs/simulator.md). Non-finite values always stop a run,
    whatever the factors. ``Divergence.off()`` disables the three tests.
    """

    grad_factor: float | None = 1e8
    loss_factor: float | None = 1e2
    iterate_factor: float | None = 1e8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _factor(getattr(self, f.name), f.name))

    @classmethod
    def off(cls) -> Divergence:
        """No growth test (only non-finite values stop a run)."""
        return cls(None, None, None)

    @classmethod
    def of(cls, value: Divergence | float | None) -> Divergence:
        """The rule for ``simulate(divergence_factor=value)``: a :class:`Divergence` as is, a
        number as ``grad_factor`` (the other tests at their defaults), ``None`` as :meth:`off`."""
        if isinstance(value, Divergence):
            return value
        if value is None:
            return cls.off()
        return cls(grad_factor=_factor(value, "divergence_factor"))

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def verdict(
        self, ref: DivergenceReference, gns: float, loss: float, dist_sq: float | None = None
    ) -> str | None:
        """Why a logged round with these metrics diverged (one sentence), or None.

        ``dist_sq`` = ‖xᵗ − x*‖² (when x* is known). A pure function of its arguments, so any
        runtime (simulator, runner, parameter server) can apply the same rule.
        """
        gap0 = None if ref.f_lower is None else ref.loss0 - ref.f_lower
        if gap0 is not None and ref.f_lower is not None and gap0 <= _floor(ref):
            # a start at the certified bound (the minimum): neither the loss nor the gradient
            # has a scale to grow from (the gradient is at rounding level there too)
            return self._iterate(ref, dist_sq)
        if self.grad_factor is not None and ref.gns0 > 0 and gns > self.grad_factor * ref.gns0:
            return (
                f"grad_norm_sq grew from {ref.gns0:.3g} to {gns:.3g} (more than "
                f"{self.grad_factor:g}x)"
            )
        if self.loss_factor is not None:
            if gap0 is not None and ref.f_lower is not None:
                if loss - ref.f_lower > self.loss_factor * gap0:
                    return (
                        f"the loss grew from {ref.loss0:.4g} to {loss:.4g}, more than "
                        f"{self.loss_factor:g}x its initial distance {gap0:.3g} to the lower "
                        f"bound {ref.f_lower:.4g}"
                    )
            elif ref.loss0 != 0 and loss - ref.loss0 > self.loss_factor * abs(ref.loss0):
                return (
                    f"the loss grew from {ref.loss0:.4g} to {loss:.4g} (by more than "
                    f"{self.loss_factor:g}x its initial magnitude)"
                )
        return self._iterate(ref, dist_sq)

    def _iterate(self, ref: DivergenceReference, dist_sq: float | None) -> str | None:
        if (
            self.iterate_factor is not None
            and dist_sq is not None
            and ref.dist0_sq is not None
            and ref.dist0_sq > 0
            and dist_sq > self.iterate_factor * ref.dist0_sq
        ):
            return (
                f"the distance to the minimiser grew from {math.sqrt(ref.dist0_sq):.3g} to "
                f"{math.sqrt(dist_sq):.3g} (its square by more than {self.iterate_factor:g}x)"
            )
        return None


def _floor(ref: DivergenceReference) -> float:
    """√eps · max(|f(x⁰)|, |f_low|): an initial gap below it is no scale to grow from."""
    assert ref.f_lower is not None
    return math.sqrt(ref.eps) * max(abs(ref.loss0), abs(ref.f_lower))


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _dtype(value: torch.dtype | str | None, name: str, allowed: tuple[torch.dtype, ...]) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        key = value.replace("torch.", "")
        table = {**_DTYPES, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if key in table:
            value = table[key]
    if isinstance(value, torch.dtype) and value in allowed:
        return value
    names = ", ".join(f"'{str(a).replace('torch.', '')}'" for a in allowed)
    raise ValueError(f"{name} must be one of {names} (or the torch dtype), got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a run is carried out (module docstring); the keywords of ``simulate`` as one value.

    ``rounds``: number of rounds; ``log_every``: a row every k rounds (round 0 and the last round
    always); ``tol``: stop (``converged``) at the first logged round with grad_norm_sq ≤ tol;
    ``divergence``: the :class:`Divergence` rule; ``dtype`` (None: the problem's), ``device``
    (None: the problem's), ``wire_dtype`` (bit counting); ``checkpoint`` (a file, or the prefix
    of the ranks' files in a distributed run) and ``checkpoint_every``; ``progress``: a progress
    bar on stderr; ``callback(round, state)`` after every logged row (True stops the run);
    ``network`` (a :class:`~shrinkgrad.network.Network` or its spec, e.g.
    ``"star[up=10mbit,down=100mbit,latency=20ms]"``): model each round's wall-clock time on it,
    the table's ``time_model_s`` column (:mod:`shrinkgrad.network.clock`; simulator only).
    """

    rounds: int = 100
    log_every: int = 1
    tol: float | None = None
    divergence: Divergence = dataclasses.field(default_factory=Divergence)
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    wire_dtype: torch.dtype = torch.float32
    checkpoint: Path | None = None
    checkpoint_every: int = 1000
    progress: bool = False
    callback: Callback | None = None
    network: Network | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "rounds", _int(self.rounds, "rounds", 0))
        put(self, "log_every", _int(self.log_every, "log_every", 1))
        tol = self.tol
        if tol is not None:
            ok = not isinstance(tol, bool) and isinstance(tol, (int, float, np.floating))
            if not ok or not float(tol) >= 0:
                raise ValueError(f"tol must be a number >= 0 or None, got {tol!r}")
            put(self, "tol", float(tol))
        if not isinstance(self.divergence, Divergence):
            put(self, "divergence", Divergence.of(self.divergence))
        put(self, "dtype", _dtype(self.dtype, "dtype", (torch.float32, torch.float64)))
        wire = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        put(self, "wire_dtype", _dtype(self.wire_dtype, "wire_dtype", wire))
        if self.device is not None and not isinstance(self.device, torch.device):
            try:
                put(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"device must be 'cpu', 'cuda', 'cuda:0', ... or None, got {self.device!r}"
                ) from None
        if self.checkpoint is not None:
            if not isinstance(self.checkpoint, (str, os.PathLike)):
                raise ValueError(
                    f"checkpoint must be a file path or None, got {type(self.checkpoint).__name__}"
                )
            put(self, "checkpoint", Path(os.fspath(self.checkpoint)))
        put(self, "checkpoint_every", _int(self.checkpoint_every, "checkpoint_every", 1))
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress must be True or False, got {self.progress!r}")
        if self.callback is not None and not callable(self.callback):
            raise ValueError(f"callback must be callable or None, got {self.callback!r}")
        put(self, "network", network_of(self.network))

    def replace(self, **changes: Any) -> RunOptions:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(
        cls,
        *,
        rounds: int = 100,
        log_every: int = 1,
        tol: float | None = None,
        divergence_factor: Divergence | float | None = 1e8,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        wire_dtype: torch.dtype | str = torch.float32,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        progress: bool = False,
        callback: Callback | None = None,
        network: Network | str | None = None,
    ) -> RunOptions:
        """The options of ``simulate``'s keywords (``divergence_factor`` as in
        :meth:`Divergence.of`, ``checkpoint_every=None`` as 1000)."""
        return cls(
            rounds=rounds,
            log_every=log_every,
            tol=tol,
            divergence=Divergence.of(divergence_factor),
            dtype=dtype,  # type: ignore[arg-type]  # normalised in __post_init__
            device=device,  # type: ignore[arg-type]
            wire_dtype=wire_dtype,  # type: ignore[arg-type]
            checkpoint=checkpoint,  # type: ignore[arg-type]
            checkpoint_every=1000 if checkpoint_every is None else checkpoint_every,
            progress=progress,
            callback=callback,
            network=network,  # type: ignore[arg-type]  # a spec is built in __post_init__
        )


def option_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """The defaults of ``fn``'s run-option keywords (those of :meth:`RunOptions.build`)."""
    names = inspect.signature(RunOptions.build).parameters
    params = inspect.signature(fn).parameters
    return {k: p.default for k, p in params.items() if k in names}


def options_of_call(
    options: RunOptions | None, arguments: Mapping[str, Any], defaults: Mapping[str, Any]
) -> RunOptions:
    """The :class:`RunOptions` of a call such as ``simulate(...)``: ``options`` when given (then
    no run-option keyword may differ from its default), else those built from the keywords.

    ``arguments`` is the call's ``locals()``, ``defaults`` :func:`option_defaults` of the function.
    """
    given = {k: arguments[k] for k in defaults if k in arguments}
    if options is None:
        return RunOptions.build(**given)
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be a RunOptions, got {type(options).__name__}")
    changed = sorted(k for k, v in given.items() if not _same(v, defaults[k]))
    if changed:
        raise TypeError(
            "pass the run options either as options=RunOptions(...) or as keywords, not both "
            f"(also given: {', '.join(changed)}); use options.replace({changed[0]}=...)"
        )
    return options


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and bool(a == b))
