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

So a distributed run follows the simulator's trajectory up to the order of the floating-point sum
across ranks (the tests check 1e-10 in float64), and writes the simulator's table
(:data:`shrinkgrad.sim.COLUMNS`): the metrics are evaluated on the full objective by summing
the ranks' local client gradients and losses in one more all-reduce, and the bit counters are
the clients' own (``bits_up`` is the mean over all n clients of their cumulative uplink bits).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from ..compressors import Compressor
from ..methods.base import BoundMethod, Method, NonFiniteError, State, make_method
from ..methods.oracle import ProblemOracle
from ..methods.stepsize import StepSize
from ..problems import Problem
from ..rng import Keys
from ..sim import COLUMNS, SimResult, load_checkpoint, save_checkpoint
from ..sim.simulate import Status

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

    def sums(self, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """(Σ_{i on this rank} ∇f_i(x), Σ_{i on this rank} f_i(x)), or None when this rank holds
        the full problem (then the metrics are evaluated on it, as the simulator does)."""
        if self.local is None:
            return None
        grad = self._oracle.grads(x, torch.arange(self.ids.numel())).sum(dim=0)
        return grad, float(self.local.client_losses(x).double().sum())


# --------------------------------------------------------------------------------------------
# the reduction
# --------------------------------------------------------------------------------------------
class _PeerDiverged(Exception):
    """Another rank's client step hit non-finite values in this round."""


class AllReduce:
    """The method's reduction across ranks: Σ_{local j} w_j c_j, then all-reduce (sum).

    One extra entry travels with the vector: the number of ranks whose client step failed with
    non-finite values this round, so that every rank stops together instead of waiting forever
    for a rank that gave up (:meth:`fail`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.bytes = 0

    def _all_reduce(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()
        dist.all_reduce(t, group=self.group)

    def __call__(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        local = weights @ values
        buf = torch.cat([local, local.new_zeros(1)])
        self._all_reduce(buf)
        if float(buf[-1]) > 0:
            raise _PeerDiverged
        return buf[:-1]

    def fail(self, d: int, dtype: torch.dtype, device: torch.device) -> None:
        """Join the round's all-reduce after this rank's client step failed."""
        buf = torch.zeros(d + 1, dtype=dtype, device=device)
        buf[-1] = 1.0
        self._all_reduce(buf)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Progress:
    state: State[Any, Any]
    up: torch.Tensor  # cumulative bits of every client (n,), zero for other ranks' clients
    up_paper: torch.Tensor
    down: torch.Tensor
    time_s: float
    rows: list[dict[str, Any]]
    gns0: float
    status: Status | None = None
    message: str = ""


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
    divergence_factor: float | None = 1e8,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    group: dist.ProcessGroup | None = None,
    callback: Callable[[int, State[Any, Any]], bool | None] | None = None,
) -> SimResult:
    """Run ``method`` on ``problem`` with the clients spread over the ranks of ``group``.

    Call it on every rank of an initialised process group with the same arguments (as
    :func:`shrinkgrad.sim.simulate`, whose parameters it shares). Returns on every rank the same
    :class:`~shrinkgrad.sim.SimResult` table; ``result.state`` holds this rank's clients only,
    ``result.bits_up`` (and the other counters) all n clients.

    ``checkpoint`` is a path prefix: rank r of W saves ``<prefix>.rank<r>-of-<W>`` atomically
    every ``checkpoint_every`` rounds (default 1000) and at the end; a run with the same
    arguments resumes from the ranks' files when they all exist and agree.
    """
    from ..sim.simulate import _dtype, _fingerprint, _prepare_problem, _x0

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "run_distributed needs an initialised process group (shrinkgrad.distributed."
            "init_process_group, or launch with torchrun / shrinkgrad train)"
        )
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    if isinstance(log_every, bool) or not isinstance(log_every, (int, np.integer)) or log_every < 1:
        raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
    if divergence_factor is not None and not divergence_factor > 1:
        raise ValueError(f"divergence_factor must be > 1 or None, got {divergence_factor!r}")
    if checkpoint_every is not None and (
        isinstance(checkpoint_every, bool)
        or not isinstance(checkpoint_every, int)
        or checkpoint_every < 1
    ):
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    rounds, log_every = int(rounds), int(log_every)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prob = _prepare_problem(problem, _dtype(dtype), None)
    meth = make_method(method)
    bound: BoundMethod[Any, Any] = meth.bind(
        prob,
        compressor,
        stepsize,
        seed,
        dtype=prob.dtype,
        device=prob.device,
        wire_dtype=wire_dtype,
    )
    cfg = bound.cfg
    ids = client_ids(cfg.n, world, rank).to(cfg.device)
    oracle = LocalOracle(prob, ids)
    reduce = AllReduce(group)
    x_start = _x0(prob, x0, cfg.dtype, cfg.device)
    info = prob.info()
    meta: dict[str, Any] = {
        "method": meth.name,
        "compressor": cfg.compressor.name,
        "stepsize": cfg.stepsize,
        "stepsize_rule": cfg.stepsize_rule,
        "seed": cfg.seed,
        "dataset": str(info.get("dataset", prob.dataset)),
        "problem": str(info.get("problem", prob.name)),
        "n_clients": cfg.n,
        "d": cfg.d,
    }
    fingerprint = _fingerprint(meta, x_start, log_every, cfg.dtype, cfg.wire_dtype)
    fingerprint.update(world_size=world, rank=rank)
    every = checkpoint_every if checkpoint_every is not None else 1000
    path = None if checkpoint is None else Path(f"{os.fspath(checkpoint)}.rank{rank}-of-{world}")

    def metrics(p: _Progress, elapsed: float) -> tuple[float, float, list[float]]:
        """(‖∇f(x)‖², f(x), [mean bits up, paper, down, time]) on the full objective."""
        x = p.state.x
        stats = torch.tensor(
            [
                float(p.up.sum()),
                float(p.up_paper.sum()),
                float(p.down.sum()),
                elapsed if rank == 0 else 0.0,
            ],
            dtype=torch.float64,
        )
        n = cfg.n
        local = oracle.sums(x)
        if local is None:  # every rank holds the full problem: the simulator's evaluation
            reduce._all_reduce(stats)
            g, loss = prob.grad(x), prob.loss(x)
            tail = stats.tolist()
            return float(torch.dot(g, g)), loss, [tail[0] / n, tail[1] / n, tail[2] / n, tail[3]]
        grad, loss_sum = local
        buf = torch.cat(
            [grad.to(torch.float64), torch.tensor([loss_sum], dtype=torch.float64), stats]
        )
        reduce._all_reduce(buf)
        g = buf[: cfg.d] / n
        tail = buf[cfg.d :].tolist()
        return float(g @ g), tail[0] / n, [tail[1] / n, tail[2] / n, tail[3] / n, tail[4]]

    def row(r: int, gns: float, loss: float, bits: list[float]) -> dict[str, Any]:
        return {
            "round": r,
            "grad_norm_sq": gns,
            "loss": loss,
            "bits_up": bits[0],
            "bits_up_paper": bits[1],
            "bits_down": bits[2],
            "time_s": bits[3],
            **meta,
        }

    def save(p: _Progress) -> None:
        if path is not None:
            data = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
            save_checkpoint(path, {"fingerprint": fingerprint, **data})

    # -- start or resume ----------------------------------------------------------------------
    prog = _resume(path, fingerprint, reduce, group) if path is not None else None
    if prog is None:
        zeros = torch.zeros(cfg.n, dtype=torch.float64, device=cfg.device)
        t0 = time.perf_counter()
        state, traffic = bound.init(x_start, oracle, ids=ids, reduce=reduce)
        elapsed = time.perf_counter() - t0
        prog = _Progress(
            state,
            zeros.index_add(0, ids, traffic.up),
            zeros.index_add(0, ids, traffic.up_paper),
            zeros.index_add(0, ids, traffic.down),
            elapsed,
            [],
            math.nan,
        )
        gns, loss, bits = metrics(prog, prog.time_s)
        if not (math.isfinite(gns) and math.isfinite(loss)):
            raise ValueError(
                f"the objective or its gradient is not finite at x0 (grad_norm_sq={gns}, "
                f"loss={loss}); choose another starting point"
            )
        prog.gns0 = gns
        prog.rows.append(row(0, gns, loss, bits))
        if tol is not None and gns <= tol:
            prog.status, prog.message = "converged", f"grad_norm_sq {gns:.3g} <= tol at round 0"
        save(prog)
    if prog.state.round > rounds:
        raise ValueError(
            f"the checkpoint {os.fspath(checkpoint or '')!r} is at round {prog.state.round} > "
            f"rounds={rounds}; ask for at least {prog.state.round} rounds or use another path"
        )

    # -- the loop -------------------------------------------------------------------------------
    while prog.state.round < rounds and prog.status is None:
        state = prog.state
        r = state.round + 1
        t0 = time.perf_counter()
        try:
            new_state, traffic = bound.step(state, oracle, reduce=reduce)
            ok = bool(torch.isfinite(new_state.x).all())
        except NonFiniteError:
            reduce.fail(cfg.d, cfg.dtype, cfg.device)  # let the other ranks stop too
            ok = False
        except _PeerDiverged:
            ok = False
        elapsed = time.perf_counter() - t0
        if not ok:
            prog.status = "diverged"
            prog.message = (
                f"diverged at round {r}: the iterate has non-finite entries (step size "
                f"{cfg.stepsize:.4g}, {cfg.stepsize_rule}, is too large?); the table ends at "
                f"round {prog.rows[-1]['round']}"
            )
            break
        prog.state = new_state
        prog.up = prog.up.index_add(0, ids, traffic.up)
        prog.up_paper = prog.up_paper.index_add(0, ids, traffic.up_paper)
        prog.down = prog.down.index_add(0, ids, traffic.down)
        prog.time_s += elapsed
        if r % log_every == 0 or r == rounds:
            gns, loss, bits = metrics(prog, prog.time_s)
            if not (math.isfinite(gns) and math.isfinite(loss)):
                prog.status = "diverged"
                prog.message = (
                    f"diverged at round {r}: grad_norm_sq={gns}, loss={loss} are not finite"
                )
                break
            prog.rows.append(row(r, gns, loss, bits))
            if (
                divergence_factor is not None
                and prog.gns0 > 0
                and gns > divergence_factor * prog.gns0
            ):
                prog.status = "diverged"
                prog.message = (
                    f"diverged at round {r}: grad_norm_sq grew from {prog.gns0:.3g} to "
                    f"{gns:.3g} (more than {divergence_factor:g}x); the step size "
                    f"{cfg.stepsize:.4g} ({cfg.stepsize_rule}) is too large"
                )
            elif tol is not None and gns <= tol:
                prog.status = "converged"
                prog.message = f"grad_norm_sq {gns:.3g} <= tol={tol:g} at round {r}"
            elif callback is not None and callback(r, prog.state):
                prog.status, prog.message = "stopped", f"stopped by the callback at round {r}"
        if r % every == 0:
            save(prog)
    if prog.status == "diverged":
        warnings.warn(prog.message, RuntimeWarning, stacklevel=2)
    save(prog)

    totals = torch.stack([prog.up, prog.up_paper, prog.down])
    reduce._all_reduce(totals)
    table = pd.DataFrame(prog.rows, columns=list(COLUMNS))
    table = table.astype({"round": "int64", "seed": "int64", "n_clients": "int64", "d": "int64"})
    return SimResult(
        table=table,
        state=prog.state,
        status=prog.status or "completed",
        message=prog.message,
        stepsize=cfg.stepsize,
        stepsize_rule=cfg.stepsize_rule,
        bits_up=totals[0],
        bits_up_paper=totals[1],
        bits_down=totals[2],
        config=fingerprint,
    )


def _resume(
    path: Path, fingerprint: dict[str, Any], reduce: AllReduce, group: dist.ProcessGroup | None
) -> _Progress | None:
    """This rank's checkpoint, when every rank has one at the same round; else None (or an error
    when only some ranks have one)."""
    data = load_checkpoint(path)
    mine = -1 if data is None else int(data["state"].round)
    rounds = torch.tensor([mine, -mine], dtype=torch.float64)  # max and -min in one reduction
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(rounds[0]), -int(rounds[1])
    if hi != lo:
        raise ValueError(
            f"the ranks' checkpoints {path.name[: path.name.rfind('.rank')]}.rank*-of-* do not "
            f"agree (rounds {lo} to {hi}; -1 = missing): delete them to start again"
        )
    if data is None:
        return None
    saved = data.get("fingerprint", {})
    diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if diff:
        detail = ", ".join(
            f"{k}: saved {saved.get(k)!r} vs now {fingerprint.get(k)!r}" for k in diff
        )
        raise ValueError(
            f"the checkpoint {str(path)!r} belongs to a different run ({detail}); delete it, or "
            "choose another checkpoint path"
        )
    fields = {f.name for f in dataclasses.fields(_Progress)}
    return _Progress(**{k: v for k, v in data.items() if k in fields})
