"""shrinkgrad on torch.distributed: compressed DDP hooks and the multi-process method runner.

* :class:`CompressionState` + :func:`compression_hook` — any shrinkgrad compressor, with no error
  feedback, EF, EF21 or EF21-W, in any DDP training loop (two lines, see docs/distributed.md);
* :func:`run_distributed` — the library's own methods with their clients spread over the ranks
  (``shrinkgrad train CONFIG.toml``, or ``torchrun ... -m shrinkgrad.distributed CONFIG.toml``);
* :mod:`~shrinkgrad.distributed.launch` — process groups with timeouts on 127.0.0.1 and local
  multi-process launches (:func:`spawn`) that never hang and never leave processes behind.
"""

from .hooks import CollectiveError, CompressionState, ErrorFeedback, compression_hook
from .launch import (
    DEFAULT_TIMEOUT,
    WorkerError,
    WorkerFailure,
    free_port,
    init_from_env,
    init_process_group,
    preload,
    spawn,
    worker_setup,
)
from .runner import AllReduce, LocalOracle, client_ids, run_distributed

__all__ = [
    "DEFAULT_TIMEOUT",
    "AllReduce",
    "CollectiveError",
    "CompressionState",
    "ErrorFeedback",
    "LocalOracle",
    "WorkerError",
    "WorkerFailure",
    "client_ids",
    "compression_hook",
    "free_port",
    "init_from_env",
    "init_process_group",
    "preload",
    "run_distributed",
    "spawn",
    "worker_setup",
]
