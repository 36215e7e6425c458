"""``k18-quantizers``: [K18] — DCGD with unbiased quantizers: the communication trade-off.

Claims ([K18]; methods.md §5): more compression means fewer bits per round but more rounds;
the total bits to reach an accuracy therefore has an interior optimum over the compression
level; and DCGD with an unbiased compressor stalls at an error floor that grows with γω
(methods.md §3: its size ∝ γω (1/n) Σ‖∇f_i(x*)‖²) and disappears when every ∇f_i(x*) = 0.

Measured from the table (medians over seeds), for each problem of ``eps_rel`` and each
family of ``families`` (``qsgd[s=…]`` ordered by s, ``rand_k[k=…]`` by k, each ending with
``identity``, the uncompressed limit), at the theory step:

1. bits per round increase strictly with the level (less compression); a run that completed no
   round has no bits per round (NaN, not 0): a level without any makes the claim n/a;
2. rounds to ‖∇f‖² ≤ ε (ε = eps_rel × ‖∇f(x⁰)‖²) fall with the level: Spearman ρ ≤ ``rank_max``;
3. for the quantization levels of ``optimum_families`` (QSGD's s: each level costs
   ⌈log₂(s+1)⌉ + 1 bits per coordinate while ω falls like 1/s), the total bits to ε are
   smallest at an interior level (neither the most compressed nor identity). For rand-k the
   table reports where the optimum lies without a verdict: at the DCGD theory step the total
   bits are ≈ k(32 + ⌈log₂ d⌉)(L + 2(d/k − 1)L_max/n)/μ, linear in k, so an end point is
   expected there. Ties in the total bits are decided by the level, not by the table's row
   order (:func:`optimum`): the smallest level attaining the minimum names it, and it is
   interior only when no end point attains it;

and at fixed steps γ = c/L_max with rand-k (ω = d/k − 1):

4. on ``floor_problem`` the floor (mean ‖∇f‖² over the last ``tail_fraction`` of rounds)
   grows like (γω)^s with a log-log slope s in ``slope_range``;
5. the floor disappears on ``zero_problem`` (every ∇f_i(x*) = 0): there the error is still
   contracting in the second half of every run (mean ‖∇f‖² over the last 10 % of the rounds ≤
   ``contract_max`` × its mean around mid-run, or the run reached the stopping tolerance), while
   on ``floor_problem`` it has stalled (that ratio ≥ ``stall_min``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...plotting.style import FIGURE_DPI
from ...registry import parse_spec
from ..claims import Claim, fmt, median, no_result, rank_correlation, reach, runs_of, tail_mean
from . import REPRODUCTIONS, PlotSpec, Reproduction

DEFAULTS: dict[str, Any] = {
    "eps_rel": {"logistic": 1e-3, "zero-residual": 1e-8},
    "families": {"qsgd": "s", "rand_k": "k"},
    "floor_problem": "noisy",
    "zero_problem": "zero-residual",
    "optimum_families": ["qsgd"],
    "tail_fraction": 0.5,
    "slope_range": [0.8, 1.2],
    "contract_max": 1e-2,
    "stall_min": 0.1,
    "rank_max": -0.8,
}


def level(compressor: str, family: str, param: str) -> float | None:
    """The compression level of ``compressor`` in ``family`` (identity = inf), else None."""
    if compressor == "identity":
        return math.inf
    spec = parse_spec(compressor)
    if spec.name != family:
        return None
    value = dict(spec.params).get(param)
    return float(value) if isinstance(value, (int, float)) else None


def tradeoff(table: pd.DataFrame, params: Mapping[str, Any]) -> pd.DataFrame:
    """Per problem, family and level: bits/round, rounds and total bits to ε (seed medians)."""
    theory = table[table["stepsize_spec"] == "theory"]
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for keys, run in runs_of(theory):
        label = str(keys["problem_label"])
        if label not in params["eps_rel"]:
            continue
        eps = float(params["eps_rel"][label]) * float(run["grad_norm_sq"].iloc[0])
        r = rows.setdefault((label, str(keys["compressor"])), {"bpr": [], "rounds": [], "bits": []})
        r["bpr"].append(bits_per_round(run))
        r["rounds"].append(reach(run, eps, x="round"))
        r["bits"].append(reach(run, eps, x="bits_up"))
    out = []
    for (label, comp), r in rows.items():
        for family, param in params["families"].items():
            lev = level(comp, family, param)
            if lev is None:
                continue
            out.append(
                {
                    "problem": label,
                    "family": family,
                    "compressor": comp,
                    "level": lev,
                    # over the seeds that completed a round; NaN (no result) when none did
                    "bits_per_round": median(v for v in r["bpr"] if not math.isnan(v)),
                    "rounds": median(r["rounds"]),
                    "bits": median(r["bits"]),
                }
            )
    df = pd.DataFrame(out)
    return by_level(df, ["problem", "family"]) if not df.empty else df


#: total bits to ε closer than this (relative) are a tie: they differ by rounding only
TIE_RTOL = 1e-9


def by_level(df: pd.DataFrame, first: list[str] | None = None) -> pd.DataFrame:
    """``df`` sorted by ``first``, the level and the compressor's name, a stable sort: the
    order (and every tie decided by it) is the same whatever the order of the table's rows."""
    return df.sort_values([*(first or []), "level", "compressor"], kind="stable")


def bits_per_round(run: pd.DataFrame) -> float:
    """Uplink bits per round of ``run`` (sorted by round): the bits sent over its rounds ÷ their
    number. NaN (no result) for a run that completed no round (its round-0 row only): it sent
    nothing, which says nothing about its compressor — not 0 bits per round."""
    rounds = float(run["round"].iloc[-1]) - float(run["round"].iloc[0])
    if not rounds > 0:
        return math.nan
    return (float(run["bits_up"].iloc[-1]) - float(run["bits_up"].iloc[0])) / rounds


def increasing(levels: Sequence[float], values: Sequence[float]) -> bool | None:
    """Whether ``values`` increase strictly with ``levels``: every value at a level is below
    every value at any higher level (compressors that share a level are not compared with each
    other, so their order does not matter). False when the known values already break it,
    None (no result) when they do not but a value is NaN, True otherwise."""
    known: dict[float, list[float]] = {}
    missing = False
    for lev, v in zip(levels, values, strict=True):
        if math.isnan(v):
            missing = True
        else:
            known.setdefault(float(lev), []).append(float(v))
    steps = [known[k] for k in sorted(known)]
    ok = all(max(lo) < min(hi) for lo, hi in itertools.pairwise(steps))
    return False if not ok else None if missing else True


def optimum(g: pd.DataFrame) -> tuple[list[str], bool | None]:
    """The compressors of ``g`` (one problem and family, sorted by :func:`by_level`) with the
    fewest total bits to ε, smallest level first, and whether the optimum is interior.

    A tie (totals equal within :data:`TIE_RTOL`, i.e. up to rounding: the crossing of ε is
    interpolated) is decided by the level, never by the order of the rows: the optimum is
    named by the smallest level that attains it (the most compressed; then the compressor's
    name), and it is interior only when no end point — the most compressed level or identity —
    attains it. None (unknown) without an identity run: the last level present is no end point.
    No compressor when no level reached ε.
    """
    bits = g["bits"].to_numpy(dtype=np.float64)
    finite = np.isfinite(bits)
    if not finite.any():
        return [], None if not bool(np.isinf(g["level"]).any()) else False
    best = float(bits[finite].min())
    at = finite & np.isclose(bits, best, rtol=TIE_RTOL, atol=0.0)
    levels = g["level"].to_numpy(dtype=np.float64)
    if not bool(np.isinf(levels).any()):
        return list(g["compressor"][at]), None
    ends = (levels == levels.min()) | np.isinf(levels)
    return list(g["compressor"][at]), not bool((at & ends).any())


def floors(table: pd.DataFrame, params: Mapping[str, Any]) -> pd.DataFrame:
    """Per problem and (compressor, γ) of the fixed-step runs: γω and the floor (seed median).

    A run that diverged or made no progress has no floor (inf) and no contraction ratio (NaN);
    the largest ("contraction") and smallest ("stall") ratio over the seeds keep a NaN, whatever
    the order of the runs (Python's max()/min() keep or drop it by position).
    """
    from ...compressors import make_compressor

    fixed = table[table["stepsize_spec"].str.contains("/L", regex=False)]
    acc: dict[tuple[str, str, str], dict[str, Any]] = {}
    for keys, run in runs_of(fixed):
        first = run.iloc[0]
        key = (str(keys["problem_label"]), str(keys["compressor"]), str(keys["stepsize_spec"]))
        omega = float(make_compressor(str(keys["compressor"])).omega(int(first["d"])))
        entry = acc.setdefault(
            key,
            {
                "gamma": float(first["stepsize"]),
                "omega": omega,
                "floor": [],
                "g0": [],
                "c": [],
                "final": [],
            },
        )
        entry["floor"].append(tail_mean(run, fraction=float(params["tail_fraction"])))
        entry["g0"].append(float(first["grad_norm_sq"]))
        entry["c"].append(_contraction(run))
        entry["final"].append(float(run["grad_norm_sq"].iloc[-1]))
    rows = [
        {
            "problem": p,
            "compressor": c,
            "stepsize_spec": s,
            "gamma_omega": e["gamma"] * e["omega"],
            "floor": median(e["floor"]),
            "final": median(e["final"]),
            "g0": median(e["g0"]),
            "contraction": float(np.max(e["c"])),
            "stall": float(np.min(e["c"])),
        }
        for (p, c, s), e in acc.items()
    ]
    return pd.DataFrame(rows)


def _contraction(run: pd.DataFrame) -> float:
    """Mean ‖∇f‖² over the last 10 % of the rounds ÷ its mean over 45–55 % (0 when the run met
    its stopping tolerance): ≪ 1 while the error still contracts, ≈ 1 on a floor. NaN for a run
    that diverged or made no progress: it neither contracts nor stalls on a floor (the rows of a
    diverged run stop before its blow-up, and their growth read as a stall)."""
    if no_result(run):
        return math.nan
    if str(run["status"].iloc[-1]) == "converged":
        return 0.0
    r = run["round"].to_numpy(dtype=np.float64)
    g = run["grad_norm_sq"].to_numpy(dtype=np.float64)
    end = g[r >= 0.9 * r[-1]]
    mid = g[(r >= 0.45 * r[-1]) & (r <= 0.55 * r[-1])]
    if not end.size or not mid.size or mid.mean() <= 0:
        return math.nan
    return float(end.mean() / mid.mean())


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    out: list[Claim] = []
    t = tradeoff(table, params)
    groups = list(t.groupby(["problem", "family"], sort=False)) if not t.empty else []
    if not groups:
        out.append(Claim("the compression trade-off", "no theory-step runs", "—", None))
    else:
        rhos: dict[str, float] = {}
        optima: dict[str, tuple[str, bool | None]] = {}
        per_round: dict[str, dict[str, float]] = {}
        mono: dict[str, bool | None] = {}
        for (prob, fam), g in groups:
            g = by_level(g)
            name = f"{prob}/{fam}"
            bpr = g["bits_per_round"].to_numpy(dtype=np.float64)
            mono[name] = increasing(g["level"].tolist(), bpr.tolist())
            per_round[name] = dict(zip(g["compressor"], bpr.tolist(), strict=True))
            rhos[name] = rank_correlation(g["level"].tolist(), g["rounds"].tolist())
            at, inner = optimum(g)
            shown = at[0] if at else "none"
            if len(at) > 1:
                shown += f" (tied with {', '.join(at[1:])})"
            optima[name] = (shown, inner)
        verdicts = list(mono.values())
        out.append(
            Claim(
                "more compression → fewer bits per round",
                ", ".join(f"{k}: {_monotone_text(v, per_round[k])}" for k, v in mono.items()),
                "bits/round strictly increasing with the level in every family",
                False if False in verdicts else None if None in verdicts else True,
                {"bits_per_round": per_round},
            )
        )
        out.append(
            Claim(
                "more compression → more rounds to ε",
                ", ".join(f"{k}: ρ={fmt(v)}" for k, v in rhos.items()),
                f"Spearman ρ(level, rounds) ≤ {params['rank_max']:g} in every family",
                all(v == v and v <= params["rank_max"] for v in rhos.values()),
                {"rho": rhos},
            )
        )
        judged = {k: v for k, v in optima.items() if k.split("/")[1] in params["optimum_families"]}
        others = {k: v for k, v in optima.items() if k not in judged}
        inner_all = [inner for _, inner in judged.values()]
        interior: bool | None = (
            None if not judged or (None in inner_all and False not in inner_all) else all(inner_all)
        )
        bits_to_eps = {
            f"{p}/{f}": dict(zip(g["compressor"], g["bits"], strict=True)) for (p, f), g in groups
        }
        out.append(
            Claim(
                "the total bits to ε have an interior optimum over the quantization level",
                ", ".join(
                    f"{k}: min at {c}" + (" (no identity run)" if inner is None else "")
                    for k, (c, inner) in judged.items()
                )
                or "no such family",
                "the minimum is neither the most compressed level nor identity",
                interior,
                {"bits_to_eps": {k: bits_to_eps[k] for k in judged}},
            )
        )
        if others:
            out.append(
                Claim(
                    "(for reference) where the optimum lies for sparsifiers",
                    ", ".join(f"{k}: min at {c}" for k, (c, _) in others.items()),
                    "no verdict: ≈ linear in k at the DCGD theory step",
                    None,
                    {"bits_to_eps": {k: bits_to_eps[k] for k in others}},
                )
            )
    f = floors(table, params)
    noisy = f[f["problem"] == params["floor_problem"]] if not f.empty else f
    zero = f[f["problem"] == params["zero_problem"]] if not f.empty else f
    if len(noisy) >= 2:
        go = noisy["gamma_omega"].to_numpy(dtype=np.float64)
        fl = noisy["floor"].to_numpy(dtype=np.float64)
        # a floor that is no result (inf: the median run diverged or made no progress), NaN or
        # not positive has no logarithm: the slope is not measured (it fails), not fitted
        # through the rows a diverged run logged before its blow-up
        ok = np.isfinite(fl) & (fl > 0) & np.isfinite(go) & (go > 0)
        x = np.log(go, where=ok, out=np.zeros_like(go))
        y = np.log(fl, where=ok, out=np.zeros_like(fl))
        slope = float(np.polyfit(x, y, 1)[0]) if ok.all() and np.ptp(x) > 0 else math.nan
        bad = noisy[~ok]
        missing = (
            "; no floor (no result or not positive) at "
            + ", ".join(
                f"{c} {s}" for c, s in zip(bad["compressor"], bad["stepsize_spec"], strict=True)
            )
            if len(bad)
            else ""
        )
        lo, hi = params["slope_range"]
        out.append(
            Claim(
                "DCGD's error floor grows in proportion to γω when ∇f_i(x*) ≠ 0",
                f"log-log slope of the floor vs γω = {fmt(slope)} over {len(noisy)} (γ, ω) pairs "
                f"(γω from {fmt(float(noisy['gamma_omega'].min()))} to "
                f"{fmt(float(noisy['gamma_omega'].max()))}){missing}",
                f"slope in [{lo:g}, {hi:g}]",
                bool(lo <= slope <= hi),
                {
                    "slope": slope,
                    "floors": noisy[["compressor", "stepsize_spec", "floor"]].to_dict("records"),
                },
            )
        )
    else:
        out.append(
            Claim("the error floor grows with γω", "fewer than 2 fixed-step runs", "—", None)
        )
    if len(noisy) and len(zero):
        # a NaN ratio (a run that is no result, or too few rows) fails the claim: not skipped
        contract = float(zero["contraction"].max(skipna=False))
        stall = float(noisy["stall"].min(skipna=False))
        why = "nan: a run diverged, made no progress or logged too few rows"
        if math.isnan(contract):
            zero_text = f"zero residuals: {why}"
        elif contract == 0:
            zero_text = "every zero-residual run reached the stopping tolerance"
        else:
            zero_text = f"zero residuals ≤ {fmt(contract)} (still contracting)"
        noisy_text = f"noisy: {why}" if math.isnan(stall) else f"noisy ≥ {fmt(stall)} (stalled)"
        out.append(
            Claim(
                "the floor disappears when every ∇f_i(x*) = 0",
                f"late/mid-run mean ‖∇f‖²: {zero_text}; {noisy_text}",
                f"≤ {params['contract_max']:g} and ≥ {params['stall_min']:g}",
                bool(contract <= params["contract_max"] and stall >= params["stall_min"]),
                {"zero_residual_contraction": contract, "noisy_stall": stall},
            )
        )
    else:  # an arm is missing: say so (n/a) rather than leave the claim out
        out.append(
            Claim(
                "the floor disappears when every ∇f_i(x*) = 0",
                f"needs fixed-step runs on both {params['floor_problem']} and "
                f"{params['zero_problem']}",
                "—",
                None,
            )
        )
    return out


def _monotone_text(verdict: bool | None, per_round: Mapping[str, float]) -> str:
    """How a family's bits/round read: a level whose every run completed no round (NaN) is
    named as having no result."""
    unknown = ", ".join(c for c, v in per_round.items() if math.isnan(v))
    text = "monotone" if verdict else "not monotone" if verdict is False else "n/a"
    return f"{text} (no round completed: {unknown})" if unknown else text


def figures(table: pd.DataFrame, params: Mapping[str, Any], directory: Path) -> list[Path]:
    """Total bits to ε against the level, one panel per family; the floor against γω."""
    from matplotlib.figure import Figure

    t = tradeoff(table, params)
    f = floors(table, params)
    families = list(dict.fromkeys(t["family"])) if not t.empty else []
    fig = Figure(figsize=(3.4 * (len(families) + 1), 3.4), layout="constrained")
    axes = fig.subplots(1, len(families) + 1, squeeze=False)[0]
    for ax, fam in zip(axes, families, strict=False):
        sub = t[t["family"] == fam]
        # one x position per level of any problem: a problem without a level's runs leaves a
        # gap instead of shifting its points under another level's name
        order = list(dict.fromkeys(by_level(sub)["compressor"]))
        for prob, g in sub.groupby("problem", sort=False):
            g = by_level(g)
            xs = [order.index(c) for c in g["compressor"]]
            ax.plot(xs, g["bits"] / g["bits"].min(), "o-", label=str(prob))
        names = [c.replace("identity", "id") for c in order]
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("total bits to ε ÷ the best level", fontsize=8)
        ax.set_title(f"[K18] {fam}: total bits to ε", fontsize=9)
        ax.legend(fontsize=6)
    ax = axes[-1]
    if not f.empty:
        for prob, g in f.groupby("problem", sort=False):
            y = g["floor"] / g["g0"]
            label = str(prob)
            if prob == params["zero_problem"]:
                y, label = g["final"] / g["g0"], f"{label} (final value)"
            ax.loglog(g["gamma_omega"], y, "o", label=label)
    ax.set_xlabel("γω", fontsize=8)
    ax.set_ylabel("floor of ‖∇f‖² ÷ ‖∇f(x⁰)‖²", fontsize=8)
    if f.empty:
        ax.text(0.5, 0.5, "no fixed-step runs", transform=ax.transAxes, ha="center", fontsize=7)
    else:
        ax.legend(fontsize=6)
    ax.set_title("[K18] DCGD error floor vs γω", fontsize=9)
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "pdf"):
        p = directory / f"tradeoff_and_floor.{ext}"
        fig.savefig(p, dpi=FIGURE_DPI)
        paths.append(p)
    return paths


REPRODUCTIONS.register(
    Reproduction(
        name="k18-quantizers",
        title="DCGD with unbiased quantizers: the communication trade-off",
        paper="[K18]",
        config="k18-quantizers.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(PlotSpec("bits", "grad_norm_sq"),),
        figures=figures,
    )
)
