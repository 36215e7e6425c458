"""Figures as pure functions of results tables (:mod:`shrinkgrad.plotting.curves`)."""

from .curves import CURVE_KEYS, X_AXES, Y_AXES, aggregate, curve_label, plot_results

__all__ = ["CURVE_KEYS", "X_AXES", "Y_AXES", "aggregate", "curve_label", "plot_results"]
