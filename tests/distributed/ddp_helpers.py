"""A small DDP training job that the hook tests run on forked ranks.

The model has tensors of several sizes (so DDP makes several buckets and ``min_numel`` leaves the
biases uncompressed); every rank draws its own data from a generator seeded by its rank, so the
ranks' gradients differ, as in real data-parallel training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.compressors import make_compressor
from shrinkgrad.distributed import CompressionState, compression_hook

SHAPES = [(48, 24), (48,), (40, 48), (40,), (4, 40), (4,)]  # weights and biases of an MLP


class ClientLoss(torch.nn.Module):
    """f_i(x) = mean log(1 + exp(−y a·x)) + λ Σ x²/(1 + x²) of methods.md §1, one parameter x:
    the simulator's logistic-regression client (``problems.logistic_regression``) as a model."""

    def __init__(self, d: int, lam: float) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))
        self.lam = lam

    def forward(self, A: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.x
        return (
            torch.nn.functional.softplus(-y * (A @ x)).mean()
            + self.lam * (x * x / (1 + x * x)).sum()
        )


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 4),
    ).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.3)
    assert [tuple(p.shape) for p in model.parameters()] == SHAPES
    return model


@dataclasses.dataclass
class Job:
    """One training run: the hook (None = DDP's default all-reduce) and the loop's settings."""

    compressor: str | None = None
    ratio: float | None = None
    method: str | None = None  # None: the default (dcgd[biased=true])
    error_feedback: str | None = None  # the deprecated alias (recorded warning, not raised)
    weights: list[float] | None = None
    min_numel: int = 45
    warmup_steps: int = 1
    client_momentum: bool = False  # momentum 0.5 in the hook instead of the optimizer
    momentum_free: bool = False  # the optimizer without momentum (the method has it: ef21_sgdm)
    seed: int = 0
    steps: int = 4
    start: int = 0  # first step (a resumed run starts later)
    dtype: torch.dtype = torch.float32
    bucket_cap_mb: float = 0.01  # several buckets
    lr: float = 0.2
    load: str | None = None  # checkpoint prefix to resume from
    save: str | None = None  # checkpoint prefix to write after the last step
    record_bytes: bool = False
    die_at: int | None = None  # rank 1 crashes (os._exit) at this step
    accumulate: int = 1  # micro-steps per step: the first ones under DDP.no_sync()
    compile: str | None = None  # torch.compile backend of the DDP model ("aot_eager", ...)
    state_dtype: str = "float32"  # where the hook keeps the method states of 16-bit gradients
    granularity: str = "tensor"  # the unit of compression: every tensor, or every bucket


def _batch(rank: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    X = torch.randn(32, 24, generator=gen, dtype=dtype)
    y = torch.randint(0, 4, (32,), generator=gen)
    return X, y


def run(rank: int, world: int, job: Job) -> dict[str, Any]:
    """Train ``job.steps`` steps; return the flat parameters after every step and the counters."""
    model = DDP(make_model(job.dtype), bucket_cap_mb=job.bucket_cap_mb)
    state = None
    if job.compressor is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # error_feedback= (the alias)
            state = CompressionState(
                job.compressor,
                ratio=job.ratio,
                method=job.method,
                error_feedback=job.error_feedback,  # type: ignore[arg-type]
                weights=job.weights,
                min_numel=job.min_numel,
                warmup_steps=job.warmup_steps,
                seed=job.seed,
                momentum=0.5 if job.client_momentum else 0.0,
                state_dtype=job.state_dtype,  # type: ignore[arg-type]
                granularity=job.granularity,  # type: ignore[arg-type]
            )
        model.register_comm_hook(state, compression_hook)
    forward: Any = model if job.compile is None else torch.compile(model, backend=job.compile)
    if job.client_momentum or job.momentum_free:
        opt = torch.optim.SGD(model.parameters(), lr=job.lr / (1 - 0.5))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=0.5)
    if job.load is not None:
        ckpt = torch.load(f"{job.load}.rank{rank}", weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        assert state is not None
        state.load_state_dict(ckpt["hook"])
    sent: list[int] = []
    if job.record_bytes:  # count at the collectives themselves, independently of the state
        real_gather = dist.all_gather_single
        real_reduce = dist.all_reduce

        def gather(out: torch.Tensor, t: torch.Tensor, *a: Any, **k: Any) -> Any:
            sent[-1] += t.numel() * t.element_size()
            return real_gather(out, t, *a, **k)

        def reduce(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            sent[-1] += t.numel() * t.element_size()
            return real_reduce(t, *a, **k)

        dist.all_gather_single = gather  # type: ignore[assignment]
        dist.all_reduce = reduce  # type: ignore[assignment]
    params: list[torch.Tensor] = []
    state_bytes: list[int] = []
    silent_changes: list[bool] = []  # did a no_sync micro-step change the hook's memory?
    for step in range(job.start, job.start + job.steps):
        if job.die_at is not None and step == job.die_at and rank == 1:
            import os

            os._exit(7)
        sent.append(0)
        X, y = _batch(rank, step, job.dtype)
        opt.zero_grad()
        parts = list(zip(X.chunk(job.accumulate), y.chunk(job.accumulate), strict=True))
        for i, (Xi, yi) in enumerate(parts):  # gradient accumulation: the last one syncs
            before = None if state is None else _memory(state)
            silent = i < len(parts) - 1
            with model.no_sync() if silent else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(forward(Xi), yi) / len(parts)
                loss.backward()
            if silent and state is not None:
                silent_changes.append(not _same_memory(before, _memory(state)))
        opt.step()
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        if state is not None:
            state_bytes.append(state.last_step_bytes)
    if job.save is not None:
        torch.save(
            {
                "model": model.module.state_dict(),
                "opt": opt.state_dict(),
                "hook": None if state is None else state.state_dict(),
            },
            f"{job.save}.rank{rank}",
        )
    return {
        "params": params,
        "sent": sent,
        "state_bytes": state_bytes,
        "bytes_sent": None if state is None else state.bytes_sent,
        "iterations": None if state is None else state.iteration,
        "silent_changes": silent_changes,
        # the units of the last iteration, and whether any bucket was compressed in a staged copy
        "layout": None if state is None else state.planner.layout(),
        "staged": state is not None and any(p.staged is not None for p in state.planner.plans),
    }


def _memory(state: CompressionState) -> dict[str, Any]:
    return state.state_dict()


def _same_memory(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Same iteration, counters and method states (every tensor equal)."""
    if a is None or a["iteration"] != b["iteration"] or a["bytes_sent"] != b["bytes_sent"]:
        return False
    ma, mb = a["memory"], b["memory"]
    if ma.keys() != mb.keys():
        return False
    for uid in ma:
        sa, sb = ma[uid]["state"], mb[uid]["state"]
        if ma[uid]["round"] != mb[uid]["round"] or sa.keys() != sb.keys():
            return False
        for k, v in sa.items():
            w = sb[k]
            if isinstance(v, torch.Tensor) and not torch.equal(v, w):
                return False
    return True


def _with_k(spec: str, k: int) -> str:
    """``spec`` with k set where ``ratio=`` sets it (inside ``scaled(...)``), by hand."""
    if spec.startswith("scaled(") and spec.endswith(")"):
        return f"scaled({_with_k(spec[len('scaled(') : -1], k)})"
    return f"{spec[:-1]},k={k}]" if spec.endswith("]") else f"{spec}[k={k}]"


def expected_bytes(job: Job, world: int, dtype: torch.dtype = torch.float32) -> int:
    """A compressed step's message size per rank from the compressors' bits formulas:
    ⌈bits(d)/8⌉ bytes per compressed tensor, d values per uncompressed one."""
    assert job.compressor is not None
    esize = torch.finfo(dtype).bits // 8
    total = 0
    for shape in SHAPES:
        d = math.prod(shape)
        if d < job.min_numel:
            total += d * esize  # uncompressed
            continue
        spec = job.compressor
        if job.ratio is not None:
            k = max(1, math.ceil(job.ratio * d))
            spec = _with_k(spec, k)
        total += math.ceil(make_compressor(spec).bits(d, dtype) / 8)
    return total
