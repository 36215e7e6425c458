"""``k18-delays``: [K18] — stale compressed gradients need the delay-dependent step size.

Claims ([K18]; methods.md §3–4): with delays bounded by τ, compressed gradient descent (and the
compressed IAG, τ = n − 1) converges at the delay step 2/[L(1 + √(1 + 8τ(τ+1)))] (capped by
the DCGD rule), ever more slowly as τ grows; the delay-free step 1/L fails once τ is large.

Measured from the table (medians over seeds), ε = ``eps_rel`` × ‖∇f(x⁰)‖²:

1. every delayed-DCGD and IAG run at the theory step reaches ε;
2. the rounds to ε at the theory step grow with τ (Spearman ρ(τ, rounds) ≥ ``rank_min``, and
   τ_max needs at least ``slowdown_min`` × the rounds of τ = 0);
3. at 1/L, τ = 0 reaches ε, while every run with τ ≥ ``tau_unstable`` (and IAG) fails: it
   diverges (the simulator's divergence stop), makes no progress (its loss ends above its
   start) or ends above its starting ‖∇f‖² (or at NaN).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from ...plotting.style import FIGURE_DPI
from ...registry import parse_spec
from ..claims import Claim, fmt, median, no_result, rank_correlation, reach, runs_of
from . import REPRODUCTIONS, PlotSpec, Reproduction

DEFAULTS: dict[str, Any] = {
    "eps_rel": 1e-8,
    "rank_min": 0.9,
    "slowdown_min": 5.0,
    "tau_unstable": 5,
    "rule": "theory",
    "naive": "1/L",
}


def tau_of(method: str, n_clients: int) -> int | None:
    """τ of ``delayed_dcgd[tau=…]`` or of the cyclic IAG (n − 1); None for other methods."""
    spec = parse_spec(method)
    if spec.name == "delayed_dcgd":
        return int(dict(spec.params).get("tau", 1))
    if spec.name == "iag":
        return n_clients - 1
    return None


def measure(table: pd.DataFrame, params: Mapping[str, Any]) -> pd.DataFrame:
    """Per method and step size: τ, rounds to ε, whether it reached ε, failed (seed medians).

    A run fails when it diverged, made no progress (its loss ended above its start), or its last
    ‖∇f‖² is above its first or not finite; a run whose last ‖∇f‖² is not finite is no result
    and reaches nothing, whatever its earlier rows show. Rows are sorted by step size, IAG, τ
    and method (a tie in τ, e.g. two delay models, is broken by the name, not the table order).
    """
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for keys, run in runs_of(table):
        first, last = run.iloc[0], run.iloc[-1]
        tau = tau_of(str(keys["method"]), int(first["n_clients"]))
        if tau is None:
            continue
        g0 = float(first["grad_norm_sq"])
        e = acc.setdefault(
            (str(keys["method"]), str(keys["stepsize_spec"])),
            {
                "tau": tau,
                "rounds": [],
                "failed": [],
                "growth": [],
                "stepsize": float(first["stepsize"]),
            },
        )
        g_last = float(last["grad_norm_sq"])
        lost = not math.isfinite(g_last)  # ended with NaN: no result, like a diverged run
        rounds = math.inf if lost else reach(run, float(params["eps_rel"]) * g0, x="round")
        e["rounds"].append(rounds)
        e["failed"].append(no_result(run) or lost or g_last > g0)
        e["growth"].append(float(last["grad_norm_sq"]) / g0 if g0 > 0 else math.nan)
    rows = [
        {
            "method": m,
            "iag": parse_spec(m).name == "iag",
            "stepsize_spec": s,
            "stepsize": e["stepsize"],
            "tau": e["tau"],
            "rounds": median(e["rounds"]),
            "reached": all(math.isfinite(r) for r in e["rounds"]),
            "failed": all(e["failed"]),
            "final_over_initial": median(e["growth"]),
        }
        for (m, s), e in acc.items()
    ]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    return df.sort_values(["stepsize_spec", "iag", "tau", "method"], kind="mergesort")


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    m = measure(table, params)
    if m.empty:
        return [Claim("delayed compressed GD", "no delayed runs", "—", None)]
    rule = m[m["stepsize_spec"] == params["rule"]]
    naive = m[m["stepsize_spec"] == params["naive"]]
    out: list[Claim] = []
    missed = rule[~rule["reached"]]
    out.append(
        Claim(
            "at the delay step every τ (and the compressed IAG) converges",
            f"{int(rule['reached'].sum())} of {len(rule)} reach ε"
            + (f"; not: {', '.join(missed['method'])}" if len(missed) else ""),
            "all reach ε",
            None if rule.empty else bool(rule["reached"].all()),
            {
                "final_over_initial": dict(
                    zip(rule["method"], rule["final_over_initial"], strict=True)
                )
            },
        )
    )
    dd = rule[~rule["iag"]].sort_values(["tau", "method"], kind="mergesort")
    if len(dd) >= 2:
        rho = rank_correlation(dd["tau"].tolist(), dd["rounds"].tolist())
        r0 = float(dd["rounds"].iloc[0])
        slow = float(dd["rounds"].iloc[-1]) / r0 if r0 > 0 else math.nan
        text = ", ".join(f"τ={t}: {fmt(r)}" for t, r in zip(dd["tau"], dd["rounds"], strict=True))
        out.append(
            Claim(
                "the slow-down grows with τ",
                f"rounds to ε: {text} (ρ = {fmt(rho)}, τ_max/τ_min = {fmt(slow)})",
                f"ρ ≥ {params['rank_min']:g} and ratio ≥ {params['slowdown_min']:g}",
                bool(rho >= params["rank_min"] and slow >= params["slowdown_min"]),
                {"rho": rho, "slowdown": slow},
            )
        )
    else:
        out.append(Claim("the slow-down grows with τ", "fewer than 2 delays", "—", None))
    if not naive.empty:
        zero = naive[(naive["tau"] == 0) & ~naive["iag"]]
        big = naive[(naive["tau"] >= params["tau_unstable"]) | naive["iag"]]
        ok0 = bool(zero["reached"].all()) if len(zero) else None
        fail_big = bool(big["failed"].all()) if len(big) else None
        desc = ", ".join(
            f"{'IAG' if i else f'τ={t}'}: {'fails' if f else ('converges' if r else 'stalls')}"
            for t, i, f, r in zip(
                naive["tau"], naive["iag"], naive["failed"], naive["reached"], strict=True
            )
        )
        passed = None if ok0 is None or fail_big is None else bool(ok0 and fail_big)
        out.append(
            Claim(
                f"at 1/L delays cause instability (τ ≥ {params['tau_unstable']} and IAG fail, "
                "τ = 0 converges)",
                desc,
                "τ = 0 reaches ε; every large-τ run diverges, makes no progress or ends above "
                "‖∇f(x⁰)‖²",
                passed,
                {
                    "final_over_initial": dict(
                        zip(naive["method"], naive["final_over_initial"], strict=True)
                    )
                },
            )
        )
    else:  # the arm is missing: say so (n/a) rather than leave the claim out
        out.append(
            Claim("at 1/L delays cause instability", f"no runs at {params['naive']}", "—", None)
        )
    return out


def figures(table: pd.DataFrame, params: Mapping[str, Any], directory: Path) -> list[Path]:
    """Rounds to ε against τ at the delay step (and the step sizes used)."""
    from matplotlib.figure import Figure

    m = measure(table, params)
    rule = m[(m["stepsize_spec"] == params["rule"]) & ~m["iag"]].sort_values("tau")
    fig = Figure(figsize=(4.6, 3.4), layout="constrained")
    ax = fig.subplots()
    x = rule["tau"].to_numpy()
    ax.plot(x, rule["rounds"], "o-", label="rounds to ε at the delay step")
    ax.plot(
        x,
        rule["rounds"].iloc[0] * rule["stepsize"].iloc[0] / rule["stepsize"],
        "k--",
        label="∝ 1/γ(τ)",
    )
    iag = m[(m["stepsize_spec"] == params["rule"]) & m["iag"]]
    if len(iag):
        ax.plot(iag["tau"], iag["rounds"], "s", label="compressed IAG (τ = n − 1)")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xlabel("maximal delay τ", fontsize=8)
    ax.set_ylabel("rounds to ε", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("[K18] slow-down with the delay", fontsize=9)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "pdf"):
        p = directory / f"rounds_vs_tau.{ext}"
        fig.savefig(p, dpi=FIGURE_DPI)
        paths.append(p)
    return paths


REPRODUCTIONS.register(
    Reproduction(
        name="k18-delays",
        title="Delayed compressed GD and compressed IAG",
        paper="[K18]",
        config="k18-delays.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(PlotSpec("rounds", "grad_norm_sq"),),
        figures=figures,
    )
)
