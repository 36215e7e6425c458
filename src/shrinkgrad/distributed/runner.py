"""The library's methods across processes: clients spread over ranks, reduction by all-reduce.

:func:`run_distributed` is :func:`shrinkgrad.sim.simulate` with the clients of the problem spread
over the ranks of a process group. Every rank

* binds the method with the problem's **global** constants, compressor, step size and seed (so the
  step size, the EF21-W weights and every keyed draw are the simulator's);
* holds a contiguous block of clients (:func:`client_ids`) and only their data
  (:class:`LocalOracle`), and runs the method's own ``init``/``step`` on them — the same client
  step as the simulator (docs/methods.md, "running a method on a subset of clients");
* reduces with Σ_{local j} w_j c_j followed by an all-reduce (sum) across ranks
  (:class:`AllReduce`); the small server state (x, g, ...) is replicated and updated identically
  on every rank.

The loop, the table, the stopping rules and the checkpoints are the simulator's own engine
(:func:`shrinkgrad.sim.run_rounds`) with a per-rank runtime. So a distributed run follows the
simulator's trajectory up to the order of the floating-point sum across ranks (the tests check
1e-10 in float64), and writes the simulator's table (:data:`shrinkgrad.sim.COLUMNS`): the metrics
are evaluated on the full objective by summing the ranks' local client gradients and losses in
one more all-reduce, and the bit counters are the clients' own (``bits_up`` is the mean over all
n clients of their cumulative uplink bits).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._sums import mean_value, squared_norm
from ..compressors import Compressor
from ..methods.base import BoundMethod, Method, NonFiniteError, State, Traffic, weighted_sum
from ..methods.oracle import ProblemOracle
from ..methods.rules import SparseMessage
from ..methods.stepsize import StepSize
from ..problems import Problem
from ..rng import Keys
from ..sim import Progress, RunSetup, SimResult, load_checkpoint, run_rounds, setup_run
from ..sim.engine import Row, held_out_values
from ..sim.options import Callback, Divergence, RunOptions, option_defaults, options_of_call

__all__ = ["AllReduce", "LocalOracle", "client_ids", "run_distributed"]


def client_ids(n: int, world_size: int, rank: int) -> torch.Tensor:
    """The global ids of ``rank``'s clients: contiguous blocks, sizes differing by at most one.

    Rank r holds clients ``np.array_split(range(n), world_size)[r]``; every rank needs at least one
    client, so n ≥ world_size.
    """
    if n < world_size:
        raise ValueError(
            f"the problem has n={n} clients but the job has {world_size} ranks: every rank needs "
            f"at least one client; use n_clients >= {world_size} or fewer processes"
        )
    block = np.array_split(np.arange(n, dtype=np.int64), world_size)[rank]
    return torch.from_numpy(block)


# --------------------------------------------------------------------------------------------
# this rank's clients
# --------------------------------------------------------------------------------------------
class LocalOracle:
    """Gradients and losses of one rank's clients, addressed by their global ids.

    Holds the data of the clients ``ids`` only (:meth:`~shrinkgrad.problems.Problem.restrict`);
    for problems that cannot be restricted it evaluates the full problem and keeps the requested
    rows (correct, not faster). Implements the
    :class:`~shrinkgrad.methods.base.GradientOracle` protocol plus the local sums the metrics
    need (:meth:`sums`).
    """

    def __init__(self, problem: Problem, ids: torch.Tensor) -> None:
        self.ids = ids.to(torch.int64)
        self.problem = problem
        local = problem.restrict(self.ids)
        self.local = local
        self._oracle = ProblemOracle(local if local is not None else problem)
        self._index = torch.full((problem.n,), -1, dtype=torch.int64)
        self._index[self.ids] = torch.arange(self.ids.numel())

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the oracle's problem for the global ``ids``."""
        if self.local is None:
            return ids
        idx = self._index.to(ids.device)[ids]
        if bool((idx < 0).any()):
            raise ValueError(f"clients {ids[idx < 0].tolist()} are not held by this rank")
        return idx

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._oracle.grads(x, self._rows(ids))

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        return self._oracle.stoch_grads(x, self._rows(ids), batch_sizes, keys)

    @property
    def record(self) -> bool:
        """Keep the metrics of the round's gradient pass (:class:`ProblemOracle`)."""
        return self._oracle.record

    @record.setter
    def record(self, value: bool) -> None:
        self._oracle.record = value

    def take_prepaid(self) -> float:
        return self._oracle.take_prepaid()

    def sums(self, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """(Σ_{i on this rank} ∇f_i(x), Σ_{i on this rank} f_i(x)), or None when this rank holds
        the full problem (then the metrics are evaluated on it, as the simulator does).

        From the round's own gradient pass when it evaluated this rank's clients at x (the
        oracle's :class:`~shrinkgrad.methods.oracle.PointMetrics`, means over the m local
        clients, times m), else from the local problem's gradients and losses.
        """
        if self.local is None:
            return None
        m = self._oracle.metrics(x)
        if m is not None:
            return m.grad * m.clients, m.loss * m.clients
        grad = self._oracle.grads(x, torch.arange(self.ids.numel())).sum(dim=0)
        return grad, float(self.local.client_losses(x).double().sum())

    def full_metrics(self, x: torch.Tensor) -> tuple[float, float]:
        """(‖∇f(x)‖², f(x)) of the full problem, which this rank holds (``sums`` is None)."""
        m = self._oracle.metrics(x)
        if m is not None:
            return squared_norm(m.grad), m.loss
        return squared_norm(self.problem.grad(x)), float(self.problem.loss(x))


# --------------------------------------------------------------------------------------------
# the reduction
# --------------------------------------------------------------------------------------------
class _PeerDiverged(NonFiniteError):
    """Another rank's client step hit non-finite values in this round."""

    def __init__(self, round: int) -> None:
        super().__init__(
            f"round {round}: another rank's clients produced non-finite values (the method "
            "diverged there; try a smaller step size, or another x0 at round 0)"
        )


class AllReduce:
    """The method's reduction across ranks: Σ_{local j} w_j c_j, then all-reduce (sum).

    One extra entry travels with the vector: the number of ranks whose client step failed with
    non-finite values this round, so that every rank stops together instead of waiting forever
    for a rank that gave up (:meth:`fail`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.bytes = 0
        #: the round being reduced (set by the runtime; only for the peers' error message)
        self.round = 0

    def sum(self, t: torch.Tensor) -> None:
        """All-reduce (sum) ``t`` in place across the ranks, counting its bytes."""
        self.bytes += t.numel() * t.element_size()
        dist.all_reduce(t, group=self.group)

    def __call__(self, values: torch.Tensor | SparseMessage, weights: torch.Tensor) -> torch.Tensor:
        local = weighted_sum(values, weights)
        buf = torch.cat([local, local.new_zeros(1)])
        self.sum(buf)
        if float(buf[-1]) > 0:
            raise _PeerDiverged(self.round)
        return buf[:-1]

    def fail(self, d: int, dtype: torch.dtype, device: torch.device) -> None:
        """Join the round's all-reduce after this rank's client step failed."""
        buf = torch.zeros(d + 1, dtype=dtype, device=device)
        buf[-1] = 1.0
        self.sum(buf)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------
class _RankRuntime:
    """This rank's share of a run (a :class:`~shrinkgrad.sim.Runtime` of the engine).

    Its clients :func:`client_ids`, their :class:`LocalOracle` and the :class:`AllReduce`
    reduction; the metrics and the bit counters are summed over the ranks with one more
    all-reduce, so every rank logs the same rows. Held-out metrics are evaluated on the full
    problem (every rank holds it, and evaluates them at the same x).
    """

    #: a rank cannot save or report an interruption alone: its peers are in the middle of a round
    standalone = False

    def __init__(self, setup: RunSetup, group: dist.ProcessGroup | None) -> None:
        cfg = setup.bound.cfg
        self.problem = setup.problem
        self.held_out = setup.held_out
        self.n, self.d = cfg.n, cfg.d
        self.group = group
        self.rank = dist.get_rank(group)
        self.ids = client_ids(cfg.n, dist.get_world_size(group), self.rank).to(cfg.device)
        self.oracle = LocalOracle(setup.problem, self.ids)
        self.reduce = AllReduce(group)

    def init(
        self, bound: BoundMethod[Any, Any], x0: torch.Tensor, *, record: bool = False
    ) -> tuple[State[Any, Any], Traffic]:
        """Round 0 of this rank's clients. Non-finite values here (an initial g_i = C(∇f_i(x⁰))
        that cannot be compressed) raise the simulator's NonFiniteError on this rank and a
        NonFiniteError on every other rank, as in :meth:`step` (there is no round to stop
        at: the run fails, as the simulator's does)."""
        self.oracle.record = record
        self.reduce.round = 0
        return self._guarded(
            bound, lambda: bound.init(x0, self.oracle, ids=self.ids, reduce=self.reduce)
        )

    def step(
        self, bound: BoundMethod[Any, Any], state: State[Any, Any], *, record: bool = False
    ) -> tuple[State[Any, Any], Traffic]:
        self.oracle.record = record
        self.reduce.round = state.round + 1
        return self._guarded(bound, lambda: bound.step(state, self.oracle, reduce=self.reduce))

    def _guarded(
        self,
        bound: BoundMethod[Any, Any],
        call: Callable[[], tuple[State[Any, Any], Traffic]],
    ) -> tuple[State[Any, Any], Traffic]:
        """``call()`` (a round of the method); when it raises NonFiniteError on this rank, join
        the round's all-reduce with the failure flag first, so the other ranks stop too."""
        try:
            return call()
        except _PeerDiverged:
            raise
        except NonFiniteError:
            cfg = bound.cfg
            self.reduce.fail(cfg.d, cfg.dtype, cfg.device)
            raise

    def prepaid_s(self) -> float:
        return self.oracle.take_prepaid()

    def row(self, progress: Progress) -> Row:
        """‖∇f(x)‖², f(x) on the full objective; mean bits over all n clients; rank 0's time.

        The bit counters travel whole, (3, n) with zeros for the other ranks' clients, so the
        all-reduce only adds zeros (exact) and the means are the simulator's
        (:func:`~shrinkgrad._sums.mean_value`: float64, in client order), bit for bit: a sum of
        per-rank partial sums would differ in the last bits whenever a message costs a
        fractional number of bits (``lazy_bernoulli[p=0.3]``'s 32·p·d paper bits).
        """
        p, x, n = progress, progress.state.x, self.n
        counters = torch.cat([p.up, p.up_paper, p.down]).to(torch.float64)
        time_s = torch.tensor(
            [p.time_s if self.rank == 0 else 0.0], dtype=torch.float64, device=counters.device
        )
        held = held_out_values(self.problem, self.held_out, x)
        local = self.oracle.sums(x)
        if local is None:  # every rank holds the full problem: the simulator's evaluation
            buf = torch.cat([time_s, counters])
            self.reduce.sum(buf)
            gns, loss = self.oracle.full_metrics(x)
        else:
            grad, loss_sum = local
            head = torch.tensor([loss_sum], dtype=torch.float64, device=counters.device)
            buf = torch.cat([grad.to(torch.float64), head, time_s, counters])
            self.reduce.sum(buf)
            gns = squared_norm(buf[: self.d] / n)  # the simulator's definition (shrinkgrad._sums)
            loss = float(buf[self.d]) / n
            buf = buf[self.d + 1 :]
        up, paper, down = (mean_value(buf[1 + k * n : 1 + (k + 1) * n]) for k in range(3))
        return (p.state.round, gns, loss, up, paper, down, float(buf[0]), *held)

    def totals(self, progress: Progress) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        totals = torch.stack([progress.up, progress.up_paper, progress.down])
        self.reduce.sum(totals)
        return totals[0], totals[1], totals[2]

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """This rank's checkpoint, when every rank has one at the same round; else None (or an
        error when only some ranks have one)."""
        data = load_checkpoint(path)
        mine = -1 if data is None else int(data["state"].round)
        rounds = torch.tensor([mine, -mine], dtype=torch.float64)  # max and -min in one reduction
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = int(rounds[0]), -int(rounds[1])
        if hi != lo:
            name = Path(path).name
            raise ValueError(
                f"the ranks' checkpoints {name[: name.rfind('.rank')]}.rank*-of-* do not "
                f"agree (rounds {lo} to {hi}; -1 = missing): delete them to start again"
            )
        return data


def run_distributed(
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
    wire_dtype: torch.dtype = torch.float32,
    divergence_factor: Divergence | float | None = 1e8,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    group: dist.ProcessGroup | None = None,
    callback: Callback | None = None,
    options: RunOptions | None = None,
) -> SimResult:
    """Run ``method`` on ``problem`` with the clients spread over the ranks of ``group``.

    Call it on every rank of an initialised process group with the same arguments (as
    :func:`shrinkgrad.sim.simulate`, whose parameters — or one ``options=RunOptions(...)`` — and
    engine it shares; the device is the problem's and the progress bar is off). Returns on every
    rank the same :class:`~shrinkgrad.sim.SimResult` table; ``result.state`` holds this rank's
    clients only, ``result.bits_up`` (and the other counters) all n clients.

    ``checkpoint`` is a path prefix: rank r of W saves ``<prefix>.rank<r>-of-<W>`` atomically
    every ``checkpoint_every`` rounds (default 1000) and at the end; a run with the same
    arguments resumes from the ranks' files when they all exist and agree.
    """
    opts = options_of_call(options, locals(), _OPTION_DEFAULTS)
    if opts.device is not None or opts.progress:
        raise ValueError(
            "run_distributed takes the device from the problem and shows no progress bar; "
            "give options without device and progress"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "run_distributed needs an initialised process group (shrinkgrad.distributed."
            "init_process_group, or launch with torchrun / shrinkgrad train)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if opts.checkpoint is not None:
        opts = opts.replace(checkpoint=Path(f"{os.fspath(opts.checkpoint)}.rank{rank}-of-{world}"))
    setup = setup_run(problem, method, compressor, stepsize, seed, x0, opts)
    check_compressor_spans(setup.bound.cfg.compressor, world)
    fingerprint = dict(setup.fingerprint, world_size=world, rank=rank)
    setup = dataclasses.replace(setup, fingerprint=fingerprint)
    return run_rounds(setup, _RankRuntime(setup, group))


_OPTION_DEFAULTS = option_defaults(run_distributed)


def check_compressor_spans(C: Compressor, world: int) -> None:
    """Refuse a compressor whose draw is one collective over every client's vector
    (``power_sgd[shared=true]``'s shared basis) on more than one process (the runner's ranks,
    the parameter server's workers): each process compresses its own clients, so the basis
    would span one process's clients only, another algorithm than the simulator's. (A
    shared-seed rand_k is keyed by the round alone and runs anywhere.)"""
    if world > 1 and bool(getattr(C, "shared", False)):
        raise ValueError(
            f"{C.name}'s shared basis is one collective over every client's matrix, and on "
            f"{world} processes each compresses only its own clients; use per-client power_sgd "
            "(shared=false), one process, or the DDP hook, which runs the shared basis"
        )
