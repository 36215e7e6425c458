"""A sweep killed at random moments (SIGKILL) and interrupted (Ctrl-C at start-up, twice): the
results on disk stay readable and complete, and the same command finishes the sweep exactly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from shrinkgrad.experiments.config import loads_config
from shrinkgrad.experiments.runner import run_experiment

pytestmark = pytest.mark.slow

#: 8 tiny runs; checkpoints every 100 of 400 rounds, a row every 50
CONFIG = """
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 400
log_every = 50
checkpoint_every = 100
seeds = 2
[grid]
methods = ["ef21", "ef21_w"]
compressors = ["top_k[k=1]", "top_k[k=2]"]
"""


def _exe() -> str:
    return str(Path(sys.executable).with_name("shrinkgrad"))


def _start(config: Path, out: Path, jobs: int) -> subprocess.Popen[str]:
    cmd = [_exe(), "run", str(config), "--out", str(out), "-j", str(jobs), "--no-progress"]
    # SIGINT back to its default: a suite started from a background job inherits it ignored
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _group_alive(pgid: int) -> list[int]:
    """Processes of the process group ``pgid`` that still run (zombies excluded)."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(d.name))
    return alive


def _no_time(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["time_s"]).sort_values(["run_id", "round"]).reset_index(drop=True)


def test_sigkill_at_random_moments_never_corrupts_the_results(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CONFIG, encoding="utf-8")
    ref = run_experiment(loads_config(CONFIG), tmp_path / "ref", jobs=1, progress=False).table
    want = {rid: _no_time(t) for rid, t in ref.groupby("run_id")}
    out = tmp_path / "out"
    rng = random.Random(18)
    kills = 0
    for attempt in range(20):
        jobs = 2 if attempt % 4 == 3 else 1
        proc = _start(config, out, jobs)
        # wait until the sweep is past its start-up, then kill at a random moment
        deadline = time.monotonic() + 120
        while not (out / "env.json").exists() and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            if jobs == 2:  # kill the parent alone: its workers must exit by themselves
                os.kill(proc.pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 20
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group_alive(proc.pid) == []  # nothing left behind to write into out/
        # what is on disk is readable and holds complete runs only
        results = out / "results.parquet"
        if results.exists():
            table = pd.read_parquet(results)
            for rid, t in table.groupby("run_id"):
                pd.testing.assert_frame_equal(_no_time(t), want[rid], check_exact=True)
        for d in (out / "runs").glob("*"):
            if (d / "done.json").exists():
                pd.testing.assert_frame_equal(
                    _no_time(pd.read_parquet(d / "table.parquet")), want[d.name], check_exact=True
                )
        if proc.returncode == 0:
            break
    assert kills >= 10
    done = subprocess.run(
        [_exe(), "run", str(config), "--out", str(out), "-j", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = pd.read_parquet(out / "results.parquet")
    pd.testing.assert_frame_equal(_no_time(got), _no_time(ref), check_exact=True)
    assert not list(out.rglob("*.tmp"))


def _forkserver_started(pid: int) -> bool:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid and b"forkserver" in cmd:
                return True
    return False


def test_ctrl_c_during_worker_start_up_exits_130_without_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CONFIG, encoding="utf-8")
    proc = _start(config, tmp_path / "out", 2)
    deadline = time.monotonic() + 120
    while not _forkserver_started(proc.pid):  # the forkserver is importing torch right now
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output


def test_a_ctrl_c_while_the_forkserver_forks_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window in which the forkserver is forked: a Ctrl-C then must still interrupt this
    process (it used to be ignored there, and the sweep ran on to its end)."""
    from multiprocessing import forkserver

    from shrinkgrad.experiments.executors import _context, _start_forkserver

    def ctrl_c_meanwhile() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(forkserver, "ensure_running", ctrl_c_meanwhile)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _start_forkserver(_context())
            time.sleep(1.0)  # where a pending signal would have been delivered by now
    finally:
        signal.signal(signal.SIGINT, old)


_FORKSERVER_MASK = """
import signal, sys, time
from multiprocessing import forkserver
from shrinkgrad.experiments.executors import _context, _start_forkserver

_start_forkserver(_context())
pid = forkserver._forkserver._forkserver_pid
deadline = time.monotonic() + 120
samples = 0
while time.monotonic() < deadline:
    status = dict(
        line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines()
    )
    ignored = int(status["SigIgn"], 16) >> (signal.SIGINT - 1) & 1
    blocked = int(status["SigBlk"], 16) >> (signal.SIGINT - 1) & 1
    if not (ignored or blocked):
        sys.exit(f"after {samples} samples the starting forkserver takes SIGINT (a traceback)")
    if ignored and not blocked:
        sys.exit(0 if samples else "the forkserver was ready before it could be sampled")
    samples += 1
    time.sleep(0.001)
sys.exit(f"the forkserver still has SIGINT ignored={ignored}, blocked={blocked}")
"""


def test_the_starting_forkserver_holds_ctrl_c_then_ignores_it_unblocked() -> None:
    """While the forkserver starts (Python, torch) SIGINT is blocked or ignored there at every
    moment, so a Ctrl-C prints no traceback; it ends with SIGINT ignored and the block lifted,
    so the workers it forks do not inherit the block. (Starting multiprocessing's resource
    tracker inside the block used to lift it before the fork.)"""
    done = subprocess.run(
        [sys.executable, "-c", _FORKSERVER_MASK], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _long_sweep_checkpointing(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A long sweep on 2 workers, returned once some run has saved a checkpoint."""
    config = tmp_path / "c.toml"
    config.write_text(CONFIG.replace("rounds = 400", "rounds = 40000"), encoding="utf-8")
    out = tmp_path / "out"
    proc = _start(config, out, 2)
    deadline = time.monotonic() + 180
    while not list(out.glob("runs/*/checkpoint.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    return proc, out


def test_a_double_ctrl_c_exits_130(tmp_path: Path) -> None:
    proc, out = _long_sweep_checkpointing(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output
    assert list(out.glob("runs/*/checkpoint.pt"))  # the runs can resume


def test_sigterm_to_the_launcher_checkpoints_like_ctrl_c_and_exits_143(tmp_path: Path) -> None:
    """SIGTERM to ``run`` alone (``kill``, ``timeout``, a job scheduler) stops the sweep as a
    Ctrl-C does: every running run saves its checkpoint, runs.csv says interrupted, no worker is
    left behind, and the exit status is 143. It used to end the launcher without either file."""
    proc, out = _long_sweep_checkpointing(tmp_path)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output
    assert "Traceback" not in output and "interrupted" in output, output
    deadline = time.monotonic() + 10  # the forkserver ends once it sees its parent gone
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_alive(proc.pid) == []
    runs = pd.read_csv(out / "runs.csv")
    assert (runs["status"] == "interrupted").sum() >= 1, runs
    assert len(list(out.glob("runs/*/checkpoint.pt"))) >= 1  # the runs can resume
