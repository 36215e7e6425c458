"""Claim measurements on hand-made tables whose answers are known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from shrinkgrad.experiments.claims import (
    Claim,
    claims_table,
    rank_correlation,
    reach,
    tail_mean,
)
from shrinkgrad.experiments.reproductions.common import common_tolerance, ef21w_ratios


def run_table(rates: dict[str, float], rounds: int = 50, bits: float = 32.0) -> pd.DataFrame:
    """‖∇f‖² = rate^t for each method, 32 bits per round, one problem with known constants."""
    rows = []
    for method, rate in rates.items():
        for t in range(rounds + 1):
            rows.append(
                {
                    "run_id": method,
                    "round": t,
                    "grad_norm_sq": rate**t,
                    "bits_up_paper": bits * t,
                    "method": method,
                    "compressor": "top_k[k=1]",
                    "stepsize_spec": "theory",
                    "seed_index": 0,
                    "problem_label": "p",
                    "n_clients": 4,
                    "d": 10,
                    "L": 1.0,
                    "L_AM": 2.0,
                    "L_QM": 4.0,
                    "L_var": 12.0,
                }
            )
    return pd.DataFrame(rows)


def test_reach_interpolates_the_crossing_log_linearly() -> None:
    run = pd.DataFrame(
        {"round": [0, 10, 20], "grad_norm_sq": [1.0, 1e-2, 1e-4], "x": [0.0, 100.0, 200.0]}
    )
    assert reach(run, 1e-1, x="x") == pytest.approx(50.0)
    assert reach(run, 1e-2, x="x") == pytest.approx(100.0)
    assert reach(run, 2.0, x="x") == 0.0
    assert reach(run, 1e-5, x="x") == math.inf


def test_rank_correlation_and_tail_mean() -> None:
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 3], [5, 5, 5]) != rank_correlation([1, 2, 3], [5, 5, 5])  # nan
    run = pd.DataFrame({"round": range(8), "grad_norm_sq": [9, 9, 9, 9, 9, 9, 1.0, 3.0]})
    assert tail_mean(run, fraction=0.25) == 2.0


def test_bits_ratio_of_two_geometric_curves_is_the_ratio_of_their_log_rates() -> None:
    # rounds to reach ε scale as log ε / log rate, so the bits ratio is log(r_w)/log(r)
    t = run_table({"ef21": 0.9, "ef21_w": 0.5})
    eps = common_tolerance(t)["p"]
    assert eps == pytest.approx(0.9**50)  # the slower method's final value
    m = ef21w_ratios(t, "ef21", "ef21_w", "top_k[k=1]")
    (row,) = m.to_dict("records")
    assert row["ratio"] == pytest.approx(math.log(0.5) / math.log(0.9), rel=1e-12)
    assert row["QM/AM"] == 2.0 and row["L_var"] == 12.0
    # predicted (L + L_QM ξ)/(L + L_AM ξ) with α = 1/d = 0.1
    xi = (1 + math.sqrt(0.9)) / 0.1 - 1
    assert row["predicted"] == pytest.approx((1 + 4 * xi) / (1 + 2 * xi), rel=1e-12)


def test_claim_table_and_json() -> None:
    claims = [
        Claim("a", "1.5", "≥ 1", True, {"x": np.float64(1.5), "y": math.inf}),
        Claim("b", "n/a", "—", None),
        Claim("c", "0.5", "≥ 1", False),
    ]
    table = claims_table(claims)
    assert table["result"].tolist() == ["pass", "n/a", "FAIL"]
    d = claims[0].as_dict()
    assert d["values"] == {"x": 1.5, "y": "inf"} and d["passed"] is True
