"""k18-async claims on parameter-server runs that are not results.

Every status the parameter server can write (``PSResult.status``: read from its source below)
is either a result (``completed``, with every worker) or not: a run cut short by a time limit,
one that lost its workers, one interrupted, or one that completed after losing a worker (its
server then steps along the live workers' average) measures nothing, and a claim that needs it
reads n/a, or FAIL when another run fails it, never pass. Small synthetic results tables as
the executor writes them; the executor itself with a fake ``run_ps``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import shrinkgrad.distributed.ps as ps_pkg
from shrinkgrad.experiments.claims import Claim
from shrinkgrad.experiments.reproductions import REPRODUCTIONS, k18_async

K18 = dict(REPRODUCTIONS.get("k18-async").defaults)
PS_DIR = Path(ps_pkg.__file__).parent

CONVERGES = "at the delay rule's step"
STALLS = "with a large step"
BOUND = "bounded staleness"
SLOWER = "slow workers are staler"
RULE = "the delay rule at the measured delay"
TITLES = (BOUND, SLOWER, CONVERGES, STALLS, RULE)


def _run(
    run_id: str,
    tau: float | None,
    gns: list[float],
    *,
    status: str = "completed",
    lost: int = 0,
    staleness_max: int | None = None,
    delay_max: int | None = None,
) -> pd.DataFrame:
    """One run's rows as k18_async.execute writes them (bounded when ``tau`` is given)."""
    n = len(gns)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "round": range(n),
            "grad_norm_sq": gns,
            "stepsize_spec": "theory" if tau else "1/L",
            "stepsize": 0.05 if tau else 1.0,
            "L": 1.0,
            "status": status,
            "tau_max_config": tau,
            "staleness_max": (5 if tau else 20) if staleness_max is None else staleness_max,
            "delay_max": (10 if tau else 30) if delay_max is None else delay_max,
            "rule_holds": tau is not None,
            "stepsize_bound_measured": 0.06 if tau else 0.02,
            "slow_mean_staleness": 4.0,
            "fast_mean_staleness_max": 2.0,
            "workers_lost": lost,
        }
    )


#: a bounded run that converges (final/initial 1e-5 ≤ converge_factor) and a 1/L run that
#: stalls (median of the 2nd half 1.5 ≥ stall_factor): every claim passes on the two
GOOD_B = ([1.0, 1e-2, 1e-4, 1e-5],)
GOOD_F = ([1.0, 2.0, 0.5, 1.5],)


def _claim(claims: list[Claim], start: str) -> Claim:
    return next(c for c in claims if c.claim.startswith(start))


def _verdicts(table: pd.DataFrame, params: dict[str, Any] = K18) -> dict[str, bool | None]:
    cs = k18_async.claims(table, params)
    return {t: _claim(cs, t).passed for t in TITLES}


def _ps_statuses() -> set[str]:
    """Every status the parameter server can write: its ``stop("…")`` calls, the divergence
    of the metrics in results.py and the default of a loop that ended without one."""
    server = (PS_DIR / "server.py").read_text(encoding="utf-8")
    results = (PS_DIR / "results.py").read_text(encoding="utf-8")
    found = set(re.findall(r'stop\(\s*"(\w+)"', server))
    found |= set(re.findall(r'status=self\.status or "(\w+)"', server))
    found |= set(re.findall(r'status, message = "(\w+)"', results))
    return found


def test_the_good_tables_pass() -> None:
    """The baseline the tests below change one run of: both arms results, every claim passes."""
    t = pd.concat([_run("a", 6.0, *GOOD_B), _run("b", None, *GOOD_F)], ignore_index=True)
    assert set(_verdicts(t).values()) == {True}


def test_every_ps_status_is_classified() -> None:
    """completed is the only result; diverged did not converge; every other status (the ones
    the PS writes today, and any new one) measures nothing."""
    statuses = _ps_statuses()
    assert {"completed", "diverged", "time_limit", "workers_lost", "interrupted"} <= statuses
    for s in statuses:
        kind = k18_async.run_kind(_run("a", 6.0, *GOOD_B, status=s))
        expected = {"completed": k18_async.RESULT, "diverged": k18_async.STOPPED}
        assert kind == expected.get(s, k18_async.CUT), s
    assert k18_async.run_kind(_run("a", 6.0, *GOOD_B, lost=1)) == k18_async.CUT


CUT_STATUSES = sorted(_ps_statuses() - {"completed", "diverged"})


@pytest.mark.parametrize("status", CUT_STATUSES)
def test_a_cut_bounded_run_does_not_make_claims_pass(status: str) -> None:
    """The bounded run was cut short with a small last row (1e-4 ≤ 1e-3): 'converges', the
    staleness bound, 'slow workers are staler' and the rule all passed on it."""
    t = pd.concat(
        [_run("a", 6.0, [1.0, 1e-4], status=status), _run("b", None, *GOOD_F)], ignore_index=True
    )
    v = _verdicts(t)
    assert v[CONVERGES] is None and v[BOUND] is None and v[SLOWER] is None and v[RULE] is None
    assert v[STALLS] is True  # the other arm is a result
    assert status in _claim(k18_async.claims(t, K18), CONVERGES).measured


@pytest.mark.parametrize("status", CUT_STATUSES)
def test_a_cut_unbounded_run_does_not_stall(status: str) -> None:
    """A 1/L run cut after one update: the median of its '2nd half' (0.9 ≥ 1e-2) read as a
    stall."""
    t = pd.concat(
        [_run("a", 6.0, *GOOD_B), _run("b", None, [1.0, 0.9], status=status, delay_max=3)],
        ignore_index=True,
    )
    v = _verdicts(t)
    assert v[STALLS] is None and v[RULE] is None and v[SLOWER] is None
    assert v[CONVERGES] is True and v[BOUND] is True


def test_a_completed_run_that_lost_a_worker_is_no_result() -> None:
    """Completed after losing a worker: its server optimises the live workers' average, so its
    ‖∇f‖² of the full f stalls (0.3 ≥ 1e-2) whatever the step, and 'does not converge' passed."""
    free = _run("b", None, [1.0, 0.5, 0.3, 0.3], lost=1)
    t = pd.concat([_run("a", 6.0, *GOOD_B), free], ignore_index=True)
    stall = _claim(k18_async.claims(t, K18), STALLS)
    assert stall.passed is None, stall.measured
    assert "1 worker(s) lost" in stall.measured
    same = pd.concat([_run("a", 6.0, *GOOD_B), free.assign(workers_lost=0)], ignore_index=True)
    assert _claim(k18_async.claims(same, K18), STALLS).passed is True  # the rows do stall


def test_a_run_that_lost_every_worker_at_once_measures_no_staleness_bound() -> None:
    """Every worker lost before the first update: max staleness 0 ≤ tau_max passed claim 1."""
    gone = _run("a0", 6.0, [1.0], status="workers_lost", staleness_max=0, delay_max=0)
    t = pd.concat([gone, _run("b", None, *GOOD_F)], ignore_index=True)
    assert _claim(k18_async.claims(t, K18), BOUND).passed is None


def test_no_result_never_hides_a_failure() -> None:
    """n/a only when nothing fails: a result run that fails, or a bound exceeded in a cut run,
    fails the claim beside a cut run."""
    t = pd.concat(
        [
            _run("a0", 6.0, [1.0, 0.5], status="time_limit", staleness_max=7),  # 7 > tau_max
            _run("a1", 6.0, [1.0, 0.5, 0.4, 0.3]),  # 0.3 > 1e-3: does not converge
            _run("b", None, *GOOD_F),
        ],
        ignore_index=True,
    )
    assert int(K18["tau_max"]) < 7
    v = _verdicts(t)
    assert v[BOUND] is False and v[CONVERGES] is False


def test_diverged_runs_keep_their_reading() -> None:
    """A diverged bounded run fails 'converges' (claims.no_result); a diverged 1/L run does
    not converge, which the claim says; neither is a measured staleness or rule."""
    t = pd.concat(
        [
            _run("a", 6.0, [1.0, 1e-3, 1e-5], status="diverged"),
            _run("b", None, [1.0, 1e-3, 1e-4], status="diverged"),
        ],
        ignore_index=True,
    )
    v = _verdicts(t)
    assert v[CONVERGES] is False and v[STALLS] is True
    assert v[BOUND] is None and v[SLOWER] is None and v[RULE] is None


@pytest.mark.parametrize(
    ("arm", "missing"), [("bounded", (BOUND, CONVERGES, RULE)), ("free", (STALLS, RULE))]
)
def test_a_missing_arm_is_na_not_left_out(arm: str, missing: tuple[str, ...]) -> None:
    """Without one arm its claims vanished from the table (4 or 3 claims, all pass)."""
    t = _run("b", None, *GOOD_F) if arm == "bounded" else _run("a", 6.0, *GOOD_B)
    cs = k18_async.claims(t, K18)
    assert len(cs) == len(TITLES)
    for title in missing:
        assert _claim(cs, title).passed is None
    assert all(c.passed is True for c in cs if not c.claim.startswith(missing))


@pytest.mark.parametrize("speeds", [[1, 1, 1, 1], [1, 1, 5, 5]])
def test_no_single_slowest_worker_is_na(speeds: list[int]) -> None:
    """With a tied maximum of speeds the executor's 'slowest' worker is the first of them (the
    index order's choice), so the claim measured a random gap."""
    t = pd.concat([_run("a", 6.0, *GOOD_B), _run("b", None, *GOOD_F)], ignore_index=True)
    assert _claim(k18_async.claims(t, {**K18, "speeds": speeds}), SLOWER).passed is None
    assert _claim(k18_async.claims(t, {**K18, "speeds": [1, 1, 5, 1]}), SLOWER).passed is True


def test_verdicts_do_not_depend_on_row_order() -> None:
    t = pd.concat(
        [
            _run("a0", 6.0, *GOOD_B),
            _run("a1", 6.0, [1.0, 1e-4], status="time_limit"),
            _run("b0", None, *GOOD_F),
            _run("b1", None, [1.0, 1e-3, 1e-4], status="diverged"),
        ],
        ignore_index=True,
    )
    base = [c.as_dict() for c in k18_async.claims(t, K18)]
    for seed in range(3):
        shuffled = t.sample(frac=1.0, random_state=seed)
        assert [c.as_dict() for c in k18_async.claims(shuffled, K18)] == base


# --------------------------------------------------------------------------------------------
# the executor: lost workers and runs without rows
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _FakePS:
    table: pd.DataFrame
    status: str
    events: pd.DataFrame
    stepsize: float = 0.1
    stepsize_rule: str = "theory"
    staleness_max: int = 3
    delay_max: int = 6
    rule_holds: bool | None = True
    stepsize_bound_measured: float | None = 0.1
    config: dict[str, Any] = dataclasses.field(default_factory=lambda: {"compressor": "qsgd"})

    def save(self, out: Path) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)

    def mean_staleness(self) -> pd.Series:
        return pd.Series({0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0})


def _events(lost: list[int]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"time_s": 0.1 * i, "update": i, "worker": w, "event": "worker_lost", "detail": "x"}
            for i, w in enumerate(lost)
        ]
        + [{"time_s": 0.0, "update": 0, "worker": 0, "event": "init_received", "detail": ""}],
        columns=["time_s", "update", "worker", "event", "detail"],
    )


def _execute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, results: list[_FakePS]) -> Any:
    from shrinkgrad.experiments.config import load_config
    from shrinkgrad.experiments.reproductions import config_path

    queue = list(results)
    monkeypatch.setattr(ps_pkg, "run_ps", lambda config, problem=None: queue.pop(0))
    cfg = load_config(config_path(REPRODUCTIONS.get("k18-async")), profile="tiny")
    return k18_async.execute(cfg, tmp_path, progress=False)


def _table(rows: int) -> pd.DataFrame:
    from shrinkgrad.distributed.ps.results import TABLE_COLUMNS

    text = {c: "x" for c in ("method", "compressor", "stepsize_rule", "dataset", "problem")}
    row = {c: 0 for c in TABLE_COLUMNS} | text | {"grad_norm_sq": 1.0, "loss": 0.7, "tau_max": 6}
    return pd.DataFrame([row | {"round": 10 * i} for i in range(rows)], columns=TABLE_COLUMNS)


def test_execute_records_the_workers_a_run_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that lost workers 1 and 3 (3 twice in the events: one worker) but completed: the
    table said nothing of it, and its claims counted it as a result."""
    lost = [1, 3, 3]
    outcome = _execute(
        tmp_path,
        monkeypatch,
        [
            _FakePS(_table(3), "completed", _events(lost)),
            _FakePS(_table(3), "completed", _events([])),
        ],
    )
    per_run = outcome.table.groupby("run_id", sort=True)["workers_lost"].first().tolist()
    assert per_run == [len(set(lost)), 0]
    first = outcome.table[outcome.table["run_id"] == sorted(outcome.table["run_id"])[0]]
    assert k18_async.run_kind(first) == k18_async.CUT


def test_execute_keeps_a_run_without_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker lost during the initial messages: the server took no snapshot, the run's
    table is empty and the run vanished from the results table (the claims measured the other
    runs only)."""
    outcome = _execute(
        tmp_path,
        monkeypatch,
        [
            _FakePS(_table(0), "workers_lost", _events([0, 1, 2, 3])),
            _FakePS(_table(3), "completed", _events([])),
        ],
    )
    runs = outcome.table.groupby("run_id", sort=True)
    assert runs.ngroups == 2
    assert runs.size().tolist() == [1, 3]
    gone = outcome.table[outcome.table["status"] == "workers_lost"]
    assert len(gone) == 1 and int(gone["round"].iloc[0]) == 0
    assert k18_async.run_kind(gone) == k18_async.CUT
