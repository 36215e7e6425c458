"""Shared test configuration: deterministic hypothesis, small thread counts, float64 defaults."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# Two cores on CI: keep every test process to one intra-op thread so xdist workers do not fight.
torch.set_num_threads(1)
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

# Derandomized hypothesis: a property test explores the same examples on every run, so the suite
# is never flaky; the example count stays modest for the 2-core budget.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
