"""Fixtures of the method tests (the classes live in methods_fixtures.py, shared with tests/sim)."""

from __future__ import annotations

import pytest
from methods_fixtures import LeastSquares


@pytest.fixture
def lsq() -> LeastSquares:
    return LeastSquares()
