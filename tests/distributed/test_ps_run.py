"""The parameter server for real: forked server + worker processes talking gloo on 127.0.0.1.

Every test starts at most three processes (one server, two workers; one worker for the exact
reductions), gives every process group a timeout, and is itself bounded by pytest-timeout.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shrinkgrad.cli import main
from shrinkgrad.distributed.ps import EXIT_SERVER_LOST, PSConfig, PSServerLost, run_ps
from shrinkgrad.methods import make_method
from shrinkgrad.methods.base import methods_for
from shrinkgrad.problems import make_problem
from shrinkgrad.rng import KeyStream
from shrinkgrad.sim import simulate
from shrinkgrad.storage import DirectoryBusy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

A1A = "logistic_regression[dataset=a1a]"


@pytest.fixture(scope="module")
def one() -> object:
    return make_problem("logistic_regression[dataset=a1a,n_clients=1]")


@pytest.fixture(scope="module")
def two() -> object:
    return make_problem("logistic_regression[dataset=a1a,n_clients=2]")


def _base(workers: int, **kw: object) -> PSConfig:
    kw.setdefault("compressor", "identity")
    return PSConfig(problem=A1A, workers=workers, timeout=30.0, **kw)  # type: ignore[arg-type]


#: a compressor for every kind of method the contract test meets
_COMPRESSORS = {"unbiased": "rand_k[k=12]", "contractive": "top_k[k=12]", "none": "identity"}


# -- exact reductions ------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["dcgd", "iag"])
def test_one_worker_without_compression_is_gradient_descent(method: str, one: object) -> None:
    gamma = 1.0 / one.L  # type: ignore[attr-defined]
    cfg = _base(1, method=method, stepsize=gamma, updates=40, log_every=1, wire_dtype="float64")
    res = run_ps(cfg, problem=one)  # type: ignore[arg-type]
    assert res.status == "completed" and res.exit_codes == {"server": 0, "worker0": 0}
    x = one.x0()  # type: ignore[attr-defined]
    for k in range(41):
        g = one.grad(x)  # type: ignore[attr-defined]
        row = res.table.iloc[k]
        assert int(row["round"]) == k
        assert row["grad_norm_sq"] == pytest.approx(float(g @ g), rel=1e-12, abs=0)
        assert row["loss"] == pytest.approx(one.loss(x), rel=1e-14)  # type: ignore[attr-defined]
        if k < 40:
            x = x - gamma * g
    torch.testing.assert_close(res.x, x, rtol=1e-13, atol=1e-15)
    assert (res.staleness["staleness"] == 0).all() and len(res.staleness) == 40


@pytest.mark.parametrize("method", methods_for("ps"))
def test_one_worker_is_the_sequential_method_exactly(method: str, one: object) -> None:
    """The contract of every method that runs on a parameter server: with one worker (no
    staleness) the run is the simulator's, n = 1, step for step and bit for bit (float64 on
    the wire): the worker runs the method's client step for its round k, the server its
    server step on the decoded message; the bits are the method's count."""
    comp, gamma = _COMPRESSORS[make_method(method).requires], 0.3
    cfg = _base(
        1,
        method=method,
        compressor=comp,
        stepsize=gamma,
        updates=25,
        log_every=1,
        seed=5,
        wire_dtype="float64",
    )
    res = run_ps(cfg, problem=one)  # type: ignore[arg-type]
    sim = simulate(one, method, comp, stepsize=gamma, rounds=25, seed=5, wire_dtype=torch.float64)  # type: ignore[arg-type]
    assert res.status == "completed" and res.table["method"].iloc[0] == f"async_{method}"
    assert torch.equal(res.x, sim.x)
    for col in ("round", "grad_norm_sq", "loss", "bits_up", "bits_up_paper", "bits_down"):
        assert res.table[col].tolist() == sim.table[col].tolist(), col
    assert not torch.equal(res.x, one.x0())  # type: ignore[attr-defined]


def test_one_worker_minibatches_use_the_keyed_sampler(one: object) -> None:
    # message k samples with the key (seed, "minibatch", 0, k), as the methods do in round k
    gamma, b, seed = 0.5, 40, 3
    cfg = _base(1, method="dcgd", stepsize=gamma, updates=15, log_every=1, seed=seed)
    res = run_ps(cfg.replace(batch_size=b, wire_dtype="float64"), problem=one)  # type: ignore[arg-type]
    keys = KeyStream(seed, [0], stream="minibatch")
    x = one.x0()  # type: ignore[attr-defined]
    for k in range(1, 16):
        g = one.client_stoch_grads(x, b, keys.at(k))[0]  # type: ignore[attr-defined]
        x = x - gamma * g
    torch.testing.assert_close(res.x, x, rtol=1e-13, atol=1e-15)
    full = run_ps(cfg, problem=one)  # type: ignore[arg-type]
    assert not torch.allclose(full.x, res.x)  # the minibatches did matter


def test_sync_mode_waits_for_every_worker_and_is_gradient_descent(two: object) -> None:
    gamma = 1.0 / two.L  # type: ignore[attr-defined]
    cfg = _base(
        2,
        method="dcgd",
        mode="sync",
        stepsize=gamma,
        speeds=(1, 4),
        delay=0.002,
        updates=20,
        log_every=1,
        wire_dtype="float64",
    )
    res = run_ps(cfg, problem=two)  # type: ignore[arg-type]
    x = two.x0()  # type: ignore[attr-defined]
    for _ in range(20):
        x = x - gamma * two.grad(x)  # type: ignore[attr-defined]
    torch.testing.assert_close(res.x, x, rtol=1e-12, atol=1e-15)
    st = res.staleness
    assert len(st) == 40 and (st["staleness"] == 0).all()  # both workers in every round
    assert (st.groupby("update")["worker"].nunique() == 2).all()
    assert res.table["method"].iloc[0] == "sync_dcgd"


# -- staleness ------------------------------------------------------------------------------------
def test_bounded_staleness_holds_and_slow_workers_are_staler(two: object) -> None:
    res = run_ps(
        _base(2, tau_max=2, speeds=(1, 6), delay=0.01, updates=120, stepsize="theory"),
        problem=two,  # type: ignore[arg-type]
    )
    st = res.staleness
    assert res.status == "completed" and len(st) == 120
    assert st["staleness"].max() <= 2  # the gate's promise
    assert st["delay"].max() <= 4  # IAG: table entries at most 2·tau_max old
    means = res.mean_staleness()
    assert means[1] > means[0]  # the 6x slower worker computes on older models
    assert res.tau_bound == 4 and res.rule_holds  # the step was derived for the bound


def test_unbounded_staleness_follows_the_speeds(two: object) -> None:
    gamma = 0.2 / two.L  # type: ignore[attr-defined]
    res = run_ps(
        _base(2, method="dcgd", speeds=(1, 10), delay=0.01, updates=150, stepsize=gamma),
        problem=two,  # type: ignore[arg-type]
    )
    st = res.staleness
    means = res.mean_staleness()
    counts = st["worker"].value_counts()
    # the fast worker delivers several updates per slow gradient, each making it staler
    assert counts[0] >= 2 * counts[1]
    assert means[1] >= means[0] + 1.5
    assert res.staleness_max >= 3  # more than the bound of the previous test allows
    # the delay rule evaluated at the *measured* delay
    assert res.delay_max == res.staleness_max
    assert res.stepsize_bound_measured == pytest.approx(
        2.0 / (two.L * (1 + (1 + 8 * res.delay_max * (res.delay_max + 1)) ** 0.5))  # type: ignore[attr-defined]
    )


# -- convergence ----------------------------------------------------------------------------------
def test_compressed_iag_converges_at_the_delay_rule_step(two: object) -> None:
    res = run_ps(
        _base(
            2,
            compressor="natural",  # unbiased, ω = 1/8
            tau_max=1,
            speeds=(1, 3),
            delay=0.002,
            updates=500,
            log_every=25,
            stepsize="theory",
        ),
        problem=two,  # type: ignore[arg-type]
    )
    gns = res.table["grad_norm_sq"].to_numpy()
    assert res.status == "completed" and res.rule_holds
    assert res.stepsize_rule.startswith("min(stepsize_dcgd,0.99*stepsize_delayed[tau=2]")
    assert gns[-1] <= 1e-4 * gns[0]
    assert res.table["loss"].iloc[-1] < res.table["loss"].iloc[0]


# -- failures -------------------------------------------------------------------------------------
def test_a_dead_worker_does_not_stop_the_server(two: object) -> None:
    pids: dict[str, int] = {}
    res = run_ps(
        _base(2, tau_max=1, delay=0.002, updates=120, stepsize="theory", kill_workers={1: 8}),
        problem=two,  # type: ignore[arg-type]
        on_start=pids.update,
    )
    assert sorted(pids) == ["server", "worker0", "worker1"]
    for pid in pids.values():  # nothing is left behind, not even a zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert res.status == "completed" and res.updates == 120
    lost = res.events[res.events["event"] == "worker_lost"]
    assert lost["worker"].tolist() == [1]
    when = int(lost["update"].iloc[0])
    assert when < 120
    after = res.staleness[res.staleness["update"] > when]
    assert len(after) > 0 and (after["worker"] == 0).all()
    assert res.exit_codes == {"server": 0, "worker0": 0, "worker1": -9}  # SIGKILL, no cleanup
    assert res.summary()["workers_lost"] == [1]


def test_a_dead_server_makes_the_workers_exit_promptly(two: object) -> None:
    cfg = _base(2, tau_max=1, delay=0.002, updates=10_000, stepsize="theory", kill_server_after=15)
    start = time.monotonic()
    with pytest.raises(PSServerLost, match="server process died") as err:
        run_ps(cfg, problem=two)  # type: ignore[arg-type]
    elapsed = time.monotonic() - start
    codes = err.value.exit_codes
    assert codes["server"] == -9
    assert codes["worker0"] == EXIT_SERVER_LOST and codes["worker1"] == EXIT_SERVER_LOST
    # noticed through the closed connection, not by waiting out the 30 s timeout
    assert elapsed < cfg.timeout


# -- command line ---------------------------------------------------------------------------------
def test_cli_runs_and_writes_every_result(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ps"  # type: ignore[operator]
    main(
        [
            "ps",
            "--workers",
            "2",
            "--tau-max",
            "1",
            "--speeds",
            "1,2",
            "--delay",
            "0.002",
            "--updates",
            "40",
            "--log-every",
            "5",
            "--compressor",
            "qsgd[s=4]",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert "status: completed" in text and "holds" in text
    for name in ("table.csv", "staleness.csv", "events.csv", "summary.json", "staleness.png"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 40 and summary["staleness_max"] <= 1
    with pytest.raises(SystemExit) as exc:
        main(["ps", "--workers", "3", "--tau-max", "1"])
    assert exc.value.code == 2
    assert "tau_max must be an integer >= 2" in capsys.readouterr().err


def test_cli_one_worker_without_staleness_holds_its_own_theory_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 12 item 6: ``--workers 1 --tau-max 0`` used to report its own theory step as
    VIOLATED (γ = 1/L equals the delay rule's bound at τ = 0, and that check is strict)."""
    main(["ps", "--workers", "1", "--tau-max", "0", "--updates", "30", "--no-progress"])
    text = capsys.readouterr().out
    assert "stepsize_dcgd" in text and "(holds)" in text and "VIOLATED" not in text


def test_cli_warns_when_speeds_have_no_delay(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # the real error (no delay bound) still follows
        main(["ps", "--workers", "2", "--speeds", "1,5"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "needs a delay bound" in err
    assert "warning: speeds without a delay change nothing" in err


# -- Ctrl-C ----------------------------------------------------------------------------------------
def test_sigint_to_the_server_ends_the_run_with_what_it_has(two: object) -> None:
    """The server's SIGINT handler stops the loop after the update in progress: the workers get
    STOP and exit normally, and the result holds every update made (status interrupted)."""
    import signal
    import threading

    cfg = _base(2, method="iag", stepsize="theory", tau_max=4, updates=10**9, log_every=50)

    def interrupt(pids: dict[str, int]) -> None:
        threading.Timer(5.0, os.kill, (pids["server"], signal.SIGINT)).start()

    res = run_ps(cfg, problem=two, on_start=interrupt)  # type: ignore[arg-type]
    assert res.status == "interrupted" and "Ctrl-C" in res.message
    assert res.exit_codes == {"server": 0, "worker0": 0, "worker1": 0}
    assert res.updates > 0 and len(res.staleness) == res.updates
    assert int(res.table["round"].iloc[-1]) == res.updates  # the final snapshot is kept


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    try:
        with open(path, encoding="ascii") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


@pytest.mark.parametrize("target", ["group", "launcher", "sigterm"])
def test_ctrl_c_saves_the_run_and_exits_130(tmp_path: object, target: str) -> None:
    """``shrinkgrad ps --out DIR`` interrupted like a terminal Ctrl-C (SIGINT to the whole
    process group), by a SIGINT to the launcher alone (it forwards it to the server), or by a
    SIGTERM to the launcher alone (``kill``, a scheduler): the results are written, with status
    interrupted, the exit status is 130 (143 after SIGTERM), and no process is left."""
    import signal

    from cli_process import assert_group_gone, kill, start

    out = Path(str(tmp_path)) / "ps"
    cmd = ["ps", "--problem", A1A, "--workers", "2", "--compressor", "qsgd[s=4]"]
    cmd += ["--tau-max", "4", "--updates", str(10**9), "--out", str(out), "--no-plot"]
    proc = start(cmd)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_children(proc.pid)) == 3, "the server and workers did not start"
        time.sleep(5.0)  # the update loop is running (~1 s after the fork, unloaded)
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM if target == "sigterm" else signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
        assert_group_gone(proc)
    finally:
        kill(proc)
    assert proc.returncode == (143 if target == "sigterm" else 130), stderr
    assert "Traceback" not in stderr and "interrupted: stopping the workers" in stderr
    assert "status: interrupted" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["updates"] > 0
    assert (out / "table.csv").exists() and (out / "staleness.csv").exists()


def test_the_server_reports_progress_on_stderr(
    two: object, capfd: pytest.CaptureFixture[str]
) -> None:
    """``progress_every``: lines 'ps: t/total updates ...' from the server process, t growing."""
    import re

    cfg = _base(2, method="iag", stepsize="theory", tau_max=4, updates=3000, delay=0.0005)
    res = run_ps(cfg, problem=two, progress_every=0.2)  # type: ignore[arg-type]
    assert res.status == "completed"
    err = capfd.readouterr().err
    seen = [int(m) for m in re.findall(r"^ps: (\d+)/3000 updates \(", err, flags=re.M)]
    assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] <= 3000
    assert "2/2 workers" in err
    quiet = run_ps(cfg, problem=two)  # type: ignore[arg-type]
    assert quiet.status == "completed" and "ps: " not in capfd.readouterr().err


def _hold_lock(out: str, held: Any, release: Any) -> None:
    from shrinkgrad.distributed.ps.checkpoint import Checkpoint

    with Checkpoint(out).hold():  # what a live launcher holds
        held.set()
        release.wait(60)


def test_a_directory_in_use_by_a_live_run_is_refused(
    two: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """While a run (here: another process holding its lock, as a live launcher does) writes
    into a directory, neither a new run nor a --resume may write there: each is refused in one
    line before any process starts. Without the lock two servers wrote the same snapshot, and
    the --resume reported updates "lost" by a server that was still running."""
    out = tmp_path / "ps"
    ctx = mp.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(out), held, release))
    holder.start()
    try:
        assert held.wait(30)
        for resume in (False, True):
            with pytest.raises(DirectoryBusy, match=r"is in use by another shrinkgrad process"):
                run_ps(_base(2, stepsize=0.1, updates=5), problem=two, out=out, resume=resume)
        with pytest.raises(SystemExit) as exc:
            main(["ps", "--workers", "2", "--stepsize", "0.1", "--out", str(out)])
        assert exc.value.code == 2 and "is in use" in capsys.readouterr().err
        assert not (out / "checkpoint" / "snapshot.pt").exists()
    finally:
        release.set()
        holder.join(30)
    # the lock ends with its process: the directory takes a run again
    res = run_ps(_base(2, stepsize=0.1, updates=5), problem=two, out=out)
    assert res.updates == 5 and (out / "checkpoint" / "snapshot.pt").exists()


def test_a_run_whose_metrics_turn_non_finite_reports_what_the_server_did(two: object) -> None:
    """γ = 1e307 keeps x finite (|x| ≈ 1e307) while f overflows (the sum of the samples'
    losses): the table stops at the last finite row, but the summary counts the updates the
    server applied (the update log) and does not pass the last finite ‖∇f‖² off as the run's
    last."""
    res = run_ps(_base(2, stepsize=1e307, updates=30, log_every=5), problem=two)
    assert res.status == "diverged" and res.message.startswith("non-finite metrics at update")
    assert len(res.staleness) == 30 and res.updates == 30
    assert int(res.table["round"].iloc[-1]) < 30
    s = res.summary()
    assert s["updates"] == 30 and s["grad_norm_sq_last"] is None and s["method"]


def test_a_run_whose_loss_explodes_with_finite_metrics_is_diverged(two: object) -> None:
    """The simulator's divergence rule (sim.options.Divergence), not only ‖∇f‖²: with the
    bounded nonconvex regularizer, γ = 1e300 leaves f and ∇f finite (f ≈ 1e299, ∇f saturated),
    and the run is diverged by the loss test at its first snapshot after round 0, the table
    ending at that row as the simulator's does. It used to report completed."""
    from shrinkgrad.sim.options import Divergence, DivergenceReference

    res = run_ps(_base(2, stepsize=1e300, updates=30, log_every=5), problem=two)
    assert res.status == "diverged" and "the loss grew from" in res.message
    rows = res.table
    assert rows["round"].tolist() == [0, 5] and rows["loss"].map(math.isfinite).all()
    ref = DivergenceReference(rows["grad_norm_sq"][0], rows["loss"][0], 0.0)
    assert Divergence().verdict(ref, rows["grad_norm_sq"][1], rows["loss"][1]) is not None
    assert res.message.endswith("at update 5") and res.updates == 30


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_network_problem_runs_with_a_numeric_step(mode: str) -> None:
    """A neural network's L is unknown: the run takes a numeric step, and the check of the
    theory at the measured delay, which needs L, is left out (None) instead of killing the
    server after the last update."""
    cfg = PSConfig(
        problem="mlp[dataset=digits,hidden=4]",
        workers=2,
        method="dcgd",
        compressor="identity",
        stepsize=0.05,
        updates=6,
        mode=mode,  # type: ignore[arg-type]
        timeout=30.0,
    )
    res = run_ps(cfg)
    assert res.status == "completed" and res.updates == 6
    assert res.rule_holds is None and res.stepsize_bound_measured is None


_CTRL_C_AT_START = """
import os, signal, sys
import multiprocessing.context as mpc
from shrinkgrad.distributed.ps import PSConfig, run_ps

signal.signal(signal.SIGINT, signal.default_int_handler)
start, n = mpc.ForkProcess.start, [0]

def start_and_interrupt(self):  # a Ctrl-C (to the launcher) while the processes start
    n[0] += 1
    if n[0] == 2:
        os.kill(os.getpid(), signal.SIGINT)
    start(self)

mpc.ForkProcess.start = start_and_interrupt
cfg = PSConfig(problem=sys.argv[1], workers=2, compressor="qsgd[s=4]", tau_max=4,
               updates=10**9, timeout=30.0)
print("status", run_ps(cfg).status, flush=True)
"""


def test_a_ctrl_c_while_the_processes_start_stops_the_run() -> None:
    """Before, a SIGINT that came while the launcher forked landed in a fork hook, where
    Python drops it, and the run went on to the end; it is held until the launcher can stop
    the run, which then ends ``interrupted`` (here with updates=10⁹ it could not end
    otherwise within the timeout)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AT_START, A1A],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    assert "status interrupted" in proc.stdout
    assert "Exception ignored" not in proc.stderr
    assert "interrupted: stopping the workers" in proc.stderr
