"""Speed of model problems (run on demand: ``python benchmarks/model_problems.py [--dtype ...]``).

The MLP of issue 15 (a9a, one hidden layer of 64 ReLU units, cross-entropy, d = 8,066) on all
32,561 rows, split into n ∈ {10, 100, 1000} contiguous clients (equal total samples), one thread.
Printed against baselines measured in the same run, the methods timed in alternation (one call
of each in turn, ``--rounds`` times; best time per method, and the spread of the per-round
ratios, since noise on a shared machine only ever adds time):

* ``client_grads`` of the registered network (a ``Sequential`` of Linear/ReLU: the hand-written
  ``linear_stack`` path of :mod:`shrinkgrad.problems.model_sequential`) against a per-client
  Python loop of ``torch.autograd.grad`` over the same data (target: ≥ 10× faster at n = 100);
* the same network with ``model_problem(..., evaluation="vmap")``, the generic ``vmap(grad)``
  path (what every model used before the fast path);
* the cost per round at n = 1000 over that at n = 10 (target ≤ 3×);
* floors: one forward and backward pass over all rows as a single batch (the gradient of f, no
  per-client split: every per-client method needs at least these products), the same with the
  input as a torch sparse CSR matrix (a9a's rows are 11% dense), the FLOP count of the pass at
  this machine's measured ``dgemm`` rate, and allocating plus first touching the (n, d) result
  (every call returns a fresh one);
* memory at n = 1000: the padded data, the (n, d) output, and the peak resident set of a fresh
  process that builds the problem and evaluates ``client_grads`` once (both paths);
* on a CUDA device the same table when one is available (else "not run").
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
HIDDEN = 64


def alternating(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of one call of each function, in turn, ``rounds`` times (after a warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def timeit(fn: Callable[[], object], repeat: int = 5) -> float:
    """Best seconds per call over ``repeat`` calls (after a warm-up)."""
    return min(alternating({"f": fn}, repeat)["f"])


def network() -> torch.nn.Module:
    return keyed_init_(mlp_module(123, 2, HIDDEN), 0)


def build(n: int, dtype: torch.dtype, device: str, generic: bool = False) -> ModelProblem:
    return model_problem(
        network(), "a9a", n_clients=n, test=0, dtype=dtype, device=device,
        evaluation="vmap" if generic else "auto",
    )  # fmt: skip


def a9a(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ds = load("a9a")
    X = torch.from_numpy(ds.X.toarray()).to(device, dtype)
    y = torch.from_numpy((np.asarray(ds.y) > 0).astype(np.int64)).to(device)
    return X, y


class Loop:
    """The baseline: the clients' rows as tensors, then one autograd.grad per client."""

    def __init__(self, p: ModelProblem, dtype: torch.dtype, device: str) -> None:
        X, y = a9a(dtype, device)
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


def floors(p: ModelProblem, dtype: torch.dtype, device: str) -> dict[str, Callable[[], object]]:
    """One forward/backward over all rows as one batch (∇ of the mean loss, no client split),
    with the input dense and as a sparse CSR matrix."""
    X, y = a9a(dtype, device)
    net = copy.deepcopy(p.module).requires_grad_(True)
    params = list(net.parameters())
    W1, b1 = net[0].weight, net[0].bias
    rest = net[1:]
    Xs = X.to_sparse_csr()

    def dense() -> object:
        return torch.autograd.grad(F.cross_entropy(net(X), y), params)

    def sparse() -> object:
        out = rest(torch.sparse.mm(Xs, W1.t()) + b1)
        return torch.autograd.grad(F.cross_entropy(out, y), params)

    return {"dense": dense, "sparse": sparse}


def pass_flops(N: int, nnz: int, p: int = 123, h: int = HIDDEN, c: int = 2) -> tuple[int, int]:
    """FLOPs of one forward/backward of the MLP over N rows (multiply-add = 2): the first layer's
    product and its weight gradient (2·N·p·h each; 2·nnz·h each with a sparse input), the second
    layer's product, weight gradient and back-propagated Δ (2·N·h·c each). Elementwise work
    (biases, ReLU, softmax) is O(N·h) and left out."""
    second = 3 * 2 * N * h * c
    return 2 * 2 * N * p * h + second, 2 * 2 * nnz * h + second


def dgemm_rate(dtype: torch.dtype, device: str) -> float:
    """FLOP/s of a 1024³ matrix product (this machine's practical peak on one thread)."""
    a = torch.randn(1024, 1024, dtype=dtype, device=device)
    return 2 * 1024**3 / timeit(lambda: a @ a)


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

n, dtype, generic = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "generic"
out = {"import": rss()}
net = keyed_init_(mlp_module(123, 2, 64), 0)
p = model_problem(net, "a9a", n_clients=n, test=0, dtype=dtype,
                  evaluation="vmap" if generic else "auto")
out["built"] = rss()
p.client_grads(p.x0())
out["grads"] = rss()
print(json.dumps(out))
"""


def peak_memory(n: int, dtype: str, path: str) -> dict[str, float]:
    """Peak RSS (MiB) of a fresh process: after import, after building, after client_grads."""
    cmd = [sys.executable, "-c", _MEMORY_PROBE, str(n), dtype, path]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}ms"


def table(dtype: torch.dtype, device: str, rounds: int) -> None:
    name = str(dtype).replace("torch.", "")
    print(f"\n== {device}, {name} ==")
    X, _ = a9a(dtype, device)
    N, nnz = X.shape[0], int((X != 0).sum())
    dense_flops, sparse_flops = pass_flops(N, nnz)
    rate = dgemm_rate(dtype, device)
    print(
        f"FLOPs of one forward/backward over all {N:,} rows: {dense_flops / 1e9:.2f} G dense, "
        f"{sparse_flops / 1e9:.2f} G with a sparse input ({nnz / X.numel():.1%} of the entries "
        f"nonzero);\nat the 1024³ dgemm rate of {rate / 1e9:.1f} GFLOP/s: "
        f"{_ms(dense_flops / rate)} dense, {_ms(sparse_flops / rate)} sparse"
    )
    head = ("n", "linear_stack", "vmap", "loop", "alloc (n, d)", "loop/linear_stack")
    widths = (6, 13, 9, 9, 13, 22)
    fns: dict[str, Callable[[], object]] = {}
    for n in NS:  # everything is built first, then timed in one alternation
        p = build(n, dtype, device)
        q = build(n, dtype, device, generic=True)
        assert p.evaluation == "linear_stack" and q.evaluation == "vmap"
        x = p.x0()
        loop = Loop(p, dtype, device)
        check = loop(x)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        torch.testing.assert_close(p.client_grads(x), check, rtol=0, atol=tol)
        torch.testing.assert_close(q.client_grads(x), check, rtol=0, atol=tol)
        fresh = (n, p.d)
        fns[f"fast{n}"] = lambda p=p, x=x: p.client_grads(x)
        fns[f"vmap{n}"] = lambda q=q, x=x: q.client_grads(x)
        fns[f"loop{n}"] = lambda loop=loop, x=x: loop(x)
        fns[f"alloc{n}"] = lambda fresh=fresh: torch.empty(fresh, dtype=dtype, device=device).fill_(
            0
        )
        if n == NS[-1]:
            item = torch.finfo(dtype).bits // 8
            data = sum(g.batch.X.numel() for g in p._groups) * item / 2**20
            grads = n * p.d * item / 2**20
            memory = f"memory at n={n}: padded data {data:.1f} MiB, (n, d) output {grads:.1f} MiB"
    fl = floors(p, dtype, device)
    fns["floor"], fns["sparse"] = fl["dense"], fl["sparse"]
    times = alternating(fns, rounds)
    best = {k: min(v) for k, v in times.items()}

    def ratio(a: str, b: str) -> str:
        r = [x / y for x, y in zip(times[a], times[b], strict=True)]
        return f"{best[a] / best[b]:.2f}× [{min(r):.2f}–{max(r):.2f}]"

    print(
        f"measured floor, one forward/backward over all rows: {_ms(best['floor'])} dense, "
        f"{_ms(best['sparse'])} with the input as a torch sparse CSR matrix"
    )
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for n in NS:
        cells = [_ms(best[f"{k}{n}"]) for k in ("fast", "vmap", "loop", "alloc")]
        line = " ".join(f"{c:>{w}}" for c, w in zip(cells, widths[1:], strict=False))
        print(f"{n:>6} {line} {ratio(f'loop{n}', f'fast{n}'):>22}")
    print(memory)
    print("ratios: best / best [range of the ratio within one alternation round]")
    for n in NS:
        print(
            f"  n={n}: linear_stack / floor {ratio(f'fast{n}', 'floor')}, loop / floor "
            f"{ratio(f'loop{n}', 'floor')}, vmap / linear_stack {ratio(f'vmap{n}', f'fast{n}')}"
        )
    print(f"  sparse floor / dense floor {ratio('sparse', 'floor')}")
    big, small = NS[-1], NS[0]
    print(
        f"  n={big} / n={small} (equal total samples): linear_stack "
        f"{ratio(f'fast{big}', f'fast{small}')}, vmap {ratio(f'vmap{big}', f'vmap{small}')}"
    )
    if device == "cpu":
        for path in ("fast", "generic"):
            mem = peak_memory(NS[-1], name, path)
            print(
                f"peak RSS of a fresh process at n={NS[-1]} ({path}): {mem['import']:.0f} MiB "
                f"after import, {mem['built']:.0f} MiB built, {mem['grads']:.0f} MiB after "
                f"client_grads (+{mem['grads'] - mem['built']:.0f} MiB for the evaluation)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float64", "float32", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load("a9a")
    print("shrinkgrad model-problem benchmark: MLP 123-64-2 (ReLU) on a9a, 32,561 rows, 1 thread")
    dtypes = (
        [torch.float64, torch.float32] if args.dtype == "both" else [getattr(torch, args.dtype)]
    )
    for dt in dtypes:
        table(dt, "cpu", args.rounds)
    if torch.cuda.is_available():
        for dt in dtypes:
            table(dt, "cuda", args.rounds)
    else:
        print("\nCUDA: not run (no GPU on this machine)")
    print("\ntargets: loop/fast ≥ 10× at n = 100; client_grads at n = 1000 ≤ 3× n = 10")


if __name__ == "__main__":
    main()
