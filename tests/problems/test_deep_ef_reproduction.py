"""The ``deep-ef`` reproduction: its configs validate and its tiny profile produces claims.

The claims themselves are measured by running the reproduction (REPRODUCTION.md); six rounds on
four clients support nothing. ``ef21_sgdm`` comes from the method registry: until it is
registered, its arms are dropped from a copy of the config and its claim is n/a.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from shrinkgrad.experiments.config import load_config
from shrinkgrad.experiments.grid import check_runs, expand
from shrinkgrad.experiments.reproductions import REPRODUCTIONS, config_path, reproduce
from shrinkgrad.methods import METHODS

HAS_SGDM = "ef21_sgdm" in METHODS


def _config(tmp_path: Path) -> Path:
    path = config_path(REPRODUCTIONS.get("deep-ef"))
    if HAS_SGDM:
        return path
    text = re.sub(r',\s*"ef21_sgdm\[[^"]*\]"', "", path.read_text())
    copy = tmp_path / "deep-ef.toml"
    copy.write_text(text)
    return copy


def test_deep_ef_configs_validate_in_every_profile(tmp_path: Path) -> None:
    path = _config(tmp_path)
    sizes = {}
    for profile in (None, "quick", "tiny"):
        cfg = load_config(path, profile=profile)
        sizes[profile] = len(expand(cfg))
        labels = {p.case for p in cfg.problems}
        assert labels == {"mlp-a9a", "cnn-digits"}, profile
    assert sizes["tiny"] < sizes["quick"] < sizes[None]
    tiny = load_config(path, profile="tiny")
    runs, notes, infos = check_runs(tiny, expand(tiny))
    assert runs and not notes
    assert all(math.isnan(i.L) for i in infos.values())  # networks: constants unknown


def test_tiny_deep_ef_produces_a_claim_table(tmp_path: Path) -> None:
    rep = dataclasses.replace(REPRODUCTIONS.get("deep-ef"), config=str(_config(tmp_path)))
    res = reproduce(rep, tmp_path / "out", profile="tiny", jobs=1, progress=False)
    assert res.outcome.complete and len(res.claims) == 6
    summary = json.loads(res.summary_path.read_text())
    assert summary["reproduction"] == "deep-ef" and summary["profile"] == "tiny"
    by_title = {c.claim: c for c in res.claims}
    versus = next(c for t, c in by_title.items() if t.startswith("EF21 matches") and "loss" in t)
    assert versus.passed is not None and "mlp-a9a" in versus.measured  # measured on both problems
    assert "cnn-digits" in versus.measured
    gap = next(c for t, c in by_title.items() if "momentum closes the gap" in t)
    if not HAS_SGDM:
        assert gap.passed is None
    assert any(p.name == "tuned_curves.png" for p in res.figures)
