"""Sweeps that meet trouble: resume counts, a second process, a dead worker, bad names and state
files, full and read-only disks, and the note on seeds that cannot differ."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from shrinkgrad import storage
from shrinkgrad.cli import main
from shrinkgrad.experiments.config import ConfigError, loads_config
from shrinkgrad.experiments.grid import expand
from shrinkgrad.experiments.results import CorruptFileError, load_results
from shrinkgrad.experiments.runner import run_experiment
from shrinkgrad.storage import DirectoryBusy, DirectoryLock, StorageError

#: 2 arms × 2 seeds with checkpoints every 20 of 60 rounds
CHECKPOINTED = """
name = "robust"
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 60
log_every = 10
checkpoint_every = 20
seeds = 2
[grid]
methods = ["ef21"]
compressors = ["top_k[k=1]", "top_k[k=2]"]
"""


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def no_time(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["time_s"]).reset_index(drop=True)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


class Recorder:
    """A display that records the events (and can act on them)."""

    def __init__(self, on_event: Any = None) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.on_event = on_event

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def event(self, kind: str, run: Any, payload: dict[str, Any]) -> None:
        self.events.append((kind, run.run_id, payload))
        if self.on_event is not None:
            self.on_event(kind, run, payload)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """The uninterrupted sweep's table."""
    out = tmp_path_factory.mktemp("reference")
    return run_experiment(loads_config(CHECKPOINTED), out, jobs=1, progress=False).table


# --------------------------------------------------------------------------------------------
# counts and notes
# --------------------------------------------------------------------------------------------
def test_a_resumed_sweep_counts_resumed_runs_apart_from_new_ones(
    tmp_path: Path, reference: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shrinkgrad.experiments.execute import execute_run

    monkeypatch.setattr(execute_run, "__defaults__", (0.0, None))  # a progress event every log row
    cfg = loads_config(CHECKPOINTED)
    runs = expand(cfg)

    def interrupt(kind: str, run: Any, payload: dict[str, Any]) -> None:
        # Ctrl-C in the middle of the second run (after its checkpoint at round 20)
        if kind == "progress" and run.run_id == runs[1].run_id and payload["round"] >= 30:
            raise KeyboardInterrupt

    first = run_experiment(cfg, tmp_path, jobs=1, display=Recorder(interrupt))
    assert first.interrupted and first.ran == 2 and first.resumed == 0 and first.skipped == 0
    second = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    assert (second.ran, second.resumed, second.skipped, second.started) == (3, 1, 1, 2)
    pd.testing.assert_frame_equal(no_time(second.table), no_time(reference), check_exact=True)
    from shrinkgrad.cli.run import summary_line

    line = summary_line(second)
    assert "4 runs (4 completed): 2 started, 1 resumed from checkpoints, 1 already finished" in line
    assert "not reached" in summary_line(first)  # runs 3 and 4 never started


def test_seeds_of_a_deterministic_arm_are_noted_as_identical(tmp_path: Path) -> None:
    cfg = loads_config(
        """
        problem = "logistic_regression[dataset=a1a,n_clients=4]"
        [run]
        rounds = 8
        log_every = 4
        seeds = 3
        [[pairs]]
        method = "ef21"
        compressor = "top_k[k=1]"
        [[pairs]]
        method = "dcgd"
        compressor = "rand_k[k=3]"
        stepsize = "1/L"
        """
    )
    res = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    dup = [n for n in res.notes if "identical" in n]
    assert len(dup) == 1 and dup[0].startswith("ef21 · top_k[k=1]") and "3 seeds" in dup[0]
    # the note says what the tables show: the random arm's seeds differ, the other's do not
    t = res.table.drop(columns=["seed", "seed_index", "run_id", "time_s"])
    ef21 = [
        g.reset_index(drop=True) for _, g in t[t["method"] == "ef21"].groupby(res.table["seed"])
    ]
    dcgd = [
        g.reset_index(drop=True) for _, g in t[t["method"] == "dcgd"].groupby(res.table["seed"])
    ]
    assert all(g.equals(ef21[0]) for g in ef21) and not dcgd[1].equals(dcgd[0])


# --------------------------------------------------------------------------------------------
# one directory, one sweep
# --------------------------------------------------------------------------------------------
def test_a_second_sweep_on_a_locked_directory_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CHECKPOINTED, encoding="utf-8")
    out = tmp_path / "out"
    with DirectoryLock(out, "shrinkgrad run other.toml"):
        with pytest.raises(
            DirectoryBusy, match=rf"in use by another shrinkgrad process \(pid {os.getpid()}"
        ):
            run_experiment(loads_config(CHECKPOINTED), out, jobs=1, progress=False)
        assert run_cli(["run", str(config), "--out", str(out), "-j", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith(f"error: {out} is in use")
            and "other.toml" in err[0]
        )
        assert not (out / "runs").exists()
    # released: the sweep runs
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from shrinkgrad.storage import DirectoryLock\n"
        f"DirectoryLock({str(tmp_path)!r}).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    import sys

    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryBusy, match=f"pid {proc.pid}"):
            DirectoryLock(tmp_path).acquire()
    finally:
        proc.kill()
        proc.wait()
    with DirectoryLock(tmp_path):
        pass


# --------------------------------------------------------------------------------------------
# a worker that dies
# --------------------------------------------------------------------------------------------
def test_a_killed_worker_is_reported_at_once_and_the_others_go_on(tmp_path: Path) -> None:
    cfg = loads_config(
        CHECKPOINTED.replace("rounds = 60", "rounds = 3000").replace(
            "checkpoint_every = 20", "checkpoint_every = 500"
        )
    )
    victim: list[str] = []

    def kill_first(kind: str, run: Any, payload: dict[str, Any]) -> None:
        if kind == "start" and not victim:
            victim.append(run.run_id)
            os.kill(payload["pid"], signal.SIGKILL)

    rec = Recorder(kill_first)
    res = run_experiment(cfg, tmp_path, jobs=2, display=rec)
    assert len(res.failed) == 1 and res.failed[0].run.run_id == victim[0]
    msg = res.failed[0].message
    assert "worker process" in msg and "SIGKILL" in msg and "run the same command again" in msg
    kinds = [(k, r) for k, r, _ in rec.events if k in ("failed", "done")]
    # reported when it happened: before the sweep's other runs finished
    assert kinds.index(("failed", victim[0])) < len(kinds) - 1
    assert sorted(r for k, r in kinds if k == "done") == sorted(
        r.run_id for r in expand(cfg) if r.run_id != victim[0]
    )
    again = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    assert again.complete and again.ran == 1 and again.skipped == 3


# --------------------------------------------------------------------------------------------
# names and state files
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("a/b", r"name: 'a/b' contains '/'.*one directory name"),
        ("..", r"name: '\.\.' is '\.\.'"),
        ("x" * 300, r"name: is 300 bytes long.*<= 200 bytes"),
    ],
)
def test_an_experiment_name_that_cannot_be_a_directory_is_a_config_error(
    name: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        loads_config(f'name = "{name}"\n' + CHECKPOINTED.split("\n", 2)[2])


def test_an_output_path_the_file_system_cannot_hold_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CHECKPOINTED, encoding="utf-8")
    out = tmp_path / ("y" * 300)
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "File name too long" in err[0] and "shorter --out" in err[0]


@pytest.mark.parametrize("victim", ["done.json", "table.parquet"])
def test_a_corrupt_run_state_file_is_named_with_the_fix(
    victim: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CHECKPOINTED, encoding="utf-8")
    out = tmp_path / "out"
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0
    run_dir = out / "runs" / expand(loads_config(CHECKPOINTED))[2].run_id
    (run_dir / victim).write_bytes(b"\x00garbage{")
    before = snapshot(out)
    with pytest.raises(CorruptFileError, match=rf"{run_dir / victim}: cannot read it"):
        run_experiment(loads_config(CHECKPOINTED), out, jobs=1, progress=False)
    capsys.readouterr()
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run_dir / victim) in err[0]
    assert f"delete the directory {run_dir} to run this run again" in err[0]
    assert snapshot(out) == before  # nothing was changed
    # the fix works
    import shutil

    shutil.rmtree(run_dir)
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0


# --------------------------------------------------------------------------------------------
# full and read-only disks
# --------------------------------------------------------------------------------------------
def test_a_disk_that_fills_up_stops_the_sweep_and_leaves_nothing_half_written(
    tmp_path: Path, reference: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = storage._fsync_path
    calls = [0]

    def full_after_some_files(path: Path) -> None:
        calls[0] += 1
        if calls[0] > 24:  # the probe writes without it; config, env, a few runs succeed
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path)

    monkeypatch.setattr(storage, "_fsync_path", full_after_some_files)
    with pytest.raises(StorageError, match="No space left on device; the disk is full"):
        run_experiment(loads_config(CHECKPOINTED), tmp_path, jobs=1, progress=False)
    monkeypatch.setattr(storage, "_fsync_path", real)
    assert not list(tmp_path.rglob("*.tmp"))  # every failed write removed its temporary file
    finished = [d for d in (tmp_path / "runs").iterdir() if (d / "done.json").exists()]
    assert 0 < len(finished) < 4
    for d in finished:  # what is there is complete
        pd.read_parquet(d / "table.parquet")
    res = run_experiment(loads_config(CHECKPOINTED), tmp_path, jobs=1, progress=False)
    assert res.complete and res.skipped == len(finished)
    pd.testing.assert_frame_equal(no_time(res.table), no_time(reference), check_exact=True)


def test_a_full_disk_is_reported_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CHECKPOINTED, encoding="utf-8")
    out = tmp_path / "out"

    def enospc(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage.os, "fsync", enospc)
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: cannot write to {out}: No space left on device; the disk is full: free some "
        "space (or choose another --out) and run the same command again; finished runs are kept"
    ]
    assert [p.name for p in out.iterdir()] == []


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str) -> Any:
    where.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a tmpfs needs root"
)


@needs_root
def test_a_real_full_disk_tmpfs(tmp_path: Path, reference: pd.DataFrame) -> None:
    """A 4 MiB tmpfs with a ballast file: the probe passes, the sweep fills the disk, stops with
    one line, and after freeing space the same command finishes with the reference table."""
    config = tmp_path / "c.toml"
    config.write_text(CHECKPOINTED.replace("seeds = 2", "seeds = [0, 1, 2, 3, 4, 5]"), "utf-8")
    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        ballast = disk / "ballast"
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        ballast.write_bytes(b"\0" * (free - storage.PROBE_BYTES - 40_000))
        out = disk / "out"
        proc = subprocess.run(
            [_exe(), "run", str(config), "--out", str(out), "-j", "1", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith("error: cannot write ") and "the disk is full" in lines[-1]
        assert "Traceback" not in proc.stderr
        assert not list(out.rglob("*.tmp"))
        ballast.unlink()
        proc = subprocess.run(
            [_exe(), "run", str(config), "--out", str(out), "-j", "1", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        got = load_results(out)
    want = reference[reference["seed_index"] < 2]
    mine = got[got["seed_index"] < 2].reset_index(drop=True)
    pd.testing.assert_frame_equal(no_time(mine), no_time(want), check_exact=True)
    assert got["run_id"].nunique() == 12


def _exe() -> str:
    import sys

    return str(Path(sys.executable).with_name("shrinkgrad"))


def test_a_read_only_out_is_one_line_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CHECKPOINTED, encoding="utf-8")
    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False
    with contextlib.ExitStack() as stack:
        if root:  # chmod does not stop root: a read-only mount does
            disk = stack.enter_context(mounted_tmpfs(tmp_path / "disk", "16m"))
        else:
            disk = tmp_path / "disk"
            disk.mkdir()
        out = disk / "out"
        assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0
        before = snapshot(out)
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        else:
            for p in [out, *out.rglob("*")]:
                p.chmod(0o555 if p.is_dir() else 0o444)
            stack.callback(lambda: [p.chmod(0o755) for p in [out, *out.rglob("*")] if p.is_dir()])
        capsys.readouterr()
        longer = ["--set", "run.rounds=80"]
        assert run_cli(["run", str(config), "--out", str(out), "-j", "1", *longer]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: cannot write to {out}: ")
        assert ("read-only" in err[0]) if root else ("Permission denied" in err[0])
        assert snapshot(out) == before


def test_config_and_file_errors_survive_pickling_between_ranks() -> None:
    """train's ranks send an error to each other pickled: it must come back as itself (it used
    to fail in __init__ with 'missing 2 required positional arguments', printed by every rank
    before the real error)."""
    import pickle

    from shrinkgrad.experiments.config import ConfigError
    from shrinkgrad.experiments.results import CorruptFileError

    e = ConfigError("a.toml", "run.rounds", "must be > 0")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.key, back.reason) == (
        ConfigError,
        "a.toml: run.rounds: must be > 0",
        "run.rounds",
        "must be > 0",
    )
    c = CorruptFileError(Path("x/done.json"), "not JSON", "delete x")
    back2 = pickle.loads(pickle.dumps(c))
    assert type(back2) is CorruptFileError and str(back2) == str(c) and back2.path == c.path
