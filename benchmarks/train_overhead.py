"""Where the time of ``shrinkgrad train`` goes, against ``shrinkgrad run`` on the same config.

Prints, for one small sweep (2 runs × ROUNDS rounds, a1a, 8 clients): the wall time of
``shrinkgrad run -j 1``, and of ``shrinkgrad train --nproc W`` for W = 1, 2, 4, split into the
start-up (process launch, imports, data, until the first run starts) and the rounds, with the time
per round and its ratio to the simulator's. Noisy on a shared machine: read the ratios.

    python benchmarks/train_overhead.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

CONFIG = """
problem = "logistic_regression[dataset=a1a,n_clients=8]"
[run]
rounds = {rounds}
log_every = 100
[grid]
methods = ["ef21", "ef21_w"]
compressors = ["top_k[k=1]"]
"""


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("shrinkgrad"))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.toml"
        cfg.write_text(CONFIG.format(rounds=args.rounds), encoding="utf-8")
        rows = []
        wall = _timed([exe, "run", str(cfg), "--out", f"{tmp}/run", "-j", "1", "--no-progress"])
        runs = pd.read_csv(f"{tmp}/run/runs.csv")
        rows.append(("run -j 1", wall, float(runs["wall_s"].sum())))
        for w in (1, 2, 4):
            out = f"{tmp}/train{w}"
            wall = _timed(
                [exe, "train", str(cfg), "--out", out, "--nproc", str(w), "--no-progress"]
            )
            runs = pd.read_csv(f"{out}/runs.csv")
            rows.append((f"train --nproc {w}", wall, float(runs["wall_s"].sum())))
        base = rows[0][2] / (2 * args.rounds)
        print(f"2 runs x {args.rounds} rounds, a1a, 8 clients (noisy, shared machine)")
        head = ("command", "wall s", "start-up s", "rounds s", "ms/round", "x run")
        print("{:18} {:>8} {:>11} {:>9} {:>9} {:>6}".format(*head))
        for name, wall, rounds_s in rows:
            per = rounds_s / (2 * args.rounds)
            print(
                f"{name:18} {wall:8.2f} {wall - rounds_s:11.2f} {rounds_s:9.2f} "
                f"{1e3 * per:9.3f} {per / base:6.1f}"
            )
        print(json.dumps({"cores": len(__import__("os").sched_getaffinity(0))}))


if __name__ == "__main__":
    main()
