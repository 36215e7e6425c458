"""Speed of every compressor on CPU, as GB/s of input and as a ratio to a memcpy.

Run: ``python benchmarks/compressors.py [--d 1e6 1e7] [--repeat 7] [--threads N] [--no-wire]
[--no-sparse] [--contraction]``.

Like is compared with like: every compressor writes into a preallocated output tensor
(``C(x, keys, out=buf)``) and the memcpy baseline copies the same input into a preallocated
buffer (``buf.copy_(x)``), both measured in this run (timings on a shared 2-core machine are
noisy; the ratio is what carries over). No allocator environment variables are changed; fresh
allocations ≥ 4 MB inside a compressor (e.g. candidate buffers) are part of its cost. Each row
reports the best of ``--repeat`` calls after one warm-up call (which also compiles the numba
kernels). ``torch.topk`` is a reference row (values + indices of the k largest |x_j|, no dense
output). The numba kernels use as many threads as torch (``--threads``, default torch's).

Caches: a d = 10⁷ float32 vector is 40 MB, which fits the last-level cache of some servers (the
development VM has a 300 MB L3, where a repeated memcpy of the same 40 MB runs at ~25 GB/s instead
of the ~12 GB/s of DRAM). ``--cold`` (the default) therefore rotates every measurement, the memcpy
baseline included, through enough distinct input/output pairs to exceed twice the last-level cache,
so that both stream from DRAM; ``--hot`` reuses one pair (everything cache-resident).

A second table times the sparse form ``C.sparse(x, keys) -> (indices, values)`` of the
sparsifiers, which never builds a dense output (the form the DDP hook sends), against the same
cache-cold memcpy. It retires the old "rand_k ≥ 1× memcpy" target of the dense form, whose
floor (zero the output, read k values) is itself ~1× memcpy: the sparse form only reads x once
(the finiteness check of the contract) and touches O(k) memory otherwise.

A third table times the wire format of every compressor: ``encode(x, keys, out=payload)`` into a
preallocated byte buffer and ``decode(payload, d, dtype, keys, out=buf)`` into a preallocated
vector, each against a memcpy measured just before it.

``--contraction`` prints no timing: the measured contraction 1 − ‖C(x) − x‖²/‖x‖² of the
low-rank compressors (power_sgd has no worst-case α; rank_k's α = r/min(m, n) for comparison)
on Gaussian matrices and on the inputs EF21 actually compresses on LIBSVM problems.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shrinkgrad import Compressor, make_compressor
from shrinkgrad.rng import Keys

#: the sparse form's rows (sparsifiers only)
SPARSE_SPECS = [
    "top_k[k={k}]",
    "rand_k[k={k}]",
    "rand_k[k={k},shared_seed=true]",
    "strat_k[k={k}]",
    "strat_k[k={k},shared_seed=true]",
    "bernoulli[p=0.01]",
]

SPECS = [
    "identity",
    "top_k[k={k}]",
    "rand_k[k={k}]",
    "rand_k_scaled[k={k}]",
    "strat_k[k={k}]",
    "bernoulli[p=0.01]",
    "qsgd[s=16]",
    "qsgd[s=1]",
    "ternary",
    "natural",
    "natural_dithering[s=8]",
    "natural_dithering[s=8,norm=inf]",
    "standard_dithering[s=16,norm=inf]",
    "lazy_bernoulli[p=0.01]",
    "scaled_sign",
    "scaled(qsgd[s=16])",
    "compose(top_k[k={k}],scaled(qsgd[s=16]))",
]


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (Linux sysfs); 512 MB when it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes) if sizes else 512 << 20


class Pool:
    """Input/output pairs used in turn, so that a measurement streams from DRAM (see --cold)."""

    def __init__(self, d: int, cold: bool) -> None:
        nbytes = 2 * 4 * d
        count = max(1, -(-2 * last_level_cache_bytes() // nbytes)) if cold else 1
        gen = torch.Generator().manual_seed(0)
        self.xs = [torch.randn(d, generator=gen) for _ in range(count)]
        self.outs = [torch.empty(d) for _ in range(count)]
        for o in self.outs:
            o.zero_()  # fault the pages in now, not inside a measurement
        self.i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i = (self.i + 1) % len(self.xs)
        return self.xs[self.i], self.outs[self.i]


def bench(d: int, repeat: int, only: str | None, cold: bool) -> None:
    """Print one table for vectors of length ``d``.

    Each row is paired with a memcpy measured just before it (same number of repeats), and its
    ratio uses that memcpy, so that load drifting on a shared machine affects both alike.
    """
    k = max(1, d // 100)
    pool = Pool(d, cold)
    keys = Keys.derive(1, round=0, client=0)
    gb = 4 * d / 1e9
    mode = f"cold: {len(pool.xs)} input/output pairs in turn" if cold else "hot: one pair"
    print(f"\nd = {d:.0e} (k = {k}, 1%), {mode}")
    print(f"{'compressor':42s} {'ms':>8s} {'GB/s':>6s} {'memcpy ms':>9s} {'x memcpy':>9s}")

    def copy() -> object:
        x, buf = pool.next()
        return buf.copy_(x)

    def measure(name: str, fn: Callable[[], object]) -> None:
        t_copy = best_of(copy, repeat)
        t = best_of(fn, repeat)
        print(f"{name:42s} {t * 1e3:8.2f} {gb / t:6.2f} {t_copy * 1e3:9.2f} {t_copy / t:9.3f}")

    def topk() -> object:
        x, _ = pool.next()
        return torch.topk(x.abs(), k)

    measure("memcpy (buf.copy_(x))", copy)
    measure("torch.topk(|x|, k) [reference]", topk)
    for spec in SPECS:
        name = spec.format(k=k)
        if only and only not in name:
            continue
        c = make_compressor(name)

        def run(c: Compressor = c) -> object:
            x, buf = pool.next()
            return c(x, keys, out=buf)

        measure(name, run)
    if not only or "rand_k" in f"rand_k[k={k}]":
        rand_k_floor(pool, k, measure)


def rand_k_floor(pool: Pool, k: int, measure: Callable[[str, Callable[[], object]], None]) -> None:
    """Reference rows: what any rand_k with a dense output must at least do, without drawing
    indices and without checking anything: zero the output, and read k scattered values of x
    (presorted indices, torch's index_select). Their sum in one call bounds rand_k's ratio from
    above; on the 2-core development VM it is about 1.0× a cold memcpy, so rand_k ≥ 1× is out of
    reach for a dense output there (docs/compressors.md, "Why rand-k stays below a memcpy")."""
    d = pool.xs[0].numel()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(d, generator=gen)[:k].sort().values
    vals = torch.empty(k)

    def zero() -> object:
        _, buf = pool.next()
        return buf.zero_()

    def gather() -> object:
        x, _ = pool.next()
        return torch.index_select(x, 0, idx, out=vals)

    def both() -> object:
        x, buf = pool.next()
        buf.zero_()
        return torch.index_select(x, 0, idx, out=vals)

    measure("floor of rand_k: out.zero_()", zero)
    measure("floor of rand_k: read k values (sorted)", gather)
    measure("floor of rand_k: both (no draw, no check)", both)


def bench_sparse(d: int, repeat: int, only: str | None, cold: bool) -> None:
    """The sparse form ``C.sparse(x, keys)`` of the sparsifiers against a memcpy of x (same
    cache-cold rotation), and the dense form ``C(x, keys, out=buf)`` of the same compressor."""
    k = max(1, d // 100)
    pool = Pool(d, cold)
    keys = Keys.derive(1, round=0, client=0)
    print(f"\nsparse form, d = {d:.0e} (k = {k}): C.sparse(x, keys) -> (indices, values)")
    print(
        f"{'compressor':42s} {'sparse ms':>9s} {'dense ms':>9s} {'memcpy ms':>9s} {'x memcpy':>9s}"
    )

    def copy() -> object:
        x, buf = pool.next()
        return buf.copy_(x)

    for spec in SPARSE_SPECS:
        name = spec.format(k=k)
        if only and only not in name:
            continue
        c = make_compressor(name)

        def sparse(c: Compressor = c) -> object:
            x, _ = pool.next()
            return c.sparse(x, keys)

        def dense(c: Compressor = c) -> object:
            x, buf = pool.next()
            return c(x, keys, out=buf)

        t_copy = best_of(copy, repeat)
        t_sparse = best_of(sparse, repeat)
        t_dense = best_of(dense, repeat)
        print(
            f"{name:42s} {t_sparse * 1e3:9.2f} {t_dense * 1e3:9.2f} {t_copy * 1e3:9.2f} "
            f"{t_copy / t_sparse:9.3f}"
        )
    if not only or "top_k" in only:
        bench_difference(pool, k, keys, repeat, copy)


def bench_difference(
    pool: Pool, k: int, keys: Keys, repeat: int, copy: Callable[[], object]
) -> None:
    """EF21's C(x − h): Top-k's ``sparse_difference(x, h)`` (selected from the difference chunk
    by chunk, never formed) against forming x − h (``torch.sub`` into a buffer) and then
    ``C.sparse``; the "dense ms" column holds the latter. x: the pool's vector, h: half the
    next one (a fixed vector with ``--hot``)."""
    c = make_compressor(f"top_k[k={k}]")
    fixed = 0.5 * torch.randn(pool.xs[0].numel(), generator=torch.Generator().manual_seed(1))

    def pair() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, buf = pool.next()
        h = pool.xs[(pool.i + 1) % len(pool.xs)] if len(pool.xs) > 1 else fixed
        return x, h, buf

    def fused() -> object:
        x, h, _ = pair()
        return c.sparse_difference(x, h, keys)

    def formed() -> object:
        x, h, buf = pair()
        return c.sparse(torch.sub(x, h, out=buf), keys)

    t_copy = best_of(copy, repeat)
    t_fused = best_of(fused, repeat)
    t_formed = best_of(formed, repeat)
    name = f"top_k[k={k}] of x − h (sub + sparse: dense ms)"
    print(
        f"{name:42s} {t_fused * 1e3:9.2f} {t_formed * 1e3:9.2f} {t_copy * 1e3:9.2f} "
        f"{t_copy / t_fused:9.3f}"
    )


def contraction() -> None:
    """Measured 1 − ‖C(x) − x‖²/‖x‖² of power_sgd (no worst-case α) and rank_k (α = r/min)."""
    import numpy as np

    from shrinkgrad import make_method, make_problem
    from shrinkgrad.methods.oracle import ProblemOracle

    print("\nmeasured contraction 1 − ‖C(x) − x‖²/‖x‖² (min / median / mean over the inputs)")
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(500, 64 * 64, generator=gen, dtype=torch.float64)
    keys = Keys.derive(0, client=np.arange(500))
    for r in (1, 4):
        for spec in (f"power_sgd[rank={r}]", f"rank_k[r={r}]"):
            c = make_compressor(spec)
            y = c(xs, keys)
            a = 1 - ((y - xs) ** 2).sum(-1) / (xs**2).sum(-1)
            extra = f"α = {c.alpha(64 * 64):.4g}" if c.constant_known else "first step (fresh Q)"
            print(
                f"  Gaussian 64×64, {spec:20s} {float(a.min()):.4f} / {float(a.median()):.4f} / "
                f"{float(a.mean()):.4f}   ({extra})"
            )
    for dataset, n, gamma in (("a9a", 50, 1.0), ("w8a", 50, 1.0), ("mushrooms", 50, 1.0)):
        p = make_problem(f"logistic_regression[dataset={dataset},n_clients={n}]")
        oracle = ProblemOracle(p)
        for spec in ("power_sgd[rank=1]", "power_sgd[rank=2]", "rank_k[r=1]"):
            c = make_compressor(spec)
            bound = make_method("ef21").bind(p, c, gamma, seed=0)
            state, _ = bound.init(p.x0(), oracle)
            ratios = []
            for _ in range(200):
                new, _ = bound.step(state, oracle)
                grads = p.client_grads(new.x)
                before = ((grads - state.clients.g) ** 2).sum(-1)
                after = ((grads - new.clients.g) ** 2).sum(-1)
                keep = before > 1e-30
                ratios.append(1 - after[keep] / before[keep])
                state = new
            a = torch.cat(ratios)
            m, nn = c.matrix_shape(p.d)
            extra = f"α = {c.alpha(p.d):.4g}" if c.constant_known else "no α"
            print(
                f"  EF21 on {dataset:9s} (d = {p.d}, {m}×{nn}), {spec:18s} {float(a.min()):.4f} / "
                f"{float(a.median()):.4f} / {float(a.mean()):.4f}   ({extra}; {a.numel()} inputs)"
            )


def bench_wire(d: int, repeat: int, only: str | None) -> None:
    """Encode (into a preallocated payload buffer) and decode (into a preallocated vector) of
    every compressor's wire format, each paired with a memcpy measured just before it."""
    k = max(1, d // 100)
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    buf = torch.empty_like(x)
    keys = Keys.derive(1, round=0, client=0)
    print(f"\nwire format, d = {d:.0e}: encode(x, keys, out=payload), decode(..., out=buf)")
    print(
        f"{'compressor':42s} {'bytes':>10s} {'enc ms':>8s} {'dec ms':>8s} {'memcpy ms':>9s} "
        f"{'enc x memcpy':>12s} {'dec x memcpy':>12s}"
    )
    for spec in SPECS:
        name = spec.format(k=k)
        if only and only not in name:
            continue
        c = make_compressor(name)
        payload = c.encode(x, keys)
        space = torch.empty(
            payload.numel() + (payload.numel() if c.variable_size else 0) + 64, dtype=torch.uint8
        )
        t_copy = best_of(lambda: buf.copy_(x), repeat)
        t_enc = best_of(lambda c=c, o=space: c.encode(x, keys, out=o), repeat)
        t_dec = best_of(lambda c=c, p=payload: c.decode(p, d, x.dtype, keys, out=buf), repeat)
        print(
            f"{name:42s} {payload.numel():10d} {t_enc * 1e3:8.2f} {t_dec * 1e3:8.2f} "
            f"{t_copy * 1e3:9.2f} {t_copy / t_enc:12.3f} {t_copy / t_dec:12.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--d", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch and kernel threads")
    ap.add_argument("--only", type=str, default=None, help="substring filter on the specs")
    ap.add_argument("--no-wire", action="store_true", help="skip the encode/decode table")
    ap.add_argument("--no-sparse", action="store_true", help="skip the sparse-form table")
    ap.add_argument(
        "--contraction", action="store_true", help="only the low-rank contraction measurement"
    )
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument(
        "--cold",
        dest="cold",
        action="store_true",
        default=True,
        help="rotate through inputs larger than the last-level cache (default)",
    )
    cache.add_argument("--hot", dest="cold", action="store_false", help="reuse one input/output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.contraction:
        contraction()
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads (torch and the numba "
        "kernels); float32; output and memcpy into preallocated buffers"
    )
    print(f"last-level cache: {last_level_cache_bytes() >> 20} MB")
    for df in args.d:
        bench(int(df), args.repeat, args.only, args.cold)
    if not args.no_sparse:
        for df in args.d:
            bench_sparse(int(df), args.repeat, args.only, args.cold)
    if not args.no_wire:
        for df in args.d:
            bench_wire(int(df), args.repeat, args.only)


if __name__ == "__main__":
    main()
