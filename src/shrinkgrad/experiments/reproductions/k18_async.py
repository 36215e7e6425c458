"""``k18-async``: [K18]'s asynchronous parameter server — the delay rule, staleness and speed.

The runs are real: every arm starts the parameter server of :mod:`shrinkgrad.distributed.ps`
(one server and W forked worker processes over gloo on 127.0.0.1), workers of different speeds
pushing compressed gradients computed at stale models, the server applying each on arrival
(asynchronous compressed IAG). The config is an ordinary experiment config; how its arms run:

* ``stepsize = "theory"`` (or ``"theory*m"``): bounded staleness ``tau_max``; the step is the
  delay rule of methods.md §4 at the bound of the IAG's delay, τ = 2·tau_max;
* any other step (``"1/L"``, a number): unbounded staleness, the delay set by the speeds.

The parameter-server settings (workers, speeds, delay per gradient, tau_max) live in the
config's ``[claims]`` table with the claims' thresholds, because the experiment schema has no
table for them. Claims ([K18]: stale gradients need a step that shrinks with the delay τ,
γ < 2/[L(1 + √(1 + 8τ(τ+1)))]; (?) in methods.md for the exact algorithm and how ω enters):

1. bounded staleness: no applied message is more than ``tau_max`` updates stale, and the IAG's
   delay stays within 2·tau_max (the bound the theory step used);
2. slow workers are staler: in every run the slowest worker's mean staleness exceeds every other
   worker's;
3. at the delay rule's step the asynchronous compressed IAG converges: ‖∇f‖² falls below
   ``converge_factor`` × its initial value (QSGD's noise floor permitting);
4. with γ = 1/L and the large delay an unbounded slow worker produces, it does not: the median of
   ‖∇f‖² over the second half of the run stays above ``stall_factor`` × its initial value;
5. the delay rule predicts both: γ satisfies it at the measured delay in the converging arm and
   violates it in the stalling one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...methods.stepsize import parse_stepsize
from ...plotting.style import FIGURE_DPI
from ..claims import Claim, fmt, no_result
from ..config import ExperimentConfig
from ..results import CONFIG_COLUMNS, default_format, write_table
from . import REPRODUCTIONS, Reproduction, claim_params

DEFAULTS: dict[str, Any] = {
    # the parameter server
    "workers": 4,
    "speeds": [1, 1, 1, 5],
    "delay": 0.01,
    "tau_max": 6,
    "timeout": 60.0,
    # the claims
    "converge_factor": 1e-3,
    "stall_factor": 1e-2,
}

#: per-run columns added beside the results table's (constant within a run)
EXTRA_COLUMNS = (
    "tau_max_config",
    "staleness_max",
    "delay_max",
    "rule_holds",
    "stepsize_bound_measured",
    "slow_mean_staleness",
    "fast_mean_staleness_max",
)


@dataclasses.dataclass
class Outcome:
    """The executor's result (the reproduction framework's ``Outcome`` protocol)."""

    table: pd.DataFrame
    complete: bool
    interrupted: bool


def _ps_stepsize(text: str, L: float) -> tuple[float | str, bool]:
    """(the PSConfig step size, whether the arm runs with bounded staleness), read with the one
    step-size grammar (:func:`shrinkgrad.methods.stepsize.parse_stepsize`)."""
    step = parse_stepsize(text)
    if step.theory:
        return str(step), True
    if step.over == "L":
        return step.value / L, False
    if step.over is None and step.of is None:
        return step.value, False
    raise ValueError(
        f"k18-async: cannot run the step size {text!r} on the parameter server; use "
        "'theory', 'theory*m', 'c/L' or a number"
    )


def execute(
    config: ExperimentConfig,
    out: Path,
    *,
    jobs: int | None = None,
    fmt: str | None = None,
    progress: bool = True,
    command: Any = None,
) -> Outcome:
    """Run every arm × seed of ``config`` on the parameter server, one after another.

    Runs never overlap (each one already uses W + 1 processes). Per run, ``out/runs/<id>/`` gets
    the parameter server's table, staleness table, events and staleness histogram; the results
    table (``out/results.*``) has the simulator's columns, the sweep's config columns and
    :data:`EXTRA_COLUMNS`.
    """
    from ...distributed.ps import PSConfig, run_ps
    from ...problems import make_problem

    params = claim_params(REPRODUCTIONS.get("k18-async"), config)
    out = Path(out)
    tables: list[pd.DataFrame] = []
    interrupted = False
    speeds = tuple(float(s) for s in params["speeds"])
    slow = max(range(len(speeds)), key=speeds.__getitem__)
    try:
        for case in config.problems:
            problem = make_problem(case.spec)
            for a, arm in enumerate(config.arms):
                stepsize, bounded = _ps_stepsize(arm.stepsize, problem.smoothness()[0])
                for index in config.run.seeds:
                    slug = re.sub(r"[^A-Za-z0-9]+", "_", arm.stepsize)
                    run_id = f"arm{a}-{arm.method}-{slug}-s{index}"
                    ps = PSConfig(
                        problem=case.spec,
                        workers=int(params["workers"]),
                        method=arm.method,
                        compressor=arm.compressor,
                        stepsize=stepsize,
                        tau_max=int(params["tau_max"]) if bounded else None,
                        updates=config.run.rounds,
                        log_every=config.run.log_every,
                        seed=config.seed_of(index),
                        speeds=speeds,
                        delay=float(params["delay"]),
                        timeout=float(params["timeout"]),
                        wire_dtype=config.run.wire_dtype,  # type: ignore[arg-type]
                    )
                    res = run_ps(ps, problem=problem)
                    res.save(out / "runs" / run_id)
                    if res.status == "interrupted":  # a first Ctrl-C: run_ps returns the run
                        raise KeyboardInterrupt  # cut short; the sweep stops, no claims
                    means = res.mean_staleness()
                    fast = [float(v) for w, v in means.items() if w != slow]
                    t = res.table.copy()
                    extra: dict[str, Any] = {
                        "run_id": run_id,
                        "experiment": config.name,
                        "problem_spec": case.spec,
                        "problem_label": case.label,
                        "stepsize_spec": arm.stepsize,
                        "seed_index": index,
                        "status": res.status,
                        "L": problem.L,
                        "L_AM": problem.L_AM,
                        "L_QM": problem.L_QM,
                        "L_max": problem.L_max,
                        "L_var": problem.L_var,
                        "mu": problem.mu,
                        "tau_max_config": ps.tau_max,
                        "staleness_max": res.staleness_max,
                        "delay_max": res.delay_max,
                        "rule_holds": res.rule_holds,
                        "stepsize_bound_measured": res.stepsize_bound_measured,
                        "slow_mean_staleness": float(means.get(slow, math.nan)),
                        "fast_mean_staleness_max": max(fast) if fast else math.nan,
                    }
                    for k, v in extra.items():
                        t[k] = v
                    tables.append(t.drop(columns=["tau_max"]))
    except KeyboardInterrupt:
        interrupted = True
    columns = [c for c in (*tables[0].columns,) if c not in CONFIG_COLUMNS] if tables else []
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    if tables:
        ordered = [c for c in columns if c not in EXTRA_COLUMNS] + list(CONFIG_COLUMNS)
        table = table[ordered + list(EXTRA_COLUMNS)]
        out.mkdir(parents=True, exist_ok=True)
        write_table(table, out / "results", fmt or default_format())  # type: ignore[arg-type]
    return Outcome(table, complete=not interrupted, interrupted=interrupted)


def _runs(table: pd.DataFrame, bounded: bool) -> list[pd.DataFrame]:
    sel = table[table["tau_max_config"].notna() == bounded]
    return [df.sort_values("round") for _, df in sel.groupby("run_id", sort=True)]


def _rule(df: pd.DataFrame) -> bool | None:
    """The run's ``rule_holds``: None when no theory covers its measured delay (None in the
    table, NaN once it went through a CSV file, where ``bool(nan)`` would read True)."""
    v = df["rule_holds"].iloc[0]
    return None if v is None or pd.isna(v) else bool(v)


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    out: list[Claim] = []
    if table.empty:
        return [Claim("k18-async runs", "no runs finished", "—", None)]
    tau_max = int(params["tau_max"])
    bounded, free = _runs(table, True), _runs(table, False)
    if bounded:
        smax = max(int(df["staleness_max"].iloc[0]) for df in bounded)
        dmax = max(int(df["delay_max"].iloc[0]) for df in bounded)
        out.append(
            Claim(
                "bounded staleness: no applied message older than tau_max, IAG delay ≤ 2·tau_max",
                f"max staleness {smax}, max delay {dmax} (tau_max = {tau_max})",
                f"≤ {tau_max} and ≤ {2 * tau_max}",
                smax <= tau_max and dmax <= 2 * tau_max,
                {"staleness_max": smax, "delay_max": dmax},
            )
        )
    runs = bounded + free
    gaps = [
        float(df["slow_mean_staleness"].iloc[0] - df["fast_mean_staleness_max"].iloc[0])
        for df in runs
    ]
    out.append(
        Claim(
            "slow workers are staler (mean staleness of the slowest worker vs the others)",
            f"slowest minus stalest other: {', '.join(fmt(g) for g in gaps)}",
            "> 0 in every run",
            all(g > 0 for g in gaps),
            {"gaps": gaps},
        )
    )

    def ratio_last(df: pd.DataFrame) -> float:
        if no_result(df):  # its last (finite) row is no result: it did not converge
            return math.inf
        g = df["grad_norm_sq"].to_numpy()
        return float(g[-1] / g[0]) if g[0] > 0 else math.nan

    def ratio_tail(df: pd.DataFrame) -> tuple[float, float]:
        if no_result(df):  # diverged: it does not converge, whatever its rows before show
            return math.inf, math.inf
        g = df["grad_norm_sq"].to_numpy()
        tail = g[len(g) // 2 :] / g[0] if g[0] > 0 else g[len(g) // 2 :] * math.nan
        return float(np.median(tail)), float(tail.min())

    def shown(df: pd.DataFrame, text: str) -> str:
        """``text``, or the status of a run that is no result (its numbers are not shown)."""
        return str(df["status"].iloc[0]) if no_result(df) else text

    if bounded:
        conv = [ratio_last(df) for df in bounded]
        shows = [shown(df, fmt(c)) for df, c in zip(bounded, conv, strict=True)]
        out.append(
            Claim(
                "at the delay rule's step (bounded τ) asynchronous compressed IAG converges",
                f"final ‖∇f‖²/‖∇f(x⁰)‖² = {', '.join(shows)}",
                f"≤ {params['converge_factor']:g}",
                all(c <= params["converge_factor"] for c in conv),
                {"ratios": conv},
            )
        )
    if free:
        tails = [ratio_tail(df) for df in free]
        stall = [t[0] for t in tails]
        delays = [int(df["delay_max"].iloc[0]) for df in free]
        gammas = [float(df["stepsize"].iloc[0] * df["L"].iloc[0]) for df in free]
        shows = [
            shown(df, f"{fmt(m)} ({fmt(lo)})") for df, (m, lo) in zip(free, tails, strict=True)
        ]
        out.append(
            Claim(
                "with a large step (e.g. γ = 1/L) and unbounded staleness it does not converge",
                f"γL = {', '.join(fmt(g) for g in gammas)}; measured delay "
                f"{', '.join(map(str, delays))}; median (min) over the 2nd half of "
                f"‖∇f‖²/‖∇f(x⁰)‖² = {', '.join(shows)}",
                f"median ≥ {params['stall_factor']:g}",
                all(s >= params["stall_factor"] for s in stall),
                {"median_ratios": stall, "min_ratios": [t[1] for t in tails], "delays": delays},
            )
        )
    if bounded and free:
        rules_b, rules_f = [_rule(df) for df in bounded], [_rule(df) for df in free]
        title = "the delay rule at the measured delay separates the two"
        if None in rules_b or None in rules_f:
            unknown = (rules_b + rules_f).count(None)
            out.append(
                Claim(
                    title,
                    f"no theory covers the measured delay of {unknown} of "
                    f"{len(rules_b) + len(rules_f)} runs",
                    "both",
                    None,
                )
            )
        else:
            ok_b = all(rules_b)
            ok_f = not any(rules_f)
            bounds = [float(df["stepsize_bound_measured"].iloc[0] * df["L"].iloc[0]) for df in free]
            out.append(
                Claim(
                    title,
                    f"rule holds in the converging runs: {ok_b}; violated in the stalling runs: "
                    f"{ok_f} (their bound γL < {', '.join(fmt(b) for b in bounds)})",
                    "both",
                    ok_b and ok_f,
                    {"bounds_gammaL": bounds},
                )
            )
    return out


def figures(table: pd.DataFrame, params: Mapping[str, Any], directory: Path) -> list[Path]:
    """‖∇f‖² per update and per second for every run, and each run's staleness histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...distributed.ps import plot_staleness

    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for _, df in table.groupby("run_id", sort=True):
        df = df.sort_values("round")
        first = df.iloc[0]
        bound = "bounded τ_max" if pd.notna(first["tau_max_config"]) else "unbounded"
        label = (
            f"{first['stepsize_spec']} (γL={first['stepsize'] * first['L']:.3g}), {bound}, "
            f"measured τ={int(first['delay_max'])}"
        )
        for ax, x in zip(axes, ("round", "time_s"), strict=True):
            ax.semilogy(df[x], df["grad_norm_sq"], label=label)
    axes[0].set_xlabel("server updates")
    axes[1].set_xlabel("wall time of the update loop (s)")
    for ax in axes:
        ax.set_ylabel("‖∇f(x)‖²")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"[K18] asynchronous compressed IAG, {params['workers']} workers, speeds "
        f"{list(params['speeds'])}",
        fontsize=10,
    )
    fig.tight_layout()
    path = directory / "convergence.png"
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
    paths.append(path)
    runs_dir = directory.parent / "runs"
    for run_id in sorted(table["run_id"].unique()):
        src = runs_dir / str(run_id) / "staleness.csv"
        if src.is_file():
            st = pd.read_csv(src)
            tau = table.loc[table["run_id"] == run_id, "tau_max_config"].iloc[0]
            paths.append(
                plot_staleness(
                    st,
                    directory / f"staleness-{run_id}.png",
                    tau_max=None if pd.isna(tau) else int(tau),
                    delay_bound=None if pd.isna(tau) else 2 * int(tau),  # the IAG's table
                    title=str(run_id),
                )
            )
    return paths


REPRODUCTIONS.register(
    Reproduction(
        name="k18-async",
        title="Asynchronous parameter server: delay rule, staleness and speeds",
        paper="[K18]",
        config="k18-async.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(),
        figures=figures,
        execute=execute,
    )
)
