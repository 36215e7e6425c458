"""Process groups and local launches: the plumbing every shrinkgrad process uses.

Used by the DDP hooks' tests, the multi-process runner (:mod:`shrinkgrad.distributed.runner`),
``shrinkgrad train`` and the parameter server. Everything talks over TCP on 127.0.0.1 with gloo
unless told otherwise, and every blocking operation has a timeout, so a dead or stuck process
turns into a clear error instead of a hang.

* :func:`free_port` — a free TCP port on the loopback interface;
* :func:`worker_setup` — what a fresh worker process must do first (one intra-op thread: forked
  children of a process that already ran multi-threaded torch ops hang otherwise);
* :func:`init_process_group` — a gloo/NCCL group over ``tcp://host:port`` with a timeout;
  :func:`init_from_env` does the same from torchrun's environment variables;
* :func:`preload` — import what DDP workers import lazily, once, before forking them;
* :func:`spawn` — run ``fn(rank, world_size, *args)`` in N fresh processes (forked by default,
  0.1 s to start instead of ~7.5 s for ``mp.spawn``), collect the return values, and turn any
  failure (an exception, a crash, a signal, a deadline) into one :class:`WorkerError` that names
  the ranks and their errors — after making sure that no child process is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "WorkerError",
    "WorkerFailure",
    "free_port",
    "init_from_env",
    "init_process_group",
    "preload",
    "spawn",
    "worker_setup",
]

#: default timeout (seconds) of process groups: a collective waiting longer than this for a peer
#: raises instead of hanging
DEFAULT_TIMEOUT = 60.0
#: environment variables that cap the thread pools of the numeric libraries
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; tiny race, no retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def worker_setup(threads: int = 1) -> None:
    """Prepare a fresh worker process: ``threads`` intra-op threads for torch and its libraries.

    Call it first in every child. A forked child of a process that already ran multi-threaded
    torch operations hangs in its first parallel op unless it sets the thread count before
    (platform notes); one thread per rank also keeps N ranks from oversubscribing the cores.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)
    for var in _THREAD_VARS:
        os.environ[var] = str(threads)


def preload() -> None:
    """Import in this process what every DDP worker imports lazily (``torch._dynamo``, ~2 s).

    Forked children inherit the parent's modules: calling this once before several
    :func:`spawn` calls saves every child those seconds (DDP's constructor imports dynamo).
    """
    import torch._dynamo
    import torch.nn.parallel  # noqa: F401


def _timeout(seconds: float) -> datetime.timedelta:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {seconds!r}")
    return datetime.timedelta(seconds=float(seconds))


def init_process_group(
    rank: int,
    world_size: int,
    *,
    port: int,
    host: str = "127.0.0.1",
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Join the default process group of ``world_size`` processes at ``tcp://host:port``.

    ``timeout`` (seconds) bounds the rendezvous and every later collective: a peer that died or
    stopped participating makes the others raise after at most that long.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{int(port)}",
        rank=rank,
        world_size=world_size,
        timeout=_timeout(timeout),
    )


def init_from_env(*, backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """Join the process group described by torchrun's variables; returns ``(rank, world_size)``.

    Needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by ``torchrun``).
    """
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise ValueError(
            f"not launched by torchrun: the environment lacks {', '.join(missing)}; start with "
            "'torchrun --standalone --nproc-per-node N ...' or use shrinkgrad.distributed.spawn"
        )
    dist.init_process_group(backend, init_method="env://", timeout=_timeout(timeout))
    return dist.get_rank(), dist.get_world_size()


# --------------------------------------------------------------------------------------------
# local multi-process launches
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """What went wrong on one rank: its exception (with traceback) or how the process ended."""

    rank: int
    message: str
    traceback: str = ""
    exitcode: int | None = None


class WorkerError(RuntimeError):
    """One or more worker processes failed; ``failures`` lists them, first failure first."""

    def __init__(self, failures: Sequence[WorkerFailure], elapsed: float) -> None:
        self.failures = list(failures)
        self.elapsed = elapsed
        lines = [f"rank {f.rank}: {f.message}" for f in self.failures]
        super().__init__(
            f"{len(self.failures)} of the distributed workers failed after {elapsed:.1f} s:\n  "
            + "\n  ".join(lines)
        )


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code < 0:
        return f"was killed by signal {-code} without a result"
    return f"exited with code {code} without a result"


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    host: str,
    port: int,
    backend: str,
    pg_timeout: float,
    threads: int,
    conn: Connection,
) -> None:
    worker_setup(threads)
    ok = False
    try:
        init_process_group(
            rank, world_size, port=port, host=host, backend=backend, timeout=pg_timeout
        )
        result = fn(rank, world_size, *args)
        # plain pickle: torch's multiprocessing reductions would share tensors through file
        # descriptors that die with this process
        conn.send_bytes(pickle.dumps(("ok", result)))
        ok = True
    except BaseException as e:  # report everything, including KeyboardInterrupt/SystemExit
        with contextlib.suppress(Exception):
            msg = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
            conn.send_bytes(pickle.dumps(msg))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        conn.close()
    if not ok:
        os._exit(1)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    grace: float | None = None,
    backend: str = "gloo",
    host: str = "127.0.0.1",
    port: int | None = None,
    threads: int = 1,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results.

    Each child calls :func:`worker_setup`, joins a process group (``backend`` over
    ``tcp://host:port``, a fresh free port by default, collectives timing out after
    ``pg_timeout`` seconds), runs ``fn`` and sends back its (picklable) return value.
    ``start_method`` is ``"fork"`` (fast; ``fn`` may be any function, including a closure) or
    ``"spawn"``/``"forkserver"`` (``fn`` and ``args`` must be picklable).

    Raises :class:`WorkerError` when any rank raises, crashes or is killed, or when the whole
    launch exceeds ``timeout`` seconds. After the first failure the other ranks get ``grace``
    seconds (default ``pg_timeout + 5``: long enough for their collectives to time out and
    report) before they are killed. No child outlives this call.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    _timeout(timeout)
    _timeout(pg_timeout)
    grace = pg_timeout + 5.0 if grace is None else float(grace)
    ctx: Any = mp.get_context(start_method)
    port = free_port(host) if port is None else int(port)
    procs: list[Any] = []
    conns: list[Connection] = []
    t0 = time.monotonic()
    results: dict[int, Any] = {}
    failures: list[WorkerFailure] = []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(
                    fn,
                    rank,
                    world_size,
                    tuple(args),
                    host,
                    port,
                    backend,
                    pg_timeout,
                    threads,
                    child_end,
                ),
                name=f"shrinkgrad-rank{rank}",
                daemon=True,
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        deadline = t0 + float(timeout)
        pending = set(range(world_size))
        closed: set[int] = set()  # ranks whose pipe ended without a message: wait for the exit
        while pending:
            now = time.monotonic()
            if now >= deadline:
                for rank in sorted(pending):
                    why = (
                        f"still running after the {timeout:g} s launch timeout (killed)"
                        if not failures
                        else f"did not stop within {grace:g} s after rank "
                        f"{failures[0].rank} failed (killed)"
                    )
                    failures.append(WorkerFailure(rank, why))
                break
            waitables: list[Any] = [conns[r] for r in pending - closed]
            waitables += [procs[r].sentinel for r in pending]
            ready = set(wait(waitables, timeout=min(deadline - now, 3600.0)))
            for rank in sorted(pending):
                conn, proc = conns[rank], procs[rank]
                msg: Any = None
                exited = proc.sentinel in ready
                if rank not in closed and (conn in ready or (exited and conn.poll())):
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        closed.add(rank)
                if msg is None and not exited:
                    continue
                pending.discard(rank)
                if msg is not None and msg[0] == "ok":
                    results[rank] = msg[1]
                    continue
                if msg is not None:
                    failures.append(WorkerFailure(rank, msg[1], msg[2]))
                else:
                    proc.join(1.0)
                    failures.append(
                        WorkerFailure(rank, _describe_exit(proc.exitcode), exitcode=proc.exitcode)
                    )
                deadline = min(deadline, time.monotonic() + grace)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in conns:
            c.close()
    if failures:
        raise WorkerError(failures, time.monotonic() - t0)
    return [results[r] for r in range(world_size)]
