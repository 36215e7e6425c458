"""The numbers a user reads from sweeps and reproductions, checked independently: claims that must
fail when the improved method diverged, the common tolerance, cumulative bit columns, grids."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from run_tables import run_table

from shrinkgrad.experiments import expand, loads_config
from shrinkgrad.experiments.config import derive_seed
from shrinkgrad.experiments.reproductions import ef21w_libsvm, ef21w_synthetic
from shrinkgrad.experiments.reproductions import time_to_accuracy as tta
from shrinkgrad.plotting import aggregate

CONSTS = {"n_clients": 5, "d": 10, "L": 1.0, "L_max": 3.0}


_run = run_table  # one run's rows (tests/experiments/run_tables.py)


def _ef21w_table(diverged_problem: str) -> pd.DataFrame:
    """Three problems; EF21-W diverged on ``diverged_problem`` (its rows look fine)."""
    parts = []
    for i, (p, am, qm) in enumerate([("a", 1.0, 1.5), ("b", 1.0, 1.2), ("c", 1.0, 1.001)]):
        c = {**CONSTS, "L_AM": am, "L_QM": qm, "L_var": qm**2 - am**2}
        g = [1.0, 0.1, 0.01, 0.001]
        bits = [0.0, 10.0, 20.0, 30.0]
        parts.append(_run(f"b{i}", p, "ef21", g, bits, **c))
        st = "diverged" if p == diverged_problem else "completed"
        parts.append(_run(f"w{i}", p, "ef21_w", g, [0.0, 5.0, 10.0, 15.0], status=st, **c))
    return pd.concat(parts, ignore_index=True)


def test_ef21w_libsvm_never_worse_fails_when_ef21w_diverged():
    """A dataset on which EF21-W diverged has no finite ratio (NaN); 'EF21-W is never worse than
    EF21' must not pass then (pandas' min() skips the NaN and the claim passes)."""
    table = _ef21w_table("b")
    out = ef21w_libsvm.claims(table, ef21w_libsvm.DEFAULTS)
    never_worse = next(c for c in out if c.claim == "EF21-W is never worse than EF21")
    assert never_worse.passed is not True, never_worse.measured


def test_ef21w_synthetic_never_worse_fails_when_ef21w_diverged():
    table = _ef21w_table("a")
    out = ef21w_synthetic.claims(table, ef21w_synthetic.DEFAULTS)
    never_worse = next(c for c in out if c.claim == "EF21-W is never worse than EF21")
    assert never_worse.passed is not True, never_worse.measured


def test_ef21w_sgd_pp_never_worse_fails_when_a_later_pair_lacks_a_run():
    """Two pairs: the first holds on every dataset, the second has no EF21-W-PP run on "b" (its
    ratio there is nan). 'never worse' is not shown then, whatever the order of the pairs
    (Python's min() of [1.6, nan] is 1.6, of [nan, 1.6] nan)."""
    from shrinkgrad.experiments.reproductions import ef21w_sgd_pp

    table = _ef21w_table("none")
    pp = table.replace({"method": {"ef21": "ef21_pp", "ef21_w": "ef21_w_pp"}})
    pp["run_id"] = "pp-" + pp["run_id"]
    pp = pp[~((pp["method"] == "ef21_w_pp") & (pp["problem_label"] == "b"))]
    both = pd.concat([table, pp], ignore_index=True)
    for pairs in (
        [["ef21", "ef21_w"], ["ef21_pp", "ef21_w_pp"]],
        [["ef21_pp", "ef21_w_pp"], ["ef21", "ef21_w"]],
    ):
        params = {**ef21w_sgd_pp.DEFAULTS, "pairs": pairs}
        out = ef21w_sgd_pp.claims(both, params)
        never = next(c for c in out if c.claim == "the weighted variants are never worse")
        assert never.passed is not True, (pairs, never.measured)
    params = {**ef21w_sgd_pp.DEFAULTS, "pairs": [["ef21", "ef21_w"]]}
    never = next(c for c in ef21w_sgd_pp.claims(table, params) if "never worse" in c.claim)
    assert never.passed is True  # and with every run there, it holds


def test_time_to_accuracy_eps_ignores_diverged_runs():
    """ε = the largest final metric over the tuned runs; a diverged run reaches nothing and sets
    no tolerance (docs/experiments.md 'No progress'), so ε must be finite: the largest final
    value of the runs that are results."""
    parts = []
    extra = {"network": "star[up=1mbit]", "n_clients": 5, "stepsize": 0.1}
    g_ok = [1.0, 0.1, 0.01]
    parts.append(_run("r1", "p", "gd", g_ok, [0, 10, 20], **extra))
    parts.append(_run("r2", "p", "dcgd", [1.0, 0.5, 0.2], [0, 5, 10], **extra))
    parts.append(_run("r3", "p", "ef21", [1.0, 10.0, 1e9], [0, 1, 2], status="diverged", **extra))
    table = pd.concat(parts, ignore_index=True)
    table["time_model_s"] = table["round"].astype(float)
    m = tta.measure(table)
    assert math.isfinite(m["p"]["eps"]), m["p"]["eps"]
    assert m["p"]["eps"] == 0.2
    # and the time to ε of the arms that are results is not their round-0 time
    assert m["p"]["arms"]["star[up=1mbit]"]["dcgd + top_k[k=1]"]["rounds"] == 2.0


def test_aggregate_repeated_x_keeps_last_round():
    """Rounds that send nothing repeat x; the curve keeps the value of the latest round."""
    r = np.arange(200)
    t = pd.DataFrame(
        {
            "round": r,
            "bits_up": (r // 10) * 100.0,
            "grad_norm_sq": 1.0 / (1 + r),
            "method": "m",
            "compressor": "c",
            "stepsize_spec": "theory",
            "problem_label": "p",
            "run_id": "r1",
            "status": "completed",
        }
    )
    a = aggregate(t, "bits", "grad_norm_sq")
    expected = t.groupby("bits_up")["grad_norm_sq"].last().to_numpy()
    np.testing.assert_array_equal(a["median"].to_numpy(), expected)


CONFIG = """
name = "audit"
problem = [
    "logistic_regression[dataset=a1a,n_clients=5]",
    "logistic_regression[dataset=a1a,n_clients=4]",
]
[run]
rounds = 7
log_every = {log_every}
seeds = [0, 2, 5]
seed = {seed}
[grid]
methods = ["dcgd"]
compressors = ["rand_k[k=3]", "identity"]
stepsizes = ["theory", "theory*2", 0.01]
"""


def test_expand_every_combination_once_with_documented_seeds():
    cfg = loads_config(CONFIG.format(log_every=3, seed=7), source="audit.toml")
    runs = expand(cfg)
    combos = [
        (r.problem.spec, r.arm.method, r.arm.compressor, r.arm.stepsize, r.seed_index) for r in runs
    ]
    assert len(combos) == len(set(combos)) == 2 * 1 * 2 * 3 * 3
    assert {r.arm.stepsize for r in runs} == {"theory", "theory*2", "0.01"}
    assert all(r.seed == derive_seed(7, r.seed_index) for r in runs)
    assert derive_seed(0, 0) == 0
    assert len({r.run_id for r in runs}) == len(runs)


def test_cumulative_bits_do_not_depend_on_log_every(tmp_path):
    """bits_up / bits_up_paper at a logged round are the totals up to that round."""
    from shrinkgrad.experiments import run_experiment

    text = CONFIG.replace("seeds = [0, 2, 5]", "seeds = [2]")
    text = text.replace('stepsizes = ["theory", "theory*2", 0.01]', 'stepsizes = ["theory"]')
    text = text.replace(
        'compressors = ["rand_k[k=3]", "identity"]', 'compressors = ["rand_k[k=3]"]'
    )
    tables = {}
    for le in (1, 3):
        cfg = loads_config(text.format(log_every=le, seed=0), source="audit.toml")
        res = run_experiment(cfg, tmp_path / f"le{le}", jobs=1, progress=False)
        tables[le] = res.table
    a, b = tables[3], tables[1]
    keys = ["problem_label", "round"]
    m = a.merge(b, on=keys, suffixes=("_3", "_1"))
    assert len(m) == len(a) == 2 * 4  # rounds 0, 3, 6, 7 per problem
    for col in ("bits_up", "bits_up_paper", "bits_down", "grad_norm_sq"):
        np.testing.assert_array_equal(m[f"{col}_3"].to_numpy(), m[f"{col}_1"].to_numpy())
    # rand_k[k=3] on d=119: per round and client 3·32 paper bits (indices free)
    d = int(a["d"].iloc[0])
    for _, row in b.iterrows():
        assert row["bits_up_paper"] == 96 * row["round"], (d, row["round"])
