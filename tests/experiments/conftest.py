"""Fixtures of the experiment tests: small configs that run in a second or two."""

from __future__ import annotations

from pathlib import Path

import pytest

#: a valid config: 2 problems (a sweep) × 3 arms (a grid of 2 + a pair) × 2 seeds = 12 runs
SMALL = """
name = "small"
description = "two datasets, EF21 vs EF21-W and DCGD"

[problem]
name = "logistic_regression"
n_clients = 4
lam = 0.1

[problem.sweep]
dataset = ["a1a", "australian_scale"]

[run]
rounds = 12
log_every = 4
seeds = 2

[grid]
methods = ["ef21", "ef21_w"]
compressors = ["top_k[k=2]"]

[[pairs]]
method = "dcgd"
compressor = "rand_k[k=3]"
stepsize = "1/L"

[profiles.tiny]
run.rounds = 6
"""


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL, encoding="utf-8")
    return path
