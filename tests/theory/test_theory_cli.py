"""``shrinkgrad theory`` and ``shrinkgrad list datasets|problems|splits``."""

from __future__ import annotations

import json

import pytest
from cli_run import run_cli

from shrinkgrad import theory as T
from shrinkgrad.problems import logistic_regression


def test_theory_command_prints_the_issue_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "theory", "--dataset", "australian", "--clients", "100", "--split", "contiguous",
        "--compressor", "top_k[k=1]",
    )  # fmt: skip
    assert code == 0
    for word in ("L_AM", "L_QM", "L_var", "xi", "ef21", "ef21_reloaded", "ef21_pp", "rare_features",
                 "delayed", "predicted rounds"):  # fmt: skip
        assert word in out
    assert "26.4907" in out  # ξ(1/14)


def test_theory_json_matches_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "theory", "--dataset", "australian_scale", "--clients", "10", "--split",
        "shuffled[seed=1]", "--compressor", "rand_k[k=2]", "--reg", "l2", "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    p = logistic_regression("australian_scale", n_clients=10, split="shuffled[seed=1]", reg="l2")
    c = report["constants"]
    assert c["L"] == pytest.approx(p.L, rel=1e-12) and c["L_QM"] == pytest.approx(p.L_QM)
    assert c["mu"] == pytest.approx(0.1)
    comp = report["compressor"]
    assert comp["kind"] == "unbiased" and comp["omega"] == pytest.approx(6.0)  # d/k − 1
    steps = {r["rule"]: r["stepsize"] for r in report["stepsizes"]}
    alpha = 1 / 7  # 1/(1 + ω)
    assert steps["ef21"] == pytest.approx(T.stepsize_ef21(p.L, p.L_QM, alpha))
    assert steps["ef21_pl"] == pytest.approx(T.stepsize_ef21_pl(p.L, p.L_QM, alpha, 0.1))
    assert steps["dcgd"] == pytest.approx(T.stepsize_dcgd(p.L, p.L_max, 6.0, 10))
    assert steps["unbiased_single (strict <)"] == pytest.approx(2 / (p.L * 7))
    assert steps["diana"] == T.stepsize_diana(p.L, p.L_QM, 6.0, 10)
    assert steps["ef21_plus"] == T.stepsize_ef21(p.L, p.L_QM, alpha)
    # a shared seed is one draw for every client: the ω/n terms take n = 1, and say so
    code, out, _ = run_cli(
        capsys, "theory", "--dataset", "australian_scale", "--clients", "10", "--split",
        "shuffled[seed=1]", "--compressor", "rand_k[k=2,shared_seed=true]", "--reg", "l2",
        "--json",
    )  # fmt: skip
    shared = {r["rule"]: r for r in json.loads(out)["stepsizes"]}
    assert shared["dcgd"]["stepsize"] == pytest.approx(T.stepsize_dcgd(p.L, p.L_max, 6.0, 1))
    assert shared["diana"]["stepsize"] == T.stepsize_diana(p.L, p.L_QM, 6.0, 1)
    assert "n = 1" in shared["dcgd"]["note"] and "n = 1" in shared["diana"]["note"]
    assert shared["ef21"]["stepsize"] == steps["ef21"]  # EF21's bound has no ω/n term


def test_theory_user_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "theory", "--dataset", "nope", "--clients", "3")
    assert code == 2 and err.startswith("error: unknown dataset 'nope'") and "Traceback" not in err
    code, _, err = run_cli(capsys, "theory", "--dataset", "australian", "--clients", "1000")
    assert code == 2 and "exceeds the 690 samples" in err
    code, _, err = run_cli(capsys, "theory", "--dataset", "australian")
    assert code != 0 and "--clients" in err and "Traceback" not in err
    code, _, err = run_cli(
        capsys, "theory", "--dataset", "australian", "--clients", "5", "--compressor", "top_q"
    )
    assert code == 2 and "unknown compressor" in err


@pytest.mark.parametrize(
    ("family", "word"),
    [("datasets", "a9a"), ("problems", "synthetic_least_squares"), ("splits", "dirichlet")],
)
def test_list_families(capsys: pytest.CaptureFixture[str], family: str, word: str) -> None:
    code, out, _ = run_cli(capsys, "list", family)
    assert code == 0 and word in out


def test_theory_on_a_synthetic_problem_needs_no_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "theory", "--problem", "synthetic_least_squares[n_clients=40,d=5,m=5,L_var=10]",
        "--compressor", "top_k[k=1]", "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["constants"]["L_var"] == pytest.approx(10.0, rel=1e-9)
    assert report["constants"]["mu"] > 0 and report["constants"]["f_star"] is not None
    code, _, err = run_cli(
        capsys, "theory", "--problem", "synthetic_least_squares", "--dataset", "a9a"
    )
    assert code == 2 and "has no parameter 'dataset'" in err
