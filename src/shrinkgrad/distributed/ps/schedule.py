"""Which arrived message the server applies next: FIFO, or bounded staleness by deadlines.

Every live worker always has exactly one *job*: the gradient it computes on the model version it
was last sent, or that gradient waiting at the server (held) after it arrived. Applying a job of
version v at server version t has staleness t − v and moves the server to t + 1; the worker then
gets x^{t+1} and its next job has version t + 1.

Unbounded (``tau_max=None``): arrivals are applied in arrival order, at once.

Bounded: every applied message must have staleness ≤ τ_max, i.e. the job of version v has the
*deadline* v + τ_max (the last server version at which it may be applied). The server applies one
job per update and may wait (waiting does not advance t), so this is unit-time scheduling with
deadlines, and a set of jobs can still all be applied in time iff, sorted by deadline,
D_(k) ≥ t + k − 1 for every k (earliest deadline first is optimal). The gate applies a held job of
version v at t only when t − v ≤ τ_max and the *other* jobs stay feasible from t + 1
(D_(k) ≥ t + k); the worker's new job (deadline t + 1 + τ_max) keeps feasibility because
τ_max ≥ W − 1 (D)[this module]. Among held jobs the earliest deadline goes first. Hence:

* every applied message has staleness ≤ τ_max (a fast worker waits for its fresh model while the
  server waits for a slow one: "a too-stale worker waits"), and
* no deadlock: when every live worker is held, the earliest-deadline job is always applicable.

At the start all W workers compute on x⁰ (W jobs of version 0, deadlines τ_max): feasible iff
τ_max ≥ W − 1, which :class:`~shrinkgrad.distributed.ps.PSConfig` requires. A lost worker's job
is dropped, which only relaxes the constraints. ``tests/distributed/test_ps_schedule.py`` checks
both properties on random event simulations.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StalenessGate"]


class StalenessGate:
    """The server's bookkeeping of jobs: versions, arrivals, and the choice of the next update."""

    def __init__(self, workers: Iterable[int], tau_max: int | None) -> None:
        if tau_max is not None and tau_max < 0:
            raise ValueError(f"tau_max must be >= 0 or None, got {tau_max}")
        self.tau_max = tau_max
        #: version of each live worker's job (the model it computes on / its held message)
        self.version: dict[int, int] = {int(w): 0 for w in workers}
        #: held workers -> arrival sequence number (arrival order)
        self.held: dict[int, int] = {}
        self._seq = 0

    # -- events ----------------------------------------------------------------------------------
    def sent(self, worker: int, version: int) -> None:
        """``worker`` was sent the model of ``version``: its new job."""
        if worker not in self.version:
            raise KeyError(f"worker {worker} is not live")
        self.held.pop(worker, None)
        self.version[worker] = int(version)

    def arrived(self, worker: int) -> None:
        """``worker``'s job (computed at ``version[worker]``) arrived and waits to be applied."""
        if worker not in self.version:
            raise KeyError(f"worker {worker} is not live")
        if worker in self.held:
            raise RuntimeError(f"worker {worker} sent a second message before getting a model")
        self.held[worker] = self._seq
        self._seq += 1

    def restarted(self, worker: int, version: int) -> None:
        """``worker`` restarted on a newer model (a resumed run): its new job keeps the
        deadline of the job it replaces, of ``version`` (the snapshot's). The IAG's delay
        bound 2·τ_max rests on the deadlines: a worker's table entry is at most τ_max older
        than its job, so a restart whose job took the resume version as its deadline let the
        entry age up to 3·τ_max (the fast workers went on while the slow one recomputed)."""
        if worker not in self.version:
            raise KeyError(f"worker {worker} is not live")
        self.version[worker] = min(self.version[worker], int(version))

    def lost(self, worker: int) -> None:
        """``worker`` is gone: forget its job."""
        self.version.pop(worker, None)
        self.held.pop(worker, None)

    # -- decisions -------------------------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        return sorted(self.version)

    def staleness(self, worker: int, t: int) -> int:
        """Staleness of ``worker``'s job if it were applied at server version ``t``."""
        return t - self.version[worker]

    def feasible(self, t: int, exclude: int | None = None) -> bool:
        """Whether all jobs except ``exclude`` can still be applied in time from version ``t``."""
        if self.tau_max is None:
            return True
        deadlines = sorted(v + self.tau_max for w, v in self.version.items() if w != exclude)
        return all(d >= t + k for k, d in enumerate(deadlines))

    def next(self, t: int) -> int | None:
        """The held worker whose message to apply at server version ``t``, or None to wait.

        Unbounded: the earliest arrival. Bounded: the held job with the earliest deadline (the
        oldest version; ties by arrival) when applying it keeps every other job feasible.
        """
        if not self.held:
            return None
        if self.tau_max is None:
            return min(self.held, key=self.held.__getitem__)
        w = min(self.held, key=lambda j: (self.version[j], self.held[j]))
        if self.staleness(w, t) > self.tau_max:
            raise RuntimeError(  # impossible while the invariant holds (module docstring)
                f"worker {w}'s message would be {self.staleness(w, t)} updates stale "
                f"(tau_max={self.tau_max}): the staleness gate's invariant was broken"
            )
        return w if self.feasible(t + 1, exclude=w) else None
