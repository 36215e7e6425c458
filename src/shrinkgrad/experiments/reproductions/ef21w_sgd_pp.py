"""``ef21w-sgd-pp``: [EFR] Fig. 2 — the weighted step also helps EF21-SGD and EF21-PP.

Claim ([EFR] §3.1–3.2, Fig. 2): EF21-W-SGD and EF21-W-PP (p = 0.5), whose step sizes use L_AM
where EF21-SGD and EF21-PP use L_QM, reach a given ‖∇f‖² with fewer bits per client, by much
where L_var is large (AUSTRALIAN) and little where it is small (W1A).

Measured per variant (a baseline/weighted pair) and dataset: ε = the largest final ‖∇f‖² of
any run of the pair (every run reaches it); R = median-over-seeds bits/n of the baseline to ε ÷
that of the weighted method. Claims, per variant: R ≥ ``big_gain`` on the dataset with the
largest L_QM/L_AM; R is larger there than on the dataset with the smallest L_QM/L_AM; and
overall the weighted methods are never worse (R ≥ 1 − ``slack``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from ..claims import Claim, fmt
from . import REPRODUCTIONS, PlotSpec, Reproduction
from .common import ef21w_ratios
from .common import label as _label

DEFAULTS: dict[str, Any] = {
    "pairs": [["ef21_sgd[b=1]", "ef21_w_sgd[b=1]"], ["ef21_pp[p=0.5]", "ef21_w_pp[p=0.5]"]],
    "compressor": "top_k[k=1]",
    "big_gain": 2.0,
    "slack": 0.03,
}


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    out: list[Claim] = []
    lows: list[float] = []
    pairs: Sequence[Sequence[str]] = params["pairs"]
    for base, imp in pairs:
        m = ef21w_ratios(table, base, imp, params["compressor"])
        if m.empty:
            out.append(Claim(f"{imp} beats {base}", "no runs of this pair", "—", None))
            continue
        lows.append(float(m["ratio"].min(skipna=False)))
        hi = m.loc[_label(m["QM/AM"].idxmax())]
        lo = m.loc[_label(m["QM/AM"].idxmin())]
        out.append(
            Claim(
                f"{imp} needs fewer bits/n than {base} to reach ε where L_var is large "
                f"({hi['problem']}, L_var={hi['L_var']:.3g})",
                f"bits ratio = {fmt(hi['ratio'])}",
                f"≥ {params['big_gain']:g}",
                bool(hi["ratio"] >= params["big_gain"]),
                {"ratio": hi["ratio"], "eps": hi["eps"]},
            )
        )
        out.append(
            Claim(
                f"{imp}'s advantage is larger where L_var is larger",
                f"{hi['problem']}: {fmt(hi['ratio'])} vs {lo['problem']}: {fmt(lo['ratio'])}",
                "first > second",
                None if len(m) < 2 else bool(hi["ratio"] > lo["ratio"]),
                {r["problem"]: r["ratio"] for _, r in m.iterrows()},
            )
        )
    if lows:
        low = float(pd.Series(lows).min(skipna=False))  # (Python's min() may drop a nan)
        out.append(
            Claim(
                "the weighted variants are never worse",
                f"min ratio over variants and datasets = {fmt(low)}",
                f"≥ {1 - params['slack']:g}",
                bool(low >= 1 - params["slack"]),
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
