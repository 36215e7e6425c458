"""Imported first in every sweep worker process (and preloaded by the forkserver).

It pins every thread pool to one thread *before* torch, numpy's BLAS or numba start theirs — a
sweep gets its parallelism from processes, and several multi-threaded workers on few cores
would only fight — and then imports the heavy modules once, so that forked workers start fast.
Importing it has this process-wide effect; only worker processes import it.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

import numpy  # noqa: E402, F401
import pandas  # noqa: E402, F401

from .. import methods, problems, sim  # noqa: E402, F401
