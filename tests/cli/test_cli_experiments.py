"""The run / plot / reproduce commands: outputs, one-line errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from shrinkgrad.cli import main

CONFIG = """
name = "cli-small"
[problem]
name = "logistic_regression"
n_clients = 3
[problem.sweep]
dataset = ["a1a", "australian_scale"]
[run]
rounds = 8
log_every = 4
seeds = 2
[grid]
methods = ["ef21", "ef21_w"]
compressors = ["top_k[k=1]"]
"""


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture
def config(tmp_path: Path) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(CONFIG, encoding="utf-8")
    return p


def test_dry_run_lists_the_runs_and_writes_nothing(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert run_cli(["run", str(config), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "8 runs" in text and text.count("to run") == 8
    assert "dataset=australian_scale" in text and "L_var" in text
    assert "network" not in text  # no network axis, no column
    assert not out.exists()
    # with a network axis each run's network is listed (the rows came in identical pairs)
    nets = '["star[up=1mbit]","star[up=9mbit]"]'
    assert run_cli(["run", str(config), "--dry-run", "--set", f"run.network={nets}"]) == 0
    text = capsys.readouterr().out
    assert "16 runs" in text and "network" in text
    assert text.count("star[up=1mbit]") == text.count("star[up=9mbit]") == 8


def test_run_then_plot(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "8 runs (8 completed): 8 started, 0 already finished" in text
    assert (out / "results.parquet").exists() and (out / "config.toml").exists()
    # same command again: nothing left to run
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0
    assert "0 started, 8 already finished" in capsys.readouterr().out
    assert run_cli(["plot", str(out), "--x", "rounds", "--y", "loss"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [
        str(out / "plots" / "loss_vs_rounds.png"),
        str(out / "plots" / "loss_vs_rounds.pdf"),
    ]
    assert all(Path(p).stat().st_size > 0 for p in printed)
    stem = tmp_path / "only_ef21"
    code = run_cli(
        ["plot", str(out), "--where", "method=ef21", "--out", str(stem), "--formats", "png"]
    )
    assert code == 0 and (tmp_path / "only_ef21.png").exists()
    assert run_cli(["plot", str(out), "--where", "colour=red"]) == 2
    assert "--where" in capsys.readouterr().err


def test_a_config_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.replace("rounds = 8", "roundz = 8"), encoding="utf-8")
    exe = str(Path(sys.executable).with_name("shrinkgrad"))
    res = subprocess.run([exe, "run", str(bad)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines == [
        f"error: {bad}: run.roundz: unknown key; allowed here: "
        + lines[0].split("allowed here: ")[1]
    ]
    assert "did you mean 'rounds'" in lines[0] and "Traceback" not in res.stderr
    res = subprocess.run(
        [exe, "plot", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120
    )
    assert (
        res.returncode == 2 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr
    )


@pytest.mark.parametrize("command", ["run", "train"])
def test_run_and_train_share_their_config_options(
    command: str,
    config: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --profile / --set reach the config; an output path that is a file is refused before
    # anything runs, given (--out) or the default runs/<config name>[-distributed]
    monkeypatch.chdir(tmp_path)
    args = [command, str(config), "--set", "run.roundz=3", "--out", "o"]
    assert run_cli(args) == 2
    assert "error: --set run.roundz=3: unknown key" in capsys.readouterr().err
    # a bad value from --set is blamed on the --set, not on the file
    assert run_cli([command, str(config), "--set", "run.rounds=abc", "--out", "o"]) == 2
    assert capsys.readouterr().err == (
        "error: --set run.rounds=abc: must be an integer >= 1, got 'abc'\n"
    )
    assert run_cli([command, str(config), "--profile", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    default = Path("runs") / ("cli-small" if command == "run" else "cli-small-distributed")
    default.parent.mkdir()
    default.write_text("", encoding="utf-8")
    assert run_cli([command, str(config), "--format", "csv"]) == 2
    assert f"--out {str(default)!r} is a file; give a directory" in capsys.readouterr().err
    assert run_cli([command, str(config), "--out", str(default)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "runs"]


def test_reproduce_prints_the_claim_table_and_writes_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["reproduce", "k18-delays", "--profile", "tiny", "--out", str(tmp_path), "-j", "1"]
    code = run_cli([*args, "--no-progress", "--strict"])
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "k18-delays" in text and "claims hold" in text and str(tmp_path / "summary.json") in text
    n, ok = len(summary["claims"]), summary["claims_passed"]
    assert n and f"{ok} of {n} claims hold" in text
    # --strict: exit 1 exactly when a claim fails
    assert code == (1 if summary["claims_failed"] else 0)


def test_reproduce_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["reproduce", "k18-delay"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown reproduction 'k18-delay'") and "k18-delays" in err
    assert run_cli(["reproduce", "k18-delays", "--quick", "--profile", "tiny"]) == 2
    assert "--quick or --profile" in capsys.readouterr().err


def test_list_reproductions(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["list", "reproductions"]) == 0
    text = capsys.readouterr().out
    for name in ("ef21w-libsvm", "ef21w-synthetic", "ef21w-sgd-pp", "ef21-vs-ef", "k18-quantizers"):
        assert name in text


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_run_without_progress_is_not_reported_as_completed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gd at 30× its theory step on a1a: f 0.69 → 4.4 in 10 rounds; exit 0 (a finding, not an
    # error), but never "completed"
    cfg = tmp_path / "steps.toml"
    cfg.write_text(
        'problem = "logistic_regression[dataset=a1a,n_clients=4]"\n[run]\nrounds = 10\n'
        'log_every = 5\n[grid]\nmethods = ["gd"]\nstepsizes = ["theory", "theory*30"]\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    assert run_cli(["run", str(cfg), "--out", str(out), "-j", "1", "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("2 runs (1 completed, 1 no progress): 2 started, 0 already finished")
    (warning,) = cap.err.strip().splitlines()
    assert warning.startswith("warning: no progress: gd · identity · γ=theory*30 · seed 0 · ")
    assert "the loss ended above its start: f(x_T) = " in warning


@pytest.mark.parametrize("when", ["running", "preparing"])
def test_a_failing_run_is_failed_in_the_summary(
    when: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a run that raises (an error the config check could not foresee) is "failed", with its
    # error, in the summary and runs.csv: not "pending"
    import shrinkgrad.experiments.execute as execute
    import shrinkgrad.sim as sim
    from shrinkgrad.experiments.config import load_config
    from shrinkgrad.experiments.grid import expand

    def boom(*args: object, **kwargs: object) -> None:
        raise ValueError("batch size 1000 for client 0 must be in [1, m_i = 160]")

    monkeypatch.setattr(
        sim if when == "running" else execute,
        "simulate" if when == "running" else "prepare_run",
        boom,
    )
    cfg = tmp_path / "one.toml"
    cfg.write_text(
        'problem = "logistic_regression[dataset=a1a,n_clients=3]"\n[run]\nrounds = 5\n'
        '[grid]\nmethods = ["ef21"]\ncompressors = ["top_k[k=1]"]\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    (run,) = expand(load_config(cfg))
    assert run_cli(["run", str(cfg), "--out", str(out), "-j", "1", "--no-progress"]) == 1
    cap = capsys.readouterr()
    assert cap.out.startswith("1 run (1 failed): 1 started, 0 already finished → ")
    message = "ValueError: batch size 1000 for client 0 must be in [1, m_i = 160]"
    assert cap.err == f"failed: {run.label} [{run.run_id}]: {message}\n"
    runs = pd.read_csv(out / "runs.csv")
    assert runs[["status", "message"]].to_dict("records") == [
        {"status": "failed", "message": message}
    ]


def test_impossible_minibatches_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "mb.toml"
    cfg.write_text(
        'problem = "logistic_regression[dataset=a1a,n_clients=10]"\n[run]\nrounds = 5\n'
        '[grid]\nmethods = ["ef21_sgd[b=1000]"]\nstepsizes = [0.01]\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    assert run_cli(["run", str(cfg), "--out", str(out), "-j", "1", "--no-progress"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {cfg}: grid: ef21_sgd[b=1000] · identity · γ=0.01: ")
    assert "minibatch size b = 1000 is larger than client 0's m_i = 160 samples" in line
    assert not out.exists()


def test_an_out_of_another_experiment_is_refused(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0
    capsys.readouterr()
    other = tmp_path / "sweep.toml"
    other.write_text(
        CONFIG.replace('name = "cli-small"', "").replace('"ef21", "ef21_w"', '"ef21"'),
        encoding="utf-8",
    )
    before = sorted(p.name for p in out.iterdir())
    for extra in ([], ["--dry-run"]):
        assert run_cli(["run", str(other), "--out", str(out), *extra]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(
            f"error: --out {str(out)!r} holds the results of another experiment ('cli-small', "
            f"from {config}); writing 'sweep' there would replace"
        )
        assert line.endswith(f"give another --out, or delete or move {str(out)!r} first")
    # train checks the same, before any process starts
    assert run_cli(["train", str(other), "--out", str(out), "--nproc", "1"]) == 2
    assert _one_error_line(capsys).startswith(
        f"error: --out {str(out)!r} holds the results of another experiment ('cli-small'"
    )
    assert sorted(p.name for p in out.iterdir()) == before
