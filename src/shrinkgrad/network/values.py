"""Per-client values of a network spec: one value, a list, or a seeded distribution.

Every link parameter (``up``, ``down``, ``bandwidth``, ``latency``, ``compute``) takes one of

* a single value, the same for every client: ``up=10mbit``;
* a list, one value per client: ``up=[10mbit,10mbit,1mbit]`` (its length must be the number of
  clients the network is used with);
* a distribution (:data:`DISTRIBUTIONS`), for heterogeneous federated clients:
  ``up=loguniform[low=1mbit,high=100mbit,seed=0]``, ``compute=uniform[low=10ms,high=50ms]``,
  ``up=lognormal[median=20mbit,sigma=1,seed=3]``. Client i's draw is a function of (seed, i)
  only (:class:`shrinkgrad.rng.Keys`, stream ``"network"``): adding clients never changes the
  values of the others, and the same seed gives the same network on every machine. Hence two
  parameters drawn with the same seed (the default 0) use the same uniforms u_i and are
  perfectly rank-correlated: with ``up=loguniform[...]`` and ``compute=uniform[...]`` the
  client with the fastest uplink is also the slowest to compute. Give each parameter its own
  seed (``up=loguniform[low=1mbit,high=100mbit,seed=1],compute=uniform[low=10ms,high=50ms,
  seed=2]``) for independent draws (docs/network.md §1).

Draws that are not finite values the parameter accepts (a bandwidth > 0, a duration >= 0 —
e.g. a loguniform whose high/low overflows, a lognormal with an enormous sigma) are a one-line
ValueError naming the parameter and the client when the values are asked for.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar

import numpy as np

from ..registry import Registry, Spec, SpecError

__all__ = [
    "DISTRIBUTIONS",
    "BandwidthValue",
    "Distribution",
    "DurationValue",
    "PerClient",
    "Value",
    "per_client",
]

#: what a link parameter accepts (see the module docstring)
Value = float | str | Sequence[float | str] | Spec
#: a bandwidth parameter, as the registry describes it in errors and listings
BandwidthValue = Annotated[
    Value, "a bandwidth (10mbit, 1gbit, 12.5MB/s, inf), a list [..] or a distribution"
]
#: a duration parameter, as the registry describes it in errors and listings
DurationValue = Annotated[Value, "a duration (20ms, 50us, 0.05s), a list [..] or a distribution"]

#: ``parse(raw, what) -> float``: a unit parser of :mod:`shrinkgrad.network.units`
Parser = Callable[[Any, str], float]


class Distribution(abc.ABC):
    """A seeded distribution of per-client values; bounds are read by the parameter's parser."""

    __registry__: ClassVar[Registry[Distribution]]
    spec: str = ""

    @abc.abstractmethod
    def check(self, parse: Parser, what: str) -> None:
        """Raise a ValueError naming ``what`` when the parameters are not valid values."""

    @abc.abstractmethod
    def draw(self, n: int, parse: Parser, what: str) -> np.ndarray:
        """The values of clients 0..n−1 (float64, shape ``(n,)``)."""

    def _uniforms(self, seed: int, n: int, k: int = 1) -> np.ndarray:
        """``k`` uniforms in (0, 1) per client, keyed by (seed, client): shape ``(n, k)``."""
        from ..rng import Keys

        keys = Keys.derive(int(seed), client=np.arange(n), stream="network")
        return keys.uniform(k).numpy()


DISTRIBUTIONS: Registry[Distribution] = Registry("distribution", base=Distribution)
Distribution.__registry__ = DISTRIBUTIONS


def _check_seed(seed: int, name: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{name}: seed must be an integer >= 0, got {seed!r}")
    return seed


@DISTRIBUTIONS.register("uniform")
class Uniform(Distribution):
    """Uniform on [low, high]: client i gets low + u_i (high − low)."""

    def __init__(self, low: float | str, high: float | str, seed: int = 0) -> None:
        self.low, self.high, self.seed = low, high, _check_seed(seed, "uniform")

    #: the name errors use (the subclasses' own)
    label = "uniform"

    def _bounds(self, parse: Parser, what: str) -> tuple[float, float]:
        name = self.label
        lo, hi = parse(self.low, f"{what}: {name} low"), parse(self.high, f"{what}: {name} high")
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
            raise ValueError(
                f"{what}: {name} needs finite low <= high, got low={self.low!r}, high={self.high!r}"
            )
        return lo, hi

    def check(self, parse: Parser, what: str) -> None:
        self._bounds(parse, what)

    def draw(self, n: int, parse: Parser, what: str) -> np.ndarray:
        lo, hi = self._bounds(parse, what)
        return np.asarray(lo + self._uniforms(self.seed, n)[:, 0] * (hi - lo), dtype=np.float64)


@DISTRIBUTIONS.register("loguniform")
class LogUniform(Uniform):
    """Log-uniform on [low, high] (low > 0): client i gets low · (high/low)^{u_i}; the usual
    model of bandwidths spread over orders of magnitude."""

    label = "loguniform"

    def _bounds(self, parse: Parser, what: str) -> tuple[float, float]:
        lo, hi = super()._bounds(parse, what)
        if lo <= 0:
            raise ValueError(f"{what}: loguniform needs low > 0, got low={self.low!r}")
        return lo, hi

    def draw(self, n: int, parse: Parser, what: str) -> np.ndarray:
        lo, hi = self._bounds(parse, what)
        u = self._uniforms(self.seed, n)[:, 0]
        with np.errstate(over="ignore"):  # an overflow is inf, refused by PerClient.values
            return np.asarray(lo * (hi / lo) ** u, dtype=np.float64)


@DISTRIBUTIONS.register("lognormal")
class LogNormal(Distribution):
    """Log-normal with the given median and σ of the log: client i gets median · e^{σ z_i},
    z_i standard normal (Box–Muller from two keyed uniforms)."""

    def __init__(self, median: float | str, sigma: float = 1.0, seed: int = 0) -> None:
        if isinstance(sigma, bool) or not math.isfinite(sigma) or sigma < 0:
            raise ValueError(f"lognormal: sigma must be a finite number >= 0, got {sigma!r}")
        self.median, self.sigma, self.seed = median, float(sigma), _check_seed(seed, "lognormal")

    def _median(self, parse: Parser, what: str) -> float:
        m = parse(self.median, f"{what}: lognormal median")
        if not (math.isfinite(m) and m > 0):
            raise ValueError(f"{what}: lognormal needs a finite median > 0, got {self.median!r}")
        return m

    def check(self, parse: Parser, what: str) -> None:
        self._median(parse, what)

    def draw(self, n: int, parse: Parser, what: str) -> np.ndarray:
        m = self._median(parse, what)
        u = self._uniforms(self.seed, n, 2)
        z = np.sqrt(-2.0 * np.log(u[:, 0])) * np.cos(2.0 * math.pi * u[:, 1])
        with np.errstate(over="ignore", under="ignore"):  # refused by PerClient.values
            return np.asarray(m * np.exp(self.sigma * z), dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class PerClient:
    """A link parameter's value for every client: see the module docstring.

    ``raw`` is what the spec (or the caller) gave, ``parse`` its unit parser and ``what`` the
    parameter's name in errors (``"star parameter 'up'"``).
    """

    raw: Any
    parse: Parser
    what: str

    def __post_init__(self) -> None:
        # fail at construction, not at first use: every form is checked here
        if isinstance(self.raw, Distribution):
            self.raw.check(self.parse, self.what)
        elif isinstance(self.raw, (tuple, list, np.ndarray)):
            if len(self.raw) == 0:
                raise ValueError(f"{self.what}: an empty list; give one value per client")
            for i, v in enumerate(self.raw):
                self.parse(v, f"{self.what}[{i}]")
        else:
            self.parse(self.raw, self.what)

    @property
    def count(self) -> int | None:
        """The number of clients a list fixes (None for a single value or a distribution)."""
        if isinstance(self.raw, (tuple, list, np.ndarray)):
            return len(self.raw)
        return None

    @property
    def single(self) -> float | None:
        """The value when it is the same for every client, else None."""
        if isinstance(self.raw, (Distribution, tuple, list, np.ndarray)):
            return None
        return self.parse(self.raw, self.what)

    def values(self, n: int) -> np.ndarray:
        """The values of clients 0..n−1, shape ``(n,)``; a list must have exactly n entries."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"the number of clients must be an integer >= 1, got {n!r}")
        if isinstance(self.raw, Distribution):
            return self._checked(self.raw.draw(int(n), self.parse, self.what))
        if isinstance(self.raw, (tuple, list, np.ndarray)):
            if len(self.raw) != n:
                raise ValueError(
                    f"{self.what}: a list of {len(self.raw)} values for {n} clients; give one "
                    f"value per client ({n} values) or a single value"
                )
            return np.array(
                [self.parse(v, f"{self.what}[{i}]") for i, v in enumerate(self.raw)],
                dtype=np.float64,
            )
        return np.full(int(n), self.parse(self.raw, self.what), dtype=np.float64)

    def _checked(self, drawn: np.ndarray) -> np.ndarray:
        """``drawn`` when every draw is a finite value the parameter's parser accepts (a
        bandwidth > 0, a duration >= 0), else a one-line ValueError naming the parameter and
        the client: a distribution whose draws overflow (loguniform with a huge high/low,
        lognormal with a huge sigma) must not give a silently infinite or zero link."""
        bad = np.flatnonzero(~np.isfinite(drawn))
        i = int(bad[0]) if bad.size else int(np.argmin(drawn))
        ok = not bad.size
        if ok:  # the smallest draw: the parser refuses it if any is out of range
            try:
                self.parse(float(drawn[i]), self.what)
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(
                f"{self.what}: {self} draws {float(drawn[i])!r} for client {i}, not a finite "
                "value > 0 (a bandwidth) or >= 0 (a duration); narrow the distribution (its "
                "low/high or sigma)"
            )
        return drawn

    def __str__(self) -> str:
        if isinstance(self.raw, Distribution):
            return self.raw.spec or type(self.raw).__name__
        return str(self.raw)


def per_client(raw: Any, parse: Parser, what: str) -> PerClient:
    """The :class:`PerClient` of a parameter: a spec value (a sub-spec names a distribution)."""
    if isinstance(raw, Spec):
        try:
            raw = DISTRIBUTIONS.make(raw)
        except SpecError as e:
            raise ValueError(f"{what}: {e}") from None
    elif isinstance(raw, str) and "[" in raw:
        raw = DISTRIBUTIONS.make(raw)
    return PerClient(raw, parse, what)
