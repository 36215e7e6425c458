"""Figures as pure functions of results tables.

* :mod:`.axes` — the axes (``--x``/``--y`` names, their columns, labels and scales), light;
* :mod:`.curves` — :func:`aggregate` (median and band over seeds) and :func:`plot_results`;
* :mod:`.style` — what makes a figure fit for a paper (line styles, limits, ticks, dpi).

The heavy names (pandas, matplotlib) load on first use, so ``shrinkgrad plot --help`` and
the axis tables stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

from .axes import X_AXES, Y_AXES

__all__ = ["CURVE_KEYS", "X_AXES", "Y_AXES", "aggregate", "curve_label", "plot_results"]

_LAZY = {
    "CURVE_KEYS": "curves",
    "aggregate": "curves",
    "curve_label": "curves",
    "plot_results": "curves",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
