"""The ``k18-async`` reproduction: its executor runs the parameter server, its claims read the
table (the tiny profile: two short runs of 1 server + 4 workers)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from shrinkgrad.experiments.reproductions import REPRODUCTIONS, reproduce
from shrinkgrad.experiments.reproductions.k18_async import claims
from shrinkgrad.experiments.results import RESULT_COLUMNS


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tiny_profile_runs_the_parameter_server(tmp_path: Path) -> None:
    res = reproduce("k18-async", tmp_path / "k18", profile="tiny", progress=False)
    table = res.outcome.table
    assert set(RESULT_COLUMNS) <= set(table.columns)
    assert set(table["stepsize_spec"]) == {"theory", "1/L"}
    bounded = table[table["tau_max_config"].notna()]
    assert bounded["staleness_max"].max() <= 6  # the bound holds even in a short run
    assert res.claims[0].passed is True
    assert any(p.name == "convergence.png" for p in res.figures)
    assert sum(p.name.startswith("staleness-") for p in res.figures) == 2
    for run_id in table["run_id"].unique():
        assert (tmp_path / "k18" / "runs" / run_id / "staleness.csv").is_file()


def _fake(
    run_id: str, spec: str, tau: float | None, gns: list[float], rule: bool, slow: float
) -> pd.DataFrame:
    n = len(gns)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "round": range(n),
            "grad_norm_sq": gns,
            "stepsize_spec": spec,
            "stepsize": 1.0 if tau is None else 0.05,
            "L": 1.0,
            "tau_max_config": tau,
            "staleness_max": 5 if tau else 20,
            "delay_max": 10 if tau else 30,
            "rule_holds": rule,
            "stepsize_bound_measured": 0.06 if tau else 0.02,
            "slow_mean_staleness": slow,
            "fast_mean_staleness_max": 2.0,
        }
    )


def test_claims_measure_the_table_and_fail_when_the_data_disagree() -> None:
    params = dict(REPRODUCTIONS.get("k18-async").defaults)
    good = pd.concat(
        [
            _fake("a", "theory", 6.0, [1.0, 1e-2, 1e-4, 1e-5], True, 4.0),
            _fake("b", "1/L", None, [1.0, 2.0, 0.5, 1.5], False, 9.0),
        ]
    )
    verdicts = [c.passed for c in claims(good, params)]
    assert verdicts == [True, True, True, True, True]
    bad = pd.concat(
        [
            _fake("a", "theory", 6.0, [1.0, 0.5, 0.4, 0.3], True, 1.0),  # no convergence
            _fake("b", "1/L", None, [1.0, 1e-3, 1e-4, 1e-5], False, 9.0),  # converges anyway
        ]
    )
    verdicts = [c.passed for c in claims(bad, params)]
    assert verdicts == [True, False, False, False, True]
    assert not math.isnan(claims(bad, params)[3].values["median_ratios"][0])
