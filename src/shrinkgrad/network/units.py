"""Quantities with units, as written in network specs: bandwidths and durations.

* A **bandwidth** is a number of bit/s (Python's or numpy's), or a number with a unit: a
  decimal prefix (``k`` = 10³, ``m``/``M`` = 10⁶, ``g``/``G`` = 10⁹, ``t``/``T`` = 10¹²;
  networks count in powers of ten) then ``bit``/``bits``/``b``/``bps`` (bits) or
  ``byte``/``bytes``/``B``/``Bps`` (bytes, × 8), optionally ``/s``: ``10mbit``, ``1gbit``,
  ``100kbit/s``, ``50Mbps``, ``12.5MB/s``, ``1.25GByte``. ``inf`` is an infinitely fast link.
  ``b`` is a bit and ``B`` a byte, as in "Mbps" against "MB/s". (``tc`` spells megabytes per
  second "mbps"; here "mbps" is megabits.) The words ``bit(s)`` and ``byte(s)`` may be in any
  case (``10MBIT``, ``1GBYTES``); ``bps`` only as ``bps`` (bits) or ``Bps`` (bytes): other
  capitalisations (``10MBPS``) are refused as ambiguous, with both spellings in the message. A
  number that overflows to infinity (``1e400``) is refused: only ``inf`` itself is an
  infinitely fast link.
* A **duration** is a number of seconds (Python's or numpy's), or a number with ``s``, ``ms``,
  ``us``/``µs`` (the micro sign or the Greek mu) or ``ns``: ``20ms``, ``50us``, ``0.05s``.

Both parsers raise a ValueError that names the parameter and the allowed form.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import numpy as np

__all__ = [
    "BANDWIDTH_FORM",
    "DURATION_FORM",
    "format_bandwidth",
    "format_duration",
    "parse_bandwidth",
    "parse_duration",
]

#: the allowed form of a bandwidth, quoted by every error about one
BANDWIDTH_FORM = (
    "a bandwidth such as 10mbit, 1gbit, 100kbit/s, 50Mbps, 12.5MB/s (bytes), inf, or a number "
    "of bit/s"
)
#: the allowed form of a duration, quoted by every error about one
DURATION_FORM = "a duration such as 20ms, 50us, 0.05s, or a number of seconds"

_NUMBER = r"(?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_RATE = re.compile(_NUMBER + r"\s*(?P<prefix>[kKmMgGtT]?)(?P<unit>[A-Za-z]+)(?:/s)?")
_TIME = re.compile(_NUMBER + r"\s*(?P<unit>s|ms|us|µs|μs|ns)")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BIT_UNITS = ("bit", "bits", "b", "bps")
_BYTE_UNITS = ("byte", "bytes", "B", "Bps", "Byte", "Bytes")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a real number — Python's or numpy's (``np.int64``,
    ``np.float32``: the entries of a per-client array) — else None; bools are not numbers."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def parse_bandwidth(value: Any, what: str = "bandwidth") -> float:
    """Bits per second of ``value`` (see the module docstring); ``what`` names the parameter.

    Must be > 0; ``inf`` (or ``math.inf``) is an infinitely fast link.
    """
    rate = _number(value)
    literal_inf = rate is not None and math.isinf(rate)  # math.inf: an infinitely fast link
    if rate is None and isinstance(value, str):
        text = value.strip()
        if text.lower() in ("inf", "+inf", "infinity"):
            rate, literal_inf = math.inf, True
        else:
            m = _RATE.fullmatch(text)
            unit = m.group("unit") if m else ""
            if m and unit.lower() == "bps" and unit not in ("bps", "Bps"):
                raise ValueError(
                    f"{what}: {value!r} is ambiguous (bits or bytes?): write "
                    f"{m.group('num')}{m.group('prefix')}bps or {m.group('num')}"
                    f"{m.group('prefix')}bit for bits per second, {m.group('num')}"
                    f"{m.group('prefix')}Bps or {m.group('num')}{m.group('prefix')}B/s for bytes"
                )
            if m and (unit in _BIT_UNITS or unit.lower() in ("bit", "bits", "bps")):
                factor = 1.0 if unit != "Bps" else 8.0
            elif m and (unit in _BYTE_UNITS or unit.lower() in ("byte", "bytes")):
                factor = 8.0
            else:
                m = None
            if m is not None:
                rate = float(m.group("num")) * _PREFIX[m.group("prefix").lower()] * factor
            elif re.fullmatch(_NUMBER, text):
                rate = float(text)  # a bare number of bit/s
    if rate is None or math.isnan(rate):
        raise ValueError(f"{what}: cannot read {value!r}; give {BANDWIDTH_FORM}")
    if math.isinf(rate) and not literal_inf:
        raise ValueError(
            f"{what}: {value!r} is out of range (it overflows to infinity); give {BANDWIDTH_FORM}"
            " (inf itself for an infinitely fast link)"
        )
    if not rate > 0:
        raise ValueError(f"{what} must be > 0, got {value!r}; give {BANDWIDTH_FORM}")
    return rate


def parse_duration(value: Any, what: str = "duration") -> float:
    """Seconds of ``value`` (see the module docstring); must be finite and ≥ 0."""
    seconds = _number(value)
    if seconds is None and isinstance(value, str):
        m = _TIME.fullmatch(value.strip())
        if m is not None:
            seconds = float(m.group("num")) * _SECONDS[m.group("unit")]
        else:
            try:
                seconds = float(value.strip())
            except ValueError:
                seconds = None
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"{what}: cannot read {value!r}; give {DURATION_FORM}")
    if seconds < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}; give {DURATION_FORM}")
    return seconds


def format_bandwidth(bits_per_s: float) -> str:
    """A readable bandwidth: ``10 Mbit/s``, ``1.5 Gbit/s``, ``inf``."""
    if math.isinf(bits_per_s):
        return "inf"
    for factor, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= factor:
            return f"{bits_per_s / factor:.4g} {name}"
    return f"{bits_per_s:.4g} bit/s"


def format_duration(seconds: float) -> str:
    """A readable duration: ``20 ms``, ``50 µs``, ``3.2 s``, ``1.5 h``."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds == 0:
        return "0 s"
    for factor, name in ((3600.0, "h"), (60.0, "min"), (1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= factor:
            return f"{seconds / factor:.4g} {name}"
    return f"{seconds * 1e9:.4g} ns"
