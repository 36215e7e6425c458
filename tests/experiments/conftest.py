"""Fixtures of the experiment tests: small configs that run in a second or two."""

from __future__ import annotations

from pathlib import Path

import pytest
from experiment_configs import SMALL


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL, encoding="utf-8")
    return path
