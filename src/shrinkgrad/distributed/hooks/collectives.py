"""The hook's collectives: asynchronous all-reduce / all-gather with byte counting, and errors.

Every collective the hook runs goes through :class:`Comm`, which counts the bytes this rank hands
over as its own message (the payloads for an all-gather, the buffer for an all-reduce) and, for
benchmarks (``skip_communication``), pretends that every rank sent what this one sent. A future's
callback never blocks (gloo runs callbacks on its worker threads: a wait there deadlocks with two
buckets in flight); the only blocking wait, the size exchange of variable-size messages, is in the
hook body (:meth:`Comm.max_size`).

Chaining: a path that needs a second collective after the first (a low-rank compressor's two
all-reduces) starts it from the first one's callback without waiting, and completes a future of
its own from the second callback (:func:`chain`).

Order: every rank must start its collectives in the same order (gloo and NCCL match them by
their sequence number in the group). A collective started from a callback (PowerSGD's Q, after
its P) would race with the next bucket's, started by the hook body, and the ranks could pair
different collectives. So every collective is *reserved* in the hook body, in bucket order, and
*started* only once the one reserved before it has started and what it waits for (``after``:
the callback that fills its buffer) is done (:meth:`Comm.all_reduce`); a reservation whose
predecessors are done starts at once, in the caller's thread, so the paths without chained
collectives run as before. Nothing ever waits: the start is a future's callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "Comm", "chain", "done", "result"]

Fut = torch.futures.Future[list[torch.Tensor]]


class CollectiveError(RuntimeError):
    """A collective of the hook failed: a peer died, or it exceeded the process group timeout."""


def done(value: list[torch.Tensor]) -> Fut:
    fut: Fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def result(fut: Fut, what: str, rank: int) -> torch.Tensor:
    """The (first) tensor of a collective's future, or a clear error (never blocks: the
    future is done). All-gather futures hold the per-rank chunks: use the output buffer."""
    try:
        return fut.value()[0]
    except Exception as e:
        raise CollectiveError(
            f"rank {rank}: the {what} of a shrinkgrad DDP hook failed — a peer process died or "
            f"stopped responding within the process group timeout ({type(e).__name__}: {e})"
        ) from e


def chain(
    first: Fut, then: Callable[[Fut], torch.futures.Future[torch.Tensor]]
) -> torch.futures.Future[torch.Tensor]:
    """A future of the tensor that ``then(first)``'s future yields, without blocking anywhere:
    ``then`` runs when ``first`` is done and may start another collective."""
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def forward(f: torch.futures.Future[torch.Tensor]) -> None:
        try:
            out.set_result(f.value())
        except Exception as e:
            out.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong

    def start(f: Fut) -> None:
        try:
            then(f).add_done_callback(forward)
        except Exception as e:
            out.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong

    first.add_done_callback(start)
    return out


def _forward(src: Fut, dst: Fut) -> None:
    try:
        dst.set_result(src.value())
    except Exception as e:
        dst.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong


class Comm:
    """This rank's collectives in ``group`` (``skip``: none, for benchmarks), counting bytes."""

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, rank: int, skip: bool):
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.skip = skip
        #: bytes handed to collectives in the current iteration
        self.step_bytes = 0
        #: set once the collective reserved last has started (None: it has)
        self._tail: torch.futures.Future[None] | None = None

    def count(self, t: torch.Tensor) -> None:
        self.step_bytes += t.numel() * t.element_size()

    def _ordered(self, start: Callable[[], Fut], after: torch.futures.Future[None] | None) -> Fut:
        """Reserve the next collective (module docstring, "Order"): ``start()`` runs now when
        the previous reservation has started and ``after`` is done, else from the callback
        that completes the last of them; the future returned is the collective's."""
        deps = [f for f in (self._tail, after) if f is not None and not f.done()]
        if not deps:
            self._tail = None
            return start()
        started: torch.futures.Future[None] = torch.futures.Future()
        self._tail = started
        out: Fut = torch.futures.Future()

        def go(_: object) -> None:
            try:
                fut = start()
            except Exception as e:
                out.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong
                return
            finally:
                started.set_result(None)
            fut.add_done_callback(lambda f: _forward(f, out))

        torch.futures.collect_all(deps).add_done_callback(go)
        return out

    def all_reduce(self, t: torch.Tensor, after: torch.futures.Future[None] | None = None) -> Fut:
        """Sum ``t`` in place over the ranks; started once ``after`` is done (its buffer is
        filled by a callback) and the collectives reserved before it have started."""
        self.count(t)

        def start() -> Fut:
            if self.skip:
                t.mul_(self.world_size)  # as if every rank had sent the same
                return done([t])
            work = dist.all_reduce(t, group=self.group, async_op=True)
            assert work is not None
            return cast(Fut, work.get_future())

        return self._ordered(start, after)

    def all_gather(
        self, out: torch.Tensor, t: torch.Tensor, after: torch.futures.Future[None] | None = None
    ) -> Fut:
        """Every rank's ``t``, in rank order, into ``out`` (world size × t.numel()); started
        as :meth:`all_reduce` is."""
        self.count(t)

        def start() -> Fut:
            if self.skip:
                out.view(self.world_size, -1).copy_(t)
                return done([out])
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(out, t, group=self.group, async_op=True)
            assert work is not None
            return cast(Fut, work.get_future())

        return self._ordered(start, after)

    def max_size(self, size: int) -> int:
        """The largest ``size`` over the ranks (a small blocking all-gather in the hook body)."""
        mine = torch.tensor([size], dtype=torch.int64)
        if self.skip:
            self.count(mine)
            return size
        sizes = torch.empty(self.world_size, dtype=torch.int64)
        fut = self.all_gather(sizes, mine)
        fut.wait()  # in the hook body, not in a callback: safe
        result(fut, "all-gather (message sizes)", self.rank)
        return int(sizes.max())
