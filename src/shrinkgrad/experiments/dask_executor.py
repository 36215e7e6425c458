"""Sweeps on a dask.distributed cluster: ``shrinkgrad run --executor dask[address=tcp://host:8786]``.

Each run of the sweep becomes one dask task (:func:`_dask_run`) that calls the same
:func:`~shrinkgrad.experiments.execute.execute_run` as a local worker, in the same output
directory, which must therefore be on a file system every dask worker sees (a cluster's shared
home or scratch). The client — ``shrinkgrad run`` — keeps everything else: the config checks, the
directory lock, skip-finished and resume decisions, the progress display (the workers send
``start``/``progress`` events through dask's event topics), ``results.parquet`` and ``env.json``.
So the results table is the one a local run writes, bit for bit except the wall-clock columns
(``time_s``, ``wall_s``): every worker runs one thread per task with torch, numba and BLAS pinned
to one thread, as local workers do.

Without an address, a ``LocalCluster`` of ``workers`` processes (one thread each) is started on
127.0.0.1 and closed at the end. When a worker dies, the scheduler reschedules its task on another
worker; the run resumes from its last checkpoint (and a run that had already written its results
is not run again: :func:`execute_run` is idempotent), so nothing is duplicated. On Ctrl-C the
client cancels the tasks not yet started; a ``LocalCluster`` is closed (its running runs resume
from their last periodic checkpoint next time), while a remote cluster's running tasks finish on
their own and write their results atomically. dask is an optional dependency:
``pip install "shrinkgrad[dask]"``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
import uuid
from typing import Any

from ..storage import StorageError
from .execute import Emit, RunTask, execute_run

__all__ = ["DaskExecutor"]

#: seconds between polls of the futures and the event queue
_POLL = 0.1


def _require_dask() -> None:
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        raise ValueError(
            "the dask executor needs dask.distributed, which is not installed: "
            "pip install 'shrinkgrad[dask]' (or run with --executor local)"
        ) from None


def _dask_run(task: RunTask, topic: str) -> tuple[str, dict[str, Any]]:
    """One run on a dask worker: ``("done", summary)`` or ``("failed", {message, traceback})``.

    A :class:`~shrinkgrad.storage.StorageError` (a full disk) propagates: the client stops the
    sweep with it.
    """
    import traceback

    from distributed import get_worker

    from ._preload import pin_threads

    pin_threads()  # numba's thread count is per thread: pin it in the task's thread
    worker = get_worker()

    def emit(kind: str, run_id: str, payload: dict[str, Any]) -> None:
        if kind in ("start", "progress"):
            worker.log_event(topic, {"kind": kind, "run_id": run_id, **payload})

    try:
        return "done", execute_run(task, emit)
    except StorageError:
        raise
    except Exception as e:
        return "failed", {
            "message": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }


class DaskExecutor:
    """The runs of a sweep as tasks of a dask.distributed cluster (module docstring)."""

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        _require_dask()
        if address is not None and (not isinstance(address, str) or "://" not in address):
            raise ValueError(
                f"executor 'dask': address must be a scheduler address such as "
                f"'tcp://host:8786', got {address!r}"
            )
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise ValueError(f"executor 'dask': workers must be an integer >= 1, got {workers!r}")
        if address is not None and workers is not None:
            raise ValueError(
                "executor 'dask': give address (an existing cluster) or workers (a LocalCluster), "
                "not both"
            )
        self.address = address
        self.n_workers = workers
        #: the client of the current run (tests use it to reach the workers)
        self.client: Any = None

    def describe(self) -> str:
        if self.address is not None:
            return f"dask[address={self.address}]"
        return f"dask[workers={self.n_workers or 'cores'}] (LocalCluster on 127.0.0.1)"

    def workers(self, tasks: int) -> int:
        if self.client is not None:
            return max(1, len(self.client.scheduler_info().get("workers", {})))
        return max(1, min(self.n_workers or 1, tasks))

    def _connect(self) -> tuple[Any, Any]:
        from distributed import Client, LocalCluster

        if self.address is not None:
            try:
                return Client(self.address, timeout="30s"), None
            except (OSError, TimeoutError) as e:
                raise ValueError(
                    f"executor 'dask': cannot reach the scheduler at {self.address} ({e}); start "
                    "it (dask scheduler / dask-jobqueue) or check the address"
                ) from None
        from .executors import default_jobs

        cluster = LocalCluster(
            n_workers=self.n_workers or default_jobs(),
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        return Client(cluster), cluster

    def run(self, tasks: list[RunTask], emit: Emit) -> bool:
        if not tasks:
            return False
        client, cluster = self._connect()
        self.client = client
        events: queue.Queue[dict[str, Any]] = queue.Queue()
        topic = f"shrinkgrad-{uuid.uuid4().hex}"
        client.subscribe_topic(topic, lambda event: events.put(event[1]))
        futures = {
            client.submit(
                _dask_run, t, topic, key=f"shrinkgrad-{t.run.run_id}-{topic}", pure=False
            ): t
            for t in tasks
        }
        started: dict[str, int] = {}
        interrupted = False

        def drain() -> None:
            while True:
                try:
                    e = events.get_nowait()
                except queue.Empty:
                    return
                kind, run_id = e.pop("kind"), e.pop("run_id")
                if kind == "start":
                    if run_id in started:
                        emit("rescheduled", run_id, {"pid": e.get("pid")})
                    started[run_id] = started.get(run_id, 0) + 1
                emit(kind, run_id, e)

        try:
            pending = dict(futures)
            while pending:
                drain()
                for fut in [f for f in pending if f.done()]:
                    task = pending.pop(fut)
                    drain()
                    run_id = task.run.run_id
                    try:
                        kind, payload = fut.result()
                    except StorageError:
                        raise
                    except Exception as e:  # KilledWorker (the task killed every worker), ...
                        kind = "failed"
                        payload = {"message": f"{type(e).__name__}: {e}"}
                    emit(kind, run_id, payload)
                time.sleep(_POLL)
        except KeyboardInterrupt:
            interrupted = True
            with contextlib.suppress(Exception):
                client.cancel(list(futures))
            for fut, task in futures.items():
                if not fut.done() and task.run.run_id in started:
                    emit("interrupted", task.run.run_id, {})
        except StorageError:
            with contextlib.suppress(Exception):
                client.cancel(list(futures))
            raise
        finally:
            with contextlib.suppress(Exception):
                client.unsubscribe_topic(topic)
            with contextlib.suppress(Exception):
                client.close()
            if cluster is not None:
                with contextlib.suppress(Exception):
                    cluster.close()
            self.client = None
        return interrupted
