"""Step-size specifications: a number, ``"theory"``, or ``"theory*m"`` (m × the theory step).

One syntax for the Python API, config files and the CLI::

    stepsize=0.1            # a constant γ
    stepsize="theory"       # the rule of methods.md §4 for the method, resolved at bind time
    stepsize="theory*4"     # four times the theory step (the usual experiment knob)
    stepsize="0.1"          # a number given as a string (config files)

The rules themselves live in :mod:`shrinkgrad.theory`; each method's ``theory_stepsize`` says
which one it uses, and the run records it as ``stepsize_rule`` (e.g.
``"stepsize_ef21_reloaded*4"``, or ``"constant"``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = ["StepSize", "parse_stepsize", "theory_function"]

_THEORY = re.compile(r"^\s*theory\s*(?:\*\s*(?P<m>[0-9.eE+\-]+)\s*)?$")
_THEORY_LEFT = re.compile(r"^\s*(?P<m>[0-9.eE+\-]+)\s*\*\s*theory\s*$")


@dataclasses.dataclass(frozen=True)
class StepSize:
    """A parsed step size: ``theory`` with a ``multiplier``, or a constant ``value``."""

    theory: bool
    multiplier: float = 1.0
    value: float = math.nan

    def __str__(self) -> str:
        if self.theory:
            return "theory" if self.multiplier == 1.0 else f"theory*{self.multiplier:g}"
        return f"{self.value:g}"


def _positive(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(
            f"cannot read the {what} {text!r}: write a positive number, 'theory' or 'theory*4'"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"the {what} must be a finite number > 0, got {text!r}")
    return v


def parse_stepsize(spec: float | int | str | StepSize) -> StepSize:
    """Parse ``0.1``, ``"0.1"``, ``"theory"``, ``"theory*4"`` (or ``"4*theory"``)."""
    if isinstance(spec, StepSize):
        return spec
    if isinstance(spec, bool):
        raise TypeError("stepsize must be a number or 'theory' / 'theory*m', got a bool")
    if isinstance(spec, (int, float)):
        return StepSize(False, value=_positive(repr(float(spec)), "step size"))
    if not isinstance(spec, str):
        raise TypeError(
            f"stepsize must be a number or 'theory' / 'theory*m', got {type(spec).__name__}"
        )
    m = _THEORY.match(spec) or _THEORY_LEFT.match(spec)
    if m is not None:
        mult = m.group("m")
        return StepSize(True, multiplier=1.0 if mult is None else _positive(mult, "multiplier"))
    if "theory" in spec:
        raise ValueError(
            f"cannot read the step size {spec!r}: write 'theory' or 'theory*m' with a positive "
            "number m, e.g. 'theory*4'"
        )
    return StepSize(False, value=_positive(spec, "step size"))


def theory_function(name: str) -> Callable[..., Any]:
    """The step-size rule ``shrinkgrad.theory.<name>``, with a clear error when it is missing."""
    from .. import theory

    fn = getattr(theory, name, None)
    if fn is None or not callable(fn):
        raise ValueError(
            f"the theory rule shrinkgrad.theory.{name} is not available in this version; pass a "
            "numeric stepsize instead"
        )
    return fn  # type: ignore[no-any-return]
