"""Small results tables for the claim tests: one run's rows as the sweep writes them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def run_table(
    run_id: str,
    problem: str,
    method: str,
    g: list[float],
    bits: list[float],
    *,
    status: str = "completed",
    **extra: Any,
) -> pd.DataFrame:
    """The rows of one run (rounds 0, 1, ...): ‖∇f‖² ``g``, cumulative bits ``bits`` (both
    ``bits_up`` and ``bits_up_paper``), top_k[k=1] at the theory step, seed 0, and ``extra``
    columns (constants, ...)."""
    n = len(g)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "problem_label": problem,
            "problem_spec": problem,
            "method": method,
            "compressor": "top_k[k=1]",
            "stepsize_spec": "theory",
            "seed_index": 0,
            "round": np.arange(n),
            "grad_norm_sq": np.asarray(g, dtype=float),
            "loss": np.linspace(1.0, 0.5, n),
            "bits_up_paper": np.asarray(bits, dtype=float),
            "bits_up": np.asarray(bits, dtype=float),
            "status": status,
            **extra,
        }
    )
