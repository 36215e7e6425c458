"""Imported first in every sweep worker process (and preloaded by the forkserver).

A sweep gets its parallelism from processes; several multi-threaded workers on few cores would
only fight. :func:`pin_threads` sets every thread pool — torch's intra-op pool, numba's, and (for
libraries that start later) OpenMP/MKL/OpenBLAS through the environment — to one thread, and
importing this module does that and then imports the heavy modules once, so forked workers start
fast. Importing it has this process-wide effect: only worker processes import it.
"""

from __future__ import annotations

import os
import sys

_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def pin_threads() -> None:
    """One thread for torch, numba and any BLAS/OpenMP pool started from now on.

    NUMBA_NUM_THREADS is only set when numba is not imported yet: numba re-reads it whenever it
    compiles, and a value that differs from the one its thread pool started with is an error
    ("Cannot set NUMBA_NUM_THREADS to a different value once the threads have been launched").
    Once numba is loaded, :func:`numba.set_num_threads` limits it instead.
    """
    for var in _VARS:
        os.environ[var] = "1"
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency
        return
    numba.set_num_threads(1)


pin_threads()

import numpy  # noqa: E402, F401
import pandas  # noqa: E402, F401

from .. import methods, problems, sim  # noqa: E402, F401
