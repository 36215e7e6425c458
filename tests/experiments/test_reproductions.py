"""Every reproduction: its configs validate, and its tiny version produces a finite claim table.

The claims themselves are checked by running the reproductions (REPRODUCTION.md), not here: a
tiny run is far too short to support them. Here: the pipeline config → runs → claims → figures
→ summary.json works, and the numbers it reports are finite.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from shrinkgrad.experiments.config import ConfigError, load_config
from shrinkgrad.experiments.grid import check_runs, expand
from shrinkgrad.experiments.reproductions import (
    REPRODUCTIONS,
    claim_params,
    config_path,
    reproduce,
)

MINE = [
    "ef21w-libsvm",
    "ef21w-synthetic",
    "ef21w-sgd-pp",
    "ef21-vs-ef",
    "k18-quantizers",
    "k18-delays",
    "time-to-accuracy",
]


def numbers(obj: Any) -> list[float]:
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, str):
        return [math.inf] if obj in ("inf", "-inf", "nan") else []
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in numbers(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in numbers(v)]
    return []


def test_every_reproduction_is_registered() -> None:
    assert set(MINE) <= set(REPRODUCTIONS.names())
    with pytest.raises(
        ValueError, match=r"unknown reproduction 'ef21-vs-eff'.*did you mean 'ef21-vs-ef'"
    ):
        REPRODUCTIONS.get("ef21-vs-eff")


@pytest.mark.parametrize("name", MINE)
def test_bundled_configs_validate_in_every_profile(name: str) -> None:
    rep = REPRODUCTIONS.get(name)
    path = config_path(rep)
    assert path.exists() and path.suffix == ".toml"
    sizes = {}
    for profile in (None, "quick", "tiny"):
        cfg = load_config(path, profile=profile)
        params = claim_params(rep, cfg)
        assert set(params) == set(rep.defaults)
        sizes[profile] = len(expand(cfg))
    assert sizes["tiny"] <= sizes["quick"] <= sizes[None]
    quick = load_config(path, profile="quick")
    runs, notes, _ = check_runs(quick, expand(quick))  # every quick pairing can run
    assert runs and not notes


def test_an_unknown_claim_parameter_is_a_config_error() -> None:
    rep = REPRODUCTIONS.get("ef21w-libsvm")
    cfg = load_config(config_path(rep), overrides=["claims.big_gian=3"])
    with pytest.raises(ConfigError, match=r"claims.big_gian: .*did you mean 'big_gain'"):
        claim_params(rep, cfg)


@pytest.mark.parametrize("name", MINE)
def test_tiny_reproduction_produces_a_finite_claim_table(name: str, tmp_path: Path) -> None:
    res = reproduce(name, tmp_path, profile="tiny", jobs=1, progress=False)
    assert res.outcome.complete
    assert res.claims and all(c.verdict in ("pass", "FAIL", "n/a") for c in res.claims)
    assert list(res.table.columns) == ["claim", "measured", "criterion", "result"]
    for c in res.claims:
        assert c.claim and c.measured and c.criterion
        vals = numbers(dict(c.values))
        if c.passed is not None:
            assert vals, c
        assert all(math.isfinite(v) for v in vals), (c.claim, c.values)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reproduction"] == name and summary["profile"] == "tiny"
    assert [c["claim"] for c in summary["claims"]] == [c.claim for c in res.claims]
    assert [c["result"] for c in summary["claims"]] == [c.verdict for c in res.claims]
    pngs = [p for p in res.figures if p.suffix == ".png"]
    assert pngs and all(p.exists() and p.stat().st_size > 0 for p in pngs)
    assert (tmp_path / "results.parquet").exists() and (tmp_path / "env.json").exists()


def test_a_custom_executor_and_no_finished_run(tmp_path: Path) -> None:
    """The execute hook is used as given; an empty table gives no claims, not a crash."""
    import dataclasses

    import pandas as pd

    from shrinkgrad.experiments.reproductions import Reproduction

    calls = []

    @dataclasses.dataclass
    class Outcome:
        table: pd.DataFrame
        complete: bool = False
        interrupted: bool = False

    def execute(config: Any, out: Path, **kwargs: Any) -> Outcome:
        calls.append((config.name, out, sorted(kwargs)))
        return Outcome(pd.DataFrame())

    def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Any]:
        raise AssertionError("claims must not be measured on an empty table")

    base = REPRODUCTIONS.get("k18-delays")
    rep = Reproduction(
        "custom", "t", "p", base.config, claims, base.defaults, base.plots, None, execute
    )
    res = reproduce(rep, tmp_path, profile="tiny")
    assert calls == [("k18-delays", tmp_path, ["command", "fmt", "jobs", "progress"])]
    assert res.claims == [] and res.figures == [] and not res.passed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["claims"] == [] and summary["complete"] is False
