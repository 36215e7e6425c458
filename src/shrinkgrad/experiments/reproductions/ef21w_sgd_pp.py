"""``ef21w-sgd-pp``: [EFR] Fig. 2 — the weighted step also helps EF21-SGD and EF21-PP.

Claim ([EFR] §3.1–3.2, Fig. 2): EF21-W-SGD and EF21-W-PP (p = 0.5), whose step sizes use L_AM
where EF21-SGD and EF21-PP use L_QM, reach a given ‖∇f‖² with fewer bits per client, by much
where L_var is large (AUSTRALIAN) and little where it is small (W1A).

Measured per variant (a baseline/weighted pair) and dataset: ε = the largest final ‖∇f‖² of
any run of the pair (every run reaches it); R = median-over-seeds bits/n of the baseline to ε ÷
that of the weighted method. Claims, per variant: R ≥ ``big_gain`` on the dataset with the
largest L_QM/L_AM; R is larger there than on the dataset with the smallest L_QM/L_AM; and
overall the weighted methods are never worse (R ≥ 1 − ``slack``).

The datasets are those of the table (the largest and smallest L_QM/L_AM are read from every
run's constants, not from the runs of one pair). A run that diverged or made no progress reaches
nothing: a method whose every run on a dataset is such has R = 0 or inf there, both methods
R = NaN, which fails the claims that need it. A pair without runs of one of its methods on a
dataset (a sweep cut short, a failed run) measures nothing there: the claims that need that
dataset read n/a (FAIL when another measurement fails them), never pass, and a pair without any
run keeps its claims, n/a. Datasets tied in L_QM/L_AM are all "the largest" (each must show the
gain and beat each of the smallest); the table's row order chooses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from ..claims import Claim, fmt
from . import REPRODUCTIONS, PlotSpec, Reproduction
from .common import ef21w_ratios, problem_constants

DEFAULTS: dict[str, Any] = {
    "pairs": [["ef21_sgd[b=1]", "ef21_w_sgd[b=1]"], ["ef21_pp[p=0.5]", "ef21_w_pp[p=0.5]"]],
    "compressor": "top_k[k=1]",
    "big_gain": 2.0,
    "slack": 0.03,
}


def _every(oks: Sequence[bool | None]) -> bool | None:
    """A verdict over parts: False when one fails, else None when one was not measured (or
    there is none), else True."""
    if any(o is False for o in oks):
        return False
    return None if not oks or any(o is None for o in oks) else True


def ratios(table: pd.DataFrame, base: str, imp: str, comp: str) -> pd.DataFrame:
    """One row per dataset of the table (sorted by L_QM/L_AM, then label): problem, QM/AM,
    L_var, ε and the ratio R of :func:`~.common.ef21w_ratios`, and ``missing``: the methods of
    the pair without a run with ``comp`` there ("" when both ran; R is then NaN and means
    nothing was measured, where a NaN R with both methods present means every run was no
    result)."""
    measured = ef21w_ratios(table, base, imp, comp)
    by_problem = {str(r["problem"]): r for _, r in measured.iterrows()}
    ran = table[table["compressor"] == comp].groupby("problem_label", sort=False)["method"]
    present = {str(k): set(v) for k, v in ran.unique().items()}
    rows = []
    for label, c in problem_constants(table).items():
        missing = [x for x in (base, imp) if x not in present.get(label, set())]
        r = by_problem.get(label)
        rows.append(
            {
                "problem": label,
                "QM/AM": float(c["L_QM"]) / float(c["L_AM"]),
                "L_var": float(c["L_var"]),
                "eps": math.nan if r is None else float(r["eps"]),
                "ratio": math.nan if r is None or missing else float(r["ratio"]),
                "missing": ", ".join(missing),
            }
        )
    cols = ["problem", "QM/AM", "L_var", "eps", "ratio", "missing"]
    frame = pd.DataFrame(rows, columns=cols)
    return frame.sort_values(["QM/AM", "problem"], kind="stable").reset_index(drop=True)


def _shown(r: pd.Series) -> str:
    """A dataset's ratio, or what it lacks."""
    return f"{r['problem']}: " + (f"no runs of {r['missing']}" if r["missing"] else fmt(r["ratio"]))


def _at_least(r: pd.Series, bound: float) -> bool | None:
    """R ≥ bound on one dataset: None when a method has no run there, False for a NaN R."""
    return None if r["missing"] else bool(r["ratio"] >= bound)


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    out: list[Claim] = []
    every: list[pd.Series] = []  # every (pair, dataset): for "never worse"
    pairs: Sequence[Sequence[str]] = params["pairs"]
    big, slack = float(params["big_gain"]), float(params["slack"])
    for base, imp in pairs:
        title_1 = f"{imp} needs fewer bits/n than {base} to reach ε where L_var is large"
        title_2 = f"{imp}'s advantage is larger where L_var is larger"
        m = ratios(table, base, imp, params["compressor"]) if len(table) else pd.DataFrame()
        every += [r for _, r in m.iterrows()]
        if m.empty or (m["missing"] != "").all():
            none = f"no runs of {base} and {imp} with {params['compressor']}"
            out += [Claim(title_1, none, "—", None), Claim(title_2, none, "—", None)]
            continue
        qm = m["QM/AM"]
        top = m[qm == qm.max()]
        bottom = m[qm == qm.min()]
        if len(m) < 2:
            out.append(
                Claim(
                    title_1 + f" ({top['problem'].iloc[0]})",
                    f"one dataset only ({_shown(top.iloc[0])}): no large L_var to tell",
                    f"≥ {big:g}",
                    None,
                )
            )
        else:
            ok_1 = [_at_least(r, big) for _, r in top.iterrows()]
            # the worst of the largest L_QM/L_AM (a NaN R first): what the verdict rests on
            worst = top.sort_values("ratio", na_position="first", kind="stable").iloc[0]
            out.append(
                Claim(
                    title_1
                    + " ("
                    + ", ".join(
                        f"{r['problem']}, L_var={r['L_var']:.3g}" for _, r in top.iterrows()
                    )
                    + ")",
                    "bits ratio = " + ", ".join(_shown(r) for _, r in top.iterrows()),
                    f"≥ {big:g}",
                    _every(ok_1),
                    {"ratio": worst["ratio"], "eps": worst["eps"], "problem": worst["problem"]},
                )
            )
        if qm.max() == qm.min():
            ok_2: list[bool | None] = [None]
            text = "no two datasets differ in L_QM/L_AM: " + ", ".join(
                _shown(r) for _, r in m.iterrows()
            )
        else:
            # each of the largest L_QM/L_AM beats each of the smallest (a NaN R fails)
            ok_2 = [
                None if hi["missing"] or lo["missing"] else bool(hi["ratio"] > lo["ratio"])
                for _, hi in top.iterrows()
                for _, lo in bottom.iterrows()
            ]
            text = (
                ", ".join(_shown(r) for _, r in top.iterrows())
                + " vs "
                + ", ".join(_shown(r) for _, r in bottom.iterrows())
            )
        out.append(
            Claim(
                title_2,
                text,
                "first > second",
                _every(ok_2),
                {r["problem"]: r["ratio"] for _, r in m.iterrows()},
            )
        )
    measured = [r for r in every if not r["missing"]]
    low = float(pd.Series([r["ratio"] for r in measured], dtype="float64").min(skipna=False))
    lacking = sorted({f"{r['problem']} ({r['missing']})" for r in every if r["missing"]})
    out.append(
        Claim(
            "the weighted variants are never worse",
            f"min ratio over variants and datasets = {fmt(low)}"
            + (f"; no runs on {', '.join(lacking)}" if lacking else ""),
            f"≥ {1 - slack:g}",
            _every([_at_least(r, 1 - slack) for r in every]),
            {"min_ratio": low},
        )
    )
    return out


REPRODUCTIONS.register(
    Reproduction(
        name="ef21w-sgd-pp",
        title="EF21-SGD/-PP vs EF21-W-SGD/-W-PP, Top-1",
        paper="[EFR] Fig. 2",
        config="ef21w-sgd-pp.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(PlotSpec("bits_paper", "grad_norm_sq"),),
    )
)
