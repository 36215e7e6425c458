"""The theory module at the ends of its ranges (stop 35's theory audit): a tiny ε or α gives a
number or one clear error, never an OverflowError, and the report's median is the median."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_run import run_cli

from shrinkgrad import theory as T
from shrinkgrad.methods import make_method
from shrinkgrad.methods.base import Constants
from shrinkgrad.problems import logistic_regression

TINY_EPS = 1e-310  # 2Φ⁰/(γε) overflows: no float counts the rounds


def test_round_counts_that_overflow_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="more rounds than floating point can count"):
        T.rounds_ef21(0.1, 1.0, TINY_EPS)
    with pytest.raises(ValueError, match="more rounds than floating point can count"):
        T.rounds_dcgd(0.1, 1.0, TINY_EPS, L=1.0, L_max=1.0, omega=0.0, n=1)
    # PL counts rounds logarithmically: ε = 1e-310 is a finite count (log Φ⁰ − log ε)
    T_pl = T.rounds_ef21_pl(0.1, 0.5, 1.0, TINY_EPS)
    assert (1 - 0.05) ** T_pl * 1.0 <= TINY_EPS < (1 - 0.05) ** (T_pl - 1) * 1.0


def test_the_theory_command_refuses_an_eps_it_cannot_count_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(
        capsys, "theory", "--dataset", "a1a", "--clients", "4", "--eps", str(TINY_EPS)
    )
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and "larger eps" in lines[0]


def test_a_tiny_explicit_alpha_gets_its_pp_and_sgd_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """power_sgd[alpha=1e-200]: the PP rows are 1/(L + L̃ ξ(αp)), EF21's rule at α' = αp, and
    the SGD rows EF21's at α_ν = α/2 (1 − (1 + ν)(1 − α) cancelled to 0 there)."""
    code, out, err = run_cli(
        capsys, "theory", "--dataset", "a1a", "--clients", "4", "--compressor",
        "power_sgd[rank=1,alpha=1e-200]", "--p", "0.5", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    c = report["constants"]
    rows = {r["rule"]: r["stepsize"] for r in report["stepsizes"]}
    pp = [name for name in rows if "pp" in name]
    assert pp, rows
    for name in pp:
        L_tilde = c["L_AM"] if "w" in name.split("pp")[0] else c["L_QM"]
        assert rows[name] == pytest.approx(T.stepsize_ef21(c["L"], L_tilde, 0.5e-200), rel=1e-12)
    sgd = T.stepsize_ef21(c["L"], c["L_QM"], 0.5e-200)
    assert rows["ef21_sgd"] == pytest.approx(sgd, rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 5])
def test_the_reported_median_of_L_i_is_the_median(
    capsys: pytest.CaptureFixture[str], n: int
) -> None:
    code, out, err = run_cli(capsys, "theory", "--dataset", "a1a", "--clients", str(n), "--json")
    assert code == 0, err
    c = json.loads(out)["constants"]
    L_i = Constants.of(logistic_regression("a1a", n_clients=n)).smoothness()[1].double().numpy()
    assert c["L_i median"] == pytest.approx(float(np.median(L_i)), rel=1e-15)
    if n == 2:
        assert c["L_i median"] == pytest.approx((L_i[0] + L_i[1]) / 2, rel=1e-15)


def test_iag_says_the_rule_it_computes() -> None:
    assert "min{DCGD rule, 0.99·delayed rule}" in make_method("iag").theory_formula()
