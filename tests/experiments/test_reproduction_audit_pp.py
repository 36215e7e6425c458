"""Claims of ``ef21w-sgd-pp`` and ``time-to-accuracy`` on partial tables and runs that are no
result, and ``k18-async`` when a parameter server dies.

Small synthetic results tables: a run that diverged, made no progress or ends with NaN must
never make a claim pass; a missing arm or dataset (a sweep cut short, a failed run) leaves the
claims that need it n/a instead of dropping them or measuring them on what is left; a tie must
not be decided by the table's row order; figures draw partial tables. A parameter server that
dies is a recorded run that is no result; the runs that finished are kept.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from run_tables import run_table

from shrinkgrad.experiments.reproductions import REPRODUCTIONS, draw, ef21w_sgd_pp, k18_async
from shrinkgrad.experiments.reproductions import time_to_accuracy as tta


def _claim(claims: list[Any], start: str) -> Any:
    return next(c for c in claims if c.claim.startswith(start))


# --------------------------------------------------------------------------------------------
# ef21w-sgd-pp
# --------------------------------------------------------------------------------------------
CONSTS = {"n_clients": 5, "d": 10, "L": 1.0, "L_max": 3.0}
SGD = ("ef21_sgd[b=1]", "ef21_w_sgd[b=1]")
PP = ("ef21_pp[p=0.5]", "ef21_w_pp[p=0.5]")
PAIRS = [list(SGD), list(PP)]
#: dataset → (L_AM, L_QM, bits ratio baseline/weighted): a large and a small L_QM/L_AM
DATASETS = {"big": (1.0, 1.5, 3.0), "small": (1.0, 1.001, 1.0)}
G = [1.0, 0.1, 0.01, 0.001]

BIG = "ef21_w_pp[p=0.5] needs fewer bits/n"
LARGER = "ef21_w_pp[p=0.5]'s advantage is larger"
NEVER = "the weighted variants are never worse"


def _pp_table(
    datasets: dict[str, tuple[float, float, float]] = DATASETS,
    *,
    drop: tuple[tuple[str, str], ...] = (),
    status: dict[tuple[str, str, int], str] | None = None,
    seeds: tuple[int, ...] = (0,),
) -> pd.DataFrame:
    """Both pairs on every dataset: the weighted method needs ``ratio``× fewer bits to each
    ‖∇f‖² than its baseline; no run of (dataset, method) in ``drop``; ``status`` per (dataset,
    method, seed)."""
    parts = []
    for p, (am, qm, ratio) in datasets.items():
        c = {**CONSTS, "L_AM": am, "L_QM": qm, "L_var": qm**2 - am**2}
        for base, imp in PAIRS:
            for method, f in ((base, ratio), (imp, 1.0)):
                if (p, method) in drop:
                    continue
                for s in seeds:
                    st = (status or {}).get((p, method, s), "completed")
                    bits = [0.0, 10 * f, 20 * f, 30 * f]
                    r = run_table(f"{p}-{method}-{s}", p, method, G, bits, status=st, **c)
                    parts.append(r.assign(seed_index=s))
    return pd.concat(parts, ignore_index=True)


def _pp(table: pd.DataFrame) -> list[Any]:
    return ef21w_sgd_pp.claims(table, {**ef21w_sgd_pp.DEFAULTS, "pairs": PAIRS})


def test_ef21w_sgd_pp_control() -> None:
    out = _pp(_pp_table())
    assert len(out) == 5 and all(c.passed is True for c in out), [c.measured for c in out]
    assert _claim(out, BIG).values["ratio"] == pytest.approx(3.0)


def test_ef21w_sgd_pp_a_variant_without_runs_does_not_pass_never_worse() -> None:
    """Every EF21-PP / EF21-W-PP run failed (none in the table): 'the weighted variants are
    never worse' passed on EF21-SGD alone."""
    t = _pp_table(drop=tuple((p, m) for p in DATASETS for m in PP))
    out = _pp(t)
    assert len(out) == 5
    assert _claim(out, BIG).passed is None and _claim(out, LARGER).passed is None
    never = _claim(out, NEVER)
    assert never.passed is None, never.measured
    assert "ef21_w_pp[p=0.5]" in never.measured


def test_ef21w_sgd_pp_no_runs_keeps_every_claim_na() -> None:
    """No run with the configured compressor: 'never worse' vanished from the claim table."""
    out = _pp(_pp_table().assign(compressor="top_k[k=2]"))
    assert len(out) == 5 and all(c.passed is None for c in out), [c.measured for c in out]


def test_ef21w_sgd_pp_large_l_var_is_read_from_every_dataset() -> None:
    """EF21-PP's pair has no run on the large-L_var dataset: its 'large L_var' claim was
    measured on 'small' (R = 1 < 2: FAIL, under the title 'where L_var is large (small, ...)'),
    and 'never worse' passed without it."""
    t = _pp_table(drop=(("big", PP[0]), ("big", PP[1])))
    out = _pp(t)
    big = _claim(out, BIG)
    assert big.passed is None, big.measured
    assert "(big," in big.claim
    assert _claim(out, NEVER).passed is None


@pytest.mark.parametrize("missing", [PP, PP[1:]])
def test_ef21w_sgd_pp_a_pair_without_runs_on_a_dataset_is_na(missing: tuple[str, ...]) -> None:
    """No run of ``missing`` on the small-L_var dataset: 'larger where L_var is larger' and
    'never worse' passed (both methods missing: the dataset dropped out) or failed on a NaN
    ratio (one missing); nothing was measured there."""
    t = _pp_table(drop=tuple(("small", m) for m in missing))
    out = _pp(t)
    assert _claim(out, BIG).passed is True  # measured on "big"
    for start in (LARGER, NEVER):
        c = _claim(out, start)
        assert c.passed is None, (start, c.measured)
        assert "small: no runs of" in c.measured or "small (" in c.measured


def test_ef21w_sgd_pp_a_missing_run_does_not_hide_a_failure() -> None:
    """n/a only when nothing fails: EF21-W-SGD is worse on 'small' (R = 0.5) while EF21-W-PP has
    no run there."""
    ds = {"big": (1.0, 1.5, 3.0), "small": (1.0, 1.001, 0.5)}
    out = _pp(_pp_table(ds, drop=(("small", PP[1]),)))
    assert _claim(out, NEVER).passed is False
    assert _claim(out, NEVER).values["min_ratio"] == pytest.approx(0.5)


def test_ef21w_sgd_pp_ties_in_l_qm_over_l_am_do_not_depend_on_row_order() -> None:
    """Two datasets share the largest L_QM/L_AM (R = 3 and 1.5): idxmax took the first in the
    table, so 'R ≥ 2 where L_var is large' passed or failed with the row order. Both are the
    largest: 1.5 < 2 fails it, and each beats the small dataset's R = 1."""
    ds = {"a": (1.0, 1.5, 3.0), "b": (1.0, 1.5, 1.5), "c": (1.0, 1.001, 1.0)}
    t = _pp_table(ds)
    order_b = pd.concat([t[t["problem_label"] == "b"], t[t["problem_label"] != "b"]])
    verdicts = []
    for table in (t, order_b):
        out = _pp(table)
        verdicts.append((_claim(out, BIG).passed, _claim(out, LARGER).passed))
    assert verdicts == [(False, True), (False, True)]


def test_ef21w_sgd_pp_no_contrast_in_l_var_is_na() -> None:
    """Every dataset has the same L_QM/L_AM: 'larger where L_var is larger' compared a dataset
    with itself (FAIL); there is no contrast to measure."""
    ds = {"a": (1.0, 1.5, 3.0), "b": (1.0, 1.5, 2.5)}
    c = _claim(_pp(_pp_table(ds)), LARGER)
    assert c.passed is None, c.measured


def test_ef21w_sgd_pp_runs_that_are_no_result_fail() -> None:
    """Every run diverged: no claim passes; the weighted method diverged on 2 of 3 seeds (a
    lucky third seed): its median reaches nothing, R = 0."""
    out = _pp(_pp_table().assign(status="diverged"))
    assert all(c.passed is False for c in out), [c.measured for c in out]
    st = {(p, PP[1], s): "diverged" for p in DATASETS for s in (1, 2)}
    out = _pp(_pp_table(status=st, seeds=(0, 1, 2)))
    assert _claim(out, BIG).values["ratio"] == 0.0 and _claim(out, BIG).passed is False
    assert _claim(out, NEVER).passed is False


@pytest.mark.parametrize("case", ["all diverged", "cut", "one dataset"])
def test_ef21w_sgd_pp_figures_of_partial_tables(case: str, tmp_path: Path) -> None:
    t = _pp_table()
    if case == "all diverged":
        t = t.assign(status="diverged")
    elif case == "cut":
        t = t[~t["method"].isin(PP)]
    else:
        t = t[t["problem_label"] == "big"]
    rep = REPRODUCTIONS.get("ef21w-sgd-pp")
    paths = draw(rep, t, {**ef21w_sgd_pp.DEFAULTS, "pairs": PAIRS}, tmp_path)
    assert paths and all(p.is_file() for p in paths)


# --------------------------------------------------------------------------------------------
# time-to-accuracy
# --------------------------------------------------------------------------------------------
SLOW, FAST = "star[up=100kbit,down=inf,compute=1ms]", "star[up=10mbit,down=inf,compute=1ms]"
UP = {SLOW: 1e5, FAST: 1e7}
C = 1e-3
GD, QSGD, TOPK = ("gd", "identity"), ("dcgd", "qsgd[s=1]"), ("ef21", "top_k[k=1]")
CHANGES = "the fastest method to ε changes with the bandwidth"
PREDICTS = "rounds-to-ε × (compute + bits/bandwidth) predicts"
GRID = "every tuned step lies inside its grid"


def _tta_run(
    problem: str,
    arm: tuple[str, str],
    step: float,
    rate: float,
    bits: float,
    net: str,
    *,
    status: str = "completed",
    last_loss: float | None = None,
    floor: float = 0.0,
) -> pd.DataFrame:
    """A run whose ‖∇f‖² and loss − floor are rate^t, sending ``bits`` per round on ``net``
    (c + bits/B a round)."""
    t = np.arange(11)
    loss = floor + rate**t
    if last_loss is not None:
        loss[-1] = last_loss
    return pd.DataFrame(
        {
            "run_id": f"{problem}|{arm}|{step}|{net}",
            "problem_label": problem,
            "network": net,
            "method": arm[0],
            "compressor": arm[1],
            "stepsize": step,
            "stepsize_spec": str(step),
            "seed_index": 0,
            "n_clients": 10,
            "round": t,
            "grad_norm_sq": rate**t,
            "loss": loss,
            "bits_up": t * bits,
            "time_model_s": t * (C + bits / UP[net]),
            "status": status,
        }
    )


def _tta_table(nets: tuple[str, ...] = (SLOW, FAST), **kw: Any) -> pd.DataFrame:
    """GD halves ‖∇f‖² per round at 1000 bits, QSGD per two rounds at 100 bits: QSGD wins on
    the slow network, GD on the fast one (B* = 800 kbit/s)."""
    parts = []
    for net in nets:
        parts.append(_tta_run("p", GD, 0.5, 0.5, 1000.0, net, **kw))
        parts.append(_tta_run("p", QSGD, 0.2, 0.5**0.5, 100.0, net, **kw))
    return pd.concat(parts, ignore_index=True)


def _by_title(claims: list[Any]) -> dict[str, Any]:
    return {t: _claim(claims, t) for t in (CHANGES, PREDICTS, GRID)}


def _tta(table: pd.DataFrame) -> dict[str, Any]:
    out = tta.claims(table, tta.DEFAULTS)
    assert len(out) == 3
    return _by_title(out)


def test_time_to_accuracy_control() -> None:
    c = _tta(_tta_table())
    assert c[CHANGES].passed is True and c[PREDICTS].passed is True and c[GRID].passed is None


@pytest.mark.parametrize("status", ["diverged", "no_progress"])
def test_time_to_accuracy_every_run_no_result_passes_nothing(status: str) -> None:
    """Every run diverged: no arm reaches ε, the 'winner' on every network was the first arm of
    the table (GD), predicted and simulated alike, and the first-principles claim passed."""
    c = _tta(_tta_table(status=status))
    assert c[CHANGES].passed is False and c[PREDICTS].passed is False, c[PREDICTS].measured
    assert "no arm reaches ε" in c[CHANGES].measured


def test_time_to_accuracy_empty_table_passes_nothing() -> None:
    """A table with no runs: all([]) passed both claims."""
    c = _tta(_tta_table().iloc[:0])
    assert all(x.passed is None for x in c.values()), [x.measured for x in c.values()]


def test_time_to_accuracy_an_arm_missing_on_a_network() -> None:
    """QSGD (the low-bandwidth winner) has no run on the fast network: KeyError. GD missing
    there instead: QSGD 'won' the fast network alone, claim 1 failed, and claim 2 passed
    reading QSGD as 'the dense arm'."""
    t = _tta_table()
    for method in ("dcgd", "gd"):
        cut = t[~((t["network"] == FAST) & (t["method"] == method))]
        c = _tta(cut)
        assert c[CHANGES].passed is None, c[CHANGES].measured
        assert c[PREDICTS].passed is None, c[PREDICTS].measured
        assert "no tuned run of" in c[CHANGES].measured
        assert "is the dense arm" not in c[PREDICTS].measured


def test_time_to_accuracy_a_missing_arm_does_not_hide_a_failure() -> None:
    """The slow network lacks GD, and on the fast one first principles name GD while the
    simulated clock says QSGD (its times doubled): the claim fails, n/a does not hide it."""
    t = _tta_table()
    t = t[~((t["network"] == SLOW) & (t["method"] == "gd"))].copy()
    wrong = (t["network"] == FAST) & (t["method"] == "gd")
    t.loc[wrong, "time_model_s"] *= 10
    assert _tta(t)[PREDICTS].passed is False


def test_time_to_accuracy_no_dense_arm_leaves_the_crossover_unmeasured() -> None:
    """No GD run at all: the crossover part was skipped with the text '<winner> is the dense
    arm' and the claim passed on the winners alone."""
    t = _tta_table()
    parts = [t[t["method"] != "gd"]]
    for net in (SLOW, FAST):  # a second compressed arm, slower everywhere
        parts.append(_tta_run("p", TOPK, 0.5, 0.9, 100.0, net))
    c = _tta(pd.concat(parts, ignore_index=True))
    assert c[PREDICTS].passed is None, c[PREDICTS].measured
    assert "no dense (identity) arm" in c[PREDICTS].measured


def test_time_to_accuracy_one_bandwidth_is_not_a_failure() -> None:
    """One network only (the others not run): 'the winner changes' failed, comparing the
    network with itself."""
    c = _tta(_tta_table(nets=(SLOW,)))
    assert c[CHANGES].passed is None, c[CHANGES].measured


def test_time_to_accuracy_a_tie_is_not_decided_by_row_order() -> None:
    """Top-k ties QSGD on the slow network (identical curves) and GD wins the fast one: the
    slow network's 'winner' was whichever tied arm came first, and the verdict of 'the
    fastest changes' flipped with the row order."""
    parts = [_tta_table()]
    for net in (SLOW, FAST):
        parts.append(_tta_run("p", TOPK, 0.2, 0.5**0.5, 100.0, net))
    t = pd.concat(parts, ignore_index=True)
    a, b = _tta(t), _tta(t.iloc[::-1])
    for title in (CHANGES, PREDICTS):
        assert a[title].passed is b[title].passed is None, (a[title].measured, b[title].measured)
    assert "tie" in a[CHANGES].measured


def test_time_to_accuracy_a_nan_final_loss_is_not_tuned() -> None:
    """QSGD at 0.2 ends with a NaN loss (status 'stopped': no status flags it): a NaN median
    compares neither above nor below, so the smallest step, first in the grid, was 'tuned'."""
    parts = []
    finals = {0.2: math.nan, 0.4: None, 0.8: None}
    floors = {0.2: 0.0, 0.4: 0.01, 0.8: 0.1}
    for net in (SLOW, FAST):
        parts.append(_tta_run("m", GD, 1.0, 0.5, 1000.0, net))
        for step, last in finals.items():
            st = "stopped" if last is not None else "completed"
            run = _tta_run("m", QSGD, step, 0.5**0.5, 100.0, net, status=st, floor=floors[step])
            if last is not None:
                run.loc[run.index[-1], "loss"] = last
            parts.append(run)
    t = pd.concat(parts, ignore_index=True)
    m = tta.measure(t, {"metric": {"m": "loss"}})
    # the lowest finite final loss: step 0.4 (0.01 + 0.5^5, against 0.1 + 0.5^5 at 0.8)
    ends = {s: float(t[(t["stepsize"] == s) & (t["round"] == 10)]["loss"].iloc[0]) for s in finals}
    best = min((s for s in finals if math.isfinite(ends[s])), key=lambda s: ends[s])
    assert m["m"]["tuned"]["dcgd + qsgd[s=1]"][0] == best == 0.4
    c = _by_title(tta.claims(t, {"metric": {"m": "loss"}}))
    assert c[GRID].passed is True, c[GRID].measured


def test_time_to_accuracy_a_tie_with_an_end_of_the_grid_is_not_inside() -> None:
    """Steps 0.4 and 0.8 (the grid's end) end at the same loss: 0.4 (the smaller) was tuned and
    'inside its grid' passed, though the grid does not show the optimum bracketed."""
    parts = []
    for net in (SLOW, FAST):
        parts.append(_tta_run("m", GD, 1.0, 0.5, 1000.0, net))
        parts.append(_tta_run("m", QSGD, 0.2, 0.5**0.5, 100.0, net, floor=0.1))
        parts.append(_tta_run("m", QSGD, 0.4, 0.5**0.5, 100.0, net))
        parts.append(_tta_run("m", QSGD, 0.8, 0.5**0.5, 100.0, net))
    c = _by_title(tta.claims(pd.concat(parts), {"metric": {"m": "loss"}}))
    assert c[GRID].passed is False, c[GRID].measured
    assert "tied with the end 0.8" in c[GRID].measured


@pytest.mark.parametrize("case", ["all diverged", "cut network", "one network", "empty"])
def test_time_to_accuracy_figures_of_partial_tables(case: str, tmp_path: Path) -> None:
    t = _tta_table()
    if case == "all diverged":
        t = t.assign(status="diverged")
    elif case == "cut network":
        t = t[~((t["network"] == FAST) & (t["method"] == "dcgd"))]
    elif case == "one network":
        t = t[t["network"] == SLOW]
    else:
        t = t.iloc[:0]
    paths = tta.figures(t, tta.DEFAULTS, tmp_path)
    assert all(p.is_file() for p in paths)
    assert len([p for p in paths if p.suffix == ".png"]) == (0 if case == "empty" else 1)


# --------------------------------------------------------------------------------------------
# k18-async: a parameter server that dies
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _FakePS:
    """A finished parameter-server run: ‖∇f‖² from 1 to 1e-5 (a 'converging' run)."""

    table: pd.DataFrame
    status: str = "completed"
    stepsize: float = 0.1
    stepsize_rule: str = "theory"
    staleness_max: int = 3
    delay_max: int = 6
    rule_holds: bool | None = False  # γL = 1: the rule is violated (the stalling arm)
    stepsize_bound_measured: float | None = 0.02
    message: str = "all updates applied"
    config: dict[str, Any] = dataclasses.field(default_factory=lambda: {"compressor": "qsgd"})
    events: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=["time_s", "update", "worker", "event"])
    )

    def save(self, out: Path) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)

    def mean_staleness(self) -> pd.Series:
        return pd.Series({0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0})


def _ps_table(gns: list[float]) -> pd.DataFrame:
    from shrinkgrad.distributed.ps.results import TABLE_COLUMNS

    text = {c: "x" for c in ("method", "compressor", "stepsize_rule", "dataset", "problem")}
    rows = [
        {c: 0 for c in TABLE_COLUMNS} | text | {"round": 10 * i, "grad_norm_sq": g, "tau_max": 6}
        for i, g in enumerate(gns)
    ]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def test_k18_async_a_lost_server_is_a_recorded_non_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server of the first run (the bounded arm) dies: run_ps raised PSServerLost through
    execute, the reproduction aborted and the 1/L run that finished after it was never
    written. Now the lost run is a row with status server_lost, its reason in failed.json and
    on stderr, the other run is kept, the bounded arm's claims read n/a, the outcome is not
    complete, and the figures draw the table."""
    import shrinkgrad.distributed.ps as ps_pkg
    from shrinkgrad.distributed.ps import PSServerLost
    from shrinkgrad.experiments.reproductions import reproduce
    from shrinkgrad.experiments.results import read_table

    calls: list[Any] = []

    def fake_run_ps(config: Any, problem: Any = None) -> _FakePS:
        calls.append(config)
        if len(calls) == 1:
            raise PSServerLost(
                "the server process died before reporting a result",
                {"server": -9, "worker0": 3},
                1.5,
            )
        return _FakePS(_ps_table([1.0, 2.0, 0.5, 1.5]), stepsize=float(config.stepsize))

    monkeypatch.setattr(ps_pkg, "run_ps", fake_run_ps)
    result = reproduce("k18-async", tmp_path, profile="tiny", progress=False)
    assert len(calls) == 2
    outcome = result.outcome
    assert not outcome.complete and not outcome.interrupted
    table = outcome.table
    by_run = table.groupby("run_id", sort=True)["status"].first()
    assert sorted(by_run) == sorted([k18_async.SERVER_LOST, "completed"])
    lost_id = by_run[by_run == k18_async.SERVER_LOST].index[0]
    lost = table[table["run_id"] == lost_id]
    assert len(lost) == 1 and lost["grad_norm_sq"].isna().all()
    assert lost["tau_max_config"].notna().all()  # the bounded arm
    assert k18_async.run_kind(lost) == k18_async.CUT
    # written to disk with the finished run
    on_disk = read_table(next(tmp_path.glob("results.*")))
    assert set(on_disk["run_id"]) == set(table["run_id"])
    failed = json.loads((tmp_path / "runs" / str(lost_id) / "failed.json").read_text())
    assert failed["status"] == k18_async.SERVER_LOST
    assert "server process died" in failed["message"] and failed["exit_codes"]["server"] == -9
    assert f"failed: {lost_id}" in capsys.readouterr().err
    # the claims: the bounded arm measured nothing, the 1/L arm stalls as it should
    v = {t: _claim(result.claims, t).passed for t in ("bounded", "at the delay", "with a large")}
    assert v == {"bounded": None, "at the delay": None, "with a large": True}
    assert _claim(result.claims, "the delay rule").passed is None
    assert any(p.name == "convergence.png" for p in result.figures)


def test_k18_async_claims_with_a_lost_run_do_not_hide_a_failure() -> None:
    """A bounded run whose server died (no staleness, no rule: NaN, None) beside a bounded run
    that converged but exceeded tau_max and in which the rule does not hold: claim 1 crashed on
    int(NaN); the rule claim read 'no theory covers the measured delay' (n/a) for the lost
    run's None instead of failing on the measured one."""

    def run(run_id: str, tau: float | None, gns: list[float], **kw: Any) -> pd.DataFrame:
        n = len(gns)
        base = {
            "run_id": run_id,
            "round": range(n),
            "grad_norm_sq": gns,
            "stepsize_spec": "theory" if tau else "1/L",
            "stepsize": 0.05 if tau else 1.0,
            "L": 1.0,
            "status": "completed",
            "tau_max_config": tau,
            "staleness_max": 5 if tau else 20,
            "delay_max": 10 if tau else 30,
            "rule_holds": tau is not None,
            "stepsize_bound_measured": 0.06 if tau else 0.02,
            "slow_mean_staleness": 4.0,
            "fast_mean_staleness_max": 2.0,
            "workers_lost": 0,
        }
        return pd.DataFrame(base | kw)

    tau_max = int(k18_async.DEFAULTS["tau_max"])
    lost = run(
        "a0",
        6.0,
        [math.nan],
        status=k18_async.SERVER_LOST,
        staleness_max=math.nan,
        delay_max=math.nan,
        rule_holds=None,
        stepsize_bound_measured=math.nan,
        slow_mean_staleness=math.nan,
        fast_mean_staleness_max=math.nan,
        workers_lost=math.nan,
    )
    bad = run("a1", 6.0, [1.0, 1e-2, 1e-5], staleness_max=tau_max + 1, rule_holds=False)
    free = run("b", None, [1.0, 2.0, 0.5, 1.5])
    t = pd.concat([lost, bad, free], ignore_index=True)
    t["rule_holds"] = t["rule_holds"].astype(object)
    t.loc[t["run_id"] == "a0", "rule_holds"] = None
    out = k18_async.claims(t, k18_async.DEFAULTS)
    assert _claim(out, "bounded staleness").passed is False
    assert _claim(out, "the delay rule").passed is False
    assert k18_async.SERVER_LOST in _claim(out, "at the delay rule's step").measured
    # and with the measured run fine, the lost one leaves every claim it needs n/a
    good = run("a1", 6.0, [1.0, 1e-2, 1e-5])
    out = k18_async.claims(pd.concat([lost, good, free], ignore_index=True), k18_async.DEFAULTS)
    for start in ("bounded staleness", "at the delay rule's step", "the delay rule"):
        assert _claim(out, start).passed is None, start
    assert _claim(out, "with a large step").passed is True
