"""What a block-stratified sparsifier would cost, against rand_k's sparse form and a memcpy.

Run: ``python benchmarks/stratified_floor.py [--d 10500000] [--ratio 0.01] [--cycles 8]``.

Issue 14 asks for rand_k with a shared seed at ≤ 1.5× a cache-cold memcpy of the gradient per
hook step; stop 33 measured that even a hand-fused hook stays at 1.35–1.55×, because the kernels
alone (draw the k indices, sort them by chunk, check the bucket finite while gathering the kept
values, store the direction) take ≈ 1.2–1.5×. This scratch benchmark measures the kernel of a
design proposed in stop 34's note (a scratch copy, not the library's): a block-stratified
sparsifier keeps one index drawn uniformly in each of k equal blocks of [0, d). Each j is kept
with probability 1/|B_j| and scaled by |B_j|, so it is unbiased with ω = max|B| − 1 = ⌈d/k⌉ − 1
(d/k − 1, rand_k's, when k divides d); its indices come sorted, so there is no draw of a
permutation and no chunk sort, and the kept value of a block is read while the finiteness check
streams over that block. It is another compressor than rand_k (its k-subsets are not uniformly
random), so it would join the registry under its own name. Stop 36 built it: ``strat_k``
(``benchmarks/compressors.py`` and ``benchmarks/ddp_hook.py --only stratk`` measure the
library's kernel); this scratch kernel is kept as stop 34's measurement.

Per cycle, each measured cold (a 64 MB buffer written first), 5 repetitions each, in turn:
a memcpy of the d float32 values; the finiteness check alone (one read of x: the floor of any
checked path); the library's ``rand_k[k, shared_seed=true]`` sparse form (``C.sparse(x, keys)``:
draw, chunk sort, checked gather); the fused stratified kernel (draw, check and gather in one
pass). Printed: the medians over all cycles and each one's ratio to the memcpy, with the range
of the per-cycle ratios. CPU clock, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from numba import njit

from shrinkgrad.compressors import make_compressor
from shrinkgrad.compressors._kernels import _check_block
from shrinkgrad.rng import Keys

MIX = np.uint64(0x9E3779B97F4A7C15)
#: entries checked per call of the library's finiteness check (its CHUNK's order of size)
SPAN = 4096


@njit(cache=True, nogil=True)
def _mix(z: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """splitmix64's finaliser: a counter-based draw keyed by (key, block)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def stratified_gather(  # pragma: no cover - compiled
    x: np.ndarray, k: int, key: np.uint64, idx: np.ndarray, vals: np.ndarray
) -> bool:
    """One pass over x: blocks b = [⌊bd/k⌋, ⌊(b+1)d/k⌋), a span of about SPAN entries of them
    at a time, checked finite with the library's vectorized check (``_check_block``), then each
    block's kept entry j = lo + (draw mod |B|) read while the span is in cache,
    vals[b] = |B|·x[j]. False when some x is not finite."""
    d = x.shape[0]
    per = max(1, SPAN // max(1, d // k))  # blocks per span
    ok = True
    for b0 in range(0, k, per):
        b1 = min(k, b0 + per)
        if _check_block(x[(b0 * d) // k : (b1 * d) // k]):
            ok = False
        for b in range(b0, b1):
            lo = (b * d) // k
            hi = ((b + 1) * d) // k
            z = _mix(key + np.uint64(b) * MIX)
            j = lo + np.int64(z % np.uint64(hi - lo))
            idx[b] = j
            vals[b] = x[j] * np.float32(hi - lo)
    return ok


@njit(cache=True, nogil=True)
def finite(x: np.ndarray) -> bool:  # pragma: no cover - compiled
    """The finiteness check alone (the library's, in spans of the same size)."""
    ok = True
    for s in range(0, x.shape[0], SPAN):
        if _check_block(x[s : s + SPAN]):
            ok = False
    return ok


def _cold(fn: Callable[[], object], flush: torch.Tensor, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        flush.add_(1.0)
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=10_500_000)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    d, k = args.d, max(1, int(np.ceil(args.ratio * args.d)))
    x = torch.randn(d)
    xn = x.numpy()
    dst = torch.empty_like(x)
    flush = torch.empty(16 * 2**20)
    idx = np.empty(k, dtype=np.int64)
    vals = np.empty(k, dtype=np.float32)
    C = make_compressor(f"rand_k[k={k},shared_seed=true]")
    keys = Keys.derive(0, round=1, client=0)
    # compile and check once: the stratified draw keeps one index per block, sorted, scaled
    assert stratified_gather(xn, k, np.uint64(12345), idx, vals) and finite(xn)
    bounds = (np.arange(k + 1) * d) // k
    assert (idx >= bounds[:-1]).all() and (idx < bounds[1:]).all()
    np.testing.assert_array_equal(vals, xn[idx] * np.diff(bounds).astype(np.float32))
    C.sparse(x, keys)
    cases: dict[str, Callable[[], object]] = {
        "memcpy": lambda: dst.copy_(x),
        "finiteness check alone": lambda: finite(xn),
        "rand_k shared, C.sparse": lambda: C.sparse(x, keys),
        "stratified, fused": lambda: stratified_gather(xn, k, np.uint64(7), idx, vals),
    }
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.cycles):
        for name, fn in cases.items():
            medians[name].append(statistics.median(_cold(fn, flush, args.reps)))
    base = medians["memcpy"]
    print(f"d = {d:,}, k = {k:,} (ratio {args.ratio}), {args.cycles} cycles x {args.reps} reps")
    for name, ts in medians.items():
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        print(
            f"  {name:26s} {statistics.median(ts) * 1e3:7.2f} ms  "
            f"{statistics.median(ratios):5.2f}x memcpy  [{min(ratios):.2f}-{max(ratios):.2f}]"
        )


if __name__ == "__main__":
    main()
