"""An interrupted ``reproduce`` says so and what finishes it, instead of an empty claim table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from shrinkgrad.cli import main
from shrinkgrad.cli.reproduce import interrupted_message, print_claims
from shrinkgrad.experiments.reproductions import REPRODUCTIONS, Reproduction, reproduce


@dataclasses.dataclass
class Interrupted:
    """What the sweep runner returns after Ctrl-C: 2 of 8 runs finished."""

    table: pd.DataFrame
    runs: pd.DataFrame
    complete: bool = False
    interrupted: bool = True


def _execute(config: Any, out: Path, **kwargs: Any) -> Interrupted:
    table = pd.DataFrame({"run_id": ["r0", "r0", "r1"], "round": [0, 1, 0]})
    return Interrupted(table, pd.DataFrame({"run_id": [f"r{i}" for i in range(8)]}))


def _claims(table: pd.DataFrame, params: Any) -> list[Any]:
    raise AssertionError("claims are not measured on an interrupted sweep")


@pytest.fixture
def rep() -> Reproduction:
    """k18-delays' config and claim parameters, with a sweep that is interrupted."""
    real = REPRODUCTIONS.get("k18-delays")
    return dataclasses.replace(real, name="fake-interrupted", claims=_claims, execute=_execute)


def test_the_result_and_summary_say_interrupted(
    rep: Reproduction, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = reproduce(rep, tmp_path, profile="tiny", command=["shrinkgrad", "reproduce", "x"])
    assert res.claims == [] and res.progress == (2, 8)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["claims"] == []
    print_claims(res)
    out = capsys.readouterr().out
    assert "claims hold" not in out and "claim" not in out.split("the claims are")[0]
    assert "fake-interrupted: interrupted after 2 of 8 runs finished" in out
    assert "run: shrinkgrad reproduce x" in out
    # without a recorded command line the message builds one that resumes the same directory
    bare = dataclasses.replace(res, command=())
    assert (
        bare.resume_command
        == f"shrinkgrad reproduce fake-interrupted --profile tiny --out {tmp_path}"
    )
    assert "not started: a, b" in interrupted_message(res, ["a", "b"])


def test_the_command_exits_130_with_the_command_that_finishes_it(
    rep: Reproduction,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(REPRODUCTIONS._entries, rep.name, rep)
    args = [
        "reproduce",
        rep.name,
        "--profile",
        "tiny",
        "--out",
        str(tmp_path),
        "--set",
        "run.seeds=1",
    ]
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    assert code == 130
    cap = capsys.readouterr()
    assert "claims hold" not in cap.out + cap.err
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0] == (
        "fake-interrupted: interrupted after 2 of 8 runs finished; the claims are measured once "
        "every run has finished. To finish (finished runs are kept), run: shrinkgrad reproduce "
        f"fake-interrupted --profile tiny --out {tmp_path} --set run.seeds=1"
    )
