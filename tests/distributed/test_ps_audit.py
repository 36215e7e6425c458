"""Audit of the asynchronous parameter server against independent computations.

* end statuses: every status a run can end with has its exit status (``results.EXIT_STATUSES``):
  a diverged run is no result and exits with 1 (it used to exit with 0), and a diverged run
  cannot be resumed (it used to run again from its last snapshot and add a ``resumed`` event);
* resume: a resumed run is the uninterrupted one (deterministic schedules: one worker, or
  synchronous rounds), also when it resumes at exactly a checkpoint round, after a time limit,
  or extends a completed run (whose last row, off the ``log_every`` grid, used to stay in the
  table); a finished run resumed without more updates changes nothing;
* staleness and the update: on real asynchronous runs every applied message is at most
  ``tau_max`` stale, the IAG's delay is at most 2·``tau_max``, the recorded delays are those of
  the recorded schedule, and x_{t} = x_{t−1} − γ (1/n) Σ_j Q_j(∇f_j(x^{v_j})) (IAG) /
  x_{t−1} − γ (1/n) Q_i(∇f_i(x^{v})) (DCGD) written from the formulas (docs/parameter_server.md,
  "Updates and scaling") gives the run's iterates; the simulator's replay of the log gives them
  too, and a replay on a problem of another size is refused.

Tiny problems (a1a cut in 1–3 clients), a few dozen updates, 127.0.0.1 only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from shrinkgrad.cli import main
from shrinkgrad.compressors import make_compressor
from shrinkgrad.distributed.ps import PSConfig, PSServerLost, run_ps
from shrinkgrad.distributed.ps.results import PSResult
from shrinkgrad.problems import make_problem
from shrinkgrad.rng import KeyStream
from shrinkgrad.sim import simulate

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

A1A = "logistic_regression[dataset=a1a]"
LSQ = "least_squares[dataset=a1a]"


@pytest.fixture(scope="module")
def one() -> Any:
    return make_problem("logistic_regression[dataset=a1a,n_clients=1]")


@pytest.fixture(scope="module")
def two() -> Any:
    return make_problem("logistic_regression[dataset=a1a,n_clients=2]")


@pytest.fixture(scope="module")
def three() -> Any:
    return make_problem("logistic_regression[dataset=a1a,n_clients=3]")


def _cfg(**kw: Any) -> PSConfig:
    base: dict[str, Any] = {
        "problem": A1A,
        "workers": 1,
        "method": "iag",
        "compressor": "rand_k[k=12]",
        "stepsize": 0.3,
        "updates": 40,
        "log_every": 5,
        "seed": 4,
        "timeout": 30.0,
        "snapshot_every": 10,
        "snapshot_seconds": 1e6,
    }
    base.update(kw)
    return PSConfig(**base)


def _cli(args: list[str]) -> int:
    """``shrinkgrad ARGS`` in this process; its exit status."""
    try:
        main(args)
    except SystemExit as e:
        return 0 if e.code is None else int(e.code)  # type: ignore[arg-type]
    return 0


def _same_trajectory(a: PSResult, b: PSResult) -> None:
    """The same iterates, rows, bits and schedule (everything but the wall times)."""
    cols = ["round", "grad_norm_sq", "loss", "bits_up", "bits_up_paper", "bits_down"]
    assert a.table["round"].tolist() == b.table["round"].tolist()
    for col in cols:
        assert a.table[col].tolist() == b.table[col].tolist(), col
    assert torch.equal(a.x, b.x)
    keep = ["update", "worker", "counter", "version_computed", "staleness", "delay"]
    assert a.staleness[keep].equals(b.staleness[keep])


def _files(out: Path) -> dict[str, bytes]:
    names = ["table.csv", "staleness.csv", "events.csv", "summary.json"]
    names += ["checkpoint/snapshot.pt", "checkpoint/updates.log"]
    return {n: (out / n).read_bytes() for n in names if (out / n).is_file()}


# -- end statuses and exit statuses ---------------------------------------------------------------
def test_every_end_status_has_an_exit_status() -> None:
    """The statuses a run can end with (PSResult's docstring and the docs' Results section)
    are exactly the mapped ones; only a result exits with 0."""
    from shrinkgrad.distributed.ps.results import EXIT_STATUSES

    assert set(EXIT_STATUSES) == {
        "completed",
        "time_limit",
        "diverged",
        "workers_lost",
        "interrupted",
    }
    assert [s for s, c in EXIT_STATUSES.items() if c == 0] == ["completed", "time_limit"]
    assert EXIT_STATUSES["diverged"] != 0 and EXIT_STATUSES["workers_lost"] != 0
    doc = (Path(__file__).parents[2] / "docs" / "parameter_server.md").read_text()
    for status in EXIT_STATUSES:
        assert f"`{status}`" in doc, status


_COMMON = ["--no-plot", "--no-progress", "--timeout", "30"]


@pytest.mark.parametrize(
    ("args", "status", "code"),
    [
        (["--stepsize", "0.5", "--updates", "6"], "completed", 0),
        (
            ["--stepsize", "0.5", "--updates", "100000", "--delay", "0.02", "--max-time", "0.3"],
            "time_limit",
            0,
        ),
        # a message norm beyond divergence_factor × the first one's: the server stops
        (
            ["--problem", LSQ, "--method", "dcgd", "--stepsize", "10", "--updates", "300"],
            "diverged",
            1,
        ),
        # f ≈ 1e299 with finite metrics: diverged by the simulator's rule, after the run
        (["--stepsize", "1e300", "--updates", "30"], "diverged", 1),
        (
            ["--stepsize", "0.5", "--updates", "100", "--set", "ps.kill_workers={0 = 3}"],
            "workers_lost",
            1,
        ),
    ],
    ids=["completed", "time_limit", "diverged-server", "diverged-metrics", "workers_lost"],
)
def test_the_exit_status_says_how_the_run_ended(
    args: list[str], status: str, code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A diverged run used to exit with 0 (only workers_lost and interrupted were non-zero)."""
    out = tmp_path / "ps"
    cmd = ["ps", "--workers", "1", "--compressor", "identity", "--log-every", "1"]
    got = _cli([*cmd, *_COMMON, *args, "--out", str(out)])
    text = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == status and f"status: {status} (" in text.out
    assert got == code
    if code:
        assert text.err.strip().splitlines()[-1].startswith("error: the run ")
    if status == "diverged":  # an independent look at the table: the loss left its start
        table = pd.read_csv(out / "table.csv")
        first, last = table["loss"].iloc[0], table["loss"].iloc[-1]
        assert not math.isfinite(last) or last > 100 * first or summary["updates"] < 300


@pytest.mark.parametrize("where", ["server", "metrics"])
def test_a_diverged_run_is_not_resumed(where: str, one: Any, two: Any, tmp_path: Path) -> None:
    """Its snapshot says diverged: a resume, with or without more updates, is refused in one
    line and changes no file. It used to run again from the last snapshot (appending a
    ``resumed`` event, and with several workers possibly another verdict)."""
    if where == "server":  # the server stops at a message beyond divergence_factor
        problem = make_problem("least_squares[dataset=a1a,n_clients=1]")
        cfg = _cfg(
            problem=LSQ,
            method="dcgd",
            compressor="identity",
            stepsize=10.0,
            updates=300,
            log_every=1,
            snapshot_every=1,
        )
    else:  # the metrics diverge after the run (f ≈ 1e299, finite)
        problem = two
        cfg = _cfg(workers=2, compressor="identity", stepsize=1e300, updates=30)
    out = tmp_path / "run"
    res = run_ps(cfg, problem=problem, out=out)
    res.save(out, plot=False)
    assert res.status == "diverged"
    before = _files(out)
    for updates in (cfg.updates, 2 * cfg.updates):
        with pytest.raises(ValueError, match=r"diverged \(.*\); there is nothing to continue"):
            run_ps(cfg.replace(updates=updates), problem=problem, out=out, resume=True)
    assert _files(out) == before


# -- resume ---------------------------------------------------------------------------------------
def test_extending_a_completed_run_is_the_longer_uninterrupted_run(
    one: Any, tmp_path: Path
) -> None:
    """23 updates (log_every 5: the last row, 23, is off the grid), then --updates 40 on
    purpose: the table is the 40-update run's, rows 0, 5, ..., 40, and so is the simulator's
    replay of the log. The row 23 used to stay in the middle of the table."""
    cfg = _cfg(updates=40, wire_dtype="float32")
    full = run_ps(cfg, problem=one, out=tmp_path / "full")
    first = run_ps(cfg.replace(updates=23), problem=one, out=tmp_path / "cut")
    assert first.table["round"].tolist() == [0, 5, 10, 15, 20, 23]
    more = run_ps(cfg, problem=one, out=tmp_path / "cut", resume=True)
    assert full.table["round"].tolist() == list(range(0, 41, 5))
    _same_trajectory(full, more)
    more.save(tmp_path / "cut", plot=False)
    sim = simulate(
        one,
        f"asynchronous[trace='{tmp_path / 'cut'}']",
        cfg.compressor_spec,
        stepsize=cfg.stepsize,
        rounds=40,
        seed=cfg.seed,
        log_every=cfg.log_every,
    )
    assert sim.table["round"].tolist() == more.table["round"].tolist()
    torch.testing.assert_close(sim.x, more.x, rtol=1e-12, atol=1e-14)


def test_a_run_resumed_after_its_time_limit_is_the_uninterrupted_run(
    one: Any, tmp_path: Path
) -> None:
    cfg = _cfg(updates=45, log_every=7, delay=0.01, wire_dtype="float32")
    full = run_ps(cfg, problem=one, out=tmp_path / "full")
    first = run_ps(cfg.replace(max_time=0.25), problem=one, out=tmp_path / "cut")
    assert first.status == "time_limit" and 0 < first.updates < 45
    res = run_ps(cfg, problem=one, out=tmp_path / "cut", resume=True)
    assert res.status == "completed"
    _same_trajectory(full, res)


def test_a_resume_at_exactly_a_checkpoint_round_is_the_uninterrupted_run(
    two: Any, tmp_path: Path
) -> None:
    """Synchronous rounds (a deterministic schedule), the server killed (-9) right after the
    snapshot of update 30: nothing is lost, and the resumed run is the uninterrupted one bit
    for bit (keys of every message, float32 wire). Resumed again without more updates, the
    finished run is refused and no file changes."""
    cfg = _cfg(workers=2, mode="sync", method="dcgd", wire_dtype="float32")
    full = run_ps(cfg, problem=two, out=tmp_path / "full")
    cut = tmp_path / "cut"
    with pytest.raises(PSServerLost, match="server process died"):
        run_ps(cfg.replace(kill_server_after=30), problem=two, out=cut)
    log = (cut / "checkpoint" / "updates.log").read_text().splitlines()
    assert int(log[-1].split(",")[0]) == 30  # the killed server's last update: the snapshot's
    res = run_ps(cfg, problem=two, out=cut, resume=True)
    assert res.summary()["resumed"] == [
        "resumed from the snapshot at update 30; the previous server had reached update 30: "
        "0 updates lost"
    ]
    _same_trajectory(full, res)
    res.save(cut, plot=False)
    before = _files(cut)
    with pytest.raises(ValueError, match="already has 40 updates"):
        run_ps(cfg, problem=two, out=cut, resume=True)
    assert _files(cut) == before


# -- staleness and the update ---------------------------------------------------------------------
def _from_the_formulas(problem: Any, cfg: PSConfig, st: pd.DataFrame) -> list[torch.Tensor]:
    """x^0, ..., x^T from the recorded schedule (worker i, its message counter k, the version v
    it was computed at) and the formulas: Q_i^k = C(∇f_i(x^v)) with the key (seed,
    "compressor", i, k); IAG: ĝ_i ← Q_i^k, x^t = x^{t−1} − γ (1/n) Σ_j ĝ_j (ĝ_j⁰ = C(∇f_j(x⁰))
    with the key of round 0); DCGD: x^t = x^{t−1} − γ (1/n) Q_i^k."""
    C = make_compressor(cfg.compressor_spec)
    n, gamma = cfg.workers, float(cfg.stepsize)

    def Q(v: torch.Tensor, i: int, k: int) -> torch.Tensor:
        return C(v.unsqueeze(0), KeyStream(cfg.seed, [i]).at(k))[0]

    xs = [problem.x0()]
    table = None
    if cfg.method == "iag":
        grads0 = problem.client_grads(xs[0])
        table = torch.stack([Q(grads0[i], i, 0) for i in range(n)])
    for i, k, v in st[["worker", "counter", "version_computed"]].itertuples(index=False):
        q = Q(problem.client_grads(xs[v])[i], i, k)
        if table is not None:
            table[i] = q
            xs.append(xs[-1] - gamma * table.mean(0))
        else:
            xs.append(xs[-1] - gamma * q / n)
    return xs


@pytest.mark.parametrize(("method", "tau_max"), [("iag", 2), ("dcgd", 3), ("dcgd", None)])
def test_staleness_delays_and_iterates_follow_the_recorded_schedule(
    method: str, tau_max: int | None, three: Any, tmp_path: Path
) -> None:
    cfg = _cfg(
        workers=3,
        method=method,
        tau_max=tau_max,
        speeds=(1, 2, 4),
        delay=0.002,
        updates=60,
        log_every=1,
        wire_dtype="float64",
    )
    res = run_ps(cfg, problem=three, out=tmp_path)
    assert res.status == "completed"
    st = res.staleness.sort_values("update").reset_index(drop=True)
    T = len(st)
    assert st["update"].tolist() == list(range(1, T + 1)) and T == 60
    # the schedule is consistent: a worker's message k was computed at the model it got after
    # its message k − 1 was applied (x⁰ for the first), and its counters run 1, 2, 3, ...
    for _, rows in st.groupby("worker"):
        assert rows["counter"].tolist() == list(range(1, len(rows) + 1))
        assert rows["version_computed"].tolist() == [0, *rows["update"].tolist()[:-1]]
    assert st["staleness"].max() >= 1  # the run really was asynchronous
    # staleness τ = (t − 1) − v, and the [K18] delay of update t: the oldest message the step
    # uses, (t − 1) − min_j v_j over the IAG's table (every entry starts at version 0)
    stale = st["update"] - 1 - st["version_computed"]
    assert stale.tolist() == st["staleness"].tolist()
    entry = [0] * cfg.workers
    delays = []
    for w, t, v in st[["worker", "update", "version_computed"]].itertuples(index=False):
        entry[w] = v
        delays.append(t - 1 - (min(entry) if method == "iag" else v))
    assert delays == st["delay"].tolist()
    if tau_max is not None:
        assert max(stale) <= tau_max
        assert max(delays) <= (2 * tau_max if method == "iag" else tau_max)
    # the update, from the formulas
    xs = _from_the_formulas(three, cfg, st)
    torch.testing.assert_close(res.x, xs[-1], rtol=1e-12, atol=1e-14)
    gns = [float(three.grad(x) @ three.grad(x)) for x in xs]
    torch.testing.assert_close(
        torch.tensor(res.table["grad_norm_sq"].to_numpy()),
        torch.tensor(gns, dtype=torch.float64),
        rtol=1e-10,
        atol=0,
    )
    # the simulator's replay of the log gives the same iterates; another problem size is refused
    res.save(tmp_path, plot=False)
    replay = f"asynchronous[trace='{tmp_path}']"
    kw: dict[str, Any] = {
        "stepsize": cfg.stepsize,
        "rounds": T,
        "seed": cfg.seed,
        "wire_dtype": torch.float64,
        "log_every": 1,
    }
    sim = simulate(three, replay, cfg.compressor_spec, **kw)
    torch.testing.assert_close(sim.x, xs[-1], rtol=1e-12, atol=1e-14)
    other = make_problem("logistic_regression[dataset=a1a,n_clients=2]")
    with pytest.raises(ValueError, match="had 3 workers, the problem has n=2 clients"):
        simulate(other, replay, cfg.compressor_spec, **kw)
