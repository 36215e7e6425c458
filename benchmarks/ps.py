"""Asynchronous compressed IAG vs synchronous DCGD on the parameter server, one slow worker.

Run: ``python benchmarks/ps.py [--dataset a9a] [--delay 0.01] [--slow 5] [--tol-rel 1e-4]``.

Set-up ([K18]'s question: what does staleness cost, what does it buy): W = 4 worker processes
and a server (gloo on 127.0.0.1), nonconvex logistic regression (λ = 0.1, contiguous split),
QSGD with s = 4 levels (unbiased, [K18]'s quantizer), every worker spending at least
``delay × speed`` seconds per gradient with speeds (1, 1, 1, ``slow``). In one run it measures:

1. a pilot of the asynchronous IAG (unbounded staleness, tiny constant step) that measures the
   [K18] delay τ̂ the schedule produces (for the IAG: the age of the oldest table entry an update
   uses); the delay rule needs it;
2. synchronous DCGD (every round waits for all four workers, so it runs at the slow worker's
   pace) at its theory step 1/(L + 2ωL_max/n), and asynchronous compressed IAG at the delay
   rule's step min{DCGD rule, 0.99 · 2/[L(1 + √(1 + 8τ̂(τ̂+1)))]} (``assume_tau`` = τ̂), plus the
   bounded variant (``tau_max`` = the pilot's largest staleness, rule at τ = 2·tau_max);
3. both at tuned multipliers of their theory steps (a small grid; the fastest to the tolerance
   wins; runs that do not reach it are reported as such).

For each run: updates per second (an async update is one message, a sync update one round of W
messages), messages per second, the measured delay, whether γ satisfies the delay rule at the
run's *own* measured delay, wall time, updates and uplink bits per client to
‖∇f‖² ≤ tol_rel·‖∇f(x⁰)‖² (from the logged snapshots; metrics are computed after each run, never
during it; each run stops at ``--max-time`` seconds or its update cap). It prints the ratios async /
sync. Timings on a shared 2-core machine are noisy; the ratios and their explanation
(REPRODUCTION.md, docs/parameter_server.md) are what carries over.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from shrinkgrad.distributed.ps import PSConfig, PSResult, prepare, run_ps
from shrinkgrad.problems import Problem


def row(label: str, res: PSResult, tol: float, W: int, sync: bool) -> dict[str, Any]:
    t_tol, u_tol, b_tol = res.time_to(tol), res.updates_to(tol), res.bits_to(tol)
    msgs = res.updates * (W if sync else 1)
    return {
        "run": label,
        "gamma*L": res.stepsize * res.L,
        "rule": res.stepsize_rule,
        "updates": res.updates,
        "upd/s": res.updates_per_s,
        "msg/s": msgs / res.wall_s if res.wall_s > 0 else math.nan,
        "delay max": res.delay_max,
        "rule holds": res.rule_holds,
        "t_tol": math.nan if t_tol is None else t_tol,
        "upd_tol": math.nan if u_tol is None else u_tol,
        "kbit/client_tol": math.nan if b_tol is None else b_tol / 1e3,
        "gns last/first": float(
            res.table["grad_norm_sq"].iloc[-1] / res.table["grad_norm_sq"].iloc[0]
        ),
        "status": res.status,
    }


def show(rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    fmt = {
        "gamma*L": "{:.4f}",
        "upd/s": "{:.1f}",
        "msg/s": "{:.1f}",
        "t_tol": "{:.2f}",
        "upd_tol": "{:.0f}",
        "kbit/client_tol": "{:.1f}",
        "gns last/first": "{:.1e}",
    }
    table = [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths, strict=True)))


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    hit = [r for r in rows if math.isfinite(r["t_tol"])]
    return min(hit, key=lambda r: r["t_tol"]) if hit else None


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="a9a")
    ap.add_argument("--compressor", default="qsgd[s=4]")
    ap.add_argument("--delay", type=float, default=0.01, help="seconds per gradient at speed 1")
    ap.add_argument("--slow", type=float, default=5.0, help="the slow worker's relative time")
    ap.add_argument("--tol-rel", type=float, default=1e-4)
    ap.add_argument("--max-time", type=float, default=8.0, help="cap per run (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-mults", default="2,4,8,16", help="tuned multipliers (async IAG)")
    ap.add_argument("--sync-mults", default="2,4", help="tuned multipliers (sync DCGD)")
    args = ap.parse_args()

    W = 4
    speeds = (1.0, 1.0, 1.0, args.slow)
    base = PSConfig(
        problem=f"logistic_regression[dataset={args.dataset}]",
        workers=W,
        compressor=args.compressor,
        speeds=speeds,
        delay=args.delay,
        seed=args.seed,
        timeout=60.0,
        stepsize=1e-3,
    )
    t0 = time.perf_counter()
    problem: Problem
    problem, _ = prepare(base)
    print(
        f"# {args.dataset}: n={problem.n} workers, d={problem.d}, L={problem.L:.4g}; "
        f"{args.compressor}; speeds {speeds} x {args.delay * 1e3:.0f} ms; tol = "
        f"{args.tol_rel:g} x ||grad f(x0)||^2"
    )

    # 1. pilot: the delay the asynchronous schedule produces (independent of the step)
    pilot = run_ps(
        base.replace(method="iag", stepsize=0.01 / problem.L, updates=600, log_every=600),
        problem=problem,
    )
    tau_hat, stale_hat = pilot.delay_max, pilot.staleness_max
    means = pilot.mean_staleness()
    print(
        f"# pilot (async IAG, {pilot.updates} updates): delay max τ̂ = {tau_hat}, staleness max "
        f"{stale_hat}, mean staleness per worker "
        + ", ".join(f"{w}: {v:.1f}" for w, v in means.items())
    )
    tol = args.tol_rel * float(pilot.table["grad_norm_sq"].iloc[0])

    def sync(mult: float) -> PSResult:
        return run_ps(
            base.replace(
                method="dcgd",
                mode="sync",
                stepsize=f"theory*{mult:g}",
                updates=200,
                log_every=1,
                max_time=args.max_time,
            ),
            problem=problem,
        )

    def asyn(mult: float, bounded: bool = False) -> PSResult:
        extra: dict[str, Any] = {"tau_max": stale_hat} if bounded else {"assume_tau": tau_hat}
        return run_ps(
            base.replace(
                method="iag",
                stepsize=f"theory*{mult:g}",
                updates=5000,
                log_every=10,
                max_time=args.max_time,
                **extra,
            ),
            problem=problem,
        )

    rows: list[dict[str, Any]] = []
    sync_rows: list[dict[str, Any]] = []
    async_rows: list[dict[str, Any]] = []
    r = row("sync DCGD @ theory", sync(1.0), tol, W, True)
    rows.append(r)
    sync_rows.append(r)
    r = row("async IAG @ theory(τ̂)", asyn(1.0), tol, W, False)
    rows.append(r)
    async_rows.append(r)
    rows.append(row(f"async IAG @ theory, tau_max={stale_hat}", asyn(1.0, True), tol, W, False))
    for m in (float(s) for s in args.sync_mults.split(",") if s):
        r = row(f"sync DCGD @ theory*{m:g}", sync(m), tol, W, True)
        rows.append(r)
        sync_rows.append(r)
    for m in (float(s) for s in args.async_mults.split(",") if s):
        r = row(f"async IAG @ theory(τ̂)*{m:g}", asyn(m), tol, W, False)
        rows.append(r)
        async_rows.append(r)
    print()
    show(rows)
    s0, a0 = sync_rows[0], async_rows[0]
    print()
    print("# ratios async IAG / sync DCGD")
    print(f"updates per second at theory:        {ratio(a0['upd/s'], s0['upd/s'])}")
    print(f"messages per second at theory:       {ratio(a0['msg/s'], s0['msg/s'])}")
    print(f"time to tol at theory (sync/async):  {ratio(s0['t_tol'], a0['t_tol'])}")
    print(
        "uplink bits/client to tol at theory:  "
        f"{ratio(a0['kbit/client_tol'], s0['kbit/client_tol'])}"
    )
    bs, ba = best(sync_rows), best(async_rows)
    if bs is not None and ba is not None:
        print(
            f"time to tol, tuned (sync/async):     {ratio(bs['t_tol'], ba['t_tol'])}  "
            f"({bs['run']} vs {ba['run']})"
        )
    print(f"# total benchmark time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
