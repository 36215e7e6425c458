"""``shrinkgrad theory``: the defects of a user audit, each pinned by its reproduction.

1. α = 1 (no compression) used to fail in the EF21-SGD rows (ν = ∞ refused);
2. --p outside (0, 1] used to print γ = nan (and invalid JSON) with exit code 0;
3. --help did not say --clients/--dataset are required for a problem on a dataset;
4. --dataset (and --clients, --split, ...) silently overrode the same parameter in --problem;
5. the "scaled C/(1+ω)" note was on some of the rules in α only;
6. a network's unknown L pointed to an option the command does not have;
7. a d whose f(x⁰) does not fit in memory refused the whole report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_run import run_cli

from shrinkgrad import simulate
from shrinkgrad import theory as T
from shrinkgrad.cli import theory as theory_cli
from shrinkgrad.compressors import make_compressor
from shrinkgrad.problems import logistic_regression, rare_features
from shrinkgrad.problems import memory as M
from shrinkgrad.problems.linear import LinearModelProblem


def _strict_json(text: str) -> Any:
    """json.loads that refuses NaN / Infinity (not JSON, though Python's json writes them)."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# 1. α = 1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dataset", "compressor"),
    [("w1a", "identity"), ("a1a", "top_k[k=123]"), ("a1a", "bernoulli[p=1]")],
)
def test_alpha_one_gives_the_full_report_with_gd_steps(
    capsys: pytest.CaptureFixture[str], dataset: str, compressor: str
) -> None:
    code, out, err = run_cli(
        capsys, "theory", "--dataset", dataset, "--clients", "10", "--compressor", compressor,
        "--json",
    )  # fmt: skip
    assert code == 0, err
    report = _strict_json(out)
    p = logistic_regression(dataset, n_clients=10)
    assert make_compressor(compressor).alpha(p.d) == 1.0 and report["compressor"]["alpha"] == 1.0
    steps = {r["rule"]: r for r in report["stepsizes"]}
    # no compression error: ξ(1) = 0, every EF21 rule without participation is GD's 1/L
    L = p.L
    assert L is not None
    gd = 1.0 / L
    for rule in ("ef21", "ef21_reloaded / ef21_w", "ef21_plus", "ef21_sgd", "ef21w_sgd"):
        assert steps[rule]["stepsize"] == pytest.approx(gd, rel=1e-14), rule
    assert "1/L" in steps["ef21_sgd"]["note"] and "1/L" in steps["ef21w_sgd"]["note"]
    # EF21-PP at α = 1 is EF21 with the contraction p ([BW] Thm 7, common p: ξ(αp))
    xi_half = (1 + math.sqrt(0.5)) / 0.5 - 1
    assert steps["ef21_pp"]["stepsize"] == pytest.approx(1 / (L + p.L_QM * xi_half))
    assert steps["ef21w_pp"]["stepsize"] == pytest.approx(1 / (L + p.L_AM * xi_half))
    assert {"rare_features", "delayed (strict <)"} <= set(steps)
    assert len(report["predictions"]) == 2 and report["notes"] == []


def test_ef21_sgd_accepts_its_own_default_nu_at_alpha_one() -> None:
    """ef21_sgd_nu(1, σ² > 0) = ∞ (the limit of α/(2(1 − α))); the rules take it back."""
    nu = T.ef21_sgd_nu(1.0, 0.3)
    assert nu == math.inf
    assert T.stepsize_ef21_sgd(4.0, 5.0, 1.0, nu=nu) == 0.25  # 1/L
    assert T.stepsize_ef21w_sgd(4.0, 5.0, 1.0, nu=nu) == 0.25
    assert T.stepsize_ef21_sgd(4.0, 5.0, 1.0, sigma2=0.3) == 0.25  # the default path, as before
    assert T.ef21_sgd_noise_floor(1.0, 0.3, nu=nu) == 0.3  # σ²: no compression error
    with pytest.raises(ValueError, match="nu must be a finite number"):
        T.stepsize_ef21_sgd(4.0, 5.0, 0.5, nu=math.inf)  # only α = 1 has ν = ∞ as its limit
    with pytest.raises(ValueError, match="nu must be"):
        T.stepsize_ef21w_sgd(4.0, 5.0, 1.0, nu=-1.0)


# 2. --p and JSON -----------------------------------------------------------------------------
@pytest.mark.parametrize("p", ["0", "1.5", "nan", "-0.5", "inf"])
@pytest.mark.parametrize("as_json", [False, True])
def test_p_outside_the_unit_interval_is_one_error_line(
    capsys: pytest.CaptureFixture[str], p: str, as_json: bool
) -> None:
    argv = ["theory", "--dataset", "australian", "--clients", "10", "--p", p]
    code, out, err = run_cli(capsys, *argv, *(["--json"] if as_json else []))
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert "'--p'" in line and "participation probability" in line and "(0, 1]" in line


def test_p_is_checked_by_the_python_report_too() -> None:
    p = logistic_regression("australian", n_clients=5)
    with pytest.raises(ValueError, match=r"participation probability .* must be in \(0, 1\]"):
        theory_cli.theory_report(p, make_compressor("top_k[k=1]"), p=0.0)


def test_p_of_one_is_the_ef21_step(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "theory", "--dataset", "australian", "--clients", "10", "--p", "1", "--json"
    )
    assert code == 0, err
    steps = {r["rule"]: r["stepsize"] for r in _strict_json(out)["stepsizes"]}
    assert steps["ef21_pp"] == pytest.approx(steps["ef21"], rel=1e-14)
    assert steps["ef21w_pp"] == pytest.approx(steps["ef21_reloaded / ef21_w"], rel=1e-14)


@pytest.mark.parametrize(("option", "value"), [("--eps", "nan"), ("--eps", "0"), ("--tau", "-1")])
def test_other_numeric_options_are_checked(
    capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    code, out, err = run_cli(
        capsys, "theory", "--dataset", "australian", "--clients", "10", option, value
    )
    assert code == 2 and out == ""
    assert f"'{option}'" in _one_error_line(err)


def test_json_writes_a_non_finite_value_as_null(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a rule returns, --json stays JSON: a non-finite float is null, never NaN."""
    monkeypatch.setattr(T, "stepsize_delayed", lambda L, tau: math.nan)
    monkeypatch.setattr(T, "xi", lambda alpha: math.inf)
    code, out, err = run_cli(
        capsys, "theory", "--dataset", "australian", "--clients", "10", "--json"
    )
    assert code == 0, err
    report = _strict_json(out)
    delayed = next(r for r in report["stepsizes"] if r["rule"] == "delayed (strict <)")
    assert delayed["stepsize"] is None and report["compressor"]["xi"] is None
    assert theory_cli._json_safe({"a": [1.0, -math.inf, {"b": math.nan}], "c": 2}) == {
        "a": [1.0, None, {"b": None}],
        "c": 2,
    }


# 3. help -------------------------------------------------------------------------------------
def test_help_says_dataset_and_clients_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "theory", "--help")
    assert code == 0
    text = " ".join(out.split())
    needed = "required for problems on a dataset unless --problem gives it"
    assert f"--clients INTEGER number of clients n ({needed}: n_clients=)" in text
    assert f"LIBSVM file path ({needed}: dataset=)" in text
    assert "in (0, 1]" in text  # --p states its range


# 4. an option and the --problem spec -----------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "extra", "words"),
    [
        ("logistic_regression[dataset=a9a]", ["--dataset", "australian", "--clients", "10"],
         "--dataset australian disagrees with dataset=a9a"),
        ("logistic_regression[dataset=australian,n_clients=20]", ["--clients", "10"],
         "--clients 10 disagrees with n_clients=20"),
        ("logistic_regression[dataset=australian,n_clients=10,split=by_label]",
         ["--split", "shuffled"], "--split shuffled disagrees with split=by_label"),
        ("logistic_regression[dataset=australian,n_clients=10,lam=0.5]", ["--lam", "0.1"],
         "--lam 0.1 disagrees with lam=0.5"),
    ],
)  # fmt: skip
def test_an_option_that_disagrees_with_the_problem_spec_is_an_error(
    capsys: pytest.CaptureFixture[str], spec: str, extra: list[str], words: str
) -> None:
    code, out, err = run_cli(capsys, "theory", "--problem", spec, *extra)
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert words in line and "inside --problem" in line


def test_an_option_that_repeats_the_problem_spec_is_fine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "logistic_regression[dataset=australian,n_clients=10,lam=0.1]"
    code, out, err = run_cli(
        capsys, "theory", "--problem", spec, "--dataset", "australian", "--clients", "10",
        "--lam", "0.1", "--split", "contiguous", "--json",
    )  # fmt: skip
    assert code == 0, err
    c = _strict_json(out)["constants"]
    assert c["dataset"] == "australian" and c["n"] == 10


# 5. notes ------------------------------------------------------------------------------------
def test_every_rule_in_alpha_says_it_is_for_the_scaled_unbiased_compressor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(
        capsys, "theory", "--dataset", "australian_scale", "--clients", "10", "--reg", "l2",
        "--compressor", "rand_k[k=2]", "--json",
    )  # fmt: skip
    assert code == 0, err
    notes = {r["rule"]: r["note"] for r in _strict_json(out)["stepsizes"]}
    in_alpha = {
        "ef21", "ef21_reloaded / ef21_w", "ef21_plus", "ef21_pl", "ef21w_pl", "ef21_pp",
        "ef21w_pp", "ef21_sgd", "ef21w_sgd", "rare_features",
    }  # fmt: skip
    assert in_alpha <= set(notes)
    for rule, note in notes.items():
        assert ("for the scaled C/(1+ω)" in note) == (rule in in_alpha), (rule, note)
    assert notes["ef21_pp"] == "p = 0.5; for the scaled C/(1+ω)"
    # ω = 0 (identity): C/(1 + ω) is C, nothing to say
    code, out, err = run_cli(
        capsys, "theory", "--dataset", "australian", "--clients", "10", "--compressor",
        "identity", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert all("scaled" not in r["note"] for r in _strict_json(out)["stepsizes"])


# 6. unknown L --------------------------------------------------------------------------------
def test_a_network_says_what_a_command_line_user_can_do(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "theory", "--problem", "mlp[dataset=australian,hidden=4]", "--clients", "2"
    )
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert "L and L_i" in line and "mlp[" in line and "pass a number" not in line
    assert "command line cannot" in line
    assert "theory_report(estimate_smoothness(problem).apply(problem), compressor)" in line
    assert "shrinkgrad.cli.theory.theory_report" in line
    assert "shrinkgrad.problems.estimate_smoothness" in line
    # ... and that advice works
    import shrinkgrad as sg
    from shrinkgrad.problems import estimate_smoothness

    p = sg.make_problem("mlp[dataset=australian,hidden=4,n_clients=2]")
    report = theory_cli.theory_report(
        estimate_smoothness(p, iters=3).apply(p), make_compressor("top_k[k=1]")
    )
    assert report["stepsizes"][0]["rule"] == "ef21" and report["stepsizes"][0]["stepsize"] > 0


# 7. high dimension ---------------------------------------------------------------------------
HUGE_D = 2_000_000_000


@pytest.fixture(scope="module")
def huge_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The audit's file: 400 samples of 5 features each, spread up to index 2·10⁹."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("hd") / "hd.svm"
    with open(path, "w") as fh:
        for i in range(400):
            cols = np.sort(rng.choice(HUGE_D - 1, size=5, replace=False) + 1)
            fh.write(("+1 " if i % 2 else "-1 ") + " ".join(f"{c}:0.5" for c in cols) + "\n")
        fh.write(f"+1 {HUGE_D}:0.5\n")  # d = 2·10⁹ exactly
    return path


@pytest.mark.parametrize("reg", ["nonconvex", "l2"])
def test_a_dimension_whose_f_x0_does_not_fit_still_gets_its_step_sizes(
    huge_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reg: str,
) -> None:
    # the loader's one d-vector (14.9 GiB) fits, f(x⁰)'s six (89.4 GiB) do not
    monkeypatch.setattr(M, "available_memory", lambda: 20 * 2**30)
    argv = ["theory", "--dataset", str(huge_file), "--clients", "10", "--reg", reg]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    report = _strict_json(out)
    assert report["constants"]["d"] == HUGE_D and report["predictions"] == []
    notes = report["notes"]
    assert notes[0].startswith("predicted rounds and bits left out: evaluating f(x⁰) at d = ")
    assert "2,000,000,000" in notes[0] and "89.4 GiB" in notes[0] and "20 GiB" in notes[0]
    assert "O(nnz)" in notes[0]
    if reg == "l2":  # f* by L-BFGS is left out as well, and said so
        assert report["constants"]["f_star"] is None and report["constants"]["mu"] > 0
        assert len(notes) == 2 and notes[1].startswith("f* left out: evaluating f* (by L-BFGS)")
    else:
        assert len(notes) == 1
    p = logistic_regression(huge_file, n_clients=10, reg=reg)
    assert isinstance(p, LinearModelProblem) and p.L is not None
    alpha = make_compressor("top_k[k=1]").alpha(HUGE_D)
    steps = {r["rule"]: r["stepsize"] for r in report["stepsizes"]}
    assert steps["ef21"] == T.stepsize_ef21(p.L, p.L_QM, alpha)
    assert steps["ef21_reloaded / ef21_w"] == T.stepsize_ef21_reloaded(p.L, p.L_AM, alpha)
    rf = rare_features(p)
    assert steps["rare_features"] == T.stepsize_rare_features(p.L, rf.L_plus, rf.c, 10, alpha)
    # the tables say the same
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    text = " ".join(out.split())
    assert "note: predicted rounds and bits left out" in text and "predicted rounds /" not in text
    assert "rare_features" in text


# 8. an unbiased C with ω < 1 is contractive itself -----------------------------------------
def test_an_unbiased_compressor_below_omega_one_gets_the_step_simulate_uses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "least_squares[dataset=australian_scale,n_clients=5,reg=l2,lam=0.5]"
    code, out, err = run_cli(
        capsys, "theory", "--problem", spec, "--compressor", "natural", "--json"
    )
    assert code == 0, err
    rows = {r["rule"]: r for r in _strict_json(out)["stepsizes"]}
    run = simulate(spec, "ef21", "natural", stepsize="theory", rounds=1).stepsize
    assert rows["ef21 (C itself)"]["stepsize"] == pytest.approx(run, rel=1e-12)
    assert rows["ef21"]["note"] == "for the scaled C/(1+ω)" and rows["ef21"]["stepsize"] > run
    code, out, _ = run_cli(
        capsys, "theory", "--problem", spec, "--compressor", "rand_k[k=2]", "--json"
    )
    assert "ef21 (C itself)" not in {r["rule"] for r in _strict_json(out)["stepsizes"]}  # ω ≥ 1
