"""``ef21-vs-ef``: [EF21] — EF21 beats classic error feedback; larger step multipliers help.

Claim ([EF21] §5): with Top-k, EF21 reaches a given ‖∇f‖² in fewer bits than classic EF
([S14]) at step sizes that are multiples of the EF21 theory step, and larger multipliers help.

Measured per dataset (both methods at the same multipliers m of the EF21 theory step):

1. ε = the best (lowest) final ‖∇f‖² EF reaches at any multiplier; the fewest bits/n EF21 needs
   to reach ε (best multiplier) vs the fewest EF needs: ratio EF/EF21 ≥ 1 on every dataset;
2. at equal multipliers, EF21's final ‖∇f‖² ≤ EF's in at least ``better_fraction`` of the
   (dataset, multiplier) pairs (a pair in which neither run is a result is left out);
3. on every dataset EF21's lowest final ‖∇f‖² (median over seeds; the smallest multiplier on a
   tie) is reached at a multiplier > 1.

A run that diverged, made no progress or ends with NaN has final ‖∇f‖² inf: it is never best.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from ...plotting.style import FIGURE_DPI
from ..claims import Claim, final_value, fmt, median, reach, runs_of
from . import REPRODUCTIONS, PlotSpec, Reproduction

DEFAULTS: dict[str, Any] = {
    "method": "ef21",
    "baseline": "ef",
    "better_fraction": 0.75,
}

_MULT = re.compile(r"\*([0-9.eE+\-]+)$")


def multiplier(stepsize_spec: str) -> float:
    """m of ``theory*m`` / ``theory(ef21)*m`` (1 without a factor)."""
    m = _MULT.search(stepsize_spec)
    return float(m.group(1)) if m else 1.0


def per_run(table: pd.DataFrame) -> list[dict[str, Any]]:
    """One record per run: problem, method, multiplier, final ‖∇f‖² and the run's rows.

    The final value is inf for a run that is no result: it diverged or made no progress
    (:func:`final_value`), or it ends with NaN (which min() would keep or drop depending on the
    order of the runs).
    """
    out = []
    for keys, run in runs_of(table):
        final = final_value(run)
        out.append(
            {
                "problem": str(keys["problem_label"]),
                "method": str(keys["method"]),
                "m": multiplier(str(keys["stepsize_spec"])),
                "final": math.inf if math.isnan(final) else final,
                "run": run,
            }
        )
    return out


def best_multiplier(runs: list[dict[str, Any]]) -> float:
    """The multiplier whose median final ‖∇f‖² over the seeds is lowest (not one lucky seed);
    the smallest of those on a tie (then larger multipliers do not help), whatever the order of
    the runs; NaN when no multiplier has a finite median (its runs diverged or made no
    progress: there is no best)."""
    score = {m: median(r["final"] for r in runs if r["m"] == m) for m in {r["m"] for r in runs}}
    best = min(score, key=lambda m: (score[m], m))
    return best if math.isfinite(score[best]) else math.nan


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    new, old = params["method"], params["baseline"]
    runs = per_run(table)
    ratios: dict[str, float] = {}
    better, pairs = 0, 0
    best_m: dict[str, float] = {}
    for label in dict.fromkeys(r["problem"] for r in runs):
        a = [r for r in runs if r["problem"] == label and r["method"] == new]
        b = [r for r in runs if r["problem"] == label and r["method"] == old]
        if not a or not b:
            continue
        eps = min(r["final"] for r in b)
        bits_new = min(reach(r["run"], eps) for r in a)
        bits_old = min(reach(r["run"], eps) for r in b)
        if not math.isfinite(eps):  # every EF run is no result: no accuracy of EF to reach
            ratios[label] = math.nan
        else:
            ok = math.isfinite(bits_new) and bits_new > 0
            ratios[label] = bits_old / bits_new if ok else 0.0
        for ra in a:
            fb = [r["final"] for r in b if r["m"] == ra["m"]]
            if fb:
                eb = median(fb)
                if math.isinf(ra["final"]) and math.isinf(eb):
                    continue  # neither is a result at this multiplier: no comparison
                pairs += 1
                better += int(ra["final"] <= eb)
        best_m[label] = best_multiplier(a)
    out: list[Claim] = []
    if not ratios:
        return [Claim("EF21 beats EF", "no dataset has runs of both methods", "—", None)]
    text = ", ".join(f"{k}: {fmt(v)}" for k, v in ratios.items())
    vals = list(ratios.values())
    out.append(
        Claim(
            "EF21 reaches EF's best accuracy in fewer bits/n (best multiplier of each)",
            f"bits ratio EF/EF21: {text}",
            "≥ 1 on every dataset",
            all(v == v and v >= 1 for v in vals),
            {"ratios": ratios},
        )
    )
    frac = better / pairs if pairs else math.nan
    out.append(
        Claim(
            "at equal step multipliers EF21 ends lower than EF",
            f"{better} of {pairs} (dataset, multiplier) pairs ({fmt(frac)})",
            f"fraction ≥ {params['better_fraction']:g}",
            None if not pairs else bool(frac >= params["better_fraction"]),
            {"fraction": frac},
        )
    )
    text = ", ".join(
        f"{k}: ×{v:g}" if v == v else f"{k}: none (every run diverged or made no progress)"
        for k, v in best_m.items()
    )
    out.append(
        Claim(
            "larger step multipliers help EF21",
            f"best multiplier: {text}",
            "> 1 on every dataset",
            all(v > 1 for v in best_m.values()),
            {"best_multiplier": best_m},
        )
    )
    return out


def figures(table: pd.DataFrame, params: Mapping[str, Any], directory: Path) -> list[Path]:
    """Final ‖∇f‖² against the step multiplier, EF21 (solid) and EF (dashed), per dataset."""
    from matplotlib.figure import Figure

    runs = per_run(table)
    labels = list(dict.fromkeys(r["problem"] for r in runs))
    fig = Figure(figsize=(4.8, 3.4 + 0.16 * len(labels)), layout="constrained")
    ax = fig.subplots()
    for i, label in enumerate(labels):
        color = f"C{i % 10}"
        for method, style in ((params["method"], "-"), (params["baseline"], "--")):
            pts = sorted(
                (r["m"], r["final"])
                for r in runs
                if r["problem"] == label and r["method"] == method
            )
            if pts:
                ax.loglog(
                    *zip(*pts, strict=True),
                    style,
                    marker="o",
                    ms=3,
                    color=color,
                    label=f"{label} · {method}",
                )
    ax.set_xlabel("step multiplier m (× the EF21 theory step)", fontsize=8)
    ax.set_ylabel("final ‖∇f(xᵗ)‖²", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=6, ncols=2, frameon=False)
    ax.set_title("[EF21] EF21 (solid) vs EF (dashed) after the same rounds", fontsize=9)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "pdf"):
        p = directory / f"final_vs_multiplier.{ext}"
        fig.savefig(p, dpi=FIGURE_DPI)
        paths.append(p)
    return paths


REPRODUCTIONS.register(
    Reproduction(
        name="ef21-vs-ef",
        title="EF21 vs classic EF, Top-1, step multipliers",
        paper="[EF21] §5",
        config="ef21-vs-ef.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(PlotSpec("bits_paper", "grad_norm_sq"),),
        figures=figures,
    )
)
