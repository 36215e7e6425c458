"""Fixtures of the simulator tests: the independent least-squares problem of tests/methods."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "methods"))

from methods_fixtures import LeastSquares


@pytest.fixture
def lsq() -> LeastSquares:
    return LeastSquares(n=6, d=8, m=5, seed=4, spread=8.0)
