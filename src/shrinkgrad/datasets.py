"""Datasets: ``shrinkgrad.datasets.load("a9a")`` (bundled LIBSVM files) or any LIBSVM file by path.

A thin alias of :mod:`shrinkgrad.problems.datasets`, where the loader and its documentation live.
"""

from __future__ import annotations

from .problems.datasets import BUNDLED, Dataset, DatasetError, available, bundled_path, load

__all__ = ["BUNDLED", "Dataset", "DatasetError", "available", "bundled_path", "load"]
