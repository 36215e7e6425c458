"""How much memory a computation may still take, and the one-line refusal when it cannot fit.

Used *before* allocating anything whose size follows from the data's declared dimension (a
LIBSVM file can name a feature index of 3·10⁸ in a few bytes): the loader checks that one float64
vector of d entries fits (every method needs the iterate x ∈ R^d), ``shrinkgrad theory`` checks
its working set of d-vectors. A refusal is a :class:`MemoryBudgetError` (a ``ValueError``, so
the command line prints it as one ``error:`` line) that says how much was needed, how much is
available and what to do.

The available memory is the smallest of what the system reports: ``MemAvailable`` of
``/proc/meminfo``, the cgroup (v2 or v1) limit minus the cgroup's usage, and the soft address
space / data limits (``ulimit -v`` / ``ulimit -d``) minus what the process already maps. Where
none is readable (not Linux) it falls back to the free physical pages.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

__all__ = ["MemoryBudgetError", "available_memory", "check_memory", "format_bytes"]


class MemoryBudgetError(ValueError):
    """A computation would need more memory than is available (said before allocating)."""


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style text for a byte count."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024.0 or unit == "PiB":
            return f"{value:.3g} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024.0
    return f"{value:.3g} PiB"  # pragma: no cover - the loop returns


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    limit = _read_int("/sys/fs/cgroup/memory.max")  # v2 ("max" reads as None)
    usage = _read_int("/sys/fs/cgroup/memory.current")
    if limit is None:
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
        if limit is not None and limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
    if limit is None:
        return None
    return max(0, limit - (usage or 0))


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rlimit_available() -> int | None:
    out: list[int] = []
    for which, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            out.append(max(0, soft - (_status_kib(field) or 0)))
    return min(out) if out else None


def available_memory() -> int:
    """Bytes this process can still allocate (the smallest limit the system reports)."""
    sources = (_meminfo_available(), _cgroup_available(), _rlimit_available())
    known = [v for v in sources if v is not None]
    if known:
        return min(known)
    try:  # pragma: no cover - not Linux
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 1 << 62


def check_memory(nbytes: float, what: str, fix: str = "") -> None:
    """Raise :class:`MemoryBudgetError` when ``nbytes`` exceed the available memory.

    ``what`` says what needs the memory (e.g. "one float64 vector of d = 3e10 entries"),
    ``fix`` what the user can do; the message is one line.
    """
    free = available_memory()
    if nbytes > free:
        hint = f"; {fix}" if fix else ""
        raise MemoryBudgetError(
            f"{what} needs {format_bytes(nbytes)}, more than the {format_bytes(free)} of memory "
            f"available{hint}"
        )
