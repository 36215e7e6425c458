"""An asynchronous parameter server with stale, compressed gradients ([K18]).

One server process and W worker processes talk point-to-point over torch.distributed (gloo on
127.0.0.1). Workers of different speeds push compressed messages computed at stale models; the
server applies each on arrival with the method's own server step (any registered method that
runs asynchronously: the compressed IAG, asynchronous DCGD, EF21 and its variants), records the
staleness of every update, can bound it (``tau_max``) so that the delay rule's step size of
methods.md §4 applies, snapshots itself so that a killed server can be resumed, and writes a log
that the simulator replays exactly (``asynchronous[trace=DIR]``). See docs/parameter_server.md.

Example::

    from shrinkgrad.distributed.ps import PSConfig, run_ps

    cfg = PSConfig(problem="logistic_regression[dataset=a1a]", workers=4, method="iag",
                   compressor="qsgd[s=4]", stepsize="theory", tau_max=6,
                   speeds=(1, 1, 1, 5), delay=0.01, updates=2000)
    result = run_ps(cfg)
    result.table          # the simulator's columns, round = server update
    result.staleness      # update, worker, version_computed, staleness, delay
"""

from .checkpoint import Checkpoint
from .config import PSConfig, load_ps_config
from .launch import PSServerLost, main, prepare, run_ps
from .results import STALENESS_COLUMNS, TABLE_COLUMNS, PSResult, build_result, plot_staleness
from .schedule import StalenessGate
from .server import Plan, plan_run
from .worker import EXIT_FAILED, EXIT_OK, EXIT_SERVER_LOST, client_oracle

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_SERVER_LOST",
    "STALENESS_COLUMNS",
    "TABLE_COLUMNS",
    "Checkpoint",
    "PSConfig",
    "PSResult",
    "PSServerLost",
    "Plan",
    "StalenessGate",
    "build_result",
    "client_oracle",
    "load_ps_config",
    "main",
    "plan_run",
    "plot_staleness",
    "prepare",
    "run_ps",
]
