"""Issue 17: ``ef21[rule=rare_features]`` selects the [RF] step size from the problem's data."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from methods_fixtures import LeastSquares

from shrinkgrad import theory as T
from shrinkgrad.compressors import make_compressor
from shrinkgrad.methods import Constants, make_method
from shrinkgrad.problems import Dataset, least_squares, logistic_regression, rare_features


def _rare_dataset() -> Dataset:
    rng = np.random.default_rng(0)
    X = sp.random(120, 30, density=0.05, random_state=rng, format="csr")
    y = np.where(rng.random(120) < 0.5, -1.0, 1.0)
    return Dataset.from_arrays(X, y, name="rare_toy")


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: least_squares(ds, n_clients=12),
        lambda ds: logistic_regression(ds, n_clients=12, lam=0.0),
        lambda ds: logistic_regression(ds, n_clients=12),  # λ > 0: c = n
    ],
)
@pytest.mark.parametrize("comp", ["top_k[k=1]", "top_k[k=4]"])
def test_rule_step_equals_stepsize_rare_features_on_the_problem(make, comp: str) -> None:  # type: ignore[no-untyped-def]
    p = make(_rare_dataset())
    rf = rare_features(p)
    alpha = make_compressor(comp).alpha(p.d)
    bound = make_method("ef21[rule=rare_features]").bind(p, comp, "theory")
    want = T.stepsize_rare_features(p.L, rf.L_plus, rf.c, p.n, alpha)
    assert bound.cfg.stepsize == want
    assert bound.cfg.stepsize_rule == f"stepsize_rare_features[c={rf.c},L_plus={rf.L_plus:.6g}]"
    # rare features (c < n) and L_+ ≤ L_QM: the [RF] step is larger than the original EF21 step
    original = make_method("ef21").bind(p, comp, "theory").cfg.stepsize
    if rf.c < p.n:
        assert bound.cfg.stepsize > original
    else:  # c = n: the rule is EF21's with L_QM replaced by L_+ ≤ L_QM
        assert bound.cfg.stepsize >= original * (1 - 1e-12)
    twice = make_method("ef21[rule=rare_features]").bind(p, comp, "theory*2")
    assert twice.cfg.stepsize == 2 * want and twice.cfg.stepsize_rule.endswith("*2")


def test_rule_is_recorded_by_the_simulator() -> None:
    from shrinkgrad import simulate

    p = least_squares(_rare_dataset(), n_clients=12)
    res = simulate(p, "ef21[rule=rare_features]", "top_k[k=2]", stepsize="theory", rounds=5)
    rule = str(res.table["stepsize_rule"].iloc[0])
    assert rule.startswith("stepsize_rare_features[c=")
    assert (
        res.table["stepsize"].iloc[0]
        == make_method("ef21[rule=rare_features]").bind(p, "top_k[k=2]", "theory").cfg.stepsize
    )


def test_rule_errors_say_what_is_missing() -> None:
    p = least_squares(_rare_dataset(), n_clients=12)
    with pytest.raises(ValueError, match="has no data matrix"):
        make_method("ef21[rule=rare_features]").bind(LeastSquares(), "top_k[k=1]", "theory")
    with pytest.raises(ValueError, match="bind the method to the problem itself"):
        consts = Constants(p.n, p.d, p.L, p.L_i)
        make_method("ef21[rule=rare_features]").bind(consts, "top_k[k=1]", "theory")
    with pytest.raises(ValueError, match="applies to plain ef21 only"):
        from shrinkgrad.methods import EF21

        EF21(weighted=True, rule="rare_features")
    with pytest.raises(ValueError, match="no PL-case form"):
        make_method("ef21[rule=rare_features,pl=true]")
    # a numeric step needs nothing from the data
    bound = make_method("ef21[rule=rare_features]").bind(LeastSquares(), "top_k[k=1]", 0.1)
    assert bound.cfg.stepsize == 0.1 and bound.cfg.stepsize_rule == "constant"
    assert "rule=rare_features" in make_method("ef21[rule=rare_features]").name
