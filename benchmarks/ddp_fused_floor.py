"""The floor of a hook step with nothing but the kernels: rand_k (shared seed) 1 % + DCGD.

Run: ``python benchmarks/ddp_fused_floor.py [--cycles 8] [--steps 5] [--clock cpu|wall]``.

Issue 14 asks for rand_k with a shared seed at ≤ 1.5× a cache-cold memcpy of the gradient per
step. ``benchmarks/ddp_hook.py --kernel-split`` splits the hook's time into its compiled
kernels and the rest (the hook's, the method's and the compressor's Python). This benchmark
measures what removing *all* of that Python would give: a hand-fused hook, written here and not
in the library, that makes the same kernel calls on the same buffers as the library's values
path — draw the k shared indices (``randk_block``), sort them by chunk (``bucket_by_chunk``),
check the bucket finite and gather the scaled kept values (``sparse_gather``), weigh them by
1/n, and, in the collective's callback, replace the previous direction's entries of the output
by the new ones (``sparse_replace``) — with about 20 Python calls per bucket and no method,
state, checkpoint or loss-scaler support. Before timing, its (indices, values) are checked
equal to ``C.sparse(x, keys)`` of the library's compressor for the same keys, and its output to
the dense direction those give.

Both hooks run on ``benchmarks/ddp.py``'s MLP (10.5 M parameters, float32, one thread), one
compression unit per DDP bucket (``granularity="bucket"``), a fake 4-rank payload set as in
``ddp_hook.py``; one cycle = a cache-cold memcpy baseline (15 repetitions), then ``--steps``
steps of each hook in turn. Printed: each hook's median time per step over all cycles, its
ratio to the median memcpy, and the spread of the per-cycle ratios.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hook import CLOCK, CONFIGS, GRANULARITY, _steps, _timed, make_state, memcpy_baseline
from ddp_hook import _model as model
from shrinkgrad.compressors import _kernels as K
from shrinkgrad.compressors import make_compressor
from shrinkgrad.compressors.base import _keys_rows
from shrinkgrad.compressors.sparse import RANDK_TAG, ROT_TRIES, randk_domain
from shrinkgrad.distributed import compression_hook, free_port
from shrinkgrad.rng import Keys

WORLD = 4  # the fake payload set's n (the values are weighed by 1/n)
RATIO = 0.01


class FusedRandK:
    """The hand-fused hook's buffers for one bucket (allocated once, as the library's plans)."""

    def __init__(self, d: int) -> None:
        self.d, self.k = d, max(1, int(np.ceil(RATIO * d)))
        self.C = make_compressor(f"rand_k[k={self.k},shared_seed=true]")
        self.idx = np.empty((1, self.k), dtype=np.int64)
        self.order = np.empty_like(self.idx)
        self.starts = np.empty((1, -(-d // K.CHUNK) + 1), dtype=np.int64)
        self.vals = np.empty((1, self.k), dtype=np.float32)
        self.scale = np.array([d / self.k], dtype=np.float32)
        self.dom = randk_domain(d)
        self.out = torch.zeros(d)
        self.old = np.empty(0, dtype=np.int64)

    def client(self, x2: np.ndarray, keys: Keys) -> None:
        """The k shared indices, and the kept values scaled by d/k and weighed by 1/n."""
        lo, hi = _keys_rows(keys.fold(RANDK_TAG))
        K.run(K.randk_block, self.idx, lo, hi, self.d, ROT_TRIES, self.idx, self.dom)
        K.bucket_by_chunk(self.idx, self.order, self.starts, True)
        status = K.run(K.sparse_gather, x2, x2, self.order, self.starts, self.scale, self.vals)
        if status != K.OK:
            raise ValueError("the bucket is not finite")
        np.divide(self.vals, WORLD, out=self.vals)

    def server(self, vals: np.ndarray) -> torch.Tensor:
        """The direction (the reduced values at the shared indices) written over the last one."""
        new = self.idx.reshape(-1)
        K.sparse_replace(self.out.numpy(), self.old, new, vals.reshape(-1), True)
        self.old = new.copy()
        return self.out


def fused_hook(buffers: dict[str, Any]) -> Any:
    iteration = [0]

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        f = buffers.get(bucket.index())
        if f is None or f.d != buf.numel():
            f = buffers[bucket.index()] = FusedRandK(buf.numel())
        keys = Keys.derive(0, round=iteration[0], client=0).fold(bucket.index())
        if bucket.is_last():
            iteration[0] += 1
        f.client(buf.numpy().reshape(1, -1), keys)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(torch.from_numpy(f.vals))  # the all-reduce of the skipped communication
        return fut.then(lambda done: f.server(done.value().numpy()))

    return hook


def check() -> None:
    """The fused kernels give the library's sparse form, and the direction it stands for."""
    d = 1_000_003
    x = torch.randn(d)
    f = FusedRandK(d)
    keys = Keys.derive(0, round=3, client=0).fold(7)
    f.client(x.numpy().reshape(1, -1), keys)
    idx, vals = f.C.sparse(x, keys)
    assert torch.equal(idx.reshape(-1), torch.from_numpy(f.idx).reshape(-1)), "indices differ"
    assert torch.equal((vals.reshape(-1) / WORLD), torch.from_numpy(f.vals).reshape(-1))
    ref = torch.zeros(d).index_put_((idx.reshape(-1),), vals.reshape(-1) / WORLD)
    assert torch.equal(f.server(f.vals), ref), "direction differs"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = ap.parse_args()
    if args.cycles < 1 or args.steps < 1:
        ap.error("--cycles and --steps need at least 1")
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    GRANULARITY[0] = "bucket"
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        check()
        hooks: dict[str, tuple[DDP, list[float]]] = {}
        for name in ("library hook", "hand-fused floor"):
            ddp = DDP(model(), bucket_cap_mb=25)
            times: list[float] = []
            if name == "library hook":
                state = make_state(*CONFIGS["randk"])
                state.world_size = WORLD
                ddp.register_comm_hook(state, _timed(compression_hook, times))
            else:
                ddp.register_comm_hook({}, _timed(fused_hook({}), times))
            _steps(ddp, 3, times)
            hooks[name] = (ddp, times)
        per: dict[str, list[float]] = {name: [] for name in hooks}
        ratios: dict[str, list[float]] = {name: [] for name in hooks}
        copies = []
        for _ in range(args.cycles):
            copy = memcpy_baseline()["median"]
            copies.append(copy)
            for name, (ddp, times) in hooks.items():
                steps = _steps(ddp, args.steps, times)
                per[name] += steps
                ratios[name].append(statistics.median(steps) / copy)
        m = statistics.median(copies)
        print(
            f"rand_k[shared_seed=true] {RATIO:g} + dcgd, one unit per bucket, fake {WORLD}-rank "
            f"payload set, {args.clock} clock, {args.cycles} cycles; cache-cold memcpy of the "
            f"gradient: median {m * 1e3:.2f} ms ({min(copies) * 1e3:.2f}-{max(copies) * 1e3:.2f})"
        )
        print(f"{'hook':20s} {'ms/step':>8s} {'x memcpy':>9s} {'per-cycle x memcpy':>20s}")
        for name, v in per.items():
            r = ratios[name]
            print(
                f"{name:20s} {statistics.median(v) * 1e3:8.2f} {statistics.median(v) / m:9.2f} "
                f"{min(r):9.2f} - {max(r):.2f}"
            )
        lib, fused = ratios["library hook"], ratios["hand-fused floor"]
        pair = [f / b for f, b in zip(fused, lib, strict=True)]
        print(
            f"hand-fused / library, per cycle: median {statistics.median(pair):.2f} "
            f"({min(pair):.2f}-{max(pair):.2f})"
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
