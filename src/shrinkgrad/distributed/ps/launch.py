"""Starting a parameter-server run: forked local processes, or one rank under torchrun.

:func:`run_ps` builds the problem and resolves the step size in the calling process (so user
errors surface before anything starts), then forks W + 1 children on 127.0.0.1 (0.1 s instead of
seconds for spawn/torchrun): rank 0 runs the server, rank i + 1 worker i. The children use the
process-group helpers of :mod:`shrinkgrad.distributed.launch` (one intra-op thread, a gloo group
with a timeout). Unlike :func:`shrinkgrad.distributed.launch.spawn`, which treats any dead rank as
a failed job, this launcher tolerates dead workers (the server carries on) and only fails when the
server dies. Nothing outlives it: children also die with their parent (``PR_SET_PDEATHSIG`` on
Linux), and leftovers are killed after a bounded wait.

:func:`main` is one rank of a torchrun launch::

    torchrun --standalone --nproc-per-node 5 -m shrinkgrad.distributed.ps ps.toml --out results/
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from ...compressors import make_compressor
from ...methods.ef21 import check_batch_fits
from ...problems import Problem, make_problem
from ...rng import KeyStream
from ..launch import free_port, init_from_env, init_process_group, worker_setup
from .checkpoint import Checkpoint, check_fingerprint, fingerprint
from .config import PSConfig, load_ps_config
from .results import PSResult, build_result, exit_status
from .server import Plan, plan_run, run_server
from .worker import EXIT_FAILED, client_oracle, run_worker

__all__ = ["PROGRESS_EVERY", "PSServerLost", "main", "prepare", "resume_point", "run_ps"]

#: seconds between the server's progress lines on a terminal
PROGRESS_EVERY = 5.0


class PSServerLost(RuntimeError):
    """The server process died or failed before reporting a result.

    ``exit_codes`` maps ``"server"`` and ``"worker<i>"`` to each process's exit status (3: a worker
    that noticed the lost server and exited; negative: killed by that signal); ``elapsed`` is
    the launch's duration in seconds.
    """

    def __init__(self, message: str, exit_codes: dict[str, int | None], elapsed: float) -> None:
        codes = ", ".join(f"{k}={v}" for k, v in exit_codes.items())
        super().__init__(f"{message} (exit codes: {codes}; after {elapsed:.1f} s)")
        self.exit_codes = exit_codes
        self.elapsed = elapsed


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphans if the launcher is killed)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def prepare(config: PSConfig, problem: Problem | None = None) -> tuple[Problem, Plan]:
    """Build (or check) the full problem and resolve the method and step size."""
    spec = config.problem_spec()
    if problem is None:
        problem = make_problem(spec)
    if problem.n != config.workers:
        raise ValueError(
            f"the problem has n={problem.n} clients but workers={config.workers}: every worker "
            "holds one client's data"
        )
    # a minibatch larger than a worker's data fails in every worker at its first gradient:
    # say so now, before any process starts
    check_batch_fits("batch_size (--batch-size)", config.batch_size, problem)
    plan = plan_run(config, problem)
    if problem.restrict(torch.tensor([0])) is None:
        warnings.warn(
            f"{problem.name} cannot be cut to one client's data (Problem.restrict returns None): "
            "every worker evaluates the full problem and keeps its own client's row (correct, "
            f"but each gradient costs {config.workers}x the work)",
            stacklevel=2,
        )
    _warm_up(problem, plan)
    return problem, plan


def _warm_up(problem: Problem, plan: Plan) -> None:
    """Run the numeric kernels once, so forked children inherit them compiled (numba caches)."""
    x0 = problem.x0()
    g = problem.client_grads(x0)[0].to(plan.cfg.wire_dtype)
    C = plan.compressor
    keys = None if C.deterministic else KeyStream(0, [0]).at(0)[0]
    C.decode(C.encode(g, keys), problem.d, plan.cfg.wire_dtype, keys)
    C(g.unsqueeze(0), None if keys is None else KeyStream(0, [0]).at(0))  # the client step's


def resume_point(
    config: PSConfig, out: str | os.PathLike[str] | None, resume: bool, data: str | None = None
) -> tuple[dict[str, Any] | None, str]:
    """(the snapshot to continue from, the line that says so) for a run into ``out``.

    ``resume=True`` loads ``out``'s snapshot (its settings must match ``config``'s, except
    :data:`~.checkpoint.FINGERPRINT_FREE`, and its problem's data digest ``data``), counts the
    updates the killed server made after it (from the update log) and cuts the log back.
    Without ``resume``, an ``out`` that already holds a run is refused, so that nothing is
    overwritten by mistake.
    """
    if out is None:
        if resume:
            raise ValueError("resume needs the run's output directory (out=..., --out DIR)")
        return None, ""
    ckpt = Checkpoint(out)
    if not resume:
        if ckpt.exists():
            raise ValueError(
                f"{str(out)!r} already holds a parameter-server run (a snapshot in "
                f"{str(ckpt.dir)!r}); continue it with --resume (resume=True) or choose another "
                "output directory"
            )
        return None, ""
    snap = ckpt.load()
    current = fingerprint(dict(config.to_dict(), compressor=config.compressor_spec), data)
    check_fingerprint(snap["fingerprint"], current, str(out))
    at = int(snap["server"].update)
    if snap.get("status") == "diverged":  # its state is the blown-up one: nothing to continue
        why = snap.get("message") or f"at update {at}"
        raise ValueError(
            f"--resume: the run in {str(out)!r} diverged ({why}); there is nothing to continue: "
            "start a new run in another --out, with a smaller step size"
        )
    elapsed = float(snap.get("elapsed", 0.0))
    if config.max_time is not None and elapsed >= config.max_time:
        raise ValueError(
            f"--resume: the run in {str(out)!r} has used {elapsed:.3g} s of its update loop "
            f"(status {snap.get('status') or 'interrupted'}), and max_time={config.max_time:g} s "
            f"would stop it at once; give a larger --max-time (e.g. {2 * elapsed:.3g}) to "
            "continue it"
        )
    if at >= config.updates:
        raise ValueError(
            f"--resume: the run in {str(out)!r} already has {at} updates (status "
            f"{snap.get('status') or 'interrupted'}); give more updates (e.g. --updates "
            f"{at + config.updates}) to continue it"
        )
    reached = ckpt.reached()
    reached = at if reached is None or reached < at else reached
    note = (
        f"resumed from the snapshot at update {at}; the previous server had reached update "
        f"{reached}: {reached - at} updates lost"
    )
    compressor = make_compressor(config.compressor_spec)
    if compressor.stateful:  # its state lives on the workers, which the snapshot does not hold
        note += (
            f"; {compressor.name} keeps state between a worker's messages (PowerSGD's Q), which "
            "restarts now: the run continues validly but not as the uninterrupted run would"
        )
    ckpt.cut(at)
    return snap, note


def _catch_sigint() -> threading.Event:
    """The server's SIGINT (Ctrl-C) handler, installed before anything else: it only sets the
    returned event, which the update loop polls; the run then stops the workers and returns
    what it has (status ``interrupted``, no updates if it had not started). The handler stays,
    so that a second signal cannot cut the result short."""
    interrupt = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupt.set())
    return interrupt


def _server_rank(
    config: PSConfig,
    problem: Problem,
    plan: Plan,
    progress_every: float | None = None,
    interrupt: threading.Event | None = None,
    out: str | os.PathLike[str] | None = None,
    resume: tuple[dict[str, Any] | None, str] = (None, ""),
) -> PSResult:
    snap, note = resume
    log = run_server(
        config, plan, problem.x0(), interrupt, progress_every, out=out, resume=snap, note=note
    )
    result = build_result(log, config, plan, problem)
    if out is not None and result.status == "diverged" and result.message != log.message:
        # diverged by the metrics, which only the result computes: the snapshot says so too
        Checkpoint(out).mark(result.status, result.message)
    return result


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the server, which stops them with its STOP message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


#: the signals the launcher holds while it forks: Ctrl-C, and SIGTERM, which the command line
#: turns into the same interruption (shrinkgrad.cli.Terminated)
_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _hold_sigint() -> set[int | signal.Signals] | None:
    """Block SIGINT and SIGTERM in this thread (a signal that comes meanwhile stays pending);
    returns the mask to restore, or None where signals cannot be blocked (not the main
    thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)


def _release_sigint() -> None:
    """In a child: take SIGINT and SIGTERM again (the launcher held them while forking) now
    that the child's own dispositions are set; a Ctrl-C that came meanwhile is delivered to it
    now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)


def _child(
    rank: int,
    world: int,
    port: int,
    config: PSConfig,
    problem: Problem,
    plan: Plan,
    conn: Connection | None,
    progress_every: float | None = None,
    out: str | os.PathLike[str] | None = None,
    resume: tuple[dict[str, Any] | None, str] = (None, ""),
) -> None:
    worker_setup(1)
    _die_with_parent()
    interrupt = _catch_sigint() if rank == 0 else None
    if rank > 0:
        _ignore_sigint()
    _release_sigint()
    code = 1
    try:
        if rank > 0:  # build the client's data before the rendezvous: the clock starts after it
            oracle = client_oracle(problem, rank - 1)
        init_process_group(rank, world, port=port, timeout=config.timeout)
        if rank == 0:
            assert conn is not None
            result = _server_rank(config, problem, plan, progress_every, interrupt, out, resume)
            # plain pickle: torch's multiprocessing pickler would share tensors through file
            # descriptors that die with this process
            conn.send_bytes(pickle.dumps(("ok", result)))
            code = 0
        else:
            code = run_worker(config, rank - 1, oracle, plan.inner, plan.cfg)
    except BaseException as e:
        who = "server" if rank == 0 else f"worker {rank - 1}"
        print(f"shrinkgrad ps {who}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.send_bytes(
                    pickle.dumps(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
                )
        code = 1 if rank == 0 else EXIT_FAILED
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: gloo's destructors may wait on dead peers


def _names(world: int) -> list[str]:
    return ["server"] + [f"worker{i}" for i in range(world - 1)]


def run_ps(
    config: PSConfig,
    *,
    problem: Problem | None = None,
    on_start: Callable[[dict[str, int]], None] | None = None,
    progress_every: float | None = None,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
) -> PSResult:
    """Run a parameter server with ``config.workers`` workers on this machine; return the result.

    ``problem`` (optional) is the already built full problem (it must match ``config.problem``).
    ``on_start`` is called with the processes' pids (``{"server": pid, "worker0": pid, ...}``)
    once they are started (tests use it to kill processes from outside). ``progress_every``:
    the server prints a progress line on stderr at most every that many seconds.

    ``out``: the server snapshots the run into ``out/checkpoint/`` every
    ``config.snapshot_every`` updates or ``config.snapshot_seconds`` seconds
    (:mod:`.checkpoint`); the caller saves the results there (``PSResult.save``). ``resume``:
    continue the run of ``out`` from its snapshot with new worker processes (a killed server
    loses the updates after its last snapshot; the ``resumed`` event says how many).

    Raises ValueError/TypeError for configuration mistakes (before any process starts) and
    :class:`PSServerLost` when the server dies; workers that die are part of the result
    (``events``, ``exit_codes``). A first Ctrl-C (KeyboardInterrupt here, SIGINT in the server)
    stops the run after the update in progress and returns it with status ``interrupted``; a
    second one aborts without a result.
    """
    problem, plan = prepare(config, problem)
    with contextlib.ExitStack() as stack:
        if out is not None:  # one run at a time writes into out (checkpoint.py: lock)
            stack.enter_context(Checkpoint(out).hold())
        return _run(config, problem, plan, on_start, progress_every, out, resume)


def _run(
    config: PSConfig,
    problem: Problem,
    plan: Plan,
    on_start: Callable[[dict[str, int]], None] | None,
    progress_every: float | None,
    out: str | os.PathLike[str] | None,
    resume: bool,
) -> PSResult:
    """:func:`run_ps` after its checks, with ``out`` (if any) held: start the processes, wait
    for the outcome."""
    start = resume_point(config, out, resume, plan.data)
    if start[1]:
        print(f"shrinkgrad ps: {start[1]}", file=sys.stderr, flush=True)
    world = config.workers + 1
    names = _names(world)
    ctx = mp.get_context("fork")
    port = free_port()
    recv_end, send_end = ctx.Pipe(duplex=False)
    procs: list[Any] = []
    t0 = time.monotonic()
    outcome: Any = None
    # a Ctrl-C while the processes start would land in a fork hook, where Python drops it (the
    # run then went on to the end): hold SIGINT until the loop below can handle it, and let
    # every child take it once its own handler is in place (_child)
    held = _hold_sigint()
    try:
        for rank in range(world):
            p = ctx.Process(
                target=_child,
                args=(
                    rank,
                    world,
                    port,
                    config,
                    problem,
                    plan,
                    send_end if rank == 0 else None,
                    progress_every,
                    out,
                    start,
                ),
                name=f"shrinkgrad-ps-{names[rank]}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        send_end.close()
        if on_start is not None:
            on_start({names[r]: int(p.pid) for r, p in enumerate(procs)})
        server = procs[0]
        deadline: float | None = None  # after a Ctrl-C: how long the server may take to report
        while outcome is None:
            try:
                if held is not None:  # a Ctrl-C held during the start is raised here
                    mask, held = held, None
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                ready = wait([recv_end, server.sentinel], timeout=left)
            except KeyboardInterrupt:
                if deadline is not None:
                    raise  # the second Ctrl-C: abort
                print(
                    "interrupted: stopping the workers and saving the updates so far "
                    "(Ctrl-C again to abort)",
                    file=sys.stderr,
                    flush=True,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGINT)  # it may not have got the terminal's
                deadline = time.monotonic() + 2.0 * config.timeout + 5.0
                continue
            if not ready:  # the interrupted server did not report in time
                outcome = ("late", 2.0 * config.timeout + 5.0)
            elif recv_end in ready or recv_end.poll():
                try:
                    outcome = pickle.loads(recv_end.recv_bytes())
                except (EOFError, OSError):
                    outcome = ("died",)
            elif server.sentinel in ready:
                outcome = ("died",)
        # the server has stopped its workers; give every process a bounded time to exit
        grace = 2.0 * config.timeout + 5.0 if outcome[0] != "ok" else config.timeout + 5.0
        deadline = (
            time.monotonic() + grace + max(config.worker_delay(i) for i in range(config.workers))
        )
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
    finally:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        recv_end.close()
    codes = {names[r]: p.exitcode for r, p in enumerate(procs)}
    elapsed = time.monotonic() - t0
    if outcome[0] == "ok":
        result: PSResult = outcome[1]
        result.exit_codes = codes
        return result
    if outcome[0] == "error":
        raise PSServerLost(f"the server failed: {outcome[1]}", codes, elapsed)
    if outcome[0] == "late":
        raise PSServerLost(
            f"the interrupted server did not report within {outcome[1]:g} s", codes, elapsed
        )
    raise PSServerLost("the server process died before reporting a result", codes, elapsed)


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of a torchrun launch: rank 0 serves and writes the results, the others work."""
    ap = argparse.ArgumentParser(
        prog="python -m shrinkgrad.distributed.ps",
        description="One rank of a shrinkgrad parameter server (start it with torchrun).",
    )
    ap.add_argument("config", help="TOML config (problem, [run], [ps]; docs/parameter_server.md)")
    ap.add_argument("--out", default="ps-results", help="directory for rank 0's results")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out")
    args = ap.parse_args(argv)
    worker_setup(1)
    config = load_ps_config(args.config)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world and world != config.workers + 1:
        raise SystemExit(
            f"error: the config has workers={config.workers}, so launch {config.workers + 1} "
            f"processes (one server + the workers), not {world}"
        )
    rank, world = init_from_env(timeout=config.timeout)
    interrupt = _catch_sigint() if rank == 0 else None
    if rank > 0:
        _ignore_sigint()
    code = 1
    try:
        problem, plan = prepare(config)
        if rank == 0:
            with Checkpoint(args.out).hold():
                start = resume_point(config, args.out, args.resume, plan.data)
                every = PROGRESS_EVERY if sys.stderr.isatty() else None
                result = _server_rank(config, problem, plan, every, interrupt, args.out, start)
                paths = result.save(args.out)
            where = paths["table"].parent
            print(f"status {result.status}: {result.updates} updates; results in {where}")
            code = exit_status(result.status)  # the CLI's: diverged and workers_lost are 1
        else:
            oracle = client_oracle(problem, rank - 1)
            code = run_worker(config, rank - 1, oracle, plan.inner, plan.cfg)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if dist.is_initialized() and code != 0:
            os._exit(code)
    os._exit(code)
