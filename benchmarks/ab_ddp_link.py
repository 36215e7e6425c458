"""A/B of DDP step times on one emulated link: torch's PowerSGD and shrinkgrad's hook from two
versions of the library, alternated in fresh processes, in one network namespace.

Run as root::

    python benchmarks/ab_ddp_link.py --old /path/to/old/src [--link 100mbit] [--rounds 3]
        [--configs psgd1 psgd_ef21] [--steps 4 --warmup 2]

Each round runs, in an order that alternates from round to round, ``benchmarks/ddp.py``'s
worker (4 gloo ranks, one thread each; the configurations of ``--configs``, keys of
``ddp.CONFIGS``) once with the library of this tree (``new``) and once with ``--old``'s (its
``src`` directory on ``PYTHONPATH``); torch's hooks run with the new tree only (they do not
depend on the library). The shrinkgrad configurations also run with ``skip_communication``
(all the hook's work, no collective) unless ``--no-skip``. Printed: per configuration and
version, the step time of every round (the median over ``--steps`` timed steps after
``--warmup``, the slowest rank), their median and range, and the new/old and
shrinkgrad/torch-PowerSGD ratios per round (same round: the closest in time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp

HERE = Path(__file__).resolve().parent
NEW_SRC = HERE.parent / "src"


def _once(prefix: list[str], src: Path, configs: list[str], args: argparse.Namespace) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, str(HERE / "ddp.py"), "--worker", args.link, "--out", out]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--no-dense"]
        cmd += ["--only", *configs] + (["--no-skip"] if args.no_skip else [])
        env = dict(os.environ, **ddp.MALLOC, PYTHONPATH=str(src))
        subprocess.run([*prefix, *cmd], check=True, env=env)
        return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--old", required=True, help="the src/ directory of the old version")
    p.add_argument("--link", default="100mbit", choices=list(ddp.LINKS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=["psgd1", "psgd_ef21"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-skip", action="store_true")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    kinds = {k: kind for k, _, kind, _ in ddp.CONFIGS}
    ours = [c for c in args.configs if kinds[c] == "shrinkgrad"]
    theirs = [c for c in args.configs if kinds[c] != "shrinkgrad"]
    rate = ddp.LINKS[args.link]
    if rate and os.geteuid() != 0:
        sys.exit("the rate-limited links need root (network namespaces); use --link loopback")
    runs: dict[str, list[float]] = {}
    mbit = []
    with ddp._link(args.link, rate) as prefix:
        for r in range(args.rounds):
            order = [("new", NEW_SRC), ("old", Path(args.old))]
            if r % 2:
                order.reverse()
            for version, src in order:
                configs = ours + (theirs if version == "new" else [])
                res = _once(prefix, src, configs, args)
                mbit.append(res["mbit_s"])
                for name, e in res["configs"].items():
                    key = (
                        f"{name} [{version}]"
                        if kinds[name.removesuffix("_skip")] == "shrinkgrad"
                        else name
                    )
                    runs.setdefault(key, []).append(e.get("step_s", float("nan")))
                print(
                    f"round {r + 1} {version}: "
                    + ", ".join(
                        f"{n} {e.get('step_s', float('nan')) * 1e3:.0f} ms"
                        for n, e in res["configs"].items()
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"A/B on {args.link} (measured TCP throughput {min(mbit):.0f}–{max(mbit):.0f} Mbit/s), "
        f"{args.rounds} rounds, {args.steps} timed steps after {args.warmup}, 4 ranks"
    )
    print(f"{'configuration [version]':52s} {'median':>8s} {'range':>17s}  rounds (ms)")
    for key, v in runs.items():
        print(
            f"{key:52s} {statistics.median(v) * 1e3:8.0f} {min(v) * 1e3:8.0f}–{max(v) * 1e3:<8.0f} "
            + " ".join(f"{t * 1e3:.0f}" for t in v)
        )
    for c in ours:
        new, old = runs.get(f"{c} [new]"), runs.get(f"{c} [old]")
        if new and old:
            ratios = [a / b for a, b in zip(new, old, strict=True)]
            print(f"{c}: new/old per round " + " ".join(f"{x:.2f}" for x in ratios))
        for t in theirs:
            ref = runs.get(t)
            for version in ("new", "old"):
                mine = runs.get(f"{c} [{version}]")
                if ref and mine:
                    ratios = [a / b for a, b in zip(mine, ref, strict=True)]
                    print(
                        f"{c} [{version}] / {t} per round " + " ".join(f"{x:.2f}" for x in ratios)
                    )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "mbit_s": mbit}, indent=2))


if __name__ == "__main__":
    main()
