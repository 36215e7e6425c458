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

Only runs that are results make a claim pass (:func:`run_kind`): a parameter-server run that
``completed`` all its updates with every worker. A ``diverged`` one did not converge (claims 3
and 4 read it so) and measures nothing else; one cut short (``time_limit``, ``workers_lost``,
``interrupted``) or that lost a worker on the way measures nothing: its claims are n/a (FAIL
when another run fails them). A missing arm leaves its claims n/a.

A run whose server process died (:class:`~shrinkgrad.distributed.ps.PSServerLost`) is recorded
and the sweep goes on: one row at update 0 with NaN metrics and status :data:`SERVER_LOST` (a run
cut short: its claims read n/a), its reason in ``runs/<id>/failed.json`` and on stderr, and the
outcome is not ``complete`` (``shrinkgrad reproduce`` says that some runs failed).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...methods.asynchronous import EVENT_LOST
from ...methods.stepsize import parse_stepsize
from ...plotting.style import FIGURE_DPI
from ..claims import Claim, fmt, no_result
from ..config import ExperimentConfig
from ..results import CONFIG_COLUMNS, default_format, write_json, write_table
from . import REPRODUCTIONS, Reproduction, claim_params

if TYPE_CHECKING:
    from ...distributed.ps import PSConfig, PSResult, PSServerLost
    from ...problems import Problem

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

#: the status of a run whose parameter-server process died (``run_ps`` raised
#: :class:`~shrinkgrad.distributed.ps.PSServerLost`; ``shrinkgrad ps`` exits with 1 for it): no
#: result, its reason in ``runs/<id>/failed.json``
SERVER_LOST = "server_lost"

#: per-run columns added beside the results table's (constant within a run)
EXTRA_COLUMNS = (
    "tau_max_config",
    "staleness_max",
    "delay_max",
    "rule_holds",
    "stepsize_bound_measured",
    "slow_mean_staleness",
    "fast_mean_staleness_max",
    "workers_lost",
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


def _rows(res: PSResult, ps: PSConfig, problem: Problem) -> pd.DataFrame:
    """The run's table (``PSResult.table``), or, for a run that logged no row (it stopped
    before its first snapshot: every worker lost, a time limit or Ctrl-C during the initial
    messages), one row at update 0 with NaN metrics, so that the run stays in the results
    table with its status instead of vanishing (the claims measured on the other runs would
    not see that it is missing)."""
    t = res.table.copy()
    if len(t):
        return t
    compressor = res.config.get("compressor")
    return _one_row(t.columns, ps, problem, compressor, res.stepsize, res.stepsize_rule)


def _one_row(
    columns: Any,
    ps: PSConfig,
    problem: Problem,
    compressor: Any,
    stepsize: Any,
    stepsize_rule: Any,
) -> pd.DataFrame:
    """One row at update 0 with NaN metrics and the run's identifying columns."""
    info = problem.info()
    row = {
        "round": 0,
        "method": ps.run_method,
        "compressor": compressor,
        "stepsize": stepsize,
        "stepsize_rule": stepsize_rule,
        "seed": ps.seed,
        "dataset": str(info.get("dataset", problem.dataset)),
        "problem": str(info.get("problem", problem.name)),
        "n_clients": problem.n,
        "d": problem.d,
        "tau_max": ps.tau_max,
    }
    return pd.DataFrame([row], columns=columns)


def _lost(
    err: PSServerLost, ps: PSConfig, problem: Problem, run_dir: Path, run_id: str
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The row and the per-run columns of a run whose server died (:data:`SERVER_LOST`): no
    metrics, no staleness, no rule (NaN, None), and ``failed.json`` in its directory with the
    reason (as the sweep's failed runs: ``execute.write_failure``)."""
    from ...distributed.ps.results import TABLE_COLUMNS

    step = ps.stepsize
    numeric = isinstance(step, (int, float))
    t = _one_row(
        TABLE_COLUMNS,
        ps,
        problem,
        ps.compressor,
        float(step) if numeric else math.nan,  # a theory step is resolved by the server
        "" if numeric else str(step),
    )
    message = f"the parameter server was lost: {err}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(
        run_dir / "failed.json",
        {
            "run_id": run_id,
            "status": SERVER_LOST,
            "message": message,
            "exit_codes": err.exit_codes,
        },
    )
    print(f"failed: {run_id}: {message}", file=sys.stderr, flush=True)
    extra: dict[str, Any] = {
        "status": SERVER_LOST,
        "staleness_max": math.nan,
        "delay_max": math.nan,
        "rule_holds": None,
        "stepsize_bound_measured": math.nan,
        "slow_mean_staleness": math.nan,
        "fast_mean_staleness_max": math.nan,
        "workers_lost": math.nan,
    }
    return t, extra


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
    from ...distributed.ps import PSConfig, PSServerLost, run_ps
    from ...problems import make_problem

    params = claim_params(REPRODUCTIONS.get("k18-async"), config)
    out = Path(out)
    tables: list[pd.DataFrame] = []
    interrupted = False
    failed = 0  # runs whose server died (recorded, SERVER_LOST)
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
                    common: dict[str, Any] = {
                        "run_id": run_id,
                        "experiment": config.name,
                        "problem_spec": case.spec,
                        "problem_label": case.label,
                        "stepsize_spec": arm.stepsize,
                        "seed_index": index,
                        "L": problem.L,
                        "L_AM": problem.L_AM,
                        "L_QM": problem.L_QM,
                        "L_max": problem.L_max,
                        "L_var": problem.L_var,
                        "mu": problem.mu,
                        "tau_max_config": ps.tau_max,
                    }
                    try:
                        res = run_ps(ps, problem=problem)
                    except PSServerLost as e:  # no result; the finished runs are kept
                        failed += 1
                        t, lost = _lost(e, ps, problem, out / "runs" / run_id, run_id)
                        for k, v in {**common, **lost}.items():
                            t[k] = v
                        tables.append(t.drop(columns=["tau_max"]))
                        continue
                    res.save(out / "runs" / run_id)
                    if res.status == "interrupted":  # a first Ctrl-C: run_ps returns the run
                        raise KeyboardInterrupt  # cut short; the sweep stops, no claims
                    means = res.mean_staleness()
                    fast = [float(v) for w, v in means.items() if w != slow]
                    t = _rows(res, ps, problem)
                    extra: dict[str, Any] = {
                        **common,
                        "status": res.status,
                        "staleness_max": res.staleness_max,
                        "delay_max": res.delay_max,
                        "rule_holds": res.rule_holds,
                        "stepsize_bound_measured": res.stepsize_bound_measured,
                        "slow_mean_staleness": float(means.get(slow, math.nan)),
                        "fast_mean_staleness_max": max(fast) if fast else math.nan,
                        # workers lost on the way (a run can complete without them: then no
                        # result, see run_kind)
                        "workers_lost": int(
                            res.events.loc[res.events["event"] == EVENT_LOST, "worker"].nunique()
                        ),
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
    return Outcome(table, complete=not interrupted and not failed, interrupted=interrupted)


def _runs(table: pd.DataFrame, bounded: bool) -> list[pd.DataFrame]:
    sel = table[table["tau_max_config"].notna() == bounded]
    return [df.sort_values("round") for _, df in sel.groupby("run_id", sort=True)]


#: a run that ran all its updates with every worker: its numbers are a result
RESULT = "result"
#: a run stopped by its own numbers (``diverged``; ``no_progress``: claims.NOT_A_RESULT): no
#: result, but a run that did not converge
STOPPED = "stopped"
#: a run that is no measurement at all: cut short from outside (``time_limit``, ``workers_lost``,
#: ``interrupted``, any status but ``completed``), or ``completed`` after losing a worker (the
#: server then steps along the live workers' average, whose stationary points are not f's:
#: docs/parameter_server.md, "A lost worker")
CUT = "cut"


def run_kind(df: pd.DataFrame) -> str:
    """:data:`RESULT`, :data:`STOPPED` or :data:`CUT` for one run's rows, from its ``status``
    (``PSResult.status``: ``completed``, ``time_limit``, ``diverged``, ``workers_lost``,
    ``interrupted``) and ``workers_lost`` columns (a table without them: a result)."""
    if no_result(df):
        return STOPPED
    if "status" in df.columns and not bool((df["status"] == "completed").all()):
        return CUT
    if "workers_lost" in df.columns and bool((df["workers_lost"].fillna(0) > 0).any()):
        return CUT
    return RESULT


def _why(df: pd.DataFrame) -> str:
    """Why a run is no result, in a claim table: its status (and the workers it lost)."""
    status = str(df["status"].iloc[0]) if "status" in df.columns else "completed"
    lost = int(df["workers_lost"].fillna(0).max()) if "workers_lost" in df.columns else 0
    return f"{status}, {lost} worker(s) lost" if lost and status == "completed" else status


def _every(oks: list[bool | None]) -> bool | None:
    """A claim over every run: False when a run fails it, else None when a run measured
    nothing (no result), else True."""
    if any(o is False for o in oks):
        return False
    return None if any(o is None for o in oks) else True


def _note(runs: list[pd.DataFrame], kinds: tuple[str, ...] = (STOPPED, CUT)) -> str:
    """'; no result: …' for the runs of ``kinds`` (nothing when there are none)."""
    why = [f"{df['run_id'].iloc[0]} ({_why(df)})" for df in runs if run_kind(df) in kinds]
    return f"; no result: {', '.join(why)}" if why else ""


def _count(df: pd.DataFrame, col: str) -> int | None:
    """The run's ``col`` (``staleness_max``, ``delay_max``) as an int; None where it was not
    measured (NaN: a run whose server died, :data:`SERVER_LOST`)."""
    v = df[col].iloc[0]
    return None if v is None or pd.isna(v) else int(v)


def _rule(df: pd.DataFrame) -> bool | None:
    """The run's ``rule_holds``: None when no theory covers its measured delay (None in the
    table, NaN once it went through a CSV file, where ``bool(nan)`` would read True)."""
    v = df["rule_holds"].iloc[0]
    return None if v is None or pd.isna(v) else bool(v)


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    """The five claims of the module docstring, over every run of the table.

    Each run is a :func:`run_kind`: a :data:`RESULT` is measured; a run that is not one never
    makes a claim pass. A :data:`STOPPED` (diverged) run did not converge: it fails claim 3 and
    supports claim 4 (the rows it keeps stop before the blow-up, so they are never read as its
    final ‖∇f‖²); it measures nothing else. A :data:`CUT` run measures nothing: a claim that
    needs it is n/a unless another run fails it. A staleness bound exceeded in any run fails
    claim 1 whatever the run's status. An arm without runs leaves its claims n/a (not out), and
    claim 2 is n/a when no single worker is the slowest (``speeds`` with a tied maximum: which
    of them the table calls "slowest" would be the index order's choice).
    """
    out: list[Claim] = []
    if table.empty:
        return [Claim("k18-async runs", "no runs finished", "—", None)]
    tau_max = int(params["tau_max"])
    bounded, free = _runs(table, True), _runs(table, False)
    kinds_b, kinds_f = [run_kind(df) for df in bounded], [run_kind(df) for df in free]
    title = "bounded staleness: no applied message older than tau_max, IAG delay ≤ 2·tau_max"
    if bounded:
        smaxs = [_count(df, "staleness_max") for df in bounded]
        dmaxs = [_count(df, "delay_max") for df in bounded]
        smax = max((v for v in smaxs if v is not None), default=None)
        dmax = max((v for v in dmaxs if v is not None), default=None)
        # an exceeded bound is a fact in any run; one kept is a measurement of a result only
        # (a run whose server died measured neither: None)
        oks_1: list[bool | None] = [
            False
            if (s is not None and s > tau_max) or (d is not None and d > 2 * tau_max)
            else (True if k == RESULT and s is not None and d is not None else None)
            for s, d, k in zip(smaxs, dmaxs, kinds_b, strict=True)
        ]
        out.append(
            Claim(
                title,
                f"max staleness {'—' if smax is None else smax}, max delay "
                f"{'—' if dmax is None else dmax} (tau_max = {tau_max})" + _note(bounded),
                f"≤ {tau_max} and ≤ {2 * tau_max}",
                _every(oks_1),
                {"staleness_max": smax, "delay_max": dmax},
            )
        )
    else:
        out.append(Claim(title, "no runs with bounded staleness (step 'theory')", "—", None))

    def shown(df: pd.DataFrame, text: str) -> str:
        """``text``, or why the run is no result (its numbers are not shown)."""
        return text if run_kind(df) == RESULT else _why(df)

    runs = bounded + free
    kinds = kinds_b + kinds_f
    title = "slow workers are staler (mean staleness of the slowest worker vs the others)"
    speeds = [float(s) for s in params["speeds"]]
    if speeds.count(max(speeds)) > 1:
        out.append(
            Claim(title, f"no single slowest worker: speeds {list(params['speeds'])}", "—", None)
        )
    else:
        gaps = [
            float(df["slow_mean_staleness"].iloc[0] - df["fast_mean_staleness_max"].iloc[0])
            for df in runs
        ]
        out.append(
            Claim(
                title,
                "slowest minus stalest other: "
                + ", ".join(shown(df, fmt(g)) for df, g in zip(runs, gaps, strict=True)),
                "> 0 in every run",
                _every([g > 0 if k == RESULT else None for g, k in zip(gaps, kinds, strict=True)]),
                {"gaps": gaps},
            )
        )

    def ratio_last(df: pd.DataFrame) -> float:
        kind = run_kind(df)  # a diverged run's last (finite) row is not its final ‖∇f‖²
        if kind != RESULT:
            return math.inf if kind == STOPPED else math.nan
        g = df["grad_norm_sq"].to_numpy()
        return float(g[-1] / g[0]) if g[0] > 0 else math.nan

    def ratio_tail(df: pd.DataFrame) -> tuple[float, float]:
        kind = run_kind(df)  # diverged: it does not converge, whatever its rows show
        if kind != RESULT:
            return (math.inf, math.inf) if kind == STOPPED else (math.nan, math.nan)
        g = df["grad_norm_sq"].to_numpy()
        tail = g[len(g) // 2 :] / g[0] if g[0] > 0 else g[len(g) // 2 :] * math.nan
        return float(np.median(tail)), float(tail.min())

    title = "at the delay rule's step (bounded τ) asynchronous compressed IAG converges"
    if bounded:
        conv = [ratio_last(df) for df in bounded]
        shows = [shown(df, fmt(c)) for df, c in zip(bounded, conv, strict=True)]
        oks_3 = [
            None if k == CUT else bool(c <= params["converge_factor"])
            for c, k in zip(conv, kinds_b, strict=True)
        ]
        out.append(
            Claim(
                title,
                f"final ‖∇f‖²/‖∇f(x⁰)‖² = {', '.join(shows)}",
                f"≤ {params['converge_factor']:g}",
                _every(oks_3),
                {"ratios": conv},
            )
        )
    else:
        out.append(Claim(title, "no runs with bounded staleness (step 'theory')", "—", None))
    title = "with a large step (e.g. γ = 1/L) and unbounded staleness it does not converge"
    if free:
        tails = [ratio_tail(df) for df in free]
        stall = [t[0] for t in tails]
        delays = [_count(df, "delay_max") for df in free]
        gammas = [float(df["stepsize"].iloc[0] * df["L"].iloc[0]) for df in free]
        shows = [
            shown(df, f"{fmt(m)} ({fmt(lo)})") for df, (m, lo) in zip(free, tails, strict=True)
        ]
        oks_4 = [
            None if k == CUT else bool(s >= params["stall_factor"])
            for s, k in zip(stall, kinds_f, strict=True)
        ]
        out.append(
            Claim(
                title,
                f"γL = {', '.join(fmt(g) for g in gammas)}; measured delay "
                f"{', '.join('—' if v is None else str(v) for v in delays)}; median (min) over "
                "the 2nd half of "
                f"‖∇f‖²/‖∇f(x⁰)‖² = {', '.join(shows)}",
                f"median ≥ {params['stall_factor']:g}",
                _every(oks_4),
                {"median_ratios": stall, "min_ratios": [t[1] for t in tails], "delays": delays},
            )
        )
    else:
        out.append(
            Claim(title, "no runs with unbounded staleness (a step not 'theory')", "—", None)
        )
    title = "the delay rule at the measured delay separates the two"
    if not (bounded and free):
        out.append(Claim(title, "needs runs of both arms (bounded and unbounded)", "both", None))
        return out
    rules_b, rules_f = [_rule(df) for df in bounded], [_rule(df) for df in free]
    # a cut run measures nothing here (its rule is not consulted: None when its server died)
    known = [r for r, k in zip(rules_b + rules_f, kinds_b + kinds_f, strict=True) if k != CUT]
    if None in known:
        out.append(
            Claim(
                title,
                f"no theory covers the measured delay of {known.count(None)} of "
                f"{len(rules_b) + len(rules_f)} runs",
                "both",
                None,
            )
        )
        return out
    # the rule holds in the converging runs (results only: a run that diverged or was cut is no
    # converging run) and is violated in the stalling ones (a diverged run stalls too; a cut
    # one's delay is that of part of a run)
    oks_b = [r if k == RESULT else None for r, k in zip(rules_b, kinds_b, strict=True)]
    oks_f = [None if k == CUT else not r for r, k in zip(rules_f, kinds_f, strict=True)]
    bounds = [float(df["stepsize_bound_measured"].iloc[0] * df["L"].iloc[0]) for df in free]
    holds = all(o is not False for o in oks_b)  # the runs the verdict reads
    violated = all(o is not False for o in oks_f)
    out.append(
        Claim(
            title,
            f"rule holds in the converging runs: {holds}; violated in the stalling runs: "
            f"{violated} (their bound γL < {', '.join(fmt(b) for b in bounds)})"
            + _note(bounded)
            + _note(free, (CUT,)),
            "both",
            _every(oks_b + oks_f),
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
        tau = _count(df, "delay_max")
        label = (
            f"{first['stepsize_spec']} (γL={first['stepsize'] * first['L']:.3g}), {bound}, "
            f"measured τ={'—' if tau is None else tau}"
            + ("" if run_kind(df) == RESULT else f" ({_why(df)})")
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
