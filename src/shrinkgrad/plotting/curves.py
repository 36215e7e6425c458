"""Convergence figures as pure functions of a results table (design.md principle 11).

:func:`aggregate` turns the per-seed rows of a results table into one curve per problem × method
× compressor × step size: the median over seeds and a quantile band, on the union of the seeds'
x values (each seed's curve is interpolated — log-linearly for positive y — only inside its own
x range, so a run that stopped early contributes only where it has data). :func:`plot_results`
draws them like the papers' figures: one panel per problem, log-scale y, legends made of the
canonical spec strings with the step-size rule, and L_var, L_QM/L_AM in each panel's title.
Nothing here reads files or global state: the same table gives the same figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

__all__ = ["CURVE_KEYS", "X_AXES", "Y_AXES", "aggregate", "curve_label", "plot_results"]

#: --x names and the results column each one plots
X_AXES: dict[str, str] = {
    "bits": "bits_up",
    "bits_paper": "bits_up_paper",
    "bits_down": "bits_down",
    "rounds": "round",
    "time": "time_s",
}
#: --y names and the results column each one plots
Y_AXES: dict[str, str] = {"grad_norm_sq": "grad_norm_sq", "loss": "loss"}

#: what distinguishes one curve from another within a panel
CURVE_KEYS = ("method", "compressor", "stepsize_spec")

_AXIS_LABELS = {
    "bits_up": "uplink bits per client (honest: values + indices + scales)",
    "bits_up_paper": "#bits / n (papers' convention: 32 bits per sent float)",
    "bits_down": "downlink bits per client",
    "round": "rounds",
    "time_s": "time (s, excluding metric evaluation)",
    "grad_norm_sq": "‖∇f(xᵗ)‖²",
    "loss": "f(xᵗ)",
}


def _column(name: str, axes: dict[str, str], table: pd.DataFrame, what: str) -> str:
    col = axes.get(name, name)
    if col not in table.columns:
        raise ValueError(
            f"cannot plot {what}={name!r}: the results table has no column {col!r}; use one of "
            + ", ".join(axes)
        )
    if not pd.api.types.is_numeric_dtype(table[col]):
        raise ValueError(f"cannot plot {what}={name!r}: column {col!r} is not numeric")
    return col


def aggregate(
    table: pd.DataFrame,
    x: str = "bits",
    y: str = "grad_norm_sq",
    *,
    facet: str = "problem_label",
    quantiles: tuple[float, float] = (0.1, 0.9),
    max_points: int = 4000,
) -> pd.DataFrame:
    """Median and quantile band over seeds of ``y`` against ``x``, one curve per group.

    Returns a long table with the columns ``facet``, :data:`CURVE_KEYS`, ``x``, ``median``,
    ``lo``, ``hi`` and ``seeds`` (how many seeds have data at that x). ``x``/``y`` are axis names
    of :data:`X_AXES`/:data:`Y_AXES` or column names. Where all seeds share their x values (the
    usual case on the rounds axis, or for deterministic bit counts) the median is exactly the
    median of the table's values.
    """
    xcol = _column(x, X_AXES, table, "x")
    ycol = _column(y, Y_AXES, table, "y")
    lo_q, hi_q = quantiles
    if not (0 <= lo_q <= 0.5 <= hi_q <= 1):
        raise ValueError(f"quantiles must satisfy 0 ≤ lo ≤ 0.5 ≤ hi ≤ 1, got {quantiles}")
    keys = [facet, *CURVE_KEYS] if facet in table.columns else list(CURVE_KEYS)
    missing = [k for k in keys if k not in table.columns]
    if missing:
        raise ValueError(f"the results table lacks the column(s) {', '.join(missing)}")
    seed_col = "seed_index" if "seed_index" in table.columns else "seed"
    out = []
    for group, df in table.groupby(keys, sort=False, dropna=False):
        series = []
        for _, s in df.groupby(seed_col, sort=True):
            s = s.sort_values(xcol)
            xs = s[xcol].to_numpy(dtype=np.float64)
            ys = s[ycol].to_numpy(dtype=np.float64)
            ok = np.isfinite(xs) & np.isfinite(ys)
            xs, ys = xs[ok], ys[ok]
            if xs.size:
                # a repeated x (nothing sent in a round) keeps its last value
                last = np.r_[xs[1:] != xs[:-1], True]
                series.append((xs[last], ys[last]))
        if not series:
            continue
        grid = np.unique(np.concatenate([xs for xs, _ in series]))
        if grid.size > max_points:
            grid = np.linspace(grid[0], grid[-1], max_points)
        values = np.full((len(series), grid.size), np.nan)
        for i, (xs, ys) in enumerate(series):
            values[i] = _interp(grid, xs, ys)
        count = np.isfinite(values).sum(axis=0)
        keep = count > 0
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med = np.nanmedian(values[:, keep], axis=0)
                lo = np.nanquantile(values[:, keep], lo_q, axis=0)
                hi = np.nanquantile(values[:, keep], hi_q, axis=0)
        frame = pd.DataFrame(
            {"x": grid[keep], "median": med, "lo": lo, "hi": hi, "seeds": count[keep]}
        )
        for k, v in zip(keys, group if isinstance(group, tuple) else (group,), strict=True):
            frame.insert(0, k, cast(Any, v))  # a group key: str or number
        out.append(frame)
    if not out:
        raise ValueError("nothing to plot: the results table has no finite values")
    return pd.concat(out, ignore_index=True)[[*keys, "x", "median", "lo", "hi", "seeds"]]


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
    """The legend entry of a curve: canonical specs, and the step-size rule when given."""
    text = f"{row['method']} · {row['compressor']} · γ={row['stepsize_spec']}"
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
            f"{rule}, γ={gamma:.3g}" if with_value and np.isfinite(gamma) else rule
        )
    return out


def _panel_title(df: pd.DataFrame, name: str) -> str:
    import textwrap

    first = df.iloc[0]
    parts = []
    for col, fmt in (("n_clients", "n={}"), ("d", "d={}")):
        if col in df.columns:
            parts.append(fmt.format(first[col]))
    if "L_var" in df.columns and np.isfinite(first["L_var"]):
        scale = float(first["L_AM"]) ** 2 if "L_AM" in df.columns else 1.0
        lvar = float(first["L_var"])
        parts.append("L_var=0" if abs(lvar) <= 1e-12 * scale else f"L_var={lvar:.3g}")
    if {"L_QM", "L_AM"} <= set(df.columns) and first["L_AM"] > 0:
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
    facet: str = "problem_label",
    quantiles: tuple[float, float] = (0.1, 0.9),
    title: str | None = None,
    logy: bool = True,
    logx: bool = False,
    formats: Sequence[str] = ("png", "pdf"),
    dpi: int = 110,
    ncols: int = 3,
) -> tuple[Any, list[Path]]:
    """Draw ``y`` against ``x`` for every curve of ``table``; save to ``out.png``/``out.pdf``.

    One panel per value of ``facet`` (the problem), one line per method × compressor × step
    size (median over seeds) with a shaded quantile band. Returns the matplotlib Figure and the
    paths written (none when ``out`` is None). Raises ValueError for unknown axes or an empty
    table.
    """
    from matplotlib.figure import Figure

    agg = aggregate(table, x, y, facet=facet, quantiles=quantiles)
    xcol = _column(x, X_AXES, table, "x")
    ycol = _column(y, Y_AXES, table, "y")
    has_facet = facet in table.columns
    panels = list(dict.fromkeys(agg[facet])) if has_facet else [None]
    keys = [facet, *CURVE_KEYS] if has_facet else list(CURVE_KEYS)
    curve_ids = list(dict.fromkeys(map(tuple, agg[list(CURVE_KEYS)].to_numpy().tolist())))
    # few curves: a legend in each panel, with each curve's γ; many: one legend below the
    # panels (the same colour is the same curve in every panel), with the rule only
    shared = len(curve_ids) > 4
    rules = _rules(table, keys, with_value=not shared)
    colors = _palette(len(curve_ids))
    cols = min(ncols, len(panels))
    rows = math.ceil(len(panels) / cols)
    width = max(4.6 * cols, 7.0 if shared else 0.0)
    extra = 0.16 * math.ceil(len(curve_ids) / max(1, int(width // 4.5))) if shared else 0.0
    if not shared:
        longest = max(
            (
                len(curve_label(dict(zip(CURVE_KEYS, c, strict=True)), r))
                for c in curve_ids
                for r in rules.values()
            ),
            default=0,
        )
        if longest > 60:  # the legends go under the panels, two lines per curve
            extra = rows * (0.25 * len(curve_ids) + 0.2)
    fig = Figure(figsize=(width, 3.6 * rows + 0.4 + extra), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        sub = agg[agg[facet] == panel] if has_facet else agg
        src = table[table[facet] == panel] if has_facet else table
        for cid in curve_ids:
            mask = np.ones(len(sub), dtype=bool)
            for k, v in zip(CURVE_KEYS, cid, strict=True):
                mask &= (sub[k] == v).to_numpy()
            c = sub[mask]
            if c.empty:
                continue
            color = colors[curve_ids.index(cid)]
            key = ((panel,) if has_facet else ()) + tuple(cid)
            label = curve_label(dict(zip(CURVE_KEYS, cid, strict=True)), rules.get(key))
            ax.plot(c["x"].to_numpy(), c["median"].to_numpy(), color=color, lw=1.4, label=label)
            if (c["lo"] != c["hi"]).any():
                ax.fill_between(
                    c["x"].to_numpy(),
                    c["lo"].to_numpy(),
                    c["hi"].to_numpy(),
                    color=color,
                    alpha=0.2,
                    lw=0,
                )
        if logy and (sub["median"] > 0).all():
            ax.set_yscale("log")
        if logx and (sub["x"] > 0).all():
            ax.set_xscale("log")
        if xcol.startswith("bits"):
            from matplotlib.ticker import EngFormatter

            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 20k, 1.5M bits
        ax.set_xlabel(_AXIS_LABELS.get(xcol, xcol), fontsize=8)
        ax.set_ylabel(_AXIS_LABELS.get(ycol, ycol), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        if panel is not None:
            ax.set_title(_panel_title(src, str(panel)), fontsize=8)
        if not shared:
            longest = max((len(str(h.get_label())) for h in ax.get_lines()), default=0)
            if longest > 60:  # long labels would hide the curves: two lines, under the panel
                lines = ax.get_lines()
                wrapped = [str(h.get_label()).replace(" (", "\n(", 1) for h in lines]
                ax.legend(
                    lines, wrapped, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22)
                )
            else:
                ax.legend(fontsize=6, loc="best")
    if shared:
        handles: dict[str, Any] = {}
        for ax in axes.flat[: len(panels)]:
            for line in ax.get_lines():
                handles.setdefault(str(line.get_label()), line)
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="outside lower center",
            ncols=max(1, int(width // 4.5)),
            fontsize=6,
            frameon=False,
        )
    if title:
        fig.suptitle(title, fontsize=10)
    paths: list[Path] = []
    if out is not None:
        stem = Path(out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        for fmt in formats:
            path = stem.with_name(f"{stem.name}.{fmt}")
            fig.savefig(path, dpi=dpi)
            paths.append(path)
    return fig, paths


def _palette(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]
