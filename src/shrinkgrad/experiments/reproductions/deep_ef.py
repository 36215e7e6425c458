"""``deep-ef``: error feedback on neural networks — [EF21] §5 (deep learning) and [FTR23].

Set-up (the config says which): an MLP on a9a and the small CNN on scikit-learn's digits, n = 20
clients split by label (every client sees one class, or two), Top-k with k ≈ 5% of d. Full
gradients: uncompressed GD, Top-k without feedback (``dcgd[biased=true]``), classic EF [S14]
and EF21.
Minibatches (b per client and round): uncompressed SGD (``ef21_sgd`` with the identity
compressor, which is exactly minibatch SGD), EF21-SGD and EF21-SGDM [FTR23] with Top-k. Every
method runs at every step size of its grid and is tuned: its step is the one with the lowest
median final training loss over the seeds (a seed = a network initialisation and held-out
split, paired across methods). Comparisons use the paired differences over seeds, mean ± SE.

Claims, written before the runs:

1. [EF21] §5: EF21 matches or beats classic EF at equal bits (same Top-k; EF21 taken at the
   bits per client EF used in all, since EF21's initialisation sends one full vector): the mean
   paired difference of the training loss, EF21 − EF, is ≤ z·SE on every problem;
2. the same for held-out accuracy: EF21 − EF ≥ −z·SE (needs the ``test_accuracy`` column);
3. error feedback fixes biased compression: Top-k without feedback ends with a higher training
   loss than EF21, by more than z·SE, on every problem;
4. compression pays: uncompressed GD needs more bits per client than EF21 to reach EF21's final
   training loss (median over seeds of the ratio > 1 on every problem);
5. [FTR23]: momentum closes the gap to uncompressed SGD: where EF21-SGD's gap to SGD (final
   training loss) is significant (> z·SE), EF21-SGDM's gap is at most ``gap_fraction`` of it;
6. the tuning is honest: every method's tuned step lies inside its grid, not at an end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..claims import Claim, fmt, median, no_result, reach, runs_of
from . import REPRODUCTIONS, PlotSpec, Reproduction

DEFAULTS: dict[str, Any] = {
    "ef21": "ef21",
    "ef": "ef",
    "no_feedback": "dcgd[biased=true]",
    "gd": "gd",
    "sgd": "ef21_sgd[b=16]",
    "sgdm": "ef21_sgdm[beta=0.9,b=16]",
    "z": 2.0,
    "gap_fraction": 0.5,
}

Record = dict[str, Any]


def _canonical(name: str) -> str:
    from ...methods import make_method

    try:
        return make_method(name).name
    except (ValueError, TypeError):  # not registered (yet): compare the text as given
        return name


def records(table: pd.DataFrame) -> list[Record]:
    """One record per run: case, seed, method, whether compressed, step, final values.

    A run that is not a result — it diverged or made no progress (:func:`no_result`: a
    ``no_progress`` run's last loss, above its start, is no final loss), or its last loss is
    not finite — has loss inf and accuracy NaN: it is never the tuned step, and a claim cannot
    pass on its numbers.
    """
    from ...registry import parse_spec

    out = []
    has_acc = "test_accuracy" in table.columns
    for keys, run in runs_of(table):
        last = run.iloc[-1]
        label = str(keys["problem_label"])
        params = dict(parse_spec(str(last["problem_spec"])).params)
        loss = float(last["loss"])
        result = not no_result(run) and math.isfinite(loss)
        out.append(
            {
                "case": label.split(",seed=")[0],
                "seed": int(params.get("seed", 0)),
                "method": str(keys["method"]),
                "compressed": str(keys["compressor"]) != "identity",
                "step": float(last["stepsize"]),
                "loss": loss if result else math.inf,
                "acc": float(last["test_accuracy"]) if has_acc and result else math.nan,
                "bits": float(last["bits_up_paper"]),
                "run": run,
            }
        )
    return out


def tuned(
    recs: list[Record], case: str, method: str, compressed: bool
) -> tuple[float, dict[int, Record], list[float]] | None:
    """(tuned step, seed → record at that step, the grid) of one method on one case."""
    mine = [
        r
        for r in recs
        if r["case"] == case and r["method"] == method and r["compressed"] == compressed
    ]
    if not mine:
        return None
    grid = sorted({r["step"] for r in mine})
    score = {s: median(r["loss"] for r in mine if r["step"] == s) for s in grid}
    best = min(grid, key=lambda s: (score[s], s))
    return best, {r["seed"]: r for r in mine if r["step"] == best}, grid


def paired(a: dict[int, Record], b: dict[int, Record], key: str) -> tuple[float, float, int]:
    """Mean and standard error of a[s][key] − b[s][key] over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    d = np.array([a[s][key] - b[s][key] for s in seeds], dtype=np.float64)
    if d.size == 0 or not np.all(np.isfinite(d)):
        return (math.nan if d.size == 0 else float(np.mean(d))), math.nan, int(d.size)
    se = float(np.std(d, ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
    return float(np.mean(d)), se, int(d.size)


def _pm(mean: float, se: float, n: int) -> str:
    return f"Δ = {fmt(mean)} ± {fmt(se)} ({n} seeds)"


def _every(oks: list[bool | None]) -> bool | None:
    """The verdict of a claim "on every problem": False when a problem fails it, else None when
    a problem could not be measured, else True."""
    if any(o is False for o in oks):
        return False
    return None if any(o is None for o in oks) else True


def _lost(new: dict[int, Record], old: dict[int, Record]) -> list[int]:
    """The seeds on which ``new`` is no result (diverged, no progress) and ``old`` is one."""
    return [
        s
        for s in sorted(set(new) & set(old))
        if math.isinf(new[s]["loss"]) and math.isfinite(old[s]["loss"])
    ]


_NO_RESULT = "diverged or made no progress"


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    recs = records(table)
    z = float(params["z"])
    names = {
        k: _canonical(str(params[k])) for k in ("ef21", "ef", "no_feedback", "gd", "sgd", "sgdm")
    }
    cases = list(dict.fromkeys(r["case"] for r in recs))
    best: dict[tuple[str, str, bool], tuple[float, dict[int, Record], list[float]]] = {}
    for case in cases:
        for method, compressed in {
            (r["method"], r["compressed"]) for r in recs if r["case"] == case
        }:
            t = tuned(recs, case, method, compressed)
            if t is not None:
                best[(case, method, compressed)] = t

    def get(case: str, role: str, compressed: bool = True) -> dict[int, Record] | None:
        t = best.get((case, names[role], compressed))
        return None if t is None else t[1]

    out: list[Claim] = []
    out.append(_versus(cases, get, "ef21", "ef", "loss", z, better="lower"))
    out.append(_versus(cases, get, "ef21", "ef", "acc", z, better="higher"))
    out.append(_beats(cases, get, z))
    out.append(_compression_pays(cases, get))
    out.append(_gap(cases, get, z, float(params["gap_fraction"])))
    out.append(_interior(best, names))
    return out


def at_bits(run: pd.DataFrame, col: str, bits: float) -> float:
    """``col`` of ``run`` at ``bits`` bits/n (papers' axis), linearly interpolated between rows."""
    xs = run["bits_up_paper"].to_numpy(dtype=np.float64)
    ys = run[col].to_numpy(dtype=np.float64)
    return float(np.interp(bits, xs, ys))


def _versus(
    cases: list[str], get: Any, new: str, old: str, key: str, z: float, better: str
) -> Claim:
    """EF21 at the bits EF used in all (EF21's init sends one full vector more) vs EF."""
    col = "loss" if key == "loss" else "test_accuracy"
    what = "final training loss" if key == "loss" else "held-out accuracy"
    title = f"EF21 matches or beats classic EF at equal bits ({what}, both tuned)"
    parts, oks = [], []
    for case in cases:
        a, b = get(case, new), get(case, old)
        if not a or not b or (key == "acc" and col not in next(iter(a.values()))["run"]):
            continue
        at = {
            s: {
                key: at_bits(a[s]["run"], col, b[s]["bits"])
                if math.isfinite(a[s]["loss"])
                else (math.inf if key == "loss" else math.nan)
            }
            for s in sorted(set(a) & set(b))
        }
        mean, se, n = paired(at, b, key)
        lost = _lost(a, b)
        ok = mean <= z * se if better == "lower" else mean >= -z * se
        # EF21 no result where EF is one: it does not match EF (whatever the other seeds say)
        oks.append(False if lost else bool(ok) if math.isfinite(se) else None)
        va, vb = median(v[key] for v in at.values()), median(b[s][key] for s in at)
        note = f"; EF21 {_NO_RESULT} on {len(lost)}" if lost else ""
        parts.append(f"{case}: EF21 {fmt(va)} vs EF {fmt(vb)}, {_pm(mean, se, n)}{note}")
    if not parts:
        why = "no test_accuracy column, or no runs of both" if key == "acc" else "no runs of both"
        return Claim(title, why, "—", None)
    crit = (
        f"EF21 − EF ≤ {z:g}·SE on every problem"
        if better == "lower"
        else f"EF21 − EF ≥ −{z:g}·SE on every problem"
    )
    return Claim(title, "; ".join(parts), crit, _every(oks))


def _beats(cases: list[str], get: Any, z: float) -> Claim:
    title = "error feedback fixes biased Top-k: no feedback ends higher than EF21"
    parts, oks = [], []
    for case in cases:
        a, b = get(case, "no_feedback"), get(case, "ef21")
        if not a or not b:
            continue
        mean, se, n = paired(a, b, "loss")
        lost = _lost(b, a)  # EF21 no result where no feedback is one: it does not end lower
        oks.append(False if lost else bool(mean > z * se) if math.isfinite(se) else None)
        note = f" (EF21 {_NO_RESULT} on {len(lost)})" if lost else ""
        parts.append(f"{case}: no feedback − EF21 {_pm(mean, se, n)}{note}")
    if not parts:
        return Claim(title, "no runs of both", "—", None)
    return Claim(title, "; ".join(parts), f"> {z:g}·SE on every problem", _every(oks))


def _compression_pays(cases: list[str], get: Any) -> Claim:
    title = "compression pays: GD needs more bits/n than EF21 to reach EF21's final loss"
    parts, oks = [], []
    for case in cases:
        gd, ef21 = get(case, "gd", compressed=False), get(case, "ef21")
        if not gd or not ef21:
            continue
        ratios, bounds, lost = [], [], 0
        for s in sorted(set(gd) & set(ef21)):
            e = ef21[s]
            if math.isinf(e["loss"]):  # EF21 no result: no loss to reach, compression lost
                lost += 1
                ratios.append(0.0)
                bounds.append(0.0)
                continue
            bits_gd = reach(gd[s]["run"], e["loss"], x="bits_up_paper", y="loss")
            ratios.append(bits_gd / e["bits"] if e["bits"] > 0 else math.nan)
            bounds.append(gd[s]["bits"] / e["bits"] if e["bits"] > 0 else math.nan)
        r = median(ratios)
        oks.append(bool(r > 1))
        if math.isinf(r):  # GD does not get there in its run: its total bits are a lower bound
            parts.append(
                f"{case}: bits GD/EF21 > {fmt(median(bounds))} (GD does not reach EF21's final "
                f"loss in its run, {len(ratios)} seeds)"
            )
        else:
            note = f"; EF21 {_NO_RESULT} on {lost}" if lost else ""
            parts.append(f"{case}: bits GD/EF21 = {fmt(r)} ({len(ratios)} seeds{note})")
    if not parts:
        return Claim(title, "no runs of both", "—", None)
    return Claim(title, "; ".join(parts), "median ratio > 1 on every problem", all(oks))


def _gap(cases: list[str], get: Any, z: float, fraction: float) -> Claim:
    title = "[FTR23] momentum closes the gap to uncompressed SGD (final training loss)"
    parts, oks = [], []
    for case in cases:
        sgd = get(case, "sgd", compressed=False)
        plain, mom = get(case, "sgd"), get(case, "sgdm")
        if not sgd or not plain or not mom:
            continue
        gp, sep, n = paired(plain, sgd, "loss")
        gm, sem, _ = paired(mom, sgd, "loss")
        if gp == math.inf:  # EF21-SGD no result where SGD is one (never the reverse): a gap
            oks.append(gm < math.inf)  # closed when EF21-SGDM is a result on every seed
            parts.append(
                f"{case}: EF21-SGD {_NO_RESULT} where SGD did not ({n} seeds), "
                f"EF21-SGDM − SGD {_pm(gm, sem, n)}"
            )
            continue
        if not (math.isfinite(sep) and gp > z * sep):
            parts.append(f"{case}: no significant gap to close (EF21-SGD − SGD {_pm(gp, sep, n)})")
            continue
        oks.append(bool(gm <= fraction * gp))
        parts.append(f"{case}: EF21-SGD − SGD {_pm(gp, sep, n)}, EF21-SGDM − SGD {_pm(gm, sem, n)}")
    if not parts:
        return Claim(title, "no runs of SGD, EF21-SGD and EF21-SGDM", "—", None)
    return Claim(
        title,
        "; ".join(parts),
        f"gap(EF21-SGDM) ≤ {fraction:g}·gap(EF21-SGD) where that gap is > {z:g}·SE",
        all(oks) if oks else None,
    )


def _interior(
    best: dict[tuple[str, str, bool], tuple[float, dict[int, Record], list[float]]],
    names: Mapping[str, str],
) -> Claim:
    title = "every tuned step lies inside its grid (the grids bracket the best step)"
    edges, small = [], 0
    for (case, method, compressed), (step, _, grid) in sorted(best.items()):
        if len(grid) < 3:
            small += 1
            continue
        if step in (grid[0], grid[-1]):
            tag = "" if compressed else " (uncompressed)"
            edges.append(f"{case} {method}{tag}: {step:g} ∈ [{grid[0]:g}, {grid[-1]:g}]")
    if small == len(best):
        return Claim(title, "grids of fewer than 3 steps (a short profile)", "—", None)
    measured = "; ".join(edges) if edges else f"all {len(best) - small} interior"
    return Claim(title, measured, "no tuned step at an end of its grid", not edges)


def figures(table: pd.DataFrame, params: Mapping[str, Any], directory: Path) -> list[Path]:
    """Tuned runs only: training loss and (when recorded) held-out accuracy per round."""
    from matplotlib.figure import Figure

    recs = records(table)
    cases = list(dict.fromkeys(r["case"] for r in recs))
    has_acc = "test_accuracy" in table.columns
    rows = 2 if has_acc else 1
    fig = Figure(figsize=(4.2 * len(cases), 3.0 * rows + 0.6), layout="constrained")
    axes = np.asarray(fig.subplots(rows, len(cases), squeeze=False))
    for j, case in enumerate(cases):
        keys = sorted({(r["method"], r["compressed"]) for r in recs if r["case"] == case})
        for i, (method, compressed) in enumerate(keys):
            t = tuned(recs, case, method, compressed)
            if t is None:
                continue
            step, per_seed, _ = t
            label = f"{method}{'' if compressed else ' (no compression)'} γ={step:g}"
            for row, col in enumerate(["loss", "test_accuracy"][:rows]):
                curves = [r["run"].set_index("round")[col] for r in per_seed.values()]
                frame = pd.concat(curves, axis=1)
                ax = axes[row, j]
                ax.plot(frame.index, frame.median(axis=1), color=f"C{i % 10}", label=label, lw=1.2)
        axes[0, j].set_title(case, fontsize=9)
        axes[0, j].set_yscale("log")
        axes[0, j].set_ylabel("training loss f(xᵗ)", fontsize=8)
        if has_acc:
            axes[1, j].set_ylabel("held-out accuracy", fontsize=8)
        axes[-1, j].set_xlabel("rounds", fontsize=8)
        for ax in axes[:, j]:
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=6, ncols=3, frameon=False)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "pdf"):
        p = directory / f"tuned_curves.{ext}"
        fig.savefig(p, dpi=90)
        paths.append(p)
    return paths


REPRODUCTIONS.register(
    Reproduction(
        name="deep-ef",
        title="Error feedback on neural networks: EF21, EF, EF21-SGDM, no feedback",
        paper="[EF21] §5, [FTR23]",
        config="deep-ef.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(PlotSpec("bits_paper", "loss"),),
        figures=figures,
    )
)
