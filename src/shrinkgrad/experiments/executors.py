"""Where the runs of a sweep execute: this process, local worker processes, or a dask cluster.

An executor takes the runs left to do (:class:`~shrinkgrad.experiments.execute.RunTask`) and an
event callback, runs every task through :func:`~shrinkgrad.experiments.execute.execute_run`, and
reports what happens as events (``start``, ``progress``, ``done``, ``failed``, ``interrupted``)
the moment it happens. ``run`` returns True when Ctrl-C stopped it, and raises
:class:`~shrinkgrad.storage.StorageError` when a run could not write its results (a full disk:
every later run would fail the same way). Executors are components, named with the registry
grammar (``shrinkgrad run --executor ...``):

* ``local[jobs=N]`` (default): N worker processes on this machine, or this process for N = 1;
* ``dask[address=tcp://host:8786]``: the workers of a running dask.distributed scheduler; without
  an address, a ``LocalCluster`` of ``workers`` (default: ``--jobs``) processes on 127.0.0.1
  (:mod:`shrinkgrad.experiments.dask_executor`; ``pip install shrinkgrad[dask]``).

Local workers are started with ``forkserver`` (``spawn`` where unavailable): forking a parent
that already ran multi-threaded torch code can hang. Each has its own pipes to this process (no
shared queue whose lock a killed worker could take with it), ignores the terminal's Ctrl-C (this
process stops them with SIGTERM, which they turn into a checkpoint), and exits by itself the
moment this process dies (a watchdog thread on an "alive" pipe), so a killed sweep leaves no
process behind to write into its directory.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from ..registry import Registry
from ..storage import StorageError
from .execute import Emit, RunTask, execute_run

__all__ = [
    "EXECUTORS",
    "Executor",
    "InProcessExecutor",
    "LocalPoolExecutor",
    "default_jobs",
    "make_executor",
]

#: seconds the workers get to save their checkpoints after Ctrl-C
STOP_GRACE = 30.0


class Executor(Protocol):
    """What :func:`~shrinkgrad.experiments.run_experiment` needs from an executor."""

    def describe(self) -> str:
        """One line for env.json and messages (``local[jobs=2]``)."""
        ...

    def workers(self, tasks: int) -> int:
        """How many runs execute at the same time for ``tasks`` runs."""
        ...

    def run(self, tasks: list[RunTask], emit: Emit) -> bool:
        """Execute ``tasks``; True when interrupted (Ctrl-C)."""
        ...


EXECUTORS: Registry[Executor] = Registry("executor")


def default_jobs() -> int:
    """The number of cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def make_executor(spec: str | Executor | None = None, jobs: int | None = None) -> Executor:
    """Build an executor from its spec (``"local"``, ``"dask[address=tcp://host:8786]"``).

    ``jobs`` is the default of ``local``'s ``jobs`` and of a dask ``LocalCluster``'s
    ``workers``. An address may be written unquoted (values with ``:`` or ``/`` are quoted here
    for the spec parser).
    """
    if spec is None:
        spec = "local"
    if not isinstance(spec, str):
        return spec
    # values with ':' or '/' (addresses) are quoted for the spec parser
    text = re.sub(
        r"(\w+\s*=\s*)([^,\]'\"]*[:/][^,\]'\"]*)", lambda m: f"{m.group(1)}'{m.group(2)}'", spec
    )
    overrides: dict[str, Any] = {}
    name = text.split("[", 1)[0].strip()
    if jobs is not None and name in EXECUTORS:
        key = "jobs" if name == "local" else "workers"
        if f"{key}=" not in text.replace(" ", ""):
            overrides[key] = jobs
    return EXECUTORS.make(text, **overrides)


def _failure(e: BaseException) -> dict[str, Any]:
    return {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


# --------------------------------------------------------------------------------------------
# this process
# --------------------------------------------------------------------------------------------
class InProcessExecutor:
    """Every run in this process, one after another (``local[jobs=1]``)."""

    def describe(self) -> str:
        return "local[jobs=1]"

    def workers(self, tasks: int) -> int:
        return 1

    def run(self, tasks: list[RunTask], emit: Emit) -> bool:
        for task in tasks:
            try:
                execute_run(task, emit)
            except KeyboardInterrupt:
                emit("interrupted", task.run.run_id, {})
                return True
            except StorageError:
                raise
            except Exception as e:
                emit("failed", task.run.run_id, _failure(e))
        return False


# --------------------------------------------------------------------------------------------
# local worker processes
# --------------------------------------------------------------------------------------------
def _watch_parent(alive: Connection) -> None:
    """Exit this worker the moment its parent dies (the alive pipe reaches end of file)."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv_bytes()
    os._exit(3)


def _worker_main(tasks: Connection, events: Connection, alive: Connection) -> None:
    """A worker process: run the tasks its parent sends; report events; stop on None or SIGTERM."""
    from ._preload import pin_threads  # threads = 1, heavy imports

    pin_threads()  # again: a forkserver started by someone else may not have preloaded us
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the parent's job
    stop = threading.Event()
    busy = [False]

    def on_term(signum: int, frame: Any) -> None:
        """SIGTERM = stop: at the run's next logged round (it saves its checkpoint), or now when
        idle; never an exception in the middle of numba or torch code."""
        if busy[0]:
            stop.set()
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)

    def emit(kind: str, run_id: str, payload: dict[str, Any]) -> None:
        if kind == "start":
            payload = {**payload, "pid": os.getpid()}
        try:
            events.send((kind, run_id, payload))
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone
            os._exit(3)

    try:
        while True:
            try:
                task = tasks.recv()
            except EOFError:
                break
            if task is None:
                break
            try:
                busy[0] = True
                execute_run(task, emit, should_stop=stop.is_set)
            except KeyboardInterrupt:
                emit("interrupted", task.run.run_id, {})
                break
            except StorageError as e:  # every later run would fail the same way: stop the sweep
                emit("fatal", task.run.run_id, {"message": str(e)})
                break
            except Exception as e:  # report and go on with the next run
                emit("failed", task.run.run_id, _failure(e))
            finally:
                busy[0] = False
            if stop.is_set():
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _context() -> Any:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["shrinkgrad.experiments._forkserver_signals", "shrinkgrad.experiments._preload"]
        )
        return ctx
    return mp.get_context("spawn")  # pragma: no cover - Windows


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT in this block (main thread only): processes started here inherit it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _start_forkserver(ctx: Any) -> None:
    """Start the forkserver with SIGINT blocked in this thread: the forkserver inherits the
    block, so a Ctrl-C while it starts Python and imports torch stays pending there until its
    first preloaded module (:mod:`._forkserver_signals`) ignores SIGINT, and prints no
    traceback; the workers it forks ignore SIGINT too. Here the block only spans the fork and
    exec (milliseconds), and a Ctrl-C that comes meanwhile is not lost: it stays pending and is
    delivered when the block ends. (Ignoring SIGINT here instead, as before, dropped a Ctrl-C
    that came in that window, and the sweep ran on to its end.)

    multiprocessing's resource tracker is started first, outside the block: starting it
    unblocks SIGINT on its way out (it blocks and unblocks around its own spawn), which would
    end the block before the forkserver is forked."""
    if ctx.get_start_method() != "forkserver":  # pragma: no cover - Windows
        return
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _Worker:
    """One worker process and this process's ends of its pipes."""

    def __init__(self, ctx: Any) -> None:
        task_r, self.tasks = ctx.Pipe(duplex=False)
        self.events, event_w = ctx.Pipe(duplex=False)
        alive_r, self.alive = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_worker_main, args=(task_r, event_w, alive_r), daemon=True
        )
        if ctx.get_start_method() == "forkserver":
            self.process.start()  # forked by the forkserver: SIGINT ignored already
        else:  # pragma: no cover - Windows
            with _sigint_ignored():
                self.process.start()
        for end in (task_r, event_w, alive_r):
            end.close()
        self.current: RunTask | None = None
        self.stopping = False

    @property
    def pid(self) -> int:
        return int(self.process.pid or -1)

    def send(self, task: RunTask | None) -> None:
        self.current = task
        with contextlib.suppress(BrokenPipeError, OSError):
            self.tasks.send(task)

    def close(self) -> None:
        for c in (self.tasks, self.events, self.alive):
            c.close()


def _describe_death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


class LocalPoolExecutor:
    """``jobs`` worker processes on this machine (``local[jobs=N]``, N ≥ 2)."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs

    def describe(self) -> str:
        return f"local[jobs={self.jobs}]"

    def workers(self, tasks: int) -> int:
        return max(1, min(self.jobs, tasks))

    def run(self, tasks: list[RunTask], emit: Emit) -> bool:
        ctx = _context()
        todo = list(reversed(tasks))  # pop() from the end: config order
        workers: list[_Worker] = []
        finished: set[str] = set()
        fatal: list[str] = []
        interrupted = False

        def handle(w: _Worker, event: tuple[str, str, dict[str, Any]]) -> None:
            kind, run_id, payload = event
            if kind == "fatal":
                fatal.append(payload["message"])
                finished.add(run_id)
                w.current = None
                return
            if kind in ("done", "failed", "interrupted"):
                finished.add(run_id)
                w.current = None
            emit(kind, run_id, payload)
            if kind in ("done", "failed") and not (interrupted or fatal):
                w.send(todo.pop() if todo else None)

        def receive(w: _Worker) -> None:
            while True:
                try:
                    if not w.events.poll():
                        return
                    handle(w, w.events.recv())
                except (EOFError, OSError):
                    return

        def buried(w: _Worker) -> None:
            """``w`` exited: report its run at once if it died in the middle of one."""
            receive(w)
            w.process.join(1.0)
            workers.remove(w)
            lost = w.current
            w.close()
            if lost is not None and lost.run.run_id not in finished:
                finished.add(lost.run.run_id)
                how = _describe_death(w.process.exitcode)
                emit(
                    "failed",
                    lost.run.run_id,
                    {
                        "message": f"the worker process (pid {w.pid}) died ({how}) during this "
                        "run; its last checkpoint is kept: run the same command again to resume"
                    },
                )
            if todo and not (interrupted or fatal):
                spawn_worker()

        def spawn_worker() -> None:
            w = _Worker(ctx)
            workers.append(w)
            w.send(todo.pop() if todo else None)

        try:
            _start_forkserver(ctx)
            for _ in range(self.workers(len(tasks))):
                spawn_worker()
            while workers and not fatal:
                ready = wait(
                    [w.events for w in workers] + [w.process.sentinel for w in workers], 1.0
                )
                for w in list(workers):
                    if w.events in ready:
                        receive(w)
                    if w.process.sentinel in ready or not w.process.is_alive():
                        buried(w)
        except KeyboardInterrupt:
            interrupted = True
            _stop(workers, handle, receive)
        finally:
            if fatal:
                _stop(workers, handle, receive)
            for w in workers:
                w.process.join(timeout=2.0)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(timeout=2.0)
                w.close()
        if fatal:
            raise StorageError(fatal[0])
        return interrupted


def _stop(
    workers: list[_Worker],
    handle: Callable[[_Worker, tuple[str, str, dict[str, Any]]], None],
    receive: Callable[[_Worker], None],
) -> None:
    """Ctrl-C: every worker saves its checkpoint (SIGTERM) and reports; a second Ctrl-C (or
    :data:`STOP_GRACE` seconds) kills them: their runs resume from the last periodic checkpoint."""
    for w in workers:
        if w.process.is_alive() and w.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    try:
        while any(w.process.is_alive() for w in workers) and time.monotonic() < deadline:
            live = [w for w in workers if w.process.is_alive()]
            wait([w.events for w in live] + [w.process.sentinel for w in live], 0.2)
            for w in live:
                receive(w)
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
        pass
    with _sigint_ignored():
        for w in workers:
            if w.process.is_alive():
                w.process.kill()
        for w in workers:
            w.process.join(timeout=5.0)
            receive(w)


@EXECUTORS.register("local", summary="worker processes on this machine (1: this process)")
def local(jobs: int | None = None) -> Executor:
    """``jobs`` worker processes on this machine (default: its cores); 1 runs in this process."""
    n = default_jobs() if jobs is None else jobs
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"executor 'local': jobs must be an integer >= 1, got {jobs!r}")
    return InProcessExecutor() if n == 1 else LocalPoolExecutor(n)


@EXECUTORS.register("dask", summary="a dask.distributed cluster (a LocalCluster without address)")
def dask(address: str | None = None, workers: int | None = None) -> Executor:
    """The workers of the dask.distributed scheduler at ``address`` (``tcp://host:8786``), or a
    ``LocalCluster`` of ``workers`` processes on 127.0.0.1 when no address is given."""
    from .dask_executor import DaskExecutor

    return DaskExecutor(address=address, workers=workers)
