"""Convergence figures as pure functions of a results table (design.md principle 11).

:func:`aggregate` turns the per-seed rows of a results table into one curve per panel ×
method × compressor × step size: the median over seeds and a quantile band, on the union of
the seeds' x values (each seed's curve is interpolated — log-linearly for positive y — only
inside its own x range, so a run that stopped early contributes only where it has data).

Diverged runs (``status == "diverged"``) and runs that made no progress (``status ==
"no_progress"``: they ended above their starting loss, docs/experiments.md) never make a curve
look good: they are left out of the median of the other seeds (the legend counts them), and a
curve whose every seed diverged or made no progress is drawn thin, grey and dotted, ending in a
cross, with "diverged" / "no progress" in the legend, and does not count for the y-limits
(unless every curve of the panel is such a curve: the panel keeps its log axis, fitted to them).

:func:`plot_results` draws them like the papers' figures: one panel per problem (``facet``),
log-scale y for positive metrics, one legend per figure made of the canonical spec strings with
the step-size rule, a colour per curve and a line style per method, readable ticks on short log
axes, y-limits that ignore numerical floors, and L_var, L_QM/L_AM in each panel's title
(:mod:`.style`). Nothing here reads files or global state: the same table gives the same figure.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

from .axes import X_AXES, Y_AXES, axis_of
from .style import (
    FIGURE_DPI,
    curve_styles,
    number_text,
    readable_log_ticks,
    save_figure,
    stepsize_text,
    y_limits,
)

__all__ = ["CURVE_KEYS", "X_AXES", "Y_AXES", "aggregate", "curve_label", "plot_results"]

#: what distinguishes one curve from another within a panel
CURVE_KEYS = ("method", "compressor", "stepsize_spec")
#: the default panel column; a table without it is drawn in one panel
DEFAULT_FACET = "problem_label"
#: the column of a sweep over networks (``run.network``): its curves are told apart by it
NETWORK = "network"
#: the value of ``status`` that marks a diverged run
DIVERGED = "diverged"
#: the value of ``status`` that marks a run that ended above its starting loss
NO_PROGRESS = "no_progress"


def _column(name: str, axes: dict[str, str], table: pd.DataFrame, what: str) -> str:
    col = axes.get(name, name)
    if col not in table.columns:
        have = [k for k, c in axes.items() if c in table.columns]
        hint = " (the problem has no held-out part)" if col.startswith("test_") else ""
        raise ValueError(
            f"cannot plot {what}={name!r}: the results table has no column {col!r}{hint}; use "
            "one of " + ", ".join(have or list(axes))
        )
    if not pd.api.types.is_numeric_dtype(table[col]):
        raise ValueError(f"cannot plot {what}={name!r}: column {col!r} is not numeric")
    return col


def _facet(table: pd.DataFrame, facet: str | None) -> str | None:
    """The panel column, checked: None for one panel (also for a missing default)."""
    if facet is None or facet == "none":
        return None
    if facet not in table.columns:
        if facet == DEFAULT_FACET:
            return None
        raise ValueError(
            f"cannot facet by {facet!r}: the results table has no such column; use none or one "
            "of " + ", ".join(map(str, table.columns))
        )
    return facet


def _curve_keys(table: pd.DataFrame, facet: str | None) -> list[str]:
    """The columns that tell the curves of one panel apart: :data:`CURVE_KEYS` but the facet,
    and the problem when the panels are not the problems (curves never mix problems)."""
    keys = [k for k in CURVE_KEYS if k != facet]
    if (
        facet != DEFAULT_FACET
        and DEFAULT_FACET in table.columns
        and table[DEFAULT_FACET].nunique(dropna=False) > 1
    ):
        keys.insert(0, DEFAULT_FACET)
    if facet != NETWORK and NETWORK in table.columns and table[NETWORK].nunique() > 1:
        keys.append(NETWORK)  # a sweep over networks: one curve per network
    return keys


def _run_column(table: pd.DataFrame) -> str:
    """The column that tells one run (seed) of a curve from another."""
    for col in ("run_id", "seed_index"):
        if col in table.columns:
            return col
    return "seed"


def aggregate(
    table: pd.DataFrame,
    x: str = "bits",
    y: str = "grad_norm_sq",
    *,
    facet: str | None = DEFAULT_FACET,
    quantiles: tuple[float, float] = (0.1, 0.9),
    max_points: int = 4000,
) -> pd.DataFrame:
    """Median and quantile band over seeds of ``y`` against ``x``, one curve per group.

    Returns a long table with the columns ``facet`` (when used), the curve keys
    (:data:`CURVE_KEYS` but the facet), ``x``, ``median``, ``lo``, ``hi``, ``seeds`` (how many
    seeds have data at that x), ``diverged`` (how many of the curve's seeds diverged),
    ``no_progress`` (how many ended above their starting loss) and ``all_diverged`` (the curve is
    made of such seeds only; the others are left out of its median). ``x``/``y`` are axis names of
    :data:`X_AXES`/:data:`Y_AXES` or column names; ``facet`` a column (None: one panel). Where
    all seeds share their x values the median is exactly the median of the table's values.
    """
    if table.empty:
        raise ValueError("nothing to plot: the results table has no rows (no run has finished)")
    xcol = _column(x, X_AXES, table, "x")
    ycol = _column(y, Y_AXES, table, "y")
    lo_q, hi_q = quantiles
    if not (0 <= lo_q <= 0.5 <= hi_q <= 1):
        raise ValueError(f"quantiles must satisfy 0 ≤ lo ≤ 0.5 ≤ hi ≤ 1, got {quantiles}")
    panel = _facet(table, facet)
    keys = ([panel] if panel else []) + _curve_keys(table, panel)
    missing = [k for k in keys if k not in table.columns]
    if missing:
        raise ValueError(f"the results table lacks the column(s) {', '.join(missing)}")
    seed_col = _run_column(table)
    out = []
    for group, df in table.groupby(keys, sort=False, dropna=False):
        series: list[tuple[np.ndarray, np.ndarray]] = []
        bad: list[tuple[np.ndarray, np.ndarray]] = []
        stalled = 0
        for _, s in df.groupby(seed_col, sort=True):
            s = s.sort_values(xcol)
            xs = s[xcol].to_numpy(dtype=np.float64)
            ys = s[ycol].to_numpy(dtype=np.float64)
            ok = np.isfinite(xs) & np.isfinite(ys)
            xs, ys = xs[ok], ys[ok]
            if xs.size:
                # a repeated x (nothing sent in a round) keeps its last value
                last = np.r_[xs[1:] != xs[:-1], True]
                status = s["status"] if "status" in s.columns else pd.Series(dtype=object)
                no_progress = bool((status == NO_PROGRESS).any())
                failed = no_progress or bool((status == DIVERGED).any())
                stalled += no_progress
                (bad if failed else series).append((xs[last], ys[last]))
        all_diverged = not series
        use = series or bad
        if not use:
            continue
        frame = _median_band(use, lo_q, hi_q, max_points)
        frame["diverged"] = len(bad) - stalled
        frame["no_progress"] = stalled
        frame["all_diverged"] = all_diverged
        for k, v in zip(keys, group if isinstance(group, tuple) else (group,), strict=True):
            frame.insert(0, k, cast(Any, v))  # a group key: str or number
        out.append(frame)
    if not out:
        raise ValueError("nothing to plot: the results table has no finite values")
    cols = [*keys, "x", "median", "lo", "hi", "seeds", "diverged", "no_progress", "all_diverged"]
    return pd.concat(out, ignore_index=True)[cols]


def _median_band(
    series: list[tuple[np.ndarray, np.ndarray]], lo_q: float, hi_q: float, max_points: int
) -> pd.DataFrame:
    """Median and band of the seeds' curves on the union of their x values."""
    grid = np.unique(np.concatenate([xs for xs, _ in series]))
    if grid.size > max_points:
        grid = np.linspace(grid[0], grid[-1], max_points)
    values = np.full((len(series), grid.size), np.nan)
    for i, (xs, ys) in enumerate(series):
        values[i] = _interp(grid, xs, ys)
    count = np.isfinite(values).sum(axis=0)
    keep = count > 0
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(values[:, keep], axis=0)
        lo = np.nanquantile(values[:, keep], lo_q, axis=0)
        hi = np.nanquantile(values[:, keep], hi_q, axis=0)
    return pd.DataFrame({"x": grid[keep], "median": med, "lo": lo, "hi": hi, "seeds": count[keep]})


def _interp(grid: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """ys at the grid points inside [xs[0], xs[-1]] (exact at xs; log-linear when ys > 0)."""
    out = np.full(grid.size, np.nan)
    inside = (grid >= xs[0]) & (grid <= xs[-1])
    if xs.size == 1:
        out[inside] = ys[0]
        return out
    if np.all(ys > 0):
        out[inside] = np.exp(np.interp(grid[inside], xs, np.log(ys)))
    else:
        out[inside] = np.interp(grid[inside], xs, ys)
    pos = np.searchsorted(xs, grid)
    exact = (pos < xs.size) & (xs[np.minimum(pos, xs.size - 1)] == grid)
    out[exact] = ys[pos[exact]]
    return out


def curve_label(row: pd.Series | dict[str, Any], rule: str | None = None) -> str:
    """The legend entry of a curve: canonical specs, and the step-size rule when given; a step
    size given as a number in the compact form of :func:`.style.number_text` (``γ=1e+06``)."""
    parts = [str(row[k]) for k in (DEFAULT_FACET, "method", "compressor") if k in row]
    if "stepsize_spec" in row:
        parts.append(f"γ={stepsize_text(row['stepsize_spec'])}")
    if NETWORK in row:
        parts.append(str(row[NETWORK]))
    text = " · ".join(parts)
    return f"{text} ({rule})" if rule else text


def _rules(
    table: pd.DataFrame, keys: list[str], with_value: bool = True
) -> dict[tuple[Any, ...], str]:
    """Step-size rule (and value, ``with_value``) of every curve (identical over seeds)."""
    out: dict[tuple[Any, ...], str] = {}
    if "stepsize_rule" not in table.columns:
        return out
    for group, df in table.groupby(keys, sort=False, dropna=False):
        rule = str(df["stepsize_rule"].iloc[0])
        gamma = df["stepsize"].iloc[0] if "stepsize" in df.columns else math.nan
        out[group if isinstance(group, tuple) else (group,)] = (
            f"{rule}, γ={number_text(gamma, 3)}" if with_value and np.isfinite(gamma) else rule
        )
    return out


def _panel_title(df: pd.DataFrame, name: str) -> str:
    first = df.iloc[0]
    parts = []
    for col, fmt in (("n_clients", "n={}"), ("d", "d={}")):
        if col in df.columns and df[col].nunique() == 1:
            parts.append(fmt.format(first[col]))
    if "L_var" in df.columns and df["L_var"].nunique() == 1 and np.isfinite(first["L_var"]):
        scale = float(first["L_AM"]) ** 2 if "L_AM" in df.columns else 1.0
        lvar = float(first["L_var"])
        parts.append("L_var=0" if abs(lvar) <= 1e-12 * scale else f"L_var={lvar:.3g}")
    if {"L_QM", "L_AM"} <= set(df.columns) and df["L_AM"].nunique() == 1 and first["L_AM"] > 0:
        parts.append(f"L_QM/L_AM={first['L_QM'] / first['L_AM']:.3g}")
    # wrap long labels (problem specs) after a comma, never inside a word
    head = "\n".join(textwrap.wrap(name.replace(",", ", "), 60)).replace(", ", ",")
    return head + ("\n" + ", ".join(parts) if parts else "")


def plot_results(
    table: pd.DataFrame,
    x: str = "bits",
    y: str = "grad_norm_sq",
    out: str | Path | None = None,
    *,
    facet: str | None = DEFAULT_FACET,
    quantiles: tuple[float, float] = (0.1, 0.9),
    title: str | None = None,
    logy: bool | None = None,
    logx: bool = False,
    formats: Sequence[str] = ("png", "pdf"),
    dpi: int = FIGURE_DPI,
    ncols: int = 3,
    max_decades: float = 12.0,
) -> tuple[Any, list[Path]]:
    """Draw ``y`` against ``x`` for every curve of ``table``; save to ``out.png``/``out.pdf``.

    One panel per value of ``facet`` (the problem; None or ``"none"``: one panel), one line
    per method × compressor × step size (median over seeds) with a shaded quantile band, one
    legend for the figure. ``logy`` defaults to the metric's scale (log for ‖∇f‖² and losses,
    linear for accuracy); a log axis spans at most ``max_decades`` below its highest value.
    ``logx`` draws x on a log scale, leaving out the points with x ≤ 0 (e.g. round 0 of a
    ``time_model`` or ``bits`` axis, before anything was sent).
    Returns the matplotlib Figure and the paths written (none when ``out`` is None). Raises
    ValueError for unknown axes, facets or formats, or an empty table, and OSError when a file
    cannot be written.
    """
    from matplotlib.figure import Figure

    agg = aggregate(table, x, y, facet=facet, quantiles=quantiles)
    xcol = _column(x, X_AXES, table, "x")
    if logx:
        # a log axis cannot show x ≤ 0 (round 0, the time before anything was sent): drop
        # those points rather than the log scale
        agg = agg[agg["x"] > 0]
        if agg.empty:
            raise ValueError(
                f"cannot draw x={x!r} on a log axis: it has no value > 0; drop logx (--logx)"
            )
    ycol = _column(y, Y_AXES, table, "y")
    log_y = axis_of(ycol).log if logy is None else bool(logy)
    panel_col = _facet(table, facet)
    curve_keys = _curve_keys(table, panel_col)
    panels = list(dict.fromkeys(agg[panel_col])) if panel_col else [None]
    curve_ids = list(dict.fromkeys(map(tuple, agg[curve_keys].to_numpy().tolist())))
    methods = [dict(zip(curve_keys, c, strict=True)).get("method", "") for c in curve_ids]
    styles = dict(zip(curve_ids, curve_styles(curve_ids, methods), strict=True))
    # one legend: with one panel each curve's γ value too; with several, γ differs by panel
    keys = ([panel_col] if panel_col else []) + curve_keys
    rules = _rules(table, keys, with_value=len(panels) == 1)

    def panel_rules(cid: tuple[Any, ...], where: Sequence[Any]) -> dict[Any, str]:
        """panel → the curve's rule there, for the panels ``where`` that have one."""
        out = {}
        for p in where:
            rule = rules.get(((p,) if panel_col else ()) + tuple(cid))
            if rule is not None:
                out[p] = rule
        return out

    cols = min(ncols, len(panels))
    rows = math.ceil(len(panels) / cols)
    width = max(4.6 * cols, 6.4)
    longest = max(
        (
            len(
                curve_label(
                    dict(zip(curve_keys, c, strict=True)),
                    _merged_rule(panel_rules(c, panels)) or None,
                )
            )
            for c in curve_ids
        ),
        default=0,
    )
    outside = len(panels) > 1 or len(curve_ids) > 6
    legend_cols = max(1, int(width // (4.6 if longest > 60 else 3.6)))
    lines = 2 if longest > 60 else 1
    legend_h = (
        (0.14 * lines + 0.04) * math.ceil(len(curve_ids) / legend_cols) + 0.25 if outside else 0.0
    )
    fig = Figure(figsize=(width, 3.6 * rows + 0.4 + legend_h), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    # legend entries: (curve, drawn as failed) → (a line, {panel: its note there}); a curve
    # whose rule reads differently per panel (a note on one problem, "estimated L") is still
    # one entry, its rule said per panel (_merged_rule)
    entries: dict[tuple[tuple[Any, ...], bool], tuple[Any, dict[Any, str]]] = {}
    for ax, panel in zip(axes.flat, panels, strict=False):
        sub = agg[agg[panel_col] == panel] if panel_col else agg
        src = table[table[panel_col] == panel] if panel_col else table
        shown = sub[~sub["all_diverged"].astype(bool)]
        if shown.empty:  # every curve of the panel diverged: fit the axis to them, same scale
            shown = sub
        limits = y_limits(
            np.concatenate([shown[c].to_numpy(dtype=np.float64) for c in ("median", "lo", "hi")]),
            log_y,
            max_decades,
        )
        floor = limits[0] if limits is not None else 0.0
        for cid in curve_ids:
            mask = np.ones(len(sub), dtype=bool)
            for k, v in zip(curve_keys, cid, strict=True):
                mask &= (sub[k] == v).to_numpy()
            c = sub[mask]
            if c.empty:
                continue
            key = ((panel,) if panel_col else ()) + tuple(cid)
            label = curve_label(dict(zip(curve_keys, cid, strict=True)), rules.get(key))
            line, note = _draw_curve(ax, c, styles[cid], label, log_y, floor)
            failed = bool(c["all_diverged"].iloc[0])
            entries.setdefault((tuple(cid), failed), (line, {}))[1][panel] = note
        if log_y and limits is not None:
            ax.set_yscale("log")
        if limits is not None:
            ax.set_ylim(*limits)
            if log_y:
                readable_log_ticks(ax.yaxis, *limits)
        if logx:
            ax.set_xscale("log")
        if xcol.startswith("bits"):
            from matplotlib.ticker import EngFormatter

            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 20k, 1.5M bits
        ax.set_xlabel(axis_of(xcol).label, fontsize=8)
        ax.set_ylabel(axis_of(ycol).label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        if panel is not None:
            ax.set_title(_panel_title(src, str(panel)), fontsize=8)
    handles = {
        _entry_label(
            curve_label(
                dict(zip(curve_keys, cid, strict=True)),
                _merged_rule(panel_rules(cid, list(notes))) or None,
            ),
            notes,
            failed,
        ): line
        for (cid, failed), (line, notes) in entries.items()
    }
    _legend(fig, axes.flat[0], handles, outside, legend_cols)
    caption = seeds_caption(agg, curve_keys + ([panel_col] if panel_col else []), quantiles)
    fig.suptitle(f"{title}\n{caption}" if title else caption, fontsize=10 if title else 7)
    paths = save_figure(fig, Path(out), formats, dpi) if out is not None else []
    return fig, paths


def seeds_caption(agg: pd.DataFrame, keys: list[str], quantiles: tuple[float, float]) -> str:
    """How the figure combines seeds, for its caption: ``median over 3 seeds per curve, band:
    10–90 % quantiles`` (a range of counts when curves differ), or ``one seed per curve``.
    The count is a curve's seeds, diverged ones included (:func:`aggregate`'s columns)."""
    if agg.empty:
        return ""
    per = agg.groupby(keys, sort=False, dropna=False).agg(
        seeds=("seeds", "max"),
        diverged=("diverged", "max"),
        no_progress=("no_progress", "max"),
        only=("all_diverged", "max"),
    )
    # a curve of diverged (or stalled) seeds only is made of them: its seeds count them already
    left_out = (per["diverged"] + per["no_progress"]).where(~per["only"].astype(bool), 0)
    counts = (per["seeds"] + left_out).astype(int)
    lo, hi = int(counts.min()), int(counts.max())
    if hi <= 1:
        return "one seed per curve"
    n = f"{lo}" if lo == hi else f"{lo}–{hi}"
    q_lo, q_hi = (round(100 * q) for q in quantiles)
    return f"median over {n} seeds per curve, band: {q_lo}–{q_hi} % quantiles"


def _draw_curve(
    ax: Any, c: pd.DataFrame, style: dict[str, Any], label: str, log_y: bool, floor: float
) -> tuple[Any, str]:
    """One curve: its median line and band; a curve of diverged seeds only is thin, grey,
    dotted and ends in a cross. On a log axis values ≤ 0 are drawn below the floor (they run
    off the bottom of the panel instead of vanishing). Returns the line and its note (what
    its label says beyond ``label``: the seeds left out, or why the curve failed; "" for
    none), the line's label being ``label`` with :func:`_with_note`."""
    xs = c["x"].to_numpy()

    def ys(col: str) -> np.ndarray:
        v = c[col].to_numpy(dtype=np.float64)
        return np.where(v > 0, v, floor * 1e-3) if log_y and floor > 0 else v

    n_div = int(c["diverged"].iloc[0])
    n_stall = int(c["no_progress"].iloc[0]) if "no_progress" in c.columns else 0
    if bool(c["all_diverged"].iloc[0]):
        what = (
            "diverged"
            if not n_stall
            else "no progress (ended above f(x⁰))"
            if not n_div
            else f"{n_div} diverged, {n_stall} no progress"
        )
        (line,) = ax.plot(
            xs, ys("median"), color="0.55", lw=0.9, ls=":", label=_with_note(label, what, True)
        )
        ax.plot(xs[-1:], ys("median")[-1:], color="0.35", marker="x", ms=6, ls="none")
        return line, what
    seeds = int(c["seeds"].max()) + n_div + n_stall
    parts = [f"{n_div}/{seeds} seeds diverged"] if n_div else []
    if n_stall:
        parts.append(f"{n_stall}/{seeds} {'seeds ' if not n_div else ''}made no progress")
    note = f"{', '.join(parts)}, left out" if parts else ""
    (line,) = ax.plot(xs, ys("median"), lw=1.4, label=_with_note(label, note, False), **style)
    if (c["lo"] != c["hi"]).any():
        ax.fill_between(xs, ys("lo"), ys("hi"), color=style["color"], alpha=0.2, lw=0)
    return line, note


def _merged_rule(rules: dict[Any, str]) -> str:
    """The step-size rule of a curve drawn in the panels of ``rules`` (panel → its rule there),
    for its one legend entry: the rule once when every panel says the same, else each rule
    after the panels it holds in (``a, c: stepsize_dcgd; b: stepsize_dcgd(f_i not convex: …)``),
    so that no panel's rule is claimed for another; "" for none."""
    by_rule: dict[str, list[str]] = {}
    for panel, rule in rules.items():
        by_rule.setdefault(rule, []).append(str(panel))
    if len(by_rule) <= 1:
        return next(iter(by_rule), "")
    return "; ".join(f"{', '.join(ps)}: {rule}" for rule, ps in by_rule.items())


def _with_note(label: str, note: str, failed: bool) -> str:
    """A curve's label with its note: ``label — diverged`` for a curve of failed seeds only,
    ``label (1/3 seeds diverged, left out)`` for one with seeds left out, else ``label``."""
    if failed:
        return f"{label} — {note}"
    return f"{label} ({note})" if note else label


def _entry_label(label: str, notes: dict[Any, str], failed: bool) -> str:
    """The legend entry of a curve drawn in one style in the panels of ``notes`` (panel →
    its note there): the note once when every panel says the same, else each panel's note
    after the panel's name, so that seeds left out (or a failure) in one panel are not
    claimed for the others — and the curve is in the legend once."""
    distinct = set(notes.values())
    if len(distinct) == 1:
        return _with_note(label, distinct.pop(), failed)
    return _with_note(label, "; ".join(f"{p}: {n}" for p, n in notes.items() if n), failed)


def _legend(fig: Any, ax: Any, handles: dict[str, Any], outside: bool, ncols: int) -> None:
    """One legend for the figure: inside a single panel with few curves, else below."""
    if not handles:
        return
    long = max(len(k) for k in handles) > 60
    labels = [k.replace(" (", "\n(", 1) if long else k for k in handles]
    if not outside:
        ax.legend(list(handles.values()), labels, fontsize=6, loc="best")
    else:
        fig.legend(
            list(handles.values()),
            labels,
            loc="outside lower center",
            ncols=ncols,
            fontsize=6,
            frameon=False,
        )
