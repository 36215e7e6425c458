"""CPU time of the shrinkgrad DDP hook per step, in one process, with a fake n-rank payload set.

Run: ``python benchmarks/ddp_hook.py [--only topk topk-sgdm randk qsgd] [--world 4] [--steps 5]
[--profile]``. ``benchmarks/ab_ddp_hook.py`` runs it alternately against an older version of the
library (A/B).

The model is ``benchmarks/ddp.py``'s MLP (1024 → 2048 → 2048 → 2048 → 16, 10.5 M parameters,
batch 32, float32, one thread). DDP runs on a one-process gloo group; the hook's state is
created with ``skip_communication=True`` and its world size set to ``--world`` (weights 1/n), so
every step does all of an n-rank job's local work — compressing its buckets, encoding, decoding
its own message (error feedback) and the n received ones (here n copies of its own) and the
sums — without any network. Printed per configuration: the hook's time per step (the sum over
the buckets of the time from the hook's call until its future is done; median and minimum over
``--steps`` steps after 3 warm-up steps; ``--clock cpu``: this process's CPU time instead of wall
time) and its ratio to the baseline measured in the same run:
a training step of the same model without a hook (forward, backward, DDP's local all-reduce,
optimizer step). ``--profile`` adds the top functions of a cProfile of the timed steps. glibc's
allocator defaults are used (the hook keeps no per-step multi-megabyte allocations).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import argparse
import cProfile
import inspect
import itertools
import json
import os
import pstats
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, free_port

#: the clock of every measurement: wall time (default) or this process's CPU time (``--clock
#: cpu``: on a shared, loaded machine it leaves out the time other processes take the core)
CLOCK = [time.perf_counter]
WIDTHS = (1024, 2048, 2048, 2048, 16)
BATCH = 32
#: key: (compressor, ratio, method, client momentum), as in benchmarks/ddp.py
CONFIGS: dict[str, tuple[str, float | None, str, float]] = {
    "topk": ("top_k", 0.01, "ef21", 0.0),
    "topk-sgdm": ("top_k", 0.01, "ef21", 0.9),  # EF21-SGDM, the example's default
    "randk": ("rand_k[shared_seed=true]", 0.01, "dcgd", 0.0),
    "qsgd": ("qsgd[s=4]", None, "dcgd", 0.0),
}
#: the same configurations for versions of the library before ``method=`` (A/B runs)
_OLD_NAMES = {"ef21": "ef21", "dcgd": "none"}


def make_state(name: str, ratio: float | None, method: str, momentum: float) -> CompressionState:
    """The hook state of a configuration, with ``method=`` or, for older versions of the library,
    the ``error_feedback=`` it replaced (so that the A/B script can run both)."""
    if "method" in inspect.signature(CompressionState).parameters:
        return CompressionState(
            name, ratio=ratio, method=method, momentum=momentum, skip_communication=True
        )
    return CompressionState(  # type: ignore[call-arg]
        name,
        ratio=ratio,
        error_feedback=_OLD_NAMES[method],
        momentum=momentum,
        skip_communication=True,
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _steps(ddp: DDP, n: int, times: list[float] | None = None) -> list[float]:
    """Run ``n`` training steps; returns their wall times (or the hook times collected in
    ``times``, one sum per step, when given)."""
    X = torch.randn(BATCH, WIDTHS[0], generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    out = []
    for _ in range(n):
        mark = len(times) if times is not None else 0
        t0 = CLOCK[0]()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(X), y).backward()
        opt.step()
        out.append(CLOCK[0]() - t0 if times is None else sum(times[mark:]))
    return out


def measure(key: str, world: int, steps: int, profile: bool) -> dict[str, Any]:
    ddp = DDP(_model(), bucket_cap_mb=25)
    state = make_state(*CONFIGS[key])
    state.world_size = world  # a fake n-rank payload set (see the module docstring)
    if hasattr(state, "weights"):  # older versions keep the weights on the state
        state.weights = torch.full((world,), 1.0 / world, dtype=torch.float64)
    times: list[float] = []

    def timed(
        state: CompressionState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        t0 = CLOCK[0]()
        fut = compression_hook(state, bucket)
        fut.wait()
        times.append(CLOCK[0]() - t0)
        return fut

    ddp.register_comm_hook(state, timed)
    _steps(ddp, 3, times)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    per_step = _steps(ddp, steps, times)
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return {"median": statistics.median(per_step), "min": min(per_step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--world", type=int, default=4, help="ranks whose payloads are decoded")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", help="also write the numbers (seconds) to this file")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        base = _steps(DDP(_model(), bucket_cap_mb=25), 3 + args.steps)[3:]
        step = statistics.median(base)
        print(
            f"shrinkgrad DDP hook, {sum(p.numel() for p in _model().parameters()) / 1e6:.2f} M "
            f"parameters, fake {args.world}-rank payload set, 1 thread, {args.clock} clock; "
            f"baseline: a step without hook, median {step * 1e3:.0f} ms"
        )
        print(f"{'configuration':44s} {'hook ms/step':>13s} {'min':>7s} {'x step':>7s}")
        numbers: dict[str, Any] = {"baseline_step": step}
        for key in args.only:
            r = numbers[key] = measure(key, args.world, args.steps, args.profile)
            name, ratio, method, momentum = CONFIGS[key]
            label = f"{name}" + (f" {ratio:g}" if ratio else "") + f" + {method}"
            label += f" momentum {momentum:g}" if momentum else ""
            print(
                f"{label:44s} {r['median'] * 1e3:13.1f} {r['min'] * 1e3:7.1f} "
                f"{r['median'] / step:7.2f}"
            )
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(numbers, fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
