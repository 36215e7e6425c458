"""A/B of the DDP hook's CPU time: this tree against another version, alternating runs.

Run: ``python benchmarks/ab_ddp_hook.py [--old REF] [--rounds 3] [--steps 5] [--only ...]
[--dtype float32|bfloat16|float16] [--granularity tensor|bucket]`` (``--granularity bucket``
needs an old version that has ``CompressionState(granularity=)``).

``REF`` (default ``main``) is any git revision of this repository: its ``src/`` is exported with
``git archive`` into a temporary directory (no worktree, nothing checked out). Then
``benchmarks/ddp_hook.py`` of *this* tree (which speaks both the old ``error_feedback=`` and the
new ``method=``) runs ``--rounds`` times for each version, alternating old, new, old, new, ...,
each run in a fresh process with ``PYTHONPATH`` pointing at that version's ``src/``. Printed per
configuration: the median over the runs of each version's per-run median hook time, the
spread (min–max of the per-run medians), and new/old. The default clock is the process's CPU
time (``--clock cpu``), which a loaded machine disturbs less than wall time (it still shares
caches and memory bandwidth); ``--clock wall`` is what a training step feels. On a shared machine
the spread says how much to trust the ratio; measure on a quiet machine for a claim.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "ddp_hook.py"


def export(ref: str, into: Path) -> Path:
    """``src/`` of git revision ``ref`` under ``into`` (via ``git archive``)."""
    archive = into / "old.tar"
    with open(archive, "wb") as fh:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], stdout=fh, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_once(src: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, str(BENCH), "--steps", str(args.steps), "--json", str(out)]
    cmd += ["--world", str(args.world), "--clock", args.clock, "--dtype", args.dtype]
    if args.only:
        cmd += ["--only", *args.only]
    if args.granularity != "tensor":
        cmd += ["--granularity", args.granularity]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--old", default="main", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each version")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--only", nargs="+", help="configurations (see benchmarks/ddp_hook.py)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="cpu",
        help="cpu (default): the process's CPU time, robust to other load; wall: elapsed time",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument(
        "--granularity",
        choices=["tensor", "bucket"],
        default="tensor",
        help="the hook's unit of compression (benchmarks/ddp_hook.py --granularity)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_src = export(args.old, Path(tmp))
        versions = {"old": old_src, "new": ROOT / "src"}
        runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for i in range(args.rounds):
            for name in ("old", "new"):
                res = run_once(versions[name], args, Path(tmp) / f"{name}{i}.json")
                runs[name].append(res)
                print(
                    f"run {i + 1}/{args.rounds} {name}: "
                    + ", ".join(
                        f"{k} {v['median'] * 1e3:.1f} ms"
                        for k, v in res.items()
                        if k != "baseline_step"
                    ),
                    flush=True,
                )
    keys = [k for k in runs["new"][0] if k != "baseline_step"]
    print(
        f"\nhook time per step ({args.clock} clock), median over {args.rounds} alternating runs "
        f"per version (old = {args.old}); spread = min–max of the runs' medians"
    )
    print(
        f"{'configuration':12s} {'old ms':>8s} {'spread':>15s} {'new ms':>8s} {'spread':>15s} "
        f"{'new/old':>8s}"
    )
    for k in keys:
        row = {}
        for name in ("old", "new"):
            meds = [r[k]["median"] * 1e3 for r in runs[name] if k in r]
            row[name] = (statistics.median(meds), min(meds), max(meds))
        (o, olo, ohi), (n, nlo, nhi) = row["old"], row["new"]
        spread_old, spread_new = f"{olo:.1f}–{ohi:.1f}", f"{nlo:.1f}–{nhi:.1f}"
        print(f"{k:12s} {o:8.1f} {spread_old:>15s} {n:8.1f} {spread_new:>15s} {n / o:8.2f}")
    base = [float(r["baseline_step"]) for v in runs.values() for r in v]
    print(f"baseline step without a hook: {min(base) * 1e3:.0f}–{max(base) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
