"""The sweep runner: results on disk, equality with simulate(), skip/resume, failures, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from shrinkgrad.experiments.config import load_config, loads_config
from shrinkgrad.experiments.grid import expand
from shrinkgrad.experiments.results import RESULT_COLUMNS, load_results
from shrinkgrad.experiments.runner import run_experiment
from shrinkgrad.sim import simulate


def no_time(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["time_s"]).reset_index(drop=True)


def test_a_sweep_writes_results_config_env_and_run_summaries(
    small_config: Path, tmp_path: Path
) -> None:
    cfg = load_config(small_config)
    out = tmp_path / "out"
    res = run_experiment(cfg, out, jobs=1, progress=False, command=["shrinkgrad", "run"])
    assert res.complete and res.ran == 12 and res.skipped == 0
    t = res.table
    assert list(t.columns) == list(RESULT_COLUMNS)
    assert t["run_id"].nunique() == 12 and len(t) == 12 * 4  # rounds 0, 4, 8, 12
    assert not t.isna().drop(columns=["mu"]).any().any()
    pd.testing.assert_frame_equal(load_results(out), t)
    env = json.loads((out / "env.json").read_text())
    for key in (
        "python",
        "torch",
        "numpy",
        "shrinkgrad",
        "host",
        "cpu_count",
        "git_commit",
        "seeds",
    ):
        assert key in env
    assert env["command"] == "shrinkgrad run" and env["runs"]["finished"] == 12
    assert load_config(out / "config.toml").fingerprint == cfg.fingerprint
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs["status"]) == {"completed"} and len(runs) == 12
    assert not any((out / "runs").glob("*/checkpoint.pt"))  # removed once a run finished


def test_each_run_is_exactly_simulate_with_the_derived_seed(
    small_config: Path, tmp_path: Path
) -> None:
    cfg = load_config(
        small_config, overrides={"grid.methods": ["ef21"], "problem.sweep.dataset": ["a1a"]}
    )
    res = run_experiment(cfg, tmp_path / "o", jobs=1, progress=False)
    from shrinkgrad.problems import make_problem

    for run in expand(cfg):
        problem = make_problem(run.problem.spec)
        step = 1.0 / problem.L if run.arm.stepsize == "1/L" else run.arm.stepsize
        ref = simulate(problem, run.arm.method, run.arm.compressor, step, 12, run.seed, log_every=4)
        got = res.table[res.table["run_id"] == run.run_id][list(ref.table.columns)]
        if run.arm.stepsize == "1/L":
            got = got.assign(stepsize_rule="constant")
        pd.testing.assert_frame_equal(no_time(got), no_time(ref.table), check_exact=True)
        assert (res.table[res.table["run_id"] == run.run_id]["L_var"] == problem.L_var).all()


def test_each_kind_of_run_is_warmed_up_once_per_process_before_it_is_timed(
    small_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One untimed round of simulate per (problem, method, compressor, step size) before the
    first timed run of that kind in the process (one-off costs, such as numba loading its
    kernels, used to land in the first run's time_s), and none before the others; the timed
    runs are unchanged (the test above compares them with simulate)."""
    import shrinkgrad.sim
    from shrinkgrad.experiments import execute

    monkeypatch.setattr(execute, "_WARMED", set())
    calls: list[tuple[str, str, int]] = []
    real = shrinkgrad.sim.simulate

    def spy(**kw: object) -> object:
        calls.append((str(kw["method"]), str(kw["compressor"]), int(kw["rounds"])))  # type: ignore[call-overload]
        return real(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(shrinkgrad.sim, "simulate", spy)
    cfg = load_config(small_config, overrides={"problem.sweep.dataset": ["a1a"]})
    res = run_experiment(cfg, tmp_path / "o", jobs=1, progress=False)
    assert len(res.table["run_id"].unique()) == 6  # 3 arms x 2 seeds
    warm = [c for c in calls if c[2] == 1]
    assert sorted(warm) == sorted({(r.arm.method, r.arm.compressor, 1) for r in expand(cfg)})
    assert len([c for c in calls if c[2] == 12]) == 6  # every timed run once


def test_rerunning_skips_finished_runs_and_keeps_the_table(
    small_config: Path, tmp_path: Path
) -> None:
    cfg = load_config(small_config, profile="tiny")
    first = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    again = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    assert again.ran == 0 and again.skipped == 12
    pd.testing.assert_frame_equal(again.table, first.table)
    # a longer run is a different run: it is not skipped
    longer = run_experiment(load_config(small_config), tmp_path, jobs=1, progress=False)
    assert longer.ran == 12 and set(longer.table["round"]) == {0, 4, 8, 12}


def test_a_failing_run_is_reported_and_the_others_finish(tmp_path: Path) -> None:
    cfg = loads_config(
        """
        problem = "logistic_regression[dataset=a1a,n_clients=3]"
        [run]
        rounds = 5
        checkpoint_every = 2
        [grid]
        methods = ["ef21", "ef21_w"]
        compressors = ["top_k[k=1]"]
        """
    )
    bad = expand(cfg)[0]
    (tmp_path / "runs" / bad.run_id).mkdir(parents=True)
    (tmp_path / "runs" / bad.run_id / "checkpoint.pt").write_bytes(b"not a checkpoint")
    res = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    assert not res.complete and len(res.failed) == 1
    assert res.failed[0].run.run_id == bad.run_id and "checkpoint" in res.failed[0].message
    assert set(res.table["method"]) == {"ef21_w"}
    runs = pd.read_csv(tmp_path / "runs.csv")
    # a run that raised is "failed" with its error (not "interrupted" or "pending")
    assert dict(zip(runs["method"], runs["status"], strict=True)) == {
        "ef21": "failed",
        "ef21_w": "completed",
    }
    (msg,) = runs.loc[runs["method"] == "ef21", "message"]
    assert msg == res.failed[0].message and "checkpoint" in msg
    # recorded in the run's directory: a later read of the directory says the same
    assert (tmp_path / "runs" / bad.run_id / "failed.json").exists()
    # once the cause is gone, the same command retries it and the failure is forgotten
    (tmp_path / "runs" / bad.run_id / "checkpoint.pt").unlink()
    again = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    assert again.complete and set(again.runs["status"]) == {"completed"}
    assert not (tmp_path / "runs" / bad.run_id / "failed.json").exists()


def test_csv_format_and_line_progress(
    small_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(small_config, profile="tiny", overrides={"grid.methods": ["ef21"]})
    res = run_experiment(cfg, tmp_path, jobs=1, fmt="csv", progress=True)
    assert res.results_path.name == "results.csv"
    assert (tmp_path / "runs" / res.table["run_id"].iloc[0] / "table.csv").exists()
    back = load_results(tmp_path)
    assert len(back) == len(res.table) and list(back.columns) == list(res.table.columns)
    err = capsys.readouterr().err
    assert err.count("\n") == 8 and "[8/8]" in err and "completed after 6 rounds" in err


def test_load_results_rebuilds_from_finished_runs(small_config: Path, tmp_path: Path) -> None:
    cfg = load_config(small_config, profile="tiny")
    res = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    (tmp_path / "results.parquet").unlink()
    rebuilt = load_results(tmp_path)
    assert set(rebuilt["run_id"]) == set(res.table["run_id"]) and len(rebuilt) == len(res.table)
    with pytest.raises(FileNotFoundError, match="no such results directory"):
        load_results(tmp_path / "missing")


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_the_same_command_resumes(tmp_path: Path) -> None:
    """SIGINT a 2-worker sweep mid-run; re-running finishes it with the uninterrupted tables."""
    config = tmp_path / "long.toml"
    config.write_text(
        """
        problem = "logistic_regression[dataset=a1a,n_clients=8]"
        [run]
        rounds = 4000
        log_every = 50
        checkpoint_every = 50
        [grid]
        methods = ["ef21", "ef21_w"]
        compressors = ["top_k[k=1]"]
        """,
        encoding="utf-8",
    )
    out = tmp_path / "out"
    exe = str(Path(sys.executable).with_name("shrinkgrad"))
    cmd = [exe, "run", str(config), "--out", str(out), "-j", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # SIGINT back to its default in the child: a suite started from a background job of a
    # non-interactive shell inherits SIGINT ignored, and Python then installs no handler
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # interrupt as soon as the first checkpoint exists (round 50 of 4000: a run takes seconds,
    # so it is certainly still running)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list(out.glob("runs/*/checkpoint.pt")):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "interrupted" in output and "run the same command again" in output
    checkpoints = list(out.glob("runs/*/checkpoint.pt"))
    assert checkpoints, output
    partial = pd.read_csv(out / "runs.csv")
    assert "interrupted" in set(partial["status"])
    # resume: the same command finishes every run
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = load_results(out)
    cfg = load_config(config)
    ref_problem = "logistic_regression[dataset=a1a,n_clients=8]"
    from shrinkgrad.problems import make_problem

    problem = make_problem(ref_problem)
    for run in expand(cfg):
        ref = simulate(
            problem, run.arm.method, run.arm.compressor, "theory", 4000, run.seed, log_every=50
        )
        got = table[table["run_id"] == run.run_id][list(ref.table.columns)]
        pd.testing.assert_frame_equal(no_time(got), no_time(ref.table), check_exact=True)


def test_worker_thread_pinning_keeps_numba_compiling(tmp_path: Path) -> None:
    """Workers import shrinkgrad (and numba) before pinning threads; compiling a parallel
    kernel afterwards must work (setting NUMBA_NUM_THREADS late breaks numba's next compile)."""
    code = (
        "import numba, numpy as np\n"
        "import shrinkgrad.experiments._preload\n"
        "from numba import njit, prange\n"
        "@njit(parallel=True)\n"
        "def f(x):\n"
        "    s = 0.0\n"
        "    for i in prange(x.shape[0]):\n"
        "        s += x[i]\n"
        "    return s\n"
        "import torch\n"
        "print(f(np.ones(10)), numba.get_num_threads(), torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["10.0", "1", "1"]
