"""Defects of a user audit of the command line: each test fails without its fix.

* ``estimate`` on a LIBSVM file whose declared d is too large to simulate refuses in one line
  before allocating anything of size n × d (it used to grow until the OOM killer struck);
* ``ps --out`` under a regular file is refused before any process starts (the pre-check of
  ``run``/``train``/``reproduce``/``plot``), and a bad flag value names the flag, not "<config>";
* ``train`` interrupted by Ctrl-C says how to resume (``run``'s message), exit 130;
* bare ``shrinkgrad`` prints the help alone; a missing option value points to the subcommand's
  help;
* ``list datasets`` lists digits; gd's theory step records gd's own rule.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shrinkgrad.cli import main


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


# -- 1. estimate: a d too large to simulate ------------------------------------------------------
def _high_dimensional_file(path: Path, d: int = 1_000_000, samples: int = 40) -> Path:
    """A LIBSVM file whose largest feature index is ``d`` (a few hundred bytes)."""
    lines = []
    for i in range(samples):
        label = "+1" if i % 2 else "-1"
        lines.append(f"{label} {1 + i}:0.5 {1000 + 7 * i}:0.25 {d - i}:0.5")
    lines.append(f"-1 3:0.5 {d}:1")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def small_memory(monkeypatch: pytest.MonkeyPatch) -> int:
    """64 MiB of 'available' memory: one d-vector of d = 10⁶ (8 MB, the loader's check) fits,
    the n × d arrays of a simulated round (10 clients: 160 MB) do not."""
    import shrinkgrad.problems.memory as memory

    budget = 64 << 20
    monkeypatch.setattr(memory, "available_memory", lambda: budget)
    return budget


@pytest.fixture
def no_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything starts simulating (the oracle) or takes a pooled buffer."""
    import shrinkgrad._buffers as buffers
    from shrinkgrad.methods import oracle

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a simulation started: the refusal must come before it")

    monkeypatch.setattr(oracle.ProblemOracle, "__init__", boom)
    monkeypatch.setattr(buffers, "empty", boom)


def test_estimate_refuses_a_dimension_it_cannot_simulate_before_allocating(
    tmp_path: Path,
    small_memory: int,
    no_simulation: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import tracemalloc

    data = _high_dimensional_file(tmp_path / "hd.svm")
    args = [
        "estimate",
        "--problem",
        f"logistic_regression[dataset={data},n_clients=10]",
        "--network",
        "star[up=10mbit]",
    ]
    assert run_cli(args) == 2  # once for the imports (tracemalloc counts their code objects)
    capsys.readouterr()
    tracemalloc.start()
    try:
        code = run_cli(args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith("error: simulating ef21 on n = 10 clients at d = 1,000,000")
    assert "needs 160 MiB, more than the 64 MiB of memory available" in line
    assert "select or hash the features" in line
    assert peak < 4 << 20  # not one d-vector (8 MB), let alone n × d (80 MB), was allocated


def test_estimate_api_refuses_before_binding(
    tmp_path: Path, small_memory: int, no_simulation: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shrinkgrad.methods.base import Method
    from shrinkgrad.network.estimate import estimate
    from shrinkgrad.problems import make_problem
    from shrinkgrad.problems.memory import MemoryBudgetError

    data = _high_dimensional_file(tmp_path / "hd.svm")
    problem = make_problem(f"logistic_regression[dataset={data},n_clients=10]")

    def no_bind(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("bound before the memory check")

    monkeypatch.setattr(Method, "bind", no_bind)
    with pytest.raises(MemoryBudgetError, match=r"d = 1,000,000 .* needs 160 MiB"):
        estimate(problem, "gd", "identity", "star[up=10mbit]")


def test_simulate_refuses_before_binding(
    tmp_path: Path, small_memory: int, no_simulation: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check sits where every simulation starts (``sim.engine.setup_run``: ``simulate``,
    the runs of ``shrinkgrad run`` and the ranks of ``shrinkgrad train``), not only in
    ``estimate``."""
    from shrinkgrad.methods.base import Method
    from shrinkgrad.problems import make_problem
    from shrinkgrad.problems.memory import MemoryBudgetError
    from shrinkgrad.sim import simulate

    data = _high_dimensional_file(tmp_path / "hd.svm")
    problem = make_problem(f"logistic_regression[dataset={data},n_clients=10]")

    def no_bind(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("bound before the memory check")

    monkeypatch.setattr(Method, "bind", no_bind)
    with pytest.raises(MemoryBudgetError, match=r"simulating ef21 on n = 10 .* needs 160 MiB"):
        simulate(problem, "ef21", "top_k[k=1]", stepsize=0.1, rounds=2)


# -- 2, 3. ps: --out under a file; the option that was wrong ----------------------------------
@pytest.fixture
def no_ps_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import shrinkgrad.distributed.ps as ps

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the parameter server started")

    monkeypatch.setattr(ps, "run_ps", boom)


def test_ps_out_under_a_file_is_refused_before_anything_starts(
    tmp_path: Path, no_ps_run: None, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x", encoding="utf-8")
    code = run_cli(
        ["ps", "--workers", "2", "--tau-max", "2", "--updates", "20", "--out", str(afile / "sub")]
    )
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line == (
        f"error: cannot create the directory {afile / 'sub'}: Not a directory; a part of the "
        "path is a file, not a directory: choose another --out"
    )
    assert "--resume" not in line and "NotADirectoryError" not in line


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--stepsize", "0"], "error: --stepsize 0: the step size must be a finite number > 0"),
        (["--delay", "-1"], "error: --delay -1.0: delay (seconds per gradient) must be"),
        (["--set", "ps.delay=-1"], "error: --set ps.delay=-1: delay (seconds per gradient)"),
        (["--set", "ps.bogus=1"], "error: --set ps.bogus=1: unknown parameter-server setting"),
        (["--workers", "0"], "error: --workers 0: workers (the number of worker processes)"),
        (
            ["--workers", "3", "--tau-max", "1"],
            "error: --workers 3, --tau-max 1: tau_max must be an integer >= 2, got 1",
        ),
        (
            ["--workers", "2", "--speeds", "1,2,3"],
            "error: --workers 2, --speeds 1,2,3: speeds needs one entry per worker",
        ),
    ],
)
def test_ps_names_the_option_that_was_wrong(
    tmp_path: Path,
    no_ps_run: None,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    start: str,
) -> None:
    base = ["ps", "--out", str(tmp_path / "X")]
    if "--workers" not in flags:
        base += ["--workers", "2", "--tau-max", "2"]
    code = run_cli([*base, *flags])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(start), line
    assert "<config>" not in line
    assert not (tmp_path / "X").exists()  # refused before the output directory was made


def test_ps_config_file_errors_still_name_the_file(
    tmp_path: Path, no_ps_run: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "ps.toml"
    config.write_text("[ps]\nworkers = 2\ndelay = -1\n", encoding="utf-8")
    assert run_cli(["ps", str(config), "--tau-max", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {config}: delay (seconds per gradient) must be")
    # a flag that makes the file's values impossible is the one named
    assert run_cli(["ps", str(config), "--set", "ps.delay=0.01", "--tau-max", "0"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --tau-max 0: tau_max must be an integer >= 1, got 0")


# -- 4. train: Ctrl-C ------------------------------------------------------------------------------
TRAIN_CONFIG = """
name = "tl"
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 1000000
log_every = 1000
checkpoint_every = 20
[grid]
methods = ["ef21"]
compressors = ["top_k[k=1]"]
"""

#: the command line with Ctrl-C delivered as KeyboardInterrupt even when the test runner was
#: started with SIGINT ignored (a background job), which its children would otherwise inherit
_WITH_SIGINT = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from shrinkgrad.cli import main; main(sys.argv[1:])"
)


@pytest.mark.distributed
@pytest.mark.slow
def test_train_interrupted_says_how_to_resume(tmp_path: Path) -> None:
    import time

    config = tmp_path / "tl.toml"
    config.write_text(TRAIN_CONFIG, encoding="utf-8")
    out = tmp_path / "tl"
    args = ["train", str(config), "--nproc", "2", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WITH_SIGINT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a terminal's foreground job
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        pattern = str(out / "runs" / "*" / "checkpoint.pt.rank*")
        while not glob.glob(pattern):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        "interrupted: finished runs are saved and running ones resume from their last "
        "checkpoint; run the same command again to resume"
    )
    assert "aborted" not in err and "Traceback" not in err
    assert glob.glob(pattern)  # the checkpoints it resumes from are still there


# -- 5. help and usage errors --------------------------------------------------------------------
def test_bare_command_prints_the_help_alone(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli([])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code in (0, 2)  # click >= 8.2: 2 (help on stderr); older: 0 (help on stdout)
    assert text.startswith("Usage: shrinkgrad [OPTIONS] COMMAND [ARGS]...")
    assert "error:" not in text and "(see '" not in text
    assert text.rstrip().splitlines()[-1].split() == [
        "train",
        "Run",
        "a",
        "config's",
        "runs",
        "on",
        "torch.distributed",
        "ranks.",
    ]


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["theory", "--clients"], "theory"),
        (["estimate", "--eps"], "estimate"),
        (["plot", "--x"], "plot"),
        (["run", "x.toml", "--jobs"], "run"),
    ],
)
def test_a_missing_option_value_points_to_the_subcommand_help(
    capsys: pytest.CaptureFixture[str], args: list[str], command: str
) -> None:
    assert run_cli(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (
        f"error: Option '{args[-1]}' requires an argument. (see 'shrinkgrad {command} --help')"
    )


def test_group_level_usage_errors_still_point_to_the_top_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_cli(["nope"]) == 2
    assert one_error_line(capsys.readouterr().err).endswith("(see 'shrinkgrad --help')")


# -- 6, 7. list datasets; gd's rule --------------------------------------------------------------
def test_list_datasets_includes_digits(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["list", "datasets"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if " digits " in line)
    assert "1797" in row and "64" in row and "10 classes" in row
    assert " a9a " in out and " w8a " in out


def test_gd_records_its_own_theory_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pandas as pd

    from shrinkgrad.methods import make_method
    from shrinkgrad.methods.gd import NOT_CONVEX
    from shrinkgrad.problems import make_problem

    p = make_problem("logistic_regression[dataset=a1a,n_clients=3]")
    bound = make_method("gd").bind(p, "identity", "theory")
    assert p.L is not None
    assert bound.cfg.stepsize_rule == "1/L" and bound.stepsize == pytest.approx(1 / p.L, rel=1e-12)
    assert make_method("gd").bind(p, None, "theory*4").cfg.stepsize_rule == "1/L*4"
    with pytest.warns(UserWarning, match="proved for convex f_i"):  # a1a's default reg
        dcgd = make_method("dcgd").bind(p, "identity", "theory")
    assert dcgd.cfg.stepsize_rule == "stepsize_dcgd" + NOT_CONVEX

    config = tmp_path / "gd.toml"
    config.write_text(
        'problem = "logistic_regression[dataset=a1a,n_clients=3]"\n[run]\nrounds = 4\n'
        'log_every = 2\n[grid]\nmethods = ["gd"]\nstepsizes = ["theory"]\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    assert run_cli(["run", str(config), "--out", str(out), "-j", "1", "--no-progress"]) == 0
    table = pd.read_parquet(out / "results.parquet")
    assert set(table["stepsize_rule"]) == {"1/L"}
    capsys.readouterr()
    assert run_cli(["list", "methods"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "│ gd " in line)
    assert "1/L (descent lemma)" in row
