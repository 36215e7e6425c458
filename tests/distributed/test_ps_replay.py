"""An asynchronous run is reproducible from its log, and a killed server is resumable.

* replay: ``simulate(problem, "asynchronous[trace=RUN_DIR]", ...)`` re-executes a real run of 3
  workers of different speeds (whatever arrival order happened) and gives its iterates;
* resume: a server killed with SIGKILL loses at most the updates since its last snapshot, says
  how many, and ``resume=True`` / ``--resume`` continues with new worker processes; the resumed
  run replays exactly too;
* the ``asynchronous`` method in the simulator (no processes): its round robin without staleness
  is the sequential IAG / DCGD, and its errors name what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from shrinkgrad.cli import main
from shrinkgrad.distributed.ps import PSConfig, PSServerLost, run_ps
from shrinkgrad.methods import make_method
from shrinkgrad.methods.gd import NOT_CONVEX
from shrinkgrad.problems import make_problem
from shrinkgrad.sim import simulate

A1A = "logistic_regression[dataset=a1a]"


@pytest.fixture(scope="module")
def three() -> object:
    return make_problem("logistic_regression[dataset=a1a,n_clients=3]")


def _config(method: str, compressor: str, **kw: object) -> PSConfig:
    base: dict[str, object] = {
        "problem": A1A,
        "workers": 3,
        "method": method,
        "compressor": compressor,
        "stepsize": 0.2,
        "updates": 120,
        "log_every": 3,
        "seed": 7,
        "speeds": (1, 2, 4),
        "delay": 0.002,
        "wire_dtype": "float64",
        "timeout": 30.0,
    }
    base.update(kw)
    return PSConfig(**base)  # type: ignore[arg-type]


def _replay(problem: object, out: Path, cfg: PSConfig, rounds: int) -> object:
    return simulate(
        problem,  # type: ignore[arg-type]
        f"asynchronous[trace='{out}']",
        cfg.compressor_spec,
        stepsize=cfg.stepsize,
        rounds=rounds,
        seed=cfg.seed,
        wire_dtype=torch.float64,
        log_every=cfg.log_every,
    )


def _same_run(res: object, sim: object) -> None:
    a, b = res.table, sim.table  # type: ignore[attr-defined]
    assert a["round"].tolist() == b["round"].tolist()
    for col in ("grad_norm_sq", "loss"):
        torch.testing.assert_close(
            torch.tensor(a[col].to_numpy()), torch.tensor(b[col].to_numpy()), rtol=1e-12, atol=0
        )
    assert a["bits_up"].tolist() == b["bits_up"].tolist()
    torch.testing.assert_close(res.x, sim.x, rtol=1e-12, atol=1e-14)  # type: ignore[attr-defined]


# -- replay ---------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("method", "compressor", "extra"),
    [
        ("iag", "rand_k[k=12]", {"tau_max": 3}),  # the table, bounded staleness
        ("dcgd", "qsgd[s=4]", {}),  # unbounded staleness, a random quantizer
        ("ef21", "top_k[k=12]", {"kill_workers": {2: 10}}),  # client memory, a lost worker
    ],
)
def test_the_simulator_replays_a_real_asynchronous_run(
    method: str, compressor: str, extra: dict[str, object], three: object, tmp_path: Path
) -> None:
    cfg = _config(method, compressor, **extra)
    res = run_ps(cfg, problem=three, out=tmp_path)  # type: ignore[arg-type]
    res.save(tmp_path, plot=False)
    st = res.staleness
    assert res.status == "completed" and set(st["worker"]) >= {0, 1}
    assert st["staleness"].max() >= 1  # the run really was asynchronous
    if "kill_workers" in extra:
        assert res.summary()["workers_lost"] == [2]
    _same_run(res, _replay(three, tmp_path, cfg, res.updates))
    # a log that contradicts itself is refused: a message computed at a version never sent
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("summary.json", "events.csv"):
        (bad / name).write_bytes((tmp_path / name).read_bytes())
    fake = st.copy()
    fake.loc[fake["update"] == 50, "version_computed"] += 1
    fake.to_csv(bad / "staleness.csv", index=False)
    with pytest.raises(ValueError, match="the trace is inconsistent: update 50"):
        _replay(three, bad, cfg, res.updates)
    with pytest.raises(ValueError, match=f"has {res.updates} updates; simulate at most"):
        _replay(three, tmp_path, cfg, res.updates + 1)


# -- resume ---------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_killed_server_resumes_from_its_snapshot_and_replays_exactly(
    three: object, tmp_path: Path
) -> None:
    cfg = _config(
        "ef21",
        "top_k[k=10]",
        updates=70,
        log_every=1,
        tau_max=4,
        snapshot_every=10,
        snapshot_seconds=1e6,
        kill_server_after=35,
    )
    with pytest.raises(PSServerLost, match="server process died") as err:
        run_ps(cfg, problem=three, out=tmp_path)  # type: ignore[arg-type]
    assert err.value.exit_codes["server"] == -9  # a real kill -9: no cleanup, no result
    assert (tmp_path / "checkpoint" / "snapshot.pt").is_file()
    with pytest.raises(ValueError, match="already holds a parameter-server run"):
        run_ps(cfg, problem=three, out=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="made with seed=7, this one has seed=8"):
        run_ps(cfg.replace(seed=8), problem=three, out=tmp_path, resume=True)  # type: ignore[arg-type]
    res = run_ps(cfg.replace(kill_server_after=None), problem=three, out=tmp_path, resume=True)  # type: ignore[arg-type]
    res.save(tmp_path, plot=False)
    assert res.status == "completed" and res.updates == 70
    assert res.summary()["resumed"] == [
        "resumed from the snapshot at update 30; the previous server had reached update 35: "
        "5 updates lost"
    ]
    assert res.exit_codes == {"server": 0, "worker0": 0, "worker1": 0, "worker2": 0}
    assert res.staleness["update"].tolist() == list(range(1, 71))  # every update once
    assert res.staleness_max <= 4
    assert res.staleness["delay"].max() <= 2 * 4  # across the restart too (the jobs' deadlines)
    assert res.table["time_s"].is_monotonic_increasing
    _same_run(res, _replay(three, tmp_path, cfg, res.updates))
    with pytest.raises(ValueError, match="already has 70 updates"):
        run_ps(cfg.replace(kill_server_after=None), problem=three, out=tmp_path, resume=True)  # type: ignore[arg-type]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_cli_resume_after_kill_9(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ps"
    cmd = ["ps", "--workers", "2", "--tau-max", "2", "--updates", "60", "--out", str(out)]
    cmd += ["--no-plot", "--no-progress", "--snapshot-every", "20"]
    cmd += ["--set", "ps.snapshot_seconds=100000"]
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--set", "ps.kill_server_after=50"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "server process died" in err and "--resume" in err
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--resume", "--set", "ps.tau_max=1"])
    assert exc.value.code == 2 and "made with tau_max=2" in capsys.readouterr().err
    main([*cmd, "--resume"])
    text = capsys.readouterr()
    assert "10 updates lost" in text.err and "status: completed" in text.out
    assert "resumed from the snapshot at update 40" in text.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 60 and len(summary["resumed"]) == 1
    assert pd.read_csv(out / "staleness.csv")["update"].tolist() == list(range(1, 61))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_resume_says_that_a_stateful_compressors_state_restarts(
    three: object, tmp_path: Path
) -> None:
    """PowerSGD's Q lives on the workers, not in the snapshot: the resumed run is valid but
    not the uninterrupted one, and its ``resumed`` line says so (a stateless compressor's
    resume is exact, test above, and says nothing of the kind)."""
    cfg = _config("ef21", "power_sgd[rank=2]", stepsize=0.05, updates=12)
    run_ps(cfg, problem=three, out=tmp_path)  # type: ignore[arg-type]
    res = run_ps(cfg.replace(updates=15), problem=three, out=tmp_path, resume=True)  # type: ignore[arg-type]
    assert res.updates == 15
    (line,) = res.summary()["resumed"]
    assert line.startswith("resumed from the snapshot at update 12")
    assert "power_sgd[rank=2] keeps state" in line and "not as the uninterrupted run" in line


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_resuming_a_run_at_its_time_limit_asks_for_more_time(three: object, tmp_path: Path) -> None:
    """A run stopped by max_time has used it up: resumed with the same max_time it would stop
    at once (it used to do nothing and exit 0); a larger one continues it."""
    cfg = _config("iag", "rand_k[k=12]", tau_max=2, updates=100_000, max_time=0.5)
    first = run_ps(cfg, problem=three, out=tmp_path)  # type: ignore[arg-type]
    assert first.status == "time_limit" and 0 < first.updates < 100_000
    with pytest.raises(ValueError, match=r"max_time=0.5 s would stop it at once; give a larger"):
        run_ps(cfg, problem=three, out=tmp_path, resume=True)  # type: ignore[arg-type]
    more = run_ps(cfg.replace(max_time=1.0), problem=three, out=tmp_path, resume=True)  # type: ignore[arg-type]
    assert more.status == "time_limit" and more.updates > first.updates


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_resume_on_a_changed_data_file_is_refused(tmp_path: Path) -> None:
    """The same spec on a LIBSVM file whose contents changed is another problem: the snapshot's
    fingerprint holds the problem's data digest (``problem.data``), so that resume is refused in
    one line; with the file as it was, it continues."""
    data = tmp_path / "mine.svm"
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(60, 5, generator=gen, dtype=torch.float64)
    labels = ["+1" if v > 0 else "-1" for v in torch.randn(60, generator=gen).tolist()]
    lines = [
        f"{y} " + " ".join(f"{j + 1}:{v:.6f}" for j, v in enumerate(row))
        for y, row in zip(labels, X.tolist(), strict=True)
    ]
    data.write_text("\n".join(lines) + "\n")
    cfg = _config(
        "dcgd", "rand_k[k=2]", problem=f"logistic_regression[dataset='{data}']", updates=12
    )
    out = tmp_path / "run"
    assert run_ps(cfg, out=out).updates == 12
    flipped = list(lines)
    flipped[7] = ("-1" if lines[7].startswith("+1") else "+1") + lines[7][2:]
    data.write_text("\n".join(flipped) + "\n")  # one label changed: same n, d, spec
    with pytest.raises(ValueError, match=r"was made with problem\.data='[0-9a-f]{40}', this one"):
        run_ps(cfg.replace(updates=24), out=out, resume=True)
    data.write_text("\n".join(lines) + "\n")
    assert run_ps(cfg.replace(updates=24), out=out, resume=True).updates == 24


def test_resume_needs_a_snapshot(tmp_path: Path) -> None:
    cfg = _config("iag", "rand_k[k=12]", tau_max=2)
    with pytest.raises(ValueError, match="no parameter-server snapshot"):
        run_ps(cfg, out=tmp_path, resume=True)
    with pytest.raises(ValueError, match="needs the run's output directory"):
        run_ps(cfg, resume=True)


# -- the asynchronous method in the simulator ------------------------------------------------------
@pytest.mark.parametrize("method", ["iag", "dcgd"])
def test_round_robin_without_staleness_is_the_sequential_method(method: str, three: object) -> None:
    # without compression there is no key to differ: client (t-1) mod n at the current model
    # (the asynchronous execution rounds messages to the wire dtype, as the wire does)
    f64 = {"stepsize": 0.5, "rounds": 30, "wire_dtype": torch.float64}
    seq = simulate(three, method, "identity", **f64)  # type: ignore[arg-type]
    rr = simulate(three, f"asynchronous({method})", "identity", **f64)  # type: ignore[arg-type]
    if method == "iag":
        assert torch.equal(rr.x, seq.x)
    else:  # incremental: one client per round instead of all
        assert not torch.allclose(rr.x, seq.x)
    theory = simulate(three, f"asynchronous({method})", "identity", rounds=1)  # type: ignore[arg-type]
    assert theory.stepsize_rule == make_method(method).bind(three, "identity").cfg.stepsize_rule  # type: ignore[arg-type]


def test_asynchronous_names_its_mistakes(tmp_path: Path, three: object) -> None:
    with pytest.raises(ValueError, match="not the directory of a parameter-server run"):
        make_method(f"asynchronous[trace='{tmp_path}']")
    with pytest.raises(ValueError, match=r"delayed_dcgd draws its delays.*asynchronously: dcgd"):
        make_method("asynchronous(delayed_dcgd)")
    with pytest.raises(ValueError, match="takes one method"):
        make_method("asynchronous(iag,dcgd)")
    m = make_method("asynchronous[tau_max=2](dcgd)")
    assert m.unsupported("ps") is not None and m.unsupported("simulator") is None
    b = m.bind(three, "rand_k[k=5]", "theory")  # type: ignore[arg-type]
    assert b.cfg.stepsize_rule.endswith("stepsize_delayed[tau=2])" + NOT_CONVEX)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resumed_float32_wire_ef21_run_is_the_uninterrupted_one(
    mode: str, tmp_path: Path
) -> None:
    """EF21's ``init="full"`` sends ∇f_i(x⁰) dense, rounded to the float32 wire: the worker's
    g_i must be that rounded vector, as the server's copy (what a resume rebuilds the worker
    from) is. It used to keep the unrounded gradient, so a killed and resumed run drifted from
    the uninterrupted one by ~1e-11 in ‖∇f‖² (float64 wires were exact). A sync round, or one
    asynchronous worker, has a deterministic schedule, so the two runs must be bit for bit
    the same."""
    workers = 3 if mode == "sync" else 1
    problem = make_problem(f"logistic_regression[dataset=a1a,n_clients={workers}]")
    cfg = _config(
        "ef21",
        "top_k[k=10]",
        workers=workers,
        mode=mode,
        speeds=None,
        updates=40,
        log_every=1,
        wire_dtype="float32",
        snapshot_every=10,
        snapshot_seconds=1e6,
    )
    full = run_ps(cfg, problem=problem, out=tmp_path / "full")  # type: ignore[arg-type]
    with pytest.raises(PSServerLost, match="server process died"):
        run_ps(cfg.replace(kill_server_after=25), problem=problem, out=tmp_path / "cut")  # type: ignore[arg-type]
    res = run_ps(cfg, problem=problem, out=tmp_path / "cut", resume=True)  # type: ignore[arg-type]
    assert res.summary()["resumed"][0].startswith("resumed from the snapshot at update 20")
    a, b = full.table, res.table
    assert a["round"].tolist() == b["round"].tolist() == list(range(41))
    for col in ("grad_norm_sq", "loss", "bits_up"):
        assert a[col].tolist() == b[col].tolist(), col
    assert torch.equal(full.x, res.x)
