"""``shrinkgrad train``: the same TOML configs and output directories as ``shrinkgrad run``."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pandas as pd
import pytest

from shrinkgrad.cli import main
from shrinkgrad.distributed import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

CONFIG = """
name = "dist-test"
[problem]
name = "logistic_regression"
dataset = "a1a"
n_clients = 5
[run]
rounds = 12
log_every = 4
seeds = 1
[grid]
methods = ["ef21", "ef21_w"]
compressors = ["top_k[k=3]"]
stepsizes = ["theory"]
"""


def _write_config(tmp_path: Path) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


def _compare(dist_dir: Path, sim_dir: Path, world_size: int = 3) -> None:
    got = pd.read_parquet(dist_dir / "results.parquet")
    want = pd.read_parquet(sim_dir / "results.parquet")
    assert list(got.columns) == list(want.columns)
    assert len(got) == len(want) == 2 * 4  # two runs, rounds 0, 4, 8, 12
    exact = [c for c in want.columns if c not in ("grad_norm_sq", "loss", "time_s")]
    pd.testing.assert_frame_equal(got[exact], want[exact])
    for c in ("grad_norm_sq", "loss"):
        assert ((got[c] - want[c]).abs() <= 1e-10 * want[c].abs()).all()
    got_runs = pd.read_csv(dist_dir / "runs.csv")
    assert got_runs["run_id"].tolist() == pd.read_csv(sim_dir / "runs.csv")["run_id"].tolist()
    assert (got_runs["world_size"] == world_size).all()


def test_train_writes_the_tables_of_shrinkgrad_run(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    main(["run", str(cfg), "--out", str(tmp_path / "sim"), "--jobs", "1", "--no-progress"])
    main(["train", str(cfg), "--nproc", "3", "--out", str(tmp_path / "dist")])
    _compare(tmp_path / "dist", tmp_path / "sim")
    assert not list((tmp_path / "dist").glob("runs/*/checkpoint*"))  # cleaned up
    # a second call finds every run finished and rewrites the same results
    before = (tmp_path / "dist" / "runs.csv").read_text()
    main(["train", str(cfg), "--nproc", "3", "--out", str(tmp_path / "dist")])
    assert (tmp_path / "dist" / "runs.csv").read_text() == before


def _torchrun_rank(rank: int, port: int, args: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    main(args)


def test_under_torchrun_each_process_is_one_rank(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    main(["run", str(cfg), "--out", str(tmp_path / "sim"), "--jobs", "1", "--no-progress"])
    args = ["train", str(cfg), "--out", str(tmp_path / "dist"), "--timeout", "30"]
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_torchrun_rank, args=(r, port, args)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(90)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    _compare(tmp_path / "dist", tmp_path / "sim")


def test_config_mistakes_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.replace('"top_k[k=3]"', '"top_k[kk=3]"'), encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        main(["train", str(bad), "--nproc", "2", "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has no parameter 'kk'" in err
    assert not (tmp_path / "x").exists()
    # --timeout: inf overflowed the process group's timeout (a traceback), nan was not named
    good = _write_config(tmp_path)
    for value, words in (("inf", "is not in the range"), ("nan", "nan is not a number")):
        with pytest.raises(SystemExit) as info:
            main(["train", str(good), "--timeout", value, "--out", str(tmp_path / "y")])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "'--timeout'" in err and words in err and "Traceback" not in err


def _train_with_progress(rank: int, world: int, cfg_path: Path, out: Path) -> list[str]:
    from shrinkgrad.experiments.config import load_config
    from shrinkgrad.experiments.distributed_sweep import train_config

    lines: list[str] = []
    train_config(load_config(cfg_path), out, progress=lines.append, progress_every=0.0)
    return lines


def test_progress_lines_come_from_rank_0_at_logged_rounds(tmp_path: Path) -> None:
    from shrinkgrad.distributed import spawn

    cfg = _write_config(tmp_path)
    by_rank = spawn(_train_with_progress, 2, (cfg, tmp_path / "dist"))
    assert by_rank[1] == []
    from shrinkgrad.experiments.config import load_config
    from shrinkgrad.experiments.distributed_sweep import plan

    runs, _, _ = plan(load_config(cfg))
    assert len(runs) == 2
    want = [f"{run.run_id} {run.label}: round {r}/12" for run in runs for r in (4, 8, 12)]
    assert by_rank[0] == want


def test_train_is_validated_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _write_config(tmp_path)
    out = tmp_path / "dist"
    # more ranks than clients: one line naming the problem, nothing written
    with pytest.raises(SystemExit) as info:
        main(["train", str(cfg), "--nproc", "6", "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nproc 6" in err[0] and "n=5 clients" in err[0]
    assert "--nproc <= 5" in err[0] and "resume" not in err[0] and not out.exists()
    # PowerSGD's shared basis spans every client: on 2 ranks each would span its own (another
    # algorithm than run's, stop 34's runtime audit); refused in one line
    shared = tmp_path / "shared.toml"
    shared.write_text(
        CONFIG.replace('"top_k[k=3]"', '"power_sgd[rank=1,rows=3,shared=true]"').replace(
            '["theory"]', "[0.5]"
        ),
        encoding="utf-8",
    )
    with pytest.raises(SystemExit) as info:
        main(["train", str(shared), "--nproc", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "shared basis" in err[0]
    assert "--nproc 2" in err[0] and not out.exists()


def test_a_resume_on_another_nproc_is_refused_and_env_json_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from shrinkgrad.experiments.config import load_config
    from shrinkgrad.experiments.grid import expand

    cfg = _write_config(tmp_path)
    out = tmp_path / "dist"
    main(["train", str(cfg), "--nproc", "2", "--out", str(out)])
    env = json.loads((out / "env.json").read_text())
    assert env["world_size"] == 2 and env["runs"] == {"total": 2, "already_finished": 0, "ran": 2}
    assert env["executor"] == "torch.distributed (gloo, 2 ranks)" and "git_commit" in env
    # an interrupted 3-process run: a 2-process resume is refused, naming the directory
    run = expand(load_config(cfg))[0]
    run_dir = out / "runs" / run.run_id
    (run_dir / "done.json").unlink()
    for r in range(3):
        (run_dir / f"checkpoint.pt.rank{r}-of-3").write_bytes(b"")
    before = (out / "results.parquet").read_bytes()
    with pytest.raises(SystemExit) as info:
        main(["train", str(cfg), "--nproc", "2", "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run_dir) in err[0] and "resume it with --nproc 3" in err[0]
    assert (out / "results.parquet").read_bytes() == before


INTERRUPTED_CONFIG = """
name = "dist-ctrl-c"
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 3000
log_every = 500
checkpoint_every = 100
[grid]
methods = ["gd"]
stepsizes = [0.05, 0.1]
"""


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_saves_the_finished_and_interrupted_runs_as_run_does(
    tmp_path: Path, how: str
) -> None:
    """``train`` interrupted while its second run goes (a terminal Ctrl-C: SIGINT to the
    process group) writes results.parquet and runs.csv, the first run completed and the second
    interrupted, prints the counts and exits with 130 (it used to write neither file). SIGTERM
    to the launcher alone (``kill``, ``timeout``, a scheduler) does the same and exits with
    143; it used to end the launcher at once and leave its ranks running the sweep unlocked."""
    import signal
    import time

    from cli_process import assert_group_gone, kill, start

    cfg = tmp_path / "c.toml"
    cfg.write_text(INTERRUPTED_CONFIG, encoding="utf-8")
    out = tmp_path / "dist"
    proc = start(["train", str(cfg), "--out", str(out), "--nproc", "2", "--no-progress"])
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            done = list(out.glob("runs/*/done.json"))
            # the second run's own checkpoint (the first run's ranks drop theirs just after
            # its done.json is written: those do not count)
            ckpt = [
                p
                for p in out.glob("runs/*/checkpoint.pt.rank*")
                if not (p.parent / "done.json").exists()
            ]
            if done and ckpt:
                break
            time.sleep(0.05)
        assert done and ckpt, "the first run did not finish, or the second did not checkpoint"
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert_group_gone(proc)
    finally:
        kill(proc)
    assert proc.returncode == (130 if how == "ctrl-c" else 143), stderr
    runs = pd.read_csv(out / "runs.csv")
    assert sorted(runs["status"]) == ["completed", "interrupted"]
    assert (out / "results.parquet").exists()
    assert "2 runs (1 completed, 1 interrupted)" in stderr and "Traceback" not in stderr
