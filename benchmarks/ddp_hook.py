"""CPU time of the shrinkgrad DDP hook per step, in one process, with a fake n-rank payload set.

Run: ``python benchmarks/ddp_hook.py [--only topk topk-sgdm topk-ef randk stratk qsgd] [--world 4]
[--steps 5] [--dtype float32|bfloat16] [--no-half-paths] [--no-fused-mirror] [--profile]
[--kernel-split] [--per-call] [--deep] [--flat N] [--granularity tensor|bucket]
[--interleave-dtypes CYCLES] [--interleave-granularity CYCLES]``.
``benchmarks/ab_ddp_hook.py`` runs it alternately against an older version of the library (A/B).

The model is ``benchmarks/ddp.py``'s MLP (1024 → 2048 → 2048 → 2048 → 16, 10.5 M parameters,
batch 32, float32, one thread); ``--deep`` replaces it by 41 layers (1024 → 512 × 40 → 16, 10.8 M
parameters in 82 tensors: a model of many tensors), ``--flat N`` by the same number of parameters
as N flat vectors (:class:`Flat`; N = 1 or 2: a proxy of one compressor call per bucket).
``--granularity bucket`` compresses every DDP bucket as one unit
(``CompressionState(granularity="bucket")``), and ``--interleave-granularity CYCLES`` runs a
per-tensor and a per-bucket hook of each configuration in turn in one process, printing the
per-cycle ratios bucket/tensor. DDP runs
on a one-process gloo group; the hook's state is created with ``skip_communication=True`` and
its world size set to ``--world`` (weights 1/n), so every step does all of an n-rank job's
local work — compressing its buckets, encoding, decoding
its own message (error feedback) and the n received ones (here n copies of its own) and the
sums — without any network. Printed per configuration: the hook's time per step (the sum over
the buckets of the time from the hook's call until its future is done; median and minimum over
``--steps`` steps after 3 warm-up steps; ``--clock cpu``: this process's CPU time instead of wall
time) and its ratio to the baseline measured in the same run:
a training step of the same model without a hook (forward, backward, DDP's local all-reduce,
optimizer step). ``--profile`` adds the top functions of a cProfile of the timed steps (which
inflates the Python part about twice); ``--kernel-split`` instead times every compiled kernel
called from Python during the timed steps and prints, under each configuration, the kernels'
ms per step against the hook's mean and the largest ones: what is not kernels is the hook's,
the method's and the compressors' Python and their small torch calls. ``--per-call`` splits
each configuration's hook time into a fixed cost per hook call and a cost per gradient entry
(the least-squares line through the median time of every bucket size: DDP calls the hook once per
bucket, and this model's two buckets, 8.4 M and 2.1 M entries, give two points, so it is a
split rather than a fit): the per-entry part alone, in memcpy units, is what the hook would
cost with no per-call work at all — a floor that only faster kernels can lower.
glibc's allocator defaults are used (the hook keeps no per-step multi-megabyte allocations).

The lighter hook's targets (issue 14) are against a **cache-cold memcpy of the gradient**,
measured in the same run: one ``copy_`` of all the model's gradient entries (in the model's
dtype) between two buffers, after writing a 64 MB buffer that evicts them from the caches;
median and minimum over 15 repetitions, on the same clock as the hook. Printed next to each
configuration: hook time / memcpy (median / median), and for the sparse compressors the
*floor*: the compressor's sparse form (``C.sparse``: top-k's selection, rand-k's index draw
and gather; for EF21 ``C.sparse_difference`` of g − h, the fused selection its client step
runs) of every compressed gradient alone, without any method arithmetic or hook bookkeeping,
in the same units. A hook cannot be cheaper than its compressor's own pass. Two more
baselines of the same run: a cold read of two float32 vectors of the gradient's size
(``torch.dot``: the traffic of EF21's client step, which reads ∇f_i and g_i once each) and, for
16-bit models, the casts of the gradient to float32 and back (the two conversion passes of
``state_dtype="float32"`` without the 16-bit fast paths). ``--no-half-paths`` turns those fast
paths off (``Planner.direct_half``, ``Planner.sparse_downcast``: the compressors reading a
bfloat16 bucket themselves, and the direction converted at its changed entries only), for
an A/B of a 16-bit model against the dense conversions (the same bits); ``--no-fused-mirror``
only converts EF21's changed entries after its server's sparse add instead of in it
(``Planner.fused_mirror``). ``--interleave-dtypes CYCLES`` measures the bf16/f32 target
instead: a float32 and a bfloat16 model of each ``--only`` configuration in one process, one
step of each in turn, and the per-cycle bf16/f32 ratios of the hook time (on a shared VM the
spread between separate runs a minute apart exceeds the effect).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import argparse
import contextlib
import cProfile
import inspect
import itertools
import json
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, free_port

#: the clock of every measurement: wall time (default) or this process's CPU time (``--clock
#: cpu``: on a shared, loaded machine it leaves out the time other processes take the core)
CLOCK = [time.perf_counter]
WIDTHS = (1024, 2048, 2048, 2048, 16)
#: ``--deep``: 41 layers of the same input, output and about the same parameter count (10.8 M in
#: 82 tensors instead of 8: what per-unit Python costs in a model of many tensors)
DEEP = (1024, *(512,) * 40, 16)
#: the widths of the model measured (WIDTHS, or DEEP with ``--deep``)
LAYERS = [WIDTHS]
BATCH = 32
#: key: (compressor, ratio, method, client momentum), as in benchmarks/ddp.py
CONFIGS: dict[str, tuple[str, float | None, str, float]] = {
    "topk": ("top_k", 0.01, "ef21", 0.0),
    "topk-sgdm": ("top_k", 0.01, "ef21", 0.9),  # EF21-SGDM, the example's default
    "topk-ef": ("top_k", 0.01, "ef", 0.0),  # classic error feedback: Top-k of e_i + ∇f_i
    "randk": ("rand_k[shared_seed=true]", 0.01, "dcgd", 0.0),
    # the block-stratified sparsifier: one draw per block, no permutation, one fused pass
    "stratk": ("strat_k[shared_seed=true]", 0.01, "dcgd", 0.0),
    "qsgd": ("qsgd[s=4]", None, "dcgd", 0.0),
    # PowerSGD's factor path (its collectives skipped: P and Q are this rank's own times n)
    "psgd-ef21": ("power_sgd[rank=4,shared=true]", None, "ef21", 0.0),
}
#: torch's own hooks, measured the same way (they do not depend on the library: in an A/B run
#: their two versions' rows are a control of the machine's drift): torch's powerSGD_hook, rank
#: 4, one bucket, after its two plain all-reduce iterations
TORCH = ("torch-psgd1",)
#: the same configurations for versions of the library before ``method=`` (A/B runs)
_OLD_NAMES = {"ef21": "ef21", "dcgd": "none", "ef": "ef"}


#: ``--granularity``: the hook's unit of compression (``CompressionState(granularity=...)``)
GRANULARITY = ["tensor"]


def make_state(name: str, ratio: float | None, method: str, momentum: float) -> CompressionState:
    """The hook state of a configuration, with ``method=`` or, for older versions of the library,
    the ``error_feedback=`` it replaced (so that the A/B script can run both); at
    ``--granularity bucket`` with every bucket one compression unit (versions before it: per
    tensor)."""
    params = inspect.signature(CompressionState).parameters
    if "method" in params:
        extra: dict[str, Any] = {}
        if "granularity" in params:
            extra["granularity"] = GRANULARITY[0]
        elif GRANULARITY[0] != "tensor":
            sys.exit("this version of the library compresses per tensor only (no granularity=)")
        return CompressionState(
            name, ratio=ratio, method=method, momentum=momentum, skip_communication=True, **extra
        )
    return CompressionState(  # type: ignore[call-arg]
        name,
        ratio=ratio,
        error_feedback=_OLD_NAMES[method],
        momentum=momentum,
        skip_communication=True,
    )


#: the model's dtype (``--dtype``)
DTYPE = [torch.float32]


#: ``--flat N``: the MLP's parameters as N flat vectors instead (None: the MLP)
FLAT: list[int | None] = [None]


class Flat(torch.nn.Module):
    """The MLP's parameter count as ``n`` flat vectors (``--flat``): logits = X[:, :16] · s with
    s = Σ_i ⟨p_i, c_i⟩, so every gradient entry is dense and the forward/backward is cheap.
    With n = 1 or 2 the hook makes one or two compressor calls per step: a proxy of one call
    per bucket (what per-tensor Python costs, against what the kernels cost)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        total = sum(a * b + b for a, b in itertools.pairwise(LAYERS[0]))
        sizes = [total // n + (i < total % n) for i in range(n)]
        g = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(m, generator=g) * 0.01) for m in sizes
        )
        for i, m in enumerate(sizes):  # buffers: ``.to(dtype)`` converts them once
            self.register_buffer(f"c{i}", torch.randn(m, generator=g), persistent=False)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        cs = (getattr(self, f"c{i}") for i in range(len(self.ps)))
        s = sum((p * c).sum() for p, c in zip(self.ps, cs, strict=True))
        return X[:, : WIDTHS[-1]] * s


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    if FLAT[0] is not None:
        return Flat(FLAT[0]).to(DTYPE[0])
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(LAYERS[0]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(DTYPE[0])


def _cold(fn: Any, reps: int = 15) -> dict[str, float]:
    """Median and minimum time of ``fn`` (the run's clock) with cold caches (a 64 MB buffer
    written first)."""
    flush = torch.empty(16 * 2**20)
    times = []
    for _ in range(reps):
        flush.add_(1.0)
        t0 = CLOCK[0]()
        fn()
        times.append(CLOCK[0]() - t0)
    return {"median": statistics.median(times), "min": min(times)}


def memcpy_baseline() -> dict[str, float]:
    """A cache-cold memcpy of the model's gradient (all its entries, in the model's dtype)."""
    n = sum(p.numel() for p in _model().parameters())
    src = torch.randn(n).to(DTYPE[0])
    dst = torch.empty_like(src)
    return _cold(lambda: dst.copy_(src))


def cast_baseline() -> dict[str, float] | None:
    """16-bit models: a cache-cold upcast of the gradient to float32 and the downcast back (the
    two conversion passes of ``state_dtype="float32"``); None for float32/float64 models."""
    if DTYPE[0] not in (torch.bfloat16, torch.float16):
        return None
    n = sum(p.numel() for p in _model().parameters())
    half = torch.randn(n).to(DTYPE[0])
    wide = torch.empty(n)

    def run() -> None:
        wide.copy_(half)
        half.copy_(wide)

    return _cold(run)


def read2_baseline() -> dict[str, float]:
    """A cache-cold read of two float32 vectors of the gradient's size (``torch.dot``): the
    traffic that EF21's client step cannot avoid (it reads ∇f_i and g_i once each)."""
    n = sum(p.numel() for p in _model().parameters())
    a, b = torch.randn(n), torch.randn(n)
    return _cold(lambda: torch.dot(a, b))


def sparse_floor(
    name: str, ratio: float | None, method: str = "dcgd", units: list[int] | None = None
) -> dict[str, float] | None:
    """The compressor's sparse form of every compressed gradient of the model alone (the part of
    a step no hook can avoid), cache-cold; None for compressors without one. For EF21 (and
    EF21-SGDM) the sparse form of the difference g − h (``C.sparse_difference``: Top-k
    selects from it chunk by chunk) that its client step compresses. ``units``: the sizes
    of the vectors the hook compressed (its plans' compressed units: the tensors, or at
    ``--granularity bucket`` the buckets); default the model's tensors of ≥ 1024 entries."""
    from shrinkgrad.compressors import COMPRESSORS, make_compressor
    from shrinkgrad.rng import Keys

    if "k" not in {p.name for p in COMPRESSORS.entry(name.split("[")[0]).keyword}:
        return None  # no sparsity parameter: not a sparsifier (qsgd, natural, ...)
    if units is None:
        units = [n for n in (p.numel() for p in _model().parameters()) if n >= 1024]
    grads = [torch.randn(n).to(DTYPE[0]) for n in units]
    comps = []
    for g in grads:
        k = max(1, math.ceil((ratio or 0.01) * g.numel()))
        C = make_compressor(f"{name}[k={k}]" if "[" not in name else name.replace("]", f",k={k}]"))
        if not C.sparse_message or not callable(getattr(C, "sparse", None)):
            return None
        comps.append(C)
    keys = Keys.derive(0, round=1, client=0)
    wide = [g.float() if g.dtype in (torch.bfloat16, torch.float16) else g for g in grads]
    memory = [torch.randn_like(g) * 0.5 for g in wide]
    fused = method == "ef21" and all(hasattr(C, "sparse_difference") for C in comps)

    def run() -> None:
        if fused:  # what the hook computes: float32 arithmetic, values rounded to the wire's
            for C, g, h, x in zip(comps, wide, memory, grads, strict=True):
                C.sparse_difference(g, h, None if C.deterministic else keys, dtype=x.dtype)
            return
        for C, g in zip(comps, grads, strict=True):
            C.sparse(g, None if C.deterministic else keys)

    run()  # compile / warm up
    return _cold(run, reps=9)


def _steps(ddp: DDP, n: int, times: list[float] | None = None) -> list[float]:
    """Run ``n`` training steps; returns their wall times (or the hook times collected in
    ``times``, one sum per step, when given)."""
    X = torch.randn(BATCH, WIDTHS[0], generator=torch.Generator().manual_seed(1))
    X = X.to(next(ddp.parameters()).dtype)  # a 16-bit model takes 16-bit inputs
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


#: the 16-bit fast paths of the hook (``--no-half-paths``: off)
HALF_PATHS = [True]
#: EF21's bfloat16 output written by its server's sparse add (``--no-fused-mirror``: after it)
FUSED_MIRROR = [True]


def _timed(hook: Any, times: list[float], sizes: list[int] | None = None) -> Any:
    """``hook`` wrapped to append the time from its call until its future is done to
    ``times`` (one entry per bucket; ``_steps`` sums a step's) and, when given, the bucket's
    number of entries to ``sizes``."""

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t0 = CLOCK[0]()
        fut = hook(state, bucket)
        fut.wait()
        times.append(CLOCK[0]() - t0)
        if sizes is not None:
            sizes.append(bucket.buffer().numel())
        return fut

    return timed


#: the numba kernels' time per step, by kernel (``--kernel-split``): None when off
KERNEL_SPLIT: list[dict[str, float] | None] = [None]


@contextlib.contextmanager
def kernel_clock(acc: dict[str, float]) -> Iterator[None]:
    """Time every call of a compiled shrinkgrad kernel made from Python (the run's clock,
    summed into ``acc`` by name) while the block runs: each numba dispatcher held by a loaded
    shrinkgrad module (``_kernels``, ``_wire`` and the modules that imported one by name) is
    replaced by a timing wrapper and restored afterwards. Enter it after the warm-up steps:
    the kernels are compiled by then, so no jitted code is typed against a wrapper. One
    thread (the benchmark's): a kernel's time is its caller's."""
    from numba.core.registry import CPUDispatcher

    wrappers: dict[int, Any] = {}
    patched: list[tuple[Any, str, Any]] = []

    def wrap(f: Any, name: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = CLOCK[0]()
            try:
                return f(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + CLOCK[0]() - t0

        return timed

    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("shrinkgrad") or mod is None:
            continue
        for name, f in list(vars(mod).items()):
            if isinstance(f, CPUDispatcher) and not name.startswith("_"):
                w = wrappers.setdefault(id(f), wrap(f, f.__name__))
                patched.append((mod, name, f))
                setattr(mod, name, w)
    try:
        yield
    finally:
        for mod, name, f in patched:
            setattr(mod, name, f)


def measure(key: str, world: int, steps: int, profile: bool) -> dict[str, Any]:
    hook: Any = compression_hook
    if key in TORCH:  # torch's PowerSGD, one bucket, on the one-process group
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        ddp = DDP(_model(), bucket_cap_mb=1000)
        state: Any = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        hook = powerSGD_hook.powerSGD_hook
    else:
        ddp = DDP(_model(), bucket_cap_mb=25)
        state = make_state(*CONFIGS[key])
        state.world_size = world  # a fake n-rank payload set (see the module docstring)
        if hasattr(state, "weights"):  # older versions keep the weights on the state
            state.weights = torch.full((world,), 1.0 / world, dtype=torch.float64)
        if not HALF_PATHS[0] and hasattr(state.planner, "direct_half"):
            state.planner.direct_half = state.planner.sparse_downcast = False
        if not FUSED_MIRROR[0] and hasattr(state.planner, "fused_mirror"):
            state.planner.fused_mirror = False
    times: list[float] = []
    sizes: list[int] = []
    ddp.register_comm_hook(state, _timed(hook, times, sizes))
    _steps(ddp, 3, times)
    warm = len(times)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    split = KERNEL_SPLIT[0]
    if split is not None:
        split.clear()
    with kernel_clock(split) if split is not None else contextlib.nullcontext():
        per_step = _steps(ddp, steps, times)
    if prof is not None:
        prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(20)
        if os.environ.get("PROFILE_CALLERS"):
            st.print_callers(os.environ["PROFILE_CALLERS"])
    out: dict[str, Any] = {
        "median": statistics.median(per_step),
        "min": min(per_step),
        "mean": statistics.mean(per_step),
    }
    out["per_call"] = per_call(times[warm:], sizes[warm:], steps)
    plans = getattr(getattr(state, "planner", None), "plans", None)
    if plans and all(hasattr(p, "compressed") for p in plans):
        out["units"] = [u.numel for p in plans for u in p.compressed]  # what the hook compresses
    return out


def per_call(times: list[float], sizes: list[int], steps: int) -> dict[str, float] | None:
    """The hook's time split into a fixed cost per call and a cost per gradient entry: the
    least-squares line t = fixed + per_entry · numel through the median time of every bucket
    size (None with fewer than two sizes), and what each part costs per step. The per-entry
    part is what a step would cost with no per-call work at all (Python, small torch calls,
    bookkeeping): only faster kernels can lower it (``--per-call``)."""
    by: dict[int, list[float]] = {}
    for n, t in zip(sizes, times, strict=True):
        by.setdefault(n, []).append(t)
    if len(by) < 2:
        return None
    xs = list(by)
    ys = [statistics.median(by[n]) for n in xs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    fixed = my - slope * mx
    return {
        "fixed": fixed,
        "per_entry": slope,
        "fixed_per_step": fixed * len(times) / steps,
        "entries_per_step": slope * sum(sizes) / steps,
    }


def _interleave(key: str, world: int, cycles: int, variants: dict[str, Any]) -> None:
    """Two variants of one configuration in one process, one step of each in turn for
    ``cycles`` cycles (after 3 warm-up steps each): prints the hook's median time per step of
    each and the median and range of the per-cycle ratios second/first. Both hooks then see
    the same machine state (load, frequency, other processes), which separate runs a minute
    apart do not on a shared VM. ``variants``: label → a function that sets the globals
    (:data:`DTYPE`, :data:`GRANULARITY`) the model and the state are then made with."""
    per: dict[str, list[float]] = {label: [] for label in variants}
    runs = {}
    for label, setup in variants.items():
        setup()
        ddp = DDP(_model(), bucket_cap_mb=25)
        state = make_state(*CONFIGS[key])
        state.world_size = world
        times: list[float] = []
        ddp.register_comm_hook(state, _timed(compression_hook, times))
        _steps(ddp, 3, times)
        runs[label] = (ddp, times)
    first, second = per
    ratios = []
    for _ in range(cycles):
        for label, (ddp, times) in runs.items():
            per[label].append(_steps(ddp, 1, times)[0])
        ratios.append(per[second][-1] / per[first][-1])
    name, ratio, method, _ = CONFIGS[key]
    print(
        f"{name} {ratio or ''} + {method}: hook ms/step {first} "
        f"{statistics.median(per[first]) * 1e3:.1f}, {second} "
        f"{statistics.median(per[second]) * 1e3:.1f}; {second}/{first} per cycle median "
        f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] ({cycles} cycles)"
    )


def interleave_dtypes(key: str, world: int, cycles: int) -> None:
    """The bf16/f32 target: a float32 and a bfloat16 model of the configuration
    (:func:`_interleave`)."""
    _interleave(
        key,
        world,
        cycles,
        {
            "float32": lambda: DTYPE.__setitem__(0, torch.float32),
            "bfloat16": lambda: DTYPE.__setitem__(0, torch.bfloat16),
        },
    )


def interleave_granularity(key: str, world: int, cycles: int) -> None:
    """Per-tensor against per-bucket compression units of the configuration, in the model's
    dtype (:func:`_interleave`)."""
    _interleave(
        key,
        world,
        cycles,
        {
            "tensor": lambda: GRANULARITY.__setitem__(0, "tensor"),
            "bucket": lambda: GRANULARITY.__setitem__(0, "bucket"),
        },
    )


def _print_split(r: dict[str, Any], steps: int) -> None:
    """``--kernel-split``: the kernels' share of the configuration's hook time (mean per
    step; the hook's own mean as the reference), the largest kernels by name."""
    split = KERNEL_SPLIT[0]
    if split is None:
        return
    total = sum(split.values()) / steps
    r["kernels"] = {name: t / steps for name, t in split.items()}
    top = sorted(split.items(), key=lambda kv: -kv[1])[:6]
    print(
        f"{'':4s}kernels {total * 1e3:.1f} ms/step of the hook's mean {r['mean'] * 1e3:.1f}: "
        + ", ".join(f"{name} {t / steps * 1e3:.2f}" for name, t in top)
    )


#: ``--per-call``: print the fixed and per-entry parts of every configuration's hook time
PER_CALL = [False]


def _print_per_call(r: dict[str, Any], memcpy: float) -> None:
    """``--per-call``: the configuration's hook time per step as its fixed per-call part plus
    its per-entry part (:func:`per_call`), each also in memcpy units."""
    pc = r.get("per_call")
    if not PER_CALL[0]:
        return
    if pc is None:
        print(f"{'':4s}per call: every bucket has the same size, no split (use --granularity)")
        return
    print(
        f"{'':4s}per call {pc['fixed'] * 1e3:.2f} ms + {pc['per_entry'] * 1e9:.3f} ns per entry: "
        f"per step {pc['fixed_per_step'] * 1e3:.2f} ms fixed "
        f"({pc['fixed_per_step'] / memcpy:.2f}x memcpy) + {pc['entries_per_step'] * 1e3:.2f} ms "
        f"per-entry ({pc['entries_per_step'] / memcpy:.2f}x memcpy: the hook with no per-call "
        "work)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=[*CONFIGS, *TORCH], default=[*CONFIGS, *TORCH])
    ap.add_argument("--world", type=int, default=4, help="ranks whose payloads are decoded")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", help="also write the numbers (seconds) to this file")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument(
        "--no-half-paths",
        action="store_true",
        help="16-bit models: the dense conversions instead of the hook's 16-bit fast paths",
    )
    ap.add_argument(
        "--no-fused-mirror",
        action="store_true",
        help="bfloat16 models: EF21's output converted after its server's sparse add, not in it",
    )
    ap.add_argument(
        "--kernel-split",
        action="store_true",
        help="also time the compiled kernels inside each hook (what is not kernels is Python "
        "and small torch calls)",
    )
    ap.add_argument(
        "--per-call",
        action="store_true",
        help="also split each hook time into a fixed cost per call and a cost per gradient "
        "entry (a line through the bucket sizes' medians)",
    )
    ap.add_argument(
        "--flat",
        type=int,
        metavar="N",
        help="the MLP's parameters as N flat vectors (N = 1, 2: a proxy of one compressor call "
        "per bucket)",
    )
    ap.add_argument(
        "--deep",
        action="store_true",
        help="an MLP of 41 layers of width 512 (10.8 M parameters in 82 tensors) instead",
    )
    ap.add_argument(
        "--granularity",
        choices=["tensor", "bucket"],
        default="tensor",
        help="the hook's unit of compression: every parameter's gradient, or every DDP bucket",
    )
    ap.add_argument(
        "--interleave-granularity",
        type=int,
        metavar="CYCLES",
        help="instead of the table: per-tensor and per-bucket hooks stepping in turn in one "
        "process, CYCLES steps of each",
    )
    ap.add_argument(
        "--interleave-dtypes",
        type=int,
        metavar="CYCLES",
        help="instead of the table: float32 and bfloat16 hooks stepping in turn in one process "
        "(the bf16/f32 target), CYCLES steps of each",
    )
    args = ap.parse_args()
    interleave = None
    for flag in ("interleave_dtypes", "interleave_granularity"):
        cycles = getattr(args, flag)
        option = "--" + flag.replace("_", "-")
        if cycles is None:
            continue
        if cycles < 1:
            ap.error(f"{option} needs CYCLES >= 1, got {cycles}")
        if args.kernel_split:
            ap.error(f"--kernel-split splits the table's hook times; run it without {option}")
        if interleave is not None:
            ap.error("give one of --interleave-dtypes and --interleave-granularity")
        interleave = (
            interleave_dtypes if flag == "interleave_dtypes" else interleave_granularity,
            cycles,
        )
    if args.steps < 1:
        ap.error(f"--steps needs at least 1 timed step, got {args.steps}")
    if args.flat is not None and args.flat < 1:
        ap.error(f"--flat needs N >= 1 vectors, got {args.flat}")
    FLAT[0] = args.flat
    LAYERS[0] = DEEP if args.deep else WIDTHS
    GRANULARITY[0] = args.granularity
    KERNEL_SPLIT[0] = {} if args.kernel_split else None
    PER_CALL[0] = args.per_call
    HALF_PATHS[0] = not args.no_half_paths
    FUSED_MIRROR[0] = not args.no_fused_mirror
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    DTYPE[0] = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        if interleave is not None:
            ours = [key for key in args.only if key not in TORCH]
            if not ours:
                sys.exit("the interleaved runs measure shrinkgrad's hooks: name one in --only")
            run_pair, cycles = interleave
            for key in ours:
                run_pair(key, args.world, cycles)
            return
        base = _steps(DDP(_model(), bucket_cap_mb=25), 3 + args.steps)[3:]
        step = statistics.median(base)
        copy = memcpy_baseline()
        read2, cast = read2_baseline(), cast_baseline()
        print(
            f"shrinkgrad DDP hook, {sum(p.numel() for p in _model().parameters()) / 1e6:.2f} M "
            "parameters"
            + (f" in {len(DEEP) - 1} layers" if args.deep else "")
            + ("" if args.flat is None else f" as {args.flat} flat vector(s)")
            + ("" if args.granularity == "tensor" else ", one compression unit per bucket")
            + f" ({args.dtype}"
            + (", dense conversions" if args.no_half_paths else "")
            + (", conversions after the sparse add" if args.no_fused_mirror else "")
            + f"), fake {args.world}-rank payload set, 1 thread, "
            f"{args.clock} clock; baselines: a step without hook, median {step * 1e3:.0f} ms; a "
            f"cache-cold memcpy of the gradient, median {copy['median'] * 1e3:.1f} ms, min "
            f"{copy['min'] * 1e3:.1f} ms; a cold read of two float32 gradient-sized vectors "
            f"(EF21's client traffic), median {read2['median'] * 1e3:.1f} ms "
            f"({read2['median'] / copy['median']:.2f}x memcpy)"
            + (
                ""
                if cast is None
                else f"; the casts to float32 and back, median {cast['median'] * 1e3:.1f} ms "
                f"({cast['median'] / copy['median']:.2f}x memcpy)"
            )
        )
        print(
            f"{'configuration':44s} {'hook ms/step':>13s} {'min':>7s} {'x step':>7s} "
            f"{'x memcpy':>9s} {'floor x memcpy':>15s}"
        )
        numbers: dict[str, Any] = {"baseline_step": step, "memcpy": copy, "read2": read2}
        if cast is not None:
            numbers["cast"] = cast
        for key in args.only:
            r = numbers[key] = measure(key, args.world, args.steps, args.profile)
            if key in TORCH:
                label = "torch powerSGD_hook r=4, one bucket"
                print(
                    f"{label:44s} {r['median'] * 1e3:13.1f} {r['min'] * 1e3:7.1f} "
                    f"{r['median'] / step:7.2f} {r['median'] / copy['median']:9.2f} {'—':>15s}"
                )
                _print_split(r, args.steps)
                _print_per_call(r, copy["median"])
                continue
            name, ratio, method, momentum = CONFIGS[key]
            floor = sparse_floor(name, ratio, method, r.get("units"))
            if floor is not None:
                r["floor"] = floor
            label = f"{name}" + (f" {ratio:g}" if ratio else "") + f" + {method}"
            label += f" momentum {momentum:g}" if momentum else ""
            floor_txt = "—" if floor is None else f"{floor['median'] / copy['median']:.2f}"
            print(
                f"{label:44s} {r['median'] * 1e3:13.1f} {r['min'] * 1e3:7.1f} "
                f"{r['median'] / step:7.2f} {r['median'] / copy['median']:9.2f} {floor_txt:>15s}"
            )
            _print_split(r, args.steps)
            _print_per_call(r, copy["median"])
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(numbers, fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
