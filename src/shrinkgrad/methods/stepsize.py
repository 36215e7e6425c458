"""Step-size specifications: the one grammar of the Python API, the configs, the CLI and every
runtime (the simulator, the runner, the parameter server), resolved by ``Method.bind``::

    stepsize=0.1                # a constant γ
    stepsize="theory"           # the rule of methods.md §4 for the method, resolved at bind time
    stepsize="theory*4"         # four times the theory step (the usual experiment knob)
    stepsize="0.1"              # a number given as a string (config files)
    stepsize="theory(ef21)*4"   # 4 × the theory step of *another* method on the same problem and
                                # compressor (classic EF has no rule; [EF21] runs it at multiples
                                # of the EF21 step); rule "stepsize_ef21*4 of ef21"
    stepsize="1/L"              # c divided by a constant of the problem: L, L_AM, L_QM or L_max

The rules themselves live in :mod:`shrinkgrad.theory`; each method's ``theory_stepsize`` says
which one it uses, and the run records it as ``stepsize_rule`` (e.g.
``"stepsize_ef21_reloaded*4"``, or ``"constant"``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

__all__ = ["CONSTANTS", "StepSize", "parse_stepsize", "theory_function"]

_THEORY = re.compile(r"^\s*theory\s*(?:\*\s*(?P<m>[0-9.eE+\-]+)\s*)?$")
_THEORY_LEFT = re.compile(r"^\s*(?P<m>[0-9.eE+\-]+)\s*\*\s*theory\s*$")
_OTHER = re.compile(r"^\s*theory\s*\((?P<method>.+)\)\s*(?:\*\s*(?P<m>[0-9.eE+\-]+)\s*)?$")
_OVER = re.compile(r"^\s*(?P<c>[0-9.eE+\-]+)\s*/\s*(?P<L>[A-Za-z_]+)\s*$")

#: the constants a step size may be written over (``"1/L"``, ``"0.5/L_AM"``)
CONSTANTS = ("L", "L_AM", "L_QM", "L_max")


@dataclasses.dataclass(frozen=True)
class StepSize:
    """A parsed step size.

    ``theory`` with a ``multiplier`` (this method's rule); ``of`` with a ``multiplier`` (the
    theory rule of the method ``of``); ``value`` over the problem constant ``over``
    (``value / L``); or a constant ``value``.
    """

    theory: bool
    multiplier: float = 1.0
    value: float = math.nan
    #: ``"theory(<of>)*m"``: the canonical name of the method whose theory rule is used
    of: str | None = None
    #: ``"c/<over>"``: one of :data:`CONSTANTS`
    over: str | None = None

    def __str__(self) -> str:
        times = "" if self.multiplier == 1.0 else f"*{self.multiplier:g}"
        if self.theory:
            return "theory" + times
        if self.of is not None:
            return f"theory({self.of}){times}"
        if self.over is not None:
            return f"{self.value:g}/{self.over}"
        return f"{self.value:g}"

    def constant(self, consts: Any) -> float:
        """The value of :attr:`over` for ``consts`` (a ``Constants``); raises when unknown."""
        L, L_i = consts.smoothness()
        values = {
            "L": float(L),
            "L_AM": float(L_i.mean()),
            "L_QM": math.sqrt(float((L_i**2).mean())),
            "L_max": float(L_i.max()),
        }
        return values[str(self.over)]


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
    """Parse ``0.1``, ``"0.1"``, ``"theory"``, ``"theory*4"`` (or ``"4*theory"``),
    ``"theory(ef21)*4"`` and ``"1/L"`` (``L``, ``L_AM``, ``L_QM``, ``L_max``).

    The method named in ``theory(...)`` is checked against the method registry and kept in its
    canonical spelling.
    """
    if isinstance(spec, StepSize):
        return spec
    if isinstance(spec, bool):
        raise TypeError("stepsize must be a number or 'theory' / 'theory*m', got a bool")
    if isinstance(spec, numbers.Real):  # numpy's scalars too (np.float32(0.1))
        return StepSize(False, value=_positive(repr(float(spec)), "step size"))
    if not isinstance(spec, str):
        raise TypeError(
            f"stepsize must be a number or 'theory' / 'theory*m', got {type(spec).__name__}"
        )
    m = _OTHER.match(spec)
    if m is not None:
        from .base import make_method

        mult = m.group("m")
        other = make_method(m.group("method").strip()).name
        return StepSize(
            False, multiplier=1.0 if mult is None else _positive(mult, "multiplier"), of=other
        )
    m = _OVER.match(spec)
    if m is not None:
        if m.group("L") not in CONSTANTS:
            raise ValueError(
                f"cannot read the step size {spec!r}: {m.group('L')!r} is not a constant; write "
                f"c/L with L one of {', '.join(CONSTANTS)}, e.g. '1/L'"
            )
        return StepSize(False, value=_positive(m.group("c"), "step size"), over=m.group("L"))
    m = _THEORY.match(spec) or _THEORY_LEFT.match(spec)
    if m is not None:
        mult = m.group("m")
        return StepSize(True, multiplier=1.0 if mult is None else _positive(mult, "multiplier"))
    if "theory" in spec:
        raise ValueError(
            f"cannot read the step size {spec!r}: write 'theory' or 'theory*m' with a positive "
            "number m, e.g. 'theory*4' (or 'theory(method)*m': another method's rule)"
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
