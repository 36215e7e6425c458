"""Claims of ``deep-ef``, ``k18-async`` and ``ef21-vs-ef`` on runs that are not results.

Small synthetic results tables: runs that diverged, made no progress (``no_progress``: ended
above their starting loss) or end with a NaN must never make a claim pass, a tie or the table's
row order must not choose a "best" multiplier, and an interrupted parameter-server run must stop
the k18-async sweep before its claims are measured.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from shrinkgrad.experiments.execute import NO_PROGRESS
from shrinkgrad.experiments.reproductions import REPRODUCTIONS, deep_ef, ef21_vs_ef, k18_async


# --------------------------------------------------------------------------------------------
# deep-ef
# --------------------------------------------------------------------------------------------
def _deep(
    case: str,
    seed: int,
    method: str,
    final: float,
    *,
    compressor: str = "top_k[k=3]",
    status: str = "completed",
    step: float = 0.5,
) -> pd.DataFrame:
    """One deep-ef run: three logged rounds from loss 0.69 to ``final`` (10 bits/n a round)."""
    name, dataset = ("mlp", "a9a") if case == "mlp-a9a" else ("cnn", "digits")
    return pd.DataFrame(
        {
            "run_id": f"{case}-{method}-{compressor}-{step}-{seed}",
            "problem_label": f"{case},seed={seed}",
            "problem_spec": f"{name}[dataset={dataset},seed={seed}]",
            "method": method,
            "compressor": compressor,
            "stepsize_spec": str(step),
            "stepsize": step,
            "seed_index": 0,
            "round": [0, 1, 2],
            "loss": [0.69, (0.69 + final) / 2, final],
            "grad_norm_sq": [1.0, 0.5, 0.25],
            "bits_up_paper": [0.0, 10.0, 20.0],
            "status": status,
        }
    )


def _deep_table(*runs: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(runs, ignore_index=True)


def _claim(claims: list[Any], start: str) -> Any:
    return next(c for c in claims if c.claim.startswith(start))


SEEDS = (0, 1, 2)


def test_deep_ef_no_progress_and_nan_runs_are_not_results() -> None:
    """A ``no_progress`` run's last loss (above its start) and a NaN loss are not results: inf
    loss, no accuracy, like a diverged run."""
    t = _deep_table(
        _deep("mlp-a9a", 0, "ef21", 0.8, status=NO_PROGRESS),
        _deep("mlp-a9a", 1, "ef21", math.nan, status="stopped"),
        _deep("mlp-a9a", 2, "ef21", 0.3),
    )
    t["test_accuracy"] = 0.7
    recs = {r["seed"]: r for r in deep_ef.records(t)}
    assert recs[0]["loss"] == math.inf and math.isnan(recs[0]["acc"])
    assert recs[1]["loss"] == math.inf and math.isnan(recs[1]["acc"])
    assert recs[2]["loss"] == 0.3 and recs[2]["acc"] == 0.7


def test_deep_ef_claims_do_not_pass_on_runs_that_made_no_progress() -> None:
    """EF21, EF and Top-k without feedback all made no progress at their every step (their final
    losses, above the start, are no results): 'EF21 matches EF' and 'no feedback ends higher
    than EF21' passed on those numbers."""
    runs = []
    for s in SEEDS:
        runs.append(_deep("mlp-a9a", s, "ef21", 0.8 + 0.01 * s, status=NO_PROGRESS))
        runs.append(_deep("mlp-a9a", s, "ef", 0.9 + 0.01 * s, status=NO_PROGRESS))
        runs.append(_deep("mlp-a9a", s, "dcgd[biased=true]", 3.0 + 0.1 * s, status=NO_PROGRESS))
    out = deep_ef.claims(_deep_table(*runs), deep_ef.DEFAULTS)
    versus = _claim(out, "EF21 matches or beats classic EF at equal bits (final training loss")
    beats = _claim(out, "error feedback fixes biased Top-k")
    assert versus.passed is not True, versus.measured
    assert beats.passed is not True, beats.measured


def test_deep_ef_claims_fail_when_ef21_diverged_and_the_baseline_did_not() -> None:
    """EF21 diverged at its every step on one problem where EF and no feedback converged:
    'EF21 matches or beats EF' and 'no feedback ends higher than EF21' are false there (they
    were n/a), even when another problem is n/a."""
    runs = []
    for s in SEEDS:
        runs.append(_deep("mlp-a9a", s, "ef21", 9.0, status="diverged"))
        runs.append(_deep("mlp-a9a", s, "ef", 0.3 + 0.01 * s))
        runs.append(_deep("mlp-a9a", s, "dcgd[biased=true]", 0.4 + 0.01 * s))
    # a second problem on which both EF21 and EF diverged: not measurable there
    runs.append(_deep("cnn-digits", 0, "ef21", 9.0, status="diverged"))
    runs.append(_deep("cnn-digits", 0, "ef", 9.0, status="diverged"))
    out = deep_ef.claims(_deep_table(*runs), deep_ef.DEFAULTS)
    versus = _claim(out, "EF21 matches or beats classic EF at equal bits (final training loss")
    beats = _claim(out, "error feedback fixes biased Top-k")
    assert versus.passed is False, versus.measured
    assert beats.passed is False, beats.measured


def test_deep_ef_momentum_claim_fails_when_both_ef21_sgd_variants_diverged() -> None:
    """On mlp-a9a EF21-SGD and EF21-SGDM diverged where SGD converged: momentum did not close
    that gap. The claim read 'no significant gap to close' there and passed on cnn-digits."""
    sgd, sgdm = "ef21_sgd[b=16]", "ef21_sgdm[beta=0.9,b=16]"
    runs = []
    for s in SEEDS:
        runs.append(_deep("mlp-a9a", s, sgd, 0.3 + 0.01 * s, compressor="identity"))
        runs.append(_deep("mlp-a9a", s, sgd, 9.0, status="diverged"))
        runs.append(_deep("mlp-a9a", s, sgdm, 9.0, status="diverged"))
        runs.append(_deep("cnn-digits", s, sgd, 0.3 + 0.01 * s, compressor="identity"))
        runs.append(_deep("cnn-digits", s, sgd, 0.6 + 0.02 * s))
        runs.append(_deep("cnn-digits", s, sgdm, 0.35 + 0.01 * s))
    out = deep_ef.claims(_deep_table(*runs), deep_ef.DEFAULTS)
    gap = _claim(out, "[FTR23] momentum closes the gap")
    assert gap.passed is False, gap.measured
    assert "no significant gap" not in gap.measured.split(";")[0], gap.measured


def test_deep_ef_compression_pays_fails_when_ef21_diverged_too() -> None:
    """GD and EF21 both diverged (at every step): GD 'never reached EF21's final loss' (inf) and
    the claim passed with a ratio of inf; EF21 has no final loss to reach."""
    runs = []
    for s in SEEDS:
        runs.append(_deep("mlp-a9a", s, "gd", 9.0, compressor="identity", status="diverged"))
        runs.append(_deep("mlp-a9a", s, "ef21", 9.0, status="diverged"))
    out = deep_ef.claims(_deep_table(*runs), deep_ef.DEFAULTS)
    pays = _claim(out, "compression pays")
    assert pays.passed is False, pays.measured
    # and with EF21 a result, GD's divergence still reads as GD never reaching it
    runs = []
    for s in SEEDS:
        runs.append(_deep("mlp-a9a", s, "gd", 9.0, compressor="identity", status="diverged"))
        runs.append(_deep("mlp-a9a", s, "ef21", 0.3))
    assert _claim(deep_ef.claims(_deep_table(*runs), deep_ef.DEFAULTS), "compression").passed


# --------------------------------------------------------------------------------------------
# k18-async
# --------------------------------------------------------------------------------------------
def _k18(
    run_id: str,
    tau: float | None,
    gns: list[float],
    *,
    status: str = "completed",
    rule: Any = None,
) -> pd.DataFrame:
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
            "staleness_max": 5 if tau else 20,
            "delay_max": 10 if tau else 30,
            "rule_holds": (tau is not None) if rule is None else rule,
            "stepsize_bound_measured": 0.06 if tau else 0.02,
            "slow_mean_staleness": 4.0,
            "fast_mean_staleness_max": 2.0,
        }
    )


K18 = dict(REPRODUCTIONS.get("k18-async").defaults)


def test_k18_a_diverged_bounded_run_does_not_converge() -> None:
    """The bounded run diverged (its table stops at the last finite row, which is small): the
    'converges' claim passed on it."""
    t = pd.concat(
        [
            _k18("a", 6.0, [1.0, 1e-2, 1e-5], status="diverged"),
            _k18("b", None, [1.0, 2.0, 0.5, 1.5]),
        ]
    )
    conv = _claim(k18_async.claims(t, K18), "at the delay rule's step")
    assert conv.passed is False, conv.measured


def test_k18_a_diverged_unbounded_run_does_not_converge() -> None:
    """γ = 1/L unbounded diverged (metrics cut at the last finite, small, row): it did not
    converge, which is the claim; the claim failed on the small rows before the blow-up."""
    t = pd.concat(
        [
            _k18("a", 6.0, [1.0, 1e-2, 1e-4, 1e-5]),
            _k18("b", None, [1.0, 1e-3, 1e-4, 1e-4], status="diverged"),
        ]
    )
    stall = _claim(k18_async.claims(t, K18), "with a large step")
    assert stall.passed is True, stall.measured
    assert "diverged" in stall.measured


@pytest.mark.parametrize(
    ("bounded_rule", "free_rule"),
    [(np.nan, False), (None, None), (True, np.nan)],
)
def test_k18_delay_rule_unknown_is_not_a_verdict(bounded_rule: Any, free_rule: Any) -> None:
    """rule_holds is None when no theory covers the measured delay (NaN once the table went
    through a CSV file): bool(nan) is True, so a NaN read as 'the rule holds'."""
    t = pd.concat(
        [
            _k18("a", 6.0, [1.0, 1e-2, 1e-4, 1e-5]),
            _k18("b", None, [1.0, 2.0, 0.5, 1.5]),
        ],
        ignore_index=True,
    )
    t["rule_holds"] = t["rule_holds"].astype(object)
    t.loc[t["run_id"] == "a", "rule_holds"] = bounded_rule
    t.loc[t["run_id"] == "b", "rule_holds"] = free_rule
    rule = _claim(k18_async.claims(t, K18), "the delay rule at the measured delay")
    assert rule.passed is None, rule.measured


@dataclasses.dataclass
class _FakePS:
    table: pd.DataFrame
    status: str
    staleness_max: int = 3
    delay_max: int = 6
    rule_holds: bool | None = True
    stepsize_bound_measured: float | None = 0.1

    def save(self, out: Path) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)

    def mean_staleness(self) -> pd.Series:
        return pd.Series({0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0})


def test_k18_execute_stops_at_an_interrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first Ctrl-C makes run_ps return its run with status 'interrupted' (no
    KeyboardInterrupt): the sweep went on with the next arm and reported itself complete, so
    the claims were measured on a cut run."""
    import shrinkgrad.distributed.ps as ps
    from shrinkgrad.distributed.ps.results import TABLE_COLUMNS
    from shrinkgrad.experiments.config import load_config
    from shrinkgrad.experiments.reproductions import config_path

    calls: list[str] = []

    def fake_run_ps(config: Any, problem: Any = None) -> _FakePS:
        calls.append(str(config.stepsize))
        row = {c: 0 for c in TABLE_COLUMNS} | {"grad_norm_sq": 1.0, "loss": 0.7, "tau_max": 6}
        return _FakePS(pd.DataFrame([row]), "interrupted" if len(calls) == 1 else "completed")

    monkeypatch.setattr(ps, "run_ps", fake_run_ps)
    cfg = load_config(config_path(REPRODUCTIONS.get("k18-async")), profile="tiny")
    outcome = k18_async.execute(cfg, tmp_path, progress=False)
    assert outcome.interrupted and not outcome.complete
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------
# ef21-vs-ef
# --------------------------------------------------------------------------------------------
def _ev(
    problem: str, method: str, m: float, g: list[float], *, status: str = "completed", seed: int = 0
) -> pd.DataFrame:
    spec = f"theory*{m:g}" if method == "ef21" else f"theory(ef21)*{m:g}"
    n = len(g)
    return pd.DataFrame(
        {
            "run_id": f"{problem}-{method}-{m:g}-{seed}",
            "problem_label": problem,
            "method": method,
            "compressor": "top_k[k=1]",
            "stepsize_spec": spec,
            "seed_index": seed,
            "round": np.arange(n),
            "grad_norm_sq": np.asarray(g, dtype=float),
            "bits_up_paper": 10.0 * np.arange(n),
            "status": status,
        }
    )


def _ev_claims(*runs: pd.DataFrame) -> dict[str, Any]:
    out = ef21_vs_ef.claims(pd.concat(runs, ignore_index=True), ef21_vs_ef.DEFAULTS)
    return {c.claim: c for c in out}


LARGER = "larger step multipliers help EF21"
EQUAL = "at equal step multipliers EF21 ends lower than EF"
FEWER = "EF21 reaches EF's best accuracy in fewer bits/n (best multiplier of each)"


def test_ef21_vs_ef_best_multiplier_is_not_a_diverged_run() -> None:
    """Every EF21 run diverged (final inf): the 'best' multiplier was the table's first run
    (×4 here), and 'larger step multipliers help' passed."""
    c = _ev_claims(
        _ev("p", "ef21", 4, [1.0, 1e3], status="diverged"),
        _ev("p", "ef21", 1, [1.0, 1e3], status="diverged"),
        _ev("p", "ef", 1, [1.0, 0.1]),
        _ev("p", "ef", 4, [1.0, 0.2]),
    )
    assert c[LARGER].passed is False, c[LARGER].measured


def test_ef21_vs_ef_best_multiplier_ties_and_row_order() -> None:
    """A tie between ×1 and ×4 (larger multipliers do not help) must not pass because ×4 comes
    first in the table, and the answer must not depend on the row order."""
    runs = [
        _ev("p", "ef21", 4, [1.0, 0.01]),
        _ev("p", "ef21", 1, [1.0, 0.01]),
        _ev("p", "ef", 1, [1.0, 0.1]),
        _ev("p", "ef", 4, [1.0, 0.2]),
    ]
    assert _ev_claims(*runs)[LARGER].passed is False
    assert _ev_claims(*reversed(runs))[LARGER].passed is False


def test_ef21_vs_ef_best_multiplier_is_not_one_lucky_seed() -> None:
    """×4 diverged on two seeds of three and reached 1e-10 on the third; ×1 reached 1e-5 on all
    three: the best multiplier (median over seeds) is ×1, not ×4."""
    runs = [_ev("p", "ef21", 4, [1.0, 1e-10], seed=0)]
    runs += [_ev("p", "ef21", 4, [1.0, 1e3], status="diverged", seed=s) for s in (1, 2)]
    runs += [_ev("p", "ef21", 1, [1.0, 1e-5], seed=s) for s in (0, 1, 2)]
    runs += [_ev("p", "ef", m, [1.0, 0.1], seed=s) for m in (1, 4) for s in (0, 1, 2)]
    c = _ev_claims(*runs)
    assert c[LARGER].values["best_multiplier"] == {"p": 1.0}
    assert c[LARGER].passed is False


def test_ef21_vs_ef_pairs_where_both_diverged_are_not_ef21_wins() -> None:
    """At ×4 and ×8 both methods diverged: inf ≤ inf counted them as pairs where EF21 ends lower
    (3 of 4 = 0.75, pass); of the two pairs that are results EF21 ends lower in one."""
    c = _ev_claims(
        _ev("p", "ef21", 1, [1.0, 0.5]),
        _ev("p", "ef", 1, [1.0, 0.1]),
        _ev("p", "ef21", 2, [1.0, 0.01]),
        _ev("p", "ef", 2, [1.0, 0.1]),
        *[
            _ev("p", meth, m, [1.0, 1e3], status="diverged")
            for m in (4, 8)
            for meth in ("ef21", "ef")
        ],
    )
    assert c[EQUAL].passed is False, c[EQUAL].measured
    assert c[EQUAL].values["fraction"] == 0.5


def test_ef21_vs_ef_nan_final_does_not_depend_on_row_order() -> None:
    """An EF run ending with NaN (no status saying so): Python's min() kept ε = nan or dropped
    it depending on the row order, and the bits ratio changed with it."""
    runs = [
        _ev("p", "ef", 1, [1.0, math.nan]),
        _ev("p", "ef", 2, [1.0, 0.1, 0.01]),
        _ev("p", "ef21", 1, [1.0, 0.01]),
    ]
    a, b = _ev_claims(*runs), _ev_claims(*reversed(runs))
    assert a[FEWER].values["ratios"] == b[FEWER].values["ratios"] == {"p": 2.0}
    assert a[FEWER].passed is b[FEWER].passed is True


def test_ef21_vs_ef_no_ef_result_gives_no_ratio() -> None:
    """EF diverged at every multiplier: there is no ε to reach, so the ratio is undefined (nan),
    not 0 (which read as EF21 never reaching it)."""
    c = _ev_claims(
        _ev("p", "ef", 1, [1.0, 1e3], status="diverged"),
        _ev("p", "ef21", 1, [1.0, 0.01]),
    )
    assert math.isnan(c[FEWER].values["ratios"]["p"]) and c[FEWER].passed is False
