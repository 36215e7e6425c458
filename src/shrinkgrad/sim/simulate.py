"""The vectorised simulator: run a method on a problem, log a tidy table, checkpoint, stop cleanly.

:func:`simulate` binds a method (:mod:`shrinkgrad.methods`) to a problem, a compressor, a step size
and a seed, runs ``init`` then ``step`` with every client on one tensor axis, and returns a
:class:`SimResult` whose ``table`` has one row per logged round (round 0 included). See
docs/simulator.md for the columns, checkpoints and divergence handling. The loop itself is the
engine of :mod:`shrinkgrad.sim.engine`, shared with the distributed runner; how the run is carried
out travels as one :class:`~shrinkgrad.sim.options.RunOptions`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..compressors import Compressor
from ..methods.base import Method
from ..methods.stepsize import StepSize
from ..network.topology import Network
from ..problems import Problem
from .engine import (
    COLUMNS,
    LocalRuntime,
    SimResult,
    SimulationInterrupted,
    Status,
    run_rounds,
    setup_run,
)
from .options import Callback, Divergence, RunOptions, option_defaults, options_of_call

__all__ = ["COLUMNS", "SimResult", "SimulationInterrupted", "Status", "simulate"]


def simulate(
    problem: Problem | str,
    method: Method[Any, Any] | str,
    compressor: Compressor | str | None = None,
    stepsize: float | str | StepSize = "theory",
    rounds: int = 100,
    seed: int = 0,
    x0: Any = None,
    *,
    log_every: int = 1,
    tol: float | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    wire_dtype: torch.dtype = torch.float32,
    divergence_factor: Divergence | float | None = 1e8,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    progress: bool = False,
    callback: Callback | None = None,
    network: Network | str | None = None,
    options: RunOptions | None = None,
) -> SimResult:
    """Run ``method`` with ``compressor`` on ``problem`` for ``rounds`` rounds.

    Parameters
    ----------
    problem, method, compressor:
        objects or names (``"ef21_pp[p=0.5]"``, ``"top_k[k=1]"``); ``compressor=None`` is the
        identity. Incompatible pairs (EF21 with an unscaled unbiased compressor, DCGD with a
        biased one) raise a ValueError saying what to use instead.
    stepsize:
        a number, ``"theory"`` or ``"theory*m"`` (see :mod:`shrinkgrad.methods.stepsize`).
    rounds, seed:
        number of rounds; seed of every keyed draw (compressor, participation, minibatch, delay,
        order). The same arguments give the same table (up to ``time_s``).
    x0:
        starting point (array-like of d numbers: shape (d,), or a row or column vector);
        default ``problem.x0()``. Any other shape is refused rather than flattened.
    log_every:
        log a row every ``log_every`` rounds (round 0 and the last round are always logged).
        The metrics come from the round's own gradient pass when the method evaluated every
        client at the new iterate, else from one fused gradient-and-loss pass; either way they
        are excluded from ``time_s``.
    tol:
        stop (status ``converged``) at the first logged round with grad_norm_sq ≤ tol.
    dtype, device:
        float64 (default: the problem's) or float32; the device of the problem's tensors.
    wire_dtype:
        the dtype values are sent in for the honest bit count (default float32).
    divergence_factor:
        when to stop as ``diverged`` (:class:`~shrinkgrad.sim.options.Divergence`): a number is
        the factor over ‖∇f(x⁰)‖² that grad_norm_sq may not exceed, with the loss and iterate
        tests at their defaults; a ``Divergence`` sets every test; ``None`` disables the growth
        tests. Non-finite iterates or metrics always stop the run, and the table never holds
        NaN or infinite metrics.
    checkpoint, checkpoint_every:
        a file path: resume from it when it exists (same run configuration, checked), and save
        the run there atomically every ``checkpoint_every`` rounds (default 1000), on
        Ctrl-C and at the end. A resumed run gives exactly the table of an uninterrupted one.
    progress:
        show a progress bar on stderr (only when stderr is a terminal).
    callback:
        ``callback(round, state)`` after every logged row; return True to stop (status
        ``stopped``).
    network:
        a network (:mod:`shrinkgrad.network`) or its spec, e.g.
        ``"star[up=10mbit,down=100mbit,latency=20ms]"``: the table gains a ``time_model_s``
        column after ``time_s``, the modelled wall-clock time of the run on that network —
        per round, the compute time (the spec's ``compute``, else the round's measured time / n)
        and the time of the round's messages (their honest bits), the slowest active client
        setting the round (docs/network.md, "The simulator's clock"). Without it the column is
        absent.
    options:
        all of the above (``rounds`` ... ``network``) as one
        :class:`~shrinkgrad.sim.options.RunOptions`, instead of the keywords (giving both is an
        error).
    """
    opts = options_of_call(options, locals(), _OPTION_DEFAULTS)
    setup = setup_run(problem, method, compressor, stepsize, seed, x0, opts)
    return run_rounds(setup, LocalRuntime(setup.problem))


_OPTION_DEFAULTS = option_defaults(simulate)
