"""Speed of model problems (run on demand: ``python benchmarks/model_problems.py [--dtype ...]``).

The MLP of issue 15 (a9a, one hidden layer of 64 ReLU units, cross-entropy, d = 8,066) on all
32,561 rows, split into n ∈ {10, 100, 1000} contiguous clients (equal total samples), one thread.
Printed against baselines measured in the same run:

* ``client_grads`` (one ``vmap(grad)`` evaluation) against a per-client Python loop of
  ``torch.autograd.grad`` over the same data (target: ≥ 10× faster at n = 100);
* the cost per round at n = 1000 over that at n = 10 (target ≤ 3×);
* the floor: one forward and backward pass over all rows as a single batch (the gradient of f,
  no per-client split) — the least any per-client method can cost on this hardware, which
  bounds the speed-up over a loop that is itself close to it;
* memory at n = 1000: the padded data, the (n, d) output, and the peak resident set of a fresh
  process that builds the problem and evaluates ``client_grads`` once;
* on a CUDA device the same table when one is available (else "not run").

Timings are the best of several batches (noise on a shared machine only ever adds time).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from shrinkgrad.problems import ModelProblem, load, model_problem
from shrinkgrad.problems.model_zoo import keyed_init_, mlp_module

NS = (10, 100, 1000)


def timeit(fn: Callable[[], object], repeat: int = 5, number: int = 3) -> float:
    """Best seconds per call over ``repeat`` batches of ``number`` calls (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def build(n: int, dtype: torch.dtype, device: str) -> ModelProblem:
    net = keyed_init_(mlp_module(123, 2, 64), 0)
    return model_problem(net, "a9a", n_clients=n, test=0, dtype=dtype, device=device)


class Loop:
    """The baseline: the clients' rows as tensors, then one autograd.grad per client."""

    def __init__(self, p: ModelProblem, dtype: torch.dtype, device: str) -> None:
        ds = load("a9a")
        X = torch.from_numpy(ds.X.toarray()).to(device, dtype)
        y = torch.from_numpy((np.asarray(ds.y) > 0).astype(np.int64)).to(device)
        self.rows = [
            (X[torch.from_numpy(r).to(device)], y[torch.from_numpy(r).to(device)]) for r in p.parts
        ]
        self.net = copy.deepcopy(p.module).requires_grad_(True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.nn.utils.vector_to_parameters(x, self.net.parameters())
        params = list(self.net.parameters())
        out = []
        for Xi, yi in self.rows:
            g = torch.autograd.grad(F.cross_entropy(self.net(Xi), yi), params)
            out.append(torch.cat([t.reshape(-1) for t in g]))
        return torch.stack(out)


def floor(p: ModelProblem, dtype: torch.dtype, device: str) -> Callable[[], object]:
    """One forward/backward over all rows as one batch: ∇ of the mean loss (no client split)."""
    ds = load("a9a")
    X = torch.from_numpy(ds.X.toarray()).to(device, dtype)
    y = torch.from_numpy((np.asarray(ds.y) > 0).astype(np.int64)).to(device)
    net = copy.deepcopy(p.module).requires_grad_(True)
    params = list(net.parameters())
    return lambda: torch.autograd.grad(F.cross_entropy(net(X), y), params)


#: run in a fresh process: peak resident set (MiB) after import, after building, after one call
_MEMORY_PROBE = """
import json, resource, sys, torch
torch.set_num_threads(1)
from shrinkgrad.problems import model_problem
from shrinkgrad.problems.model_zoo import keyed_init_, mlp_module

def rss():  # peak resident set of this process (VmHWM; ru_maxrss survives exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

n, dtype = int(sys.argv[1]), sys.argv[2]
out = {"import": rss()}
p = model_problem(keyed_init_(mlp_module(123, 2, 64), 0), "a9a", n_clients=n, test=0, dtype=dtype)
out["built"] = rss()
p.client_grads(p.x0())
out["grads"] = rss()
print(json.dumps(out))
"""


def peak_memory(n: int, dtype: str) -> dict[str, float]:
    """Peak RSS (MiB) of a fresh process: after import, after building, after client_grads."""
    cmd = [sys.executable, "-c", _MEMORY_PROBE, str(n), dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(dtype: torch.dtype, device: str) -> None:
    name = str(dtype).replace("torch.", "")
    print(f"\n== {device}, {name} ==")
    head = ("n", "client_grads", "loop", "loop/batched", "vs n=10", "vs floor")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 13, 10, 13, 8, 9), strict=True)))
    base = None
    fl = None
    for n in NS:
        p = build(n, dtype, device)
        x = p.x0()
        loop = Loop(p, dtype, device)
        check = loop(x)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        torch.testing.assert_close(p.client_grads(x), check, rtol=0, atol=tol)
        if fl is None:
            fl = timeit(floor(p, dtype, device))
            print(f"{'floor':>6} {fl * 1e3:11.1f}ms   (one forward/backward over all 32,561 rows)")
        t = timeit(lambda p=p, x=x: p.client_grads(x))
        t_loop = timeit(lambda loop=loop, x=x: loop(x), repeat=2 if n >= 1000 else 3, number=1)
        base = base or t
        print(
            f"{n:>6} {t * 1e3:11.1f}ms {t_loop * 1e3:8.1f}ms {t_loop / t:12.1f}× {t / base:7.2f}× "
            f"{t / fl:8.2f}×"
        )
        if n == NS[-1]:
            item = torch.finfo(dtype).bits // 8
            data = sum(g.batch.X.numel() for g in p._groups) * item / 2**20
            grads = n * p.d * item / 2**20
            print(f"memory at n={n}: padded data {data:.1f} MiB, (n, d) output {grads:.1f} MiB")
    if device == "cpu":
        mem = peak_memory(NS[-1], name)
        print(
            f"peak RSS of a fresh process at n={NS[-1]}: {mem['import']:.0f} MiB after import, "
            f"{mem['built']:.0f} MiB built, {mem['grads']:.0f} MiB after client_grads "
            f"(+{mem['grads'] - mem['built']:.0f} MiB for the evaluation)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float64", "float32", "both"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load("a9a")
    print("shrinkgrad model-problem benchmark: MLP 123-64-2 (ReLU) on a9a, 32,561 rows, 1 thread")
    dtypes = (
        [torch.float64, torch.float32] if args.dtype == "both" else [getattr(torch, args.dtype)]
    )
    for dt in dtypes:
        table(dt, "cpu")
    if torch.cuda.is_available():
        for dt in dtypes:
            table(dt, "cuda")
    else:
        print("\nCUDA: not run (no GPU on this machine)")
    print("\ntargets: loop/batched ≥ 10× at n = 100; client_grads at n = 1000 ≤ 3× n = 10")


if __name__ == "__main__":
    main()
