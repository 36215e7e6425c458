"""Objectives f = (1/n) Σ f_i over client splits of real or synthetic data, with L, L_i, μ."""

from .base import Problem

__all__ = ["Problem"]
