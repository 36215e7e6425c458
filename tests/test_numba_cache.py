"""numba's on-disk cache: every cached dispatcher of the package has a cache of its own.

numba names a cache file after the function's module, qualified name and first line, and keys
its entries by signature only, not by compile options. Two cached dispatchers of one Python
function (a serial and a ``parallel=True`` one) therefore loaded each other's machine code:
``logistic_regression(..., threads=2)`` ran its pass on one core. This test walks every module
of the package and fails on any two cached dispatchers that would share a cache file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict
from typing import Any

import numba
from numba.core.caching import NullCache

import shrinkgrad

#: modules that need an optional extra (skipped when it is not installed)
OPTIONAL = ("dask", "distributed")


def _dispatchers() -> list[tuple[str, Any]]:
    """(name, dispatcher) of every numba dispatcher bound in a module of the package (a
    dispatcher re-exported by another module appears once: keyed by identity)."""
    found: dict[int, tuple[str, Any]] = {}
    for info in pkgutil.walk_packages(shrinkgrad.__path__, "shrinkgrad."):
        try:
            module = importlib.import_module(info.name)
        except ImportError as err:
            if getattr(err, "name", None) in OPTIONAL:
                continue
            raise
        for attr, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher):
                found.setdefault(id(value), (f"{info.name}.{attr}", value))
    return list(found.values())


def test_no_two_cached_dispatchers_share_a_cache_file() -> None:
    by_file: dict[tuple[str, str, int], set[str]] = defaultdict(set)
    dispatchers = _dispatchers()
    for name, disp in dispatchers:
        if isinstance(disp._cache, NullCache):
            continue
        f = disp.py_func
        by_file[(f.__module__, f.__qualname__, f.__code__.co_firstlineno)].add(name)
    assert len(by_file) >= 20, f"too few cached kernels found: {len(by_file)}"
    shared = {key: names for key, names in by_file.items() if len(names) > 1}
    assert not shared, f"cached dispatchers sharing one numba cache file: {shared}"


def test_the_threaded_pass_is_a_parallel_dispatcher_and_the_serial_one_is_not() -> None:
    from shrinkgrad.problems import _kernels as K

    for serial, threaded in (
        (K.point_pass_csr, K.point_pass_csr_threads),
        (K.point_pass_dense, K.point_pass_dense_threads),
    ):
        assert threaded.targetoptions.get("parallel") is True
        assert not serial.targetoptions.get("parallel")
        assert serial.py_func.__code__ is threaded.py_func.__code__  # one implementation
