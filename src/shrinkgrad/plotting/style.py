"""House style of the figures: what makes them fit for a paper.

* :func:`curve_styles` — a colour per curve and a line style per method, so that curves that
  share a colour (more curves than colours) are still told apart, and so are the methods in
  greyscale; past the palette a marker is added;
* :func:`y_limits` — limits that show the curves, not a numerical floor: the axis spans at most
  ``max_decades`` below the highest value (a run that reaches 1e-30, or exactly 0, runs off the
  bottom instead of squashing every other curve into the top of the panel);
* :func:`readable_log_ticks` — labelled ticks on log axes that span less than a decade or two
  (matplotlib labels only powers of ten, so such an axis would show one label or none);
* :func:`number_text` and :func:`stepsize_text` — numbers in labels, legends and ticks in one
  compact form (``1e+06``, ``1e-07``, ``0.5``, ``123456``), never Python's ``1000000.0``;
* :data:`FIGURE_DPI` and :func:`save_figure` — PNG at 200 dpi next to the vector PDF.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FIGURE_DPI",
    "LINESTYLES",
    "curve_styles",
    "number_text",
    "readable_log_ticks",
    "save_figure",
    "stepsize_text",
    "y_limits",
]

#: resolution of PNG figures (150–300 dpi is what journals ask for)
FIGURE_DPI = 200
#: one line style per method, in order of appearance
LINESTYLES: tuple[Any, ...] = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
#: past the palette's colours, curves get a marker as well
MARKERS: tuple[str | None, ...] = (None, "o", "s", "^", "v", "D", "x")


def number_text(value: float, digits: int | None = None) -> str:
    """``value`` in the compact ``%g`` form of every label and legend of a figure.

    With ``digits``: that many significant digits (``1.23e+05`` for 123456 at 3). Without: the
    fewest significant digits that give ``value`` back exactly, so a number that names a curve
    (a step size given as a number) is never rounded into another: ``1e+06`` for 1000000.0,
    ``1e-07``, ``0.5``, ``123456``, ``0.1``. ``inf`` and ``nan`` are spelled out.
    """
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    if digits is not None:
        return f"{v:.{digits}g}"
    for p in range(1, 18):  # 17 significant digits give back any float64
        text = f"{v:.{p}g}"
        if float(text) == v:
            return text
    return repr(v)  # pragma: no cover - 17 digits always round-trip


def stepsize_text(spec: Any) -> str:
    """A step-size spec (``stepsize_spec``) for a label: a plain number in the form of
    :func:`number_text` (a config's ``stepsize = 1e6`` is recorded as ``"1000000.0"``, shown as
    ``1e+06``), any other spec (``theory*2``, ``0.1/L_max``) as it is."""
    if isinstance(spec, bool):
        return str(spec)
    if isinstance(spec, (int, float, np.integer, np.floating)):
        return number_text(float(spec))
    text = str(spec).strip()
    try:
        v = float(text)
    except ValueError:
        return str(spec)
    return number_text(v) if math.isfinite(v) else str(spec)


def curve_styles(curves: Sequence[tuple[Any, ...]], methods: Sequence[Any]) -> list[dict[str, Any]]:
    """Matplotlib line properties of each curve; ``methods[i]`` is curve i's method.

    Colour i of tab10 for curve i (cycling), line style by the method's first appearance, and
    from the 11th curve on a marker per cycle of the palette: no two curves look alike as long
    as there are at most 70, and two methods never share a line style (up to six methods).
    """
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    order = list(dict.fromkeys(methods))
    out = []
    for i, _ in enumerate(curves):
        cycle = i // cmap.N
        out.append(
            {
                "color": cmap(i % cmap.N),
                "linestyle": LINESTYLES[order.index(methods[i]) % len(LINESTYLES)],
                "marker": MARKERS[cycle % len(MARKERS)],
                "markevery": 0.1,
                "markersize": 3,
            }
        )
    return out


def y_limits(
    values: np.ndarray, log: bool, max_decades: float = 12.0
) -> tuple[float, float] | None:
    """(bottom, top) showing ``values`` (the plotted medians and bands), or None when nothing
    finite is drawn. On a log axis the bottom is at most ``max_decades`` below the top."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if log:
        v = v[v > 0]
    if v.size == 0:
        return None
    lo, hi = float(v.min()), float(v.max())
    if not log:
        pad = 0.05 * (hi - lo) if hi > lo else (abs(hi) * 0.05 or 1.0)
        return lo - pad, hi + pad
    lo = max(lo, hi * 10.0 ** (-max_decades))
    span = math.log10(hi / lo) if hi > lo else 1.0
    pad = 10.0 ** (0.05 * span)
    return lo / pad, hi * pad


def readable_log_ticks(axis: Any, bottom: float, top: float) -> None:
    """Labelled ticks on a log ``axis`` (``ax.yaxis``) whose range [bottom, top] spans fewer
    than three decades: at 1–9 × 10^k under one decade, at 1, 2, 5 × 10^k under three, with
    plain number labels (``0.4``, ``2e-05``); wider ranges keep matplotlib's 10^k labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if not (bottom > 0 and top > bottom):
        return
    decades = math.log10(top / bottom)
    if decades >= 3:
        return
    subs = [float(k) for k in range(1, 10)] if decades < 1 else [1.0, 2.0, 5.0]
    axis.set_major_locator(LogLocator(base=10.0, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: number_text(v, 3)))
    axis.set_minor_formatter(NullFormatter())


def save_figure(
    fig: Any, stem: Path, formats: Sequence[str] = ("png", "pdf"), dpi: int = FIGURE_DPI
) -> list[Path]:
    """Write ``fig`` to ``stem.<format>`` for every format; return the paths written.

    Raises ValueError for a format matplotlib cannot write and OSError (with the path in its
    message) when a file or its directory cannot be created.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    supported = FigureCanvasAgg(fig).get_supported_filetypes()
    bad = [f for f in formats if f not in supported]
    if bad or not formats:
        raise ValueError(
            f"cannot write figures as {', '.join(bad) or 'nothing'}: give formats among "
            + ", ".join(sorted(supported))
        )
    for parent in (stem.parent, *stem.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(
                    f"cannot write the figure {str(stem)!r}: {str(parent)!r} is a file, not a "
                    "directory"
                )
            break
    paths = []
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        for fmt in formats:
            path = stem.with_name(f"{stem.name}.{fmt}")
            fig.savefig(path, dpi=dpi)
            paths.append(path)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(stem) else ""
        raise type(e)(f"cannot write the figure {str(stem)!r}: {e.strerror or e}{where}") from None
    return paths
