"""DDP step time and bytes per step: dense all-reduce vs torch's and shrinkgrad's hooks.

Run as root (the rate-limited links need network namespaces)::

    python benchmarks/ddp.py                       # loopback, 1 Gbit/s and 100 Mbit/s
    python benchmarks/ddp.py --links loopback --steps 3 --no-task   # a quick look

What it measures, in the same run, for a 4-rank gloo job (forked processes, one thread each)
training an MLP of ~10.5 M parameters (1024 → 2048 → 2048 → 2048 → 16, float32, batch 32 per
rank, SGD) on synthetic data:

* ``dense``: DDP without a hook (its own bucketed all-reduce), and the same step with
  communication skipped (``no_sync``): the compute time of a step;
* torch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4, ``start_powerSGD_iter=2``) with
  DDP's default buckets — where PowerSGD hangs on gloo (it waits on a future inside a callback;
  platform notes), which the benchmark detects with a timeout and reports as ``hangs`` — and with
  one bucket (``bucket_cap_mb=1000``), where it runs;
* shrinkgrad's hook with top_k 1% + EF21, rand_k 1% with a shared seed (values only) and
  qsgd[s=4], each also with ``skip_communication=True`` (all the compression work, no collective),
  so that communication time = step − step without communication;
* on three links: the plain loopback, and the loopback of a network namespace limited by
  ``tc tbf`` to 1 Gbit/s and to 100 Mbit/s (created and removed by the benchmark; all four ranks
  run inside the namespace and share its link, like four hosts on one shared segment). Each link's
  measured TCP throughput is printed.

Bytes per step are counted at the collectives (Python-level all-reduce / all-gather calls, per
rank, what the rank hands over as its message; the transport's ring overhead is not counted);
DDP's own all-reduce (no hook) is counted as 4 bytes per parameter. Step times are medians over
``--steps`` timed steps after ``--warmup`` steps, each step starting after a barrier.
Communication time for the torch hooks is step − the dense compute step (their compression cost
is counted as communication). Ratios are against the dense all-reduce of the same run.

Unless ``--no-task``, it also trains the example task of ``examples/ddp_mlp.py`` (an MLP on a9a,
4 ranks, loopback) with fp16_compress_hook, top_k 1% + EF21 and top_k 1% + EF21-SGDM (client
momentum) for the same number of steps, for ``--task-seeds`` seeds (``--task-only``: only this),
and prints the final training losses: mean over seeds and the paired difference to fp16.

Memory allocator: every configuration runs in fresh processes with ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` set (see ``MALLOC``; no THP variables). The shrinkgrad hooks no longer
allocate multi-megabyte tensors per step, so this matters for torch's hooks and DDP only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WIDTHS = (1024, 2048, 2048, 2048, 16)
BATCH = 32
WORLD = 4
LINKS = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit"}
#: every configuration runs with these glibc settings: freed multi-megabyte buffers are reused
#: instead of being unmapped and page-faulted in again (platform notes)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}
#: (key, label, kind, options)
CONFIGS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("dense", "dense all-reduce (no hook)", "dense", {}),
    ("fp16", "torch fp16_compress_hook", "fp16", {}),
    ("psgd", "torch powerSGD_hook r=4, default buckets", "powersgd", {}),
    ("psgd1", "torch powerSGD_hook r=4, one bucket", "powersgd", {"bucket_cap_mb": 1000}),
    (
        "topk",
        "shrinkgrad top_k 1% + EF21",
        "shrinkgrad",
        {"c": "top_k", "ratio": 0.01, "method": "ef21"},
    ),
    (
        "randk",
        "shrinkgrad rand_k 1% shared seed",
        "shrinkgrad",
        {"c": "rand_k[shared_seed=true]", "ratio": 0.01, "method": "dcgd"},
    ),
    (
        "qsgd",
        "shrinkgrad qsgd[s=4]",
        "shrinkgrad",
        {"c": "qsgd[s=4]", "ratio": None, "method": "dcgd"},
    ),
]


# --------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------
def _rank(
    rank: int, world: int, kind: str, opts: dict[str, Any], skip: bool, steps: int, warmup: int
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shrinkgrad.distributed import CompressionState, compression_hook

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, bucket_cap_mb=opts.get("bucket_cap_mb", 25))
    state: Any = None
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif kind == "shrinkgrad":
        state = CompressionState(
            opts["c"], ratio=opts["ratio"], method=opts["method"], skip_communication=skip
        )
        ddp.register_comm_hook(state, compression_hook)
    ops: list[tuple[str, int, torch.dtype]] = []  # this step's collectives
    real_reduce, real_gather = dist.all_reduce, dist.all_gather_single

    def reduce(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        ops.append(("allreduce", t.numel(), t.dtype))
        return real_reduce(t, *a, **k)

    def gather(out: torch.Tensor, t: torch.Tensor, *a: Any, **k: Any) -> Any:
        ops.append(("allgather", t.numel(), t.dtype))
        return real_gather(out, t, *a, **k)

    dist.all_reduce = reduce  # type: ignore[assignment]
    dist.all_gather_single = gather  # type: ignore[assignment]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    X = torch.randn(BATCH, WIDTHS[0], generator=gen)
    y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen)
    times, sent = [], []
    for step in range(warmup + steps):
        real_reduce(torch.zeros(1))  # a barrier that is not counted
        ops.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        ctx = ddp.no_sync() if (skip and kind != "shrinkgrad") else contextlib.nullcontext()
        with ctx:
            loss = torch.nn.functional.cross_entropy(ddp(X), y)
            loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
            if kind == "dense" and not skip:  # DDP's reducer all-reduces 25 MB buckets in C++
                cap = 25 * 2**20 // 4
                ops[:] = [
                    ("allreduce", min(cap, n_params - i), torch.float32)
                    for i in range(0, n_params, cap)
                ]
            sent.append(sum(n * torch.empty(0, dtype=dt_).element_size() for _, n, dt_ in ops))
    # communication alone: the last step's collectives again, back to back, without compute
    world_ = dist.get_world_size()
    bufs = [
        (
            op,
            torch.zeros(n, dtype=dt_),
            torch.zeros(n * world_, dtype=dt_) if op == "allgather" else None,
        )
        for op, n, dt_ in list(ops)
    ]
    replay = []
    for _ in range(3 if bufs else 0):
        real_reduce(torch.zeros(1))
        t0 = time.perf_counter()
        for op, t, out in bufs:
            if op == "allreduce":
                real_reduce(t)
            else:
                real_gather(out, t)
        replay.append(time.perf_counter() - t0)
    # the link's latency for the network model: a 1-float all-reduce is 2(p−1) latency steps
    tiny = torch.zeros(1)
    small = []
    for _ in range(20):
        t0 = time.perf_counter()
        real_reduce(tiny)
        small.append(time.perf_counter() - t0)
    return {
        "times": times,
        "sent": sent,
        "params": n_params,
        "comm_s": statistics.median(replay) if replay else 0.0,
        "ops": [(op, n, torch.empty(0, dtype=dt_).element_size()) for op, n, dt_ in ops],
        "alpha_s": statistics.median(small) / max(1, 2 * (world_ - 1)),
    }


# --------------------------------------------------------------------------------------------
# one link: every configuration in fresh processes (run inside the namespace)
# --------------------------------------------------------------------------------------------
def _throughput() -> float:
    """Measured TCP throughput of 127.0.0.1 in Mbit/s (16 MB through one connection)."""
    size = 16 * 2**20
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def sink() -> None:
        conn, _ = srv.accept()
        got = 0
        while got < size:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        conn.sendall(b"k")
        conn.close()

    th = threading.Thread(target=sink, daemon=True)
    th.start()
    cli = socket.create_connection(("127.0.0.1", port))
    payload = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(size >> 20):
        cli.sendall(payload)
    cli.recv(1)
    dt = time.perf_counter() - t0
    cli.close()
    srv.close()
    return size * 8 / dt / 1e6


def _why(e: Any, elapsed: float) -> str:
    """One line on why a configuration failed: the rank that crashed or hung, not its victims."""
    crashed = [f for f in e.failures if f.exitcode is not None]
    hung = [f for f in e.failures if "launch timeout" in f.message]
    if hung:
        return f"hangs (killed after {elapsed:.0f} s)"
    if crashed:
        f = crashed[0]
        return f"crashes: rank {f.rank} {f.message}; the others lose their connection"
    return e.failures[0].message.splitlines()[0][:160]


def worker(
    link: str, steps: int, warmup: int, only: list[str] | None, out: str, hang_timeout: float
) -> None:
    from shrinkgrad.distributed import WorkerError, preload, spawn

    preload()
    results: dict[str, Any] = {"link": link, "mbit_s": _throughput(), "configs": {}}
    for key, label, kind, opts in CONFIGS:
        if only and key not in only and key != "dense":
            continue
        for skip in (False, True):
            if skip and kind in ("fp16", "powersgd"):
                continue  # their compute-only step is the dense one
            name = key + ("_skip" if skip else "")
            budget = hang_timeout if kind == "powersgd" else 1800.0
            t0 = time.monotonic()
            try:
                per_rank = spawn(
                    _rank,
                    WORLD,
                    (kind, opts, skip, steps, warmup),
                    timeout=budget,
                    pg_timeout=budget,
                    grace=5.0,
                )
                entry: dict[str, Any] = {
                    "label": label,
                    "step_s": max(statistics.median(r["times"]) for r in per_rank),
                    "comm_s": max(r["comm_s"] for r in per_rank),
                    "bytes": statistics.median(per_rank[0]["sent"]),
                    "params": per_rank[0]["params"],
                    "ops": per_rank[0]["ops"],
                    "alpha_s": statistics.median(r["alpha_s"] for r in per_rank),
                }
            except WorkerError as e:
                entry = {"label": label, "error": _why(e, time.monotonic() - t0)}
            results["configs"][name] = entry
            print(f"[{link}] {name}: {entry}", file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps(results, indent=2))


# --------------------------------------------------------------------------------------------
# the example task: fp16 vs top_k 1% + EF21 at equal steps, over several seeds
# --------------------------------------------------------------------------------------------
TASK_CONFIGS = (
    ("fp16", "torch fp16_compress_hook", ["--hook", "fp16"]),
    (
        "ef21",
        "top_k 1% + EF21",
        ["--hook", "shrinkgrad", "--method", "ef21", "--no-client-momentum"],
    ),
    (
        "ef21_sgdm",
        "top_k 1% + EF21-SGDM",
        ["--hook", "shrinkgrad", "--method", "ef21", "--client-momentum"],
    ),
)


def task(steps: int, seeds: int) -> dict[str, Any]:
    """Final training loss of every TASK_CONFIGS entry for seeds 0 .. seeds − 1.

    A seed fixes the train/test split and the initial weights (the ranks' minibatch orders are
    the same for every seed), and all configurations of one seed share them, so the differences
    to fp16 are paired. One seed's difference is dominated by where the last steps happen to
    land; the mean over seeds is what the target is judged on."""
    path = Path(__file__).resolve().parent.parent / "examples" / "ddp_mlp.py"
    spec = importlib.util.spec_from_file_location("ddp_mlp", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from shrinkgrad.distributed import spawn

    losses: dict[str, list[float]] = {key: [] for key, _, _ in TASK_CONFIGS}
    accuracy: dict[str, list[float]] = {key: [] for key, _, _ in TASK_CONFIGS}
    test_loss: dict[str, list[float]] = {key: [] for key, _, _ in TASK_CONFIGS}
    for seed in range(seeds):
        for key, _, extra in TASK_CONFIGS:
            argv = ["--steps", str(steps), "--log-every", str(steps), "--seed", str(seed)]
            args = mod.parse_args([*argv, *extra])
            res = spawn(mod.train, WORLD, (args,), timeout=3600.0, pg_timeout=120.0)
            losses[key].append(res[0]["final_train_loss"])
            accuracy[key].append(res[0]["history"][-1]["test_acc"])
            test_loss[key].append(res[0]["history"][-1]["test_loss"])
            print(f"[task] seed {seed} {key}: {losses[key][-1]:.4f}", file=sys.stderr, flush=True)
    return {
        "steps": steps,
        "seeds": seeds,
        "final_train_loss": losses,
        "test_loss": test_loss,
        "test_acc": accuracy,
    }


def _mean_se(v: list[float]) -> str:
    se = statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else 0.0
    return f"{statistics.mean(v):+.4f} ± {se:.4f}"


def task_report(res: dict[str, Any]) -> str:
    """Mean ± standard deviation of the final training loss over seeds, the paired difference
    to fp16 (mean ± standard error; how many seeds end at or below fp16), and the same paired
    difference of the final test loss, and the mean final test accuracy."""
    losses = res["final_train_loss"]
    n = res["seeds"]
    base = losses["fp16"]
    lines = [
        f"example task (examples/ddp_mlp.py, a9a, {WORLD} ranks, {res['steps']} steps, seeds "
        f"0..{n - 1}): final training loss",
        "",
        "| configuration | mean ± sd | − fp16 (paired, mean ± s.e.) | seeds ≤ fp16 "
        "| test loss − fp16 | test acc. |",
        "|---|---|---|---|---|---|",
    ]
    for key, label, _ in TASK_CONFIGS:
        v = losses[key]
        sd = statistics.stdev(v) if n > 1 else 0.0
        row = f"| {label} | {statistics.mean(v):.4f} ± {sd:.4f} |"
        acc = f" {100 * statistics.mean(res['test_acc'][key]):.2f} % |"
        if key == "fp16":
            tl = statistics.mean(res["test_loss"][key])
            lines.append(row + f" | | {tl:.4f} (its mean) |" + acc)
            continue
        diff = [a - b for a, b in zip(v, base, strict=True)]
        wins = sum(a <= b for a, b in zip(v, base, strict=True))
        tdiff = [
            a - b for a, b in zip(res["test_loss"][key], res["test_loss"]["fp16"], strict=True)
        ]
        lines.append(row + f" {_mean_se(diff)} | {wins}/{n} | {_mean_se(tdiff)} |" + acc)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------
def _run_link(link: str, rate: str | None, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps if rate != "100mbit" else max(2, args.steps - 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", link, "--out", out]
        cmd += ["--steps", str(steps), "--warmup", str(args.warmup)]
        cmd += ["--hang-timeout", str(args.hang_timeout)]
        if args.only:
            cmd += ["--only", *args.only]
        ns = None
        try:
            if rate is not None:
                ns = f"sgbench{os.getpid()}{link}"
                burst = "4mbit" if rate == "1gbit" else "1mbit"
                for c in (
                    ["ip", "netns", "add", ns],
                    ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        "lo",
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        burst,
                        "latency",
                        "400ms",
                    ],
                ):
                    subprocess.run(c, check=True)
                cmd = ["ip", "netns", "exec", ns, *cmd]
            subprocess.run(cmd, check=True, env=dict(os.environ, **MALLOC))
            return json.loads(Path(out).read_text())
        finally:
            if ns is not None:
                subprocess.run(["ip", "netns", "del", ns], check=False)


def _model_txt(e: dict[str, Any], mbit_s: float) -> str:
    if "ops" not in e or not e["ops"]:
        return "— | —"
    m = modelled_comm(e, mbit_s)
    ratio = f"{m / e['comm_s']:.2f}" if e["comm_s"] > 0 else "—"
    return f"{m * 1e3:.1f} ms | {ratio}"


def _fmt_bytes(b: float) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def modelled_comm(e: dict[str, Any], mbit_s: float) -> float:
    """The network model's communication time of a step's collectives (``shrinkgrad.network``:
    ring all-reduce and all-gather on ``WORLD`` ranks) with the link's *measured* bandwidth and
    latency (issue 16's calibration).

    The emulated link is one token bucket on the namespace's loopback that every rank's traffic
    passes through, and in a ring step all ``WORLD`` ranks send at once: each rank's share is
    B / WORLD (B: the measured throughput of one TCP connection alone): the ring's ``shared``
    parameter. A ring all-reduce of S bytes then takes 2(p−1)/p · 8S/(B/p) = 2(p−1)·8S/B, all
    the bytes every rank sends over B. On real hardware (a link per rank) ``shared`` is 1."""
    from shrinkgrad.network import Collective, make_network

    ring = make_network("ring", bandwidth=mbit_s * 1e6, shared=WORLD, latency=e["alpha_s"])
    return sum(ring.collective(Collective(op, n * size), WORLD).total_s for op, n, size in e["ops"])


def report(res: dict[str, Any]) -> str:
    """The markdown table of one link."""
    cfg = res["configs"]
    dense = cfg["dense"]
    compute = cfg["dense_skip"]["step_s"]
    lines = [
        f"### {res['link']} (measured TCP throughput {res['mbit_s']:.0f} Mbit/s; "
        f"{dense['params'] / 1e6:.2f} M parameters, {WORLD} ranks)",
        "",
        "| configuration | step | step without comm. | comm. (replayed) | bytes/step/rank "
        "| step speed-up | comm. speed-up | modelled comm. | model / replayed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label, kind, _ in CONFIGS:
        e = cfg.get(key)
        if e is None:
            continue
        if "error" in e:
            lines.append(f"| {label} | {e['error']} | | | | | | | |")
            continue
        skip = cfg.get(key + "_skip", {}).get("step_s") if kind == "shrinkgrad" else compute
        skip_txt = f"{skip * 1e3:.0f} ms" if skip is not None else "—"
        if kind in ("fp16", "powersgd"):
            skip_txt += " (dense)"
        lines.append(
            f"| {label} | {e['step_s'] * 1e3:.0f} ms | {skip_txt} | {e['comm_s'] * 1e3:.1f} ms "
            f"| {_fmt_bytes(e['bytes'])} | {dense['step_s'] / e['step_s']:.2f}× "
            f"| {dense['comm_s'] / max(e['comm_s'], 1e-6):.1f}× "
            f"| {_model_txt(e, res['mbit_s'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    p.add_argument("--steps", type=int, default=5, help="timed steps (2 fewer at 100 Mbit/s)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--hang-timeout", type=float, default=300.0, help="seconds before PowerSGD counts as hung"
    )
    p.add_argument("--only", nargs="+", help="configuration keys (dense always runs)")
    p.add_argument("--task-steps", type=int, default=600)
    p.add_argument("--task-seeds", type=int, default=5, help="seeds of the example task")
    p.add_argument("--no-task", action="store_true", help="skip the example task")
    p.add_argument("--task-only", action="store_true", help="only the example task, no links")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.only, args.out, args.hang_timeout)
        return
    if args.task_only:
        args.links = []
    if args.task_steps < 1 or args.task_seeds < 1:
        sys.exit("--task-steps and --task-seeds must be >= 1")
    if any(LINKS[k] for k in args.links) and os.geteuid() != 0:
        sys.exit("the rate-limited links need root (network namespaces); use --links loopback")
    results = [_run_link(k, LINKS[k], args) for k in args.links]
    for r in results:
        print(report(r) + "\n")
    summary: dict[str, Any] = {"links": results}
    if not args.no_task:
        summary["task"] = task(args.task_steps, args.task_seeds)
        print(task_report(summary["task"]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
