"""Measurements shared by several reproductions (all computed from the results table)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from ..claims import median, no_result, reach, runs_of

__all__ = [
    "bits_to_reach",
    "common_tolerance",
    "ef21w_ratios",
    "label",
    "problem_constants",
    "ratio",
    "step_ratio_prediction",
]


def label(index_label: object) -> Any:
    """An index label from ``Series.idxmax()``/``idxmin()``, typed for ``DataFrame.loc`` (the
    pandas stubs type the former as ``Hashable`` and the latter's key as a scalar)."""
    return index_label


def problem_constants(table: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """problem_label → its constants (n, d, L, L_AM, L_QM, L_var) as recorded in the table."""
    out: dict[str, dict[str, Any]] = {}
    cols = ["n_clients", "d", "L", "L_AM", "L_QM", "L_max", "L_var", "problem_spec"]
    for label, df in table.groupby("problem_label", sort=False):
        first = df.iloc[0]
        out[str(label)] = {c: first[c] for c in cols if c in df.columns}
    return out


def common_tolerance(table: pd.DataFrame) -> dict[str, float]:
    """problem_label → the largest final ‖∇f‖² over the table's runs on it.

    Every run reaches this tolerance, so "bits to reach ε" is finite for all of them, and the
    method that ends highest sets it (an honest common target: no method is measured at an
    accuracy it never attains). Runs that diverged or made no progress set no target (they
    reach nothing); a problem on which every run is such has none: NaN, so its ratios are NaN
    and a claim over them fails, instead of the problem dropping out of the measurement. A run
    whose last ‖∇f‖² is NaN makes the target NaN (its last value, not its last finite one: no
    run reaches a NaN target).
    """
    out: dict[str, float] = {}
    for label, df in table.groupby("problem_label", sort=False):
        finals = [
            float(run["grad_norm_sq"].iloc[-1]) for _, run in runs_of(df) if not no_result(run)
        ]
        out[str(label)] = float(np.max(finals)) if finals else math.nan  # np.max keeps a NaN
    return out


def bits_to_reach(
    table: pd.DataFrame,
    eps: Mapping[str, float],
    *,
    x: str = "bits_up_paper",
    where: Mapping[str, Any] | None = None,
) -> dict[tuple[str, str], float]:
    """(problem_label, method) → median over seeds of the first ``x`` with ‖∇f‖² ≤ eps[problem].

    ``where`` restricts the runs (e.g. ``{"compressor": "top_k[k=1]"}``).
    """
    per: dict[tuple[str, str], list[float]] = {}
    for keys, run in runs_of(table):
        if where and any(keys.get(k, run.iloc[0].get(k)) != v for k, v in where.items()):
            continue
        label = str(keys["problem_label"])
        if label not in eps:
            continue
        per.setdefault((label, str(keys["method"])), []).append(reach(run, eps[label], x=x))
    return {k: median(v) for k, v in per.items()}


def ef21w_ratios(table: pd.DataFrame, base: str, imp: str, comp: str) -> pd.DataFrame:
    """Per problem: L_var, L_QM/L_AM, ε, bits/n of ``base`` and ``imp`` to ε, their ratio, and
    the predicted ratio (L + L_QM ξ)/(L + L_AM ξ).

    ε is the largest final ‖∇f‖² of any run of the two methods (:func:`common_tolerance`), so
    every run reaches it; bits are on the papers' axis (``bits_up_paper``), median over seeds.
    Problems without runs of the pair have no ε and no row; a problem on which every run of the
    pair diverged or made no progress has a row with ε and ratio NaN (a missing measurement).
    """
    consts = problem_constants(table)
    sub = table[table["method"].isin([base, imp]) & (table["compressor"] == comp)]
    eps = common_tolerance(sub)
    bits = bits_to_reach(sub, eps)
    rows = []
    for label, c in consts.items():
        if label not in eps:
            continue
        b0, b1 = bits.get((label, base), math.nan), bits.get((label, imp), math.nan)
        rows.append(
            {
                "problem": label,
                "L_var": float(c["L_var"]),
                "QM/AM": float(c["L_QM"]) / float(c["L_AM"]),
                "eps": eps[label],
                "bits_base": b0,
                "bits_improved": b1,
                "ratio": ratio(b0, b1),
                "predicted": step_ratio_prediction(c, comp),
            }
        )
    return pd.DataFrame(rows)


def step_ratio_prediction(constants: Mapping[str, Any], compressor: str) -> float:
    """(L + L_QM ξ(α))/(L + L_AM ξ(α)): the [EFR] ratio of the γ_AM and γ_QM step sizes."""
    from ...compressors import make_compressor
    from ...theory import xi

    d = int(constants["d"])
    alpha = float(make_compressor(compressor).alpha(d))
    x = xi(alpha)
    L, am, qm = (float(constants[k]) for k in ("L", "L_AM", "L_QM"))
    return (L + qm * x) / (L + am * x)


def ratio(a: float, b: float) -> float:
    """a / b with inf and zero handled: inf when only ``b`` is reached (finite), 0 when only
    ``a`` is (the improved method never reached ε: infinitely worse, which a "never worse"
    claim must see, not skip), nan when undefined (neither, or a missing run)."""
    if math.isfinite(a) and math.isinf(b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.inf if math.isinf(a) and math.isfinite(b) else math.nan
    return a / b
