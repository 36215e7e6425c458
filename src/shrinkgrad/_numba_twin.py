"""Serial and threaded numba dispatchers of one kernel, each with a disk cache of its own.

numba's on-disk cache names a dispatcher's file after its function's module, qualified name and
first line, and keys the entries inside by signature only, not by compile options. Two cached
dispatchers of one Python function (a serial one and a ``parallel=True`` one) therefore shared
their entries: whichever compiled first was loaded by both, and a ``threads=2`` pass ran the
serial machine code on one core. :func:`twin` gives the threaded dispatcher a renamed copy of
the function (the same code object: one implementation). ``tests/test_numba_cache.py`` fails on
any two cached dispatchers that would share a cache file.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["twin"]


def twin(func: Any, suffix: str = "_threads") -> Any:
    """A copy of ``func`` (same code, globals, defaults, closure) whose ``__name__`` and
    ``__qualname__`` end in ``suffix``, for a second dispatcher with other compile options."""
    copy = types.FunctionType(
        func.__code__, func.__globals__, func.__name__ + suffix, func.__defaults__, func.__closure__
    )
    copy.__qualname__ = func.__qualname__ + suffix
    copy.__doc__ = func.__doc__
    return copy
