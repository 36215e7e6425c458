"""The model charges what the DDP hook sends: ``hook_collectives`` against the hook's own
counter ``last_step_bytes`` and the collectives it calls, on 2 real gloo ranks."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations at runtime.
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, preload, spawn
from shrinkgrad.network import hook_collectives

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

STEPS = 3  # the warm-up step, then two compressed steps (DDP rebuilds its buckets at the 2nd)


@pytest.fixture(scope="module", autouse=True)
def _preload() -> None:
    preload()  # DDP's imports, once, before forking


def _train(kwargs: dict[str, Any], cap_mb: float, rank: int) -> dict[str, Any]:
    """Train STEPS steps with the hook; record DDP's buckets, the collectives and the counter."""
    gen = torch.Generator().manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)
    )  # tensors of 2048, 64, 640 and 10 entries
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    state = CompressionState(**kwargs)
    layouts: list[list[list[int]]] = []
    shapes: list[list[list[tuple[int, ...]]]] = []
    calls: list[list[tuple[str, int]]] = []

    def hook(s: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        layouts[-1].append([p.numel() for p in bucket.parameters()])
        shapes[-1].append([tuple(p.shape) for p in bucket.parameters()])
        return compression_hook(s, bucket)

    ddp.register_comm_hook(state, hook)
    real_reduce, real_gather = dist.all_reduce, dist.all_gather_into_tensor
    real_single = getattr(dist, "all_gather_single", None)

    def reduce(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        calls[-1].append(("allreduce", t.numel() * t.element_size()))
        return real_reduce(t, *a, **k)

    def gather(out: torch.Tensor, t: torch.Tensor, *a: Any, **k: Any) -> Any:
        calls[-1].append(("allgather", t.numel() * t.element_size()))
        return real_gather(out, t, *a, **k)

    dist.all_reduce = reduce  # type: ignore[assignment]
    dist.all_gather_into_tensor = gather  # type: ignore[assignment]
    if real_single is not None:
        dist.all_gather_single = gather  # type: ignore[attr-defined]
    try:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        sent = []
        for step in range(STEPS):
            layouts.append([])
            shapes.append([])
            calls.append([])
            g = torch.Generator().manual_seed(100 * rank + step)
            X, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(X), y).backward()
            opt.step()
            sent.append(state.last_step_bytes)
    finally:
        dist.all_reduce, dist.all_gather_into_tensor = real_reduce, real_gather
        if real_single is not None:
            dist.all_gather_single = real_single  # type: ignore[attr-defined]
    return {"sent": sent, "layouts": layouts, "shapes": shapes, "calls": calls}


CASES = [
    dict(compressor="top_k", ratio=0.1, error_feedback="ef21", min_numel=45),
    dict(compressor="qsgd[s=4]", min_numel=100),
    dict(compressor="rand_k[shared_seed=true]", ratio=0.1, min_numel=45),
    dict(compressor="identity", min_numel=0),
    dict(compressor="natural", error_feedback="ef", min_numel=45),
    dict(compressor="rank_k[r=2]", method="ef21", min_numel=45),  # factors all-gathered
    # PowerSGD's shared basis: the raw values and P all-reduced, then Q (the matrix views)
    dict(compressor="power_sgd[rank=2,shared=true]", method="ef21", min_numel=45),
    # every bucket one vector (CompressionState(granularity="bucket"))
    dict(compressor="top_k", ratio=0.1, error_feedback="ef21", min_numel=45, granularity="bucket"),
    dict(compressor="rand_k[shared_seed=true]", ratio=0.1, min_numel=45, granularity="bucket"),
    dict(compressor="qsgd[s=4]", min_numel=100, granularity="bucket"),
    # summed rounds all-gathered and added in the method's dtype (the default for 16-bit models
    # under EF21/DIANA; forced here): the same bytes, all-gathers instead of all-reduces
    dict(compressor="identity", method="ef21", min_numel=0, summation="gather"),
    dict(compressor="rand_k[shared_seed=true]", ratio=0.1, method="diana", summation="gather"),
    dict(compressor="power_sgd[rank=2,shared=true]", method="ef21", summation="gather"),
]
#: DDP's default (one bucket for so small a model) and a cap that cuts it in two after the
#: first iteration (DDP's rebuild; tensors fill a bucket until it reaches the cap)
CAPS = (25.0, 0.001)


def _all_cases(rank: int, world: int) -> list[dict[str, Any]]:
    return [_train(kwargs, cap, rank) for cap in CAPS for kwargs in CASES]


def test_model_bytes_equal_the_hooks_counters() -> None:
    results = spawn(_all_cases, 2, timeout=240)
    several = False
    for rank_results in results:
        runs = iter(rank_results)
        for cap in CAPS:
            for kwargs in CASES:
                r = next(runs)
                args = {
                    k: v
                    for k, v in kwargs.items()
                    if k in ("ratio", "min_numel", "granularity", "method", "summation")
                }
                for step in range(STEPS):
                    layout = r["layouts"][step]
                    several |= len(layout) > 1
                    model = hook_collectives(
                        kwargs["compressor"],
                        layout,
                        shapes=r["shapes"][step],
                        warmup=step == 0,
                        **args,
                    )
                    where = f"{kwargs['compressor']}, cap {cap} MB, step {step}"
                    # the bytes the model charges = the hook's own counter
                    assert sum(c.nbytes for c in model) == r["sent"][step], where
                    # and collective by collective, in the order the hook calls them
                    assert [(c.kind, c.nbytes) for c in model] == r["calls"][step], where
    assert several, "the small cap gives several buckets"
