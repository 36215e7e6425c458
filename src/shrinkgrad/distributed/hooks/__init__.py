"""DDP communication hooks that run the library's registered methods on compressed gradients.

Two lines in any training loop (``model`` is a ``DistributedDataParallel``)::

    state = CompressionState("top_k", ratio=0.01, method="ef21")
    model.register_comm_hook(state, compression_hook)

Every parameter's gradient (a *tensor*, GRACE's unit of compression; with
``granularity="bucket"`` every DDP bucket as one vector) runs the method as one client per rank
(docs/distributed.md, section 1). One job per module:

* :mod:`.config` — arguments, the method (``method=``, the deprecated ``error_feedback=``,
  ``momentum=``), the compressor of every tensor size, the keys of the random draws;
* :mod:`.plan` — bucket planning: units (tensors or whole buckets), canonical ids, message
  sizes, preallocated buffers;
* :mod:`.adapter` — the method adapter: the bound method per tensor, the hook's oracle, config
  and compressor port;
* :mod:`.memory` — the method states per unit (split per parameter when DDP regroups them),
  their snapshot (overflows) and checkpoints;
* :mod:`.collectives` — asynchronous all-reduce / all-gather with byte counting, errors;
* :mod:`.exchange` — one bucket's iteration: client parts, collective, server parts;
* :mod:`.state` — :class:`CompressionState` and :func:`compression_hook`.
"""

from .collectives import CollectiveError
from .config import ALIASES, STREAM, ErrorFeedback
from .memory import STATE_FORMAT
from .state import CompressionState, compression_hook

__all__ = [
    "ALIASES",
    "STATE_FORMAT",
    "STREAM",
    "CollectiveError",
    "CompressionState",
    "ErrorFeedback",
    "compression_hook",
]
