"""How a sweep reports its runs (a user audit): runs that made no progress are never
"completed" nor the best run, runs that raised are "failed", impossible minibatches are refused
before anything runs, an --out of another experiment is refused, --set errors name the --set."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from shrinkgrad.experiments.claims import final_value, reach, runs_of
from shrinkgrad.experiments.config import ConfigError, load_config, loads_config
from shrinkgrad.experiments.execute import no_progress
from shrinkgrad.experiments.grid import check_runs, expand
from shrinkgrad.experiments.reproductions.common import common_tolerance
from shrinkgrad.experiments.reproductions.ef21_vs_ef import claims as ef21_vs_ef_claims
from shrinkgrad.experiments.runner import (
    OtherExperimentError,
    check_output_dir,
    run_experiment,
)

#: gd at 30× its theory step on a1a ends above f(x⁰) after 10 rounds (f: 0.69 → 4.4, and its
#: ‖∇f‖² 0.44 → 0.56); the theory step and a stochastic DCGD (whose ‖∇f‖² goes up and down)
#: make progress
NO_PROGRESS_CONFIG = """
name = "no-progress"
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 10
log_every = 5
[grid]
methods = ["gd"]
stepsizes = ["theory", "theory*30"]
[[pairs]]
method = "dcgd"
compressor = "rand_k[k=5]"
stepsize = 0.7
"""


def _table(losses: list[float], grads: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {"round": range(len(losses)), "loss": losses, "grad_norm_sq": grads}, dtype="float64"
    )


def test_the_no_progress_criterion_reads_the_loss_only() -> None:
    up = _table([0.69, 1.2, 2.98], [0.30, 0.5, 0.82])
    assert no_progress(up, "completed") == (
        "the loss ended above its start: f(x_T) = 2.98 > f(x⁰) = 0.69"
    )
    # a saturated loss: ‖∇f‖² went down, the loss went up: no progress all the same
    assert no_progress(_table([0.69, 10.0, 26.9], [0.30, 0.1, 0.045]), "completed")
    # a stochastic method whose last ‖∇f‖² is above its first, with a lower loss: progress
    assert no_progress(_table([0.69, 0.55, 0.54], [0.30, 0.02, 0.41]), "completed") is None
    assert "nan" in str(no_progress(_table([0.69, 0.5, math.nan], [0.3] * 3), "completed"))
    # rounding at the start (x⁰ at the minimum) is not a lack of progress; above √eps it is
    f0 = 0.6931471805599453
    assert no_progress(_table([f0, f0, f0 * (1 + 1e-12)], [0.0] * 3), "completed") is None
    assert no_progress(_table([f0, f0, f0 * (1 + 1e-6)], [0.0] * 3), "completed")
    assert no_progress(_table([f0, f0, f0 * (1 + 1e-6)], [0.0] * 3), "completed", "float32") is None
    # only runs that ran to their end: the other statuses say why they stopped
    for status in ("converged", "diverged", "stopped"):
        assert no_progress(up, status) is None


def test_a_run_that_ends_above_its_start_is_flagged_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = loads_config(NO_PROGRESS_CONFIG)
    res = run_experiment(cfg, tmp_path, jobs=1, progress=True)
    assert res.complete
    runs = pd.read_csv(tmp_path / "runs.csv").set_index("stepsize_spec")
    assert runs["status"].to_dict() == {
        "theory": "completed",
        "theory*30": "no_progress",
        "0.7": "completed",
    }
    bad = runs.loc["theory*30"]
    assert bad["loss"] > 0.69 and bad["message"].startswith("the loss ended above its start: ")
    assert bad["message"].endswith("(no progress; try a smaller step size)")
    # the results table and the run's done.json say the same
    rows = res.table[res.table["stepsize_spec"] == "theory*30"]
    assert set(rows["status"]) == {"no_progress"}
    done = json.loads((tmp_path / "runs" / bad["run_id"] / "done.json").read_text())
    assert done["status"] == "no_progress"
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["runs"]["finished"] == 3
    # the progress line marks it
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "γ=theory*30" in ln]
    assert "NO PROGRESS after 10 rounds" in line and "completed" not in line
    # a directory written before the criterion existed ("completed" on disk) reads the same
    done["status"] = "completed"
    (tmp_path / "runs" / bad["run_id"] / "done.json").write_text(json.dumps(done))
    again = run_experiment(cfg, tmp_path, jobs=1, progress=False)
    assert again.ran == 0
    assert dict(zip(again.runs["stepsize_spec"], again.runs["status"], strict=True)) == {
        "theory": "completed",
        "theory*30": "no_progress",
        "0.7": "completed",
    }
    assert set(again.table.loc[again.table["stepsize_spec"] == "theory*30", "status"]) == {
        "no_progress"
    }


def _claims_table() -> pd.DataFrame:
    """EF21 at ×1 (progress: ‖∇f‖² 0.4 → 0.1) and ×4 (no progress: f ends at 27, with the
    smallest ‖∇f‖² of all, 0.01), EF at both multipliers (0.4 → 0.2)."""
    rows = []
    finals = {("ef21", 1): (0.1, 0.5), ("ef21", 4): (0.01, 27.0)}
    for method in ("ef21", "ef"):
        for m in (1, 4):
            g_end, f_end = finals.get((method, m), (0.2, 0.6))
            status = "no_progress" if f_end > 0.69 else "completed"
            for t in range(3):
                rows.append(
                    {
                        "run_id": f"{method}-{m}",
                        "round": t,
                        "grad_norm_sq": 0.4 + (g_end - 0.4) * t / 2,
                        "loss": 0.69 + (f_end - 0.69) * t / 2,
                        "bits_up_paper": 32.0 * t,
                        "method": method,
                        "compressor": "top_k[k=1]",
                        "stepsize_spec": "theory(ef21)" + (f"*{m}" if m != 1 else ""),
                        "seed_index": 0,
                        "problem_label": "p",
                        "status": status,
                    }
                )
    return pd.DataFrame(rows)


def test_a_run_that_made_no_progress_is_never_the_best() -> None:
    table = _claims_table()
    runs = {keys["run_id"]: run for keys, run in runs_of(table)}
    assert final_value(runs["ef21-4"]) == math.inf and reach(runs["ef21-4"], 0.3) == math.inf
    best = min(runs, key=lambda k: final_value(runs[k]))
    assert best == "ef21-1"  # not ef21-4, whose last ‖∇f‖² is the smallest
    assert common_tolerance(table) == {"p": 0.2}  # it sets no target either
    third = ef21_vs_ef_claims(table, {"method": "ef21", "baseline": "ef", "better_fraction": 0.5})[
        2
    ]
    assert third.values["best_multiplier"] == {"p": 1.0} and third.passed is False


MINIBATCH = """
problem = "logistic_regression[dataset=a1a,n_clients=10]"
[run]
rounds = 5
[grid]
methods = ["ef21_sgd[b=1000]"]
stepsizes = [0.01]
"""


def test_a_minibatch_larger_than_a_client_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    cfg = loads_config(MINIBATCH, source="mb.toml")
    with pytest.raises(ConfigError) as e:
        run_experiment(cfg, tmp_path / "out", jobs=1, progress=False)
    assert str(e.value).startswith(
        "mb.toml: grid: ef21_sgd[b=1000] · identity · γ=0.01: ef21_sgd[b=1000]: minibatch size "
        "b = 1000 is larger than client 0's m_i = 160 samples (the smallest client holds 160); "
        "use b <= 160"
    )
    assert not (tmp_path / "out").exists()
    # the theory step names the batch too, not a missing variance bound (160 per client)
    theory = loads_config(
        MINIBATCH.replace("b=1000", "b=161").replace("stepsizes = [0.01]", 'stepsizes = ["theory"]')
    )
    with pytest.raises(ConfigError, match=r"b = 161 is larger than client 0's m_i = 160") as e:
        check_runs(theory, expand(theory))
    assert "sigma2" not in str(e.value) and "minibatch_variance_bound" not in str(e.value)
    fits = loads_config(MINIBATCH.replace("b=1000", "b=160"))
    assert len(check_runs(fits, expand(fits))[0]) == 1


def test_the_theory_step_of_ef21_sgd_names_the_batch_size() -> None:
    from shrinkgrad.problems import make_problem
    from shrinkgrad.sim import simulate

    p = make_problem("logistic_regression[dataset=a1a,n_clients=10]")
    for method in ("ef21_sgd[b=161]", "ef21_sgdm[b=161]"):
        with pytest.raises(ValueError) as e:
            simulate(p, method, "top_k[k=1]", stepsize="theory", rounds=2)
        assert str(e.value) == (
            f"{method}: minibatch size b = 161 is larger than client 0's m_i = 160 samples (the "
            "smallest client holds 160); use b <= 160 or fewer clients"
        )


def test_an_out_of_another_experiment_is_refused(tmp_path: Path) -> None:
    base = """
    problem = "logistic_regression[dataset=a1a,n_clients=3]"
    [run]
    rounds = 4
    [grid]
    methods = ["ef21"]
    compressors = ["top_k[k=1]"]
    """
    first = loads_config('name = "first"\n' + base, source="first.toml")
    out = tmp_path / "out"
    run_experiment(first, out, jobs=1, progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    other = loads_config('name = "other"\n' + base.replace("ef21", "ef21_w"), source="o.toml")
    with pytest.raises(OtherExperimentError) as e:
        run_experiment(other, out, jobs=1, progress=False)
    assert str(e.value) == (
        f"--out {str(out)!r} holds the results of another experiment ('first', from first.toml); "
        "writing 'other' there would replace its results.*, runs.csv and config.toml but leave "
        f"the rest: give another --out, or delete or move {str(out)!r} first"
    )
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing touched
    # the same experiment resumes; edited (more rounds, another method) it still writes there
    assert run_experiment(first, out, jobs=1, progress=False).skipped == 1
    edited = loads_config(
        'name = "first"\n' + base.replace('["ef21"]', '["ef21", "ef21_w"]'), source="first.toml"
    )
    assert run_experiment(edited, out, jobs=1, progress=False).skipped == 1
    # a config without a name is named by its file
    nameless = loads_config(base, source=str(tmp_path / "sweep.toml"))
    with pytest.raises(OtherExperimentError, match=r"another experiment \('first'.*'sweep'"):
        check_output_dir(nameless, out)
    out2 = tmp_path / "out2"
    check_output_dir(nameless, out2)  # nothing there: fine
    run_experiment(nameless, out2, jobs=1, progress=False)
    # its resolved config.toml (another file name) determines the same runs: a resume
    resumed = run_experiment(load_config(out2 / "config.toml"), out2, jobs=1, progress=False)
    assert resumed.skipped == 1
    with pytest.raises(OtherExperimentError, match=r"another experiment \('config'.*'other'"):
        check_output_dir(other, out2)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.rounds=abc", "--set run.rounds=abc: must be an integer >= 1, got 'abc'"),
        ("run.roundz=3", "--set run.roundz=3: unknown key; allowed here: "),
        (
            'grid.methods=["ef21", "nope"]',
            '--set grid.methods=["ef21", "nope"]: grid.methods[1]: unknown method \'nope\'',
        ),
    ],
)
def test_an_override_error_names_the_override(
    small_config: Path, override: str, message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(small_config, overrides=[override])
    assert str(e.value).startswith(message)
    # the same value in the file is the file's error
    with pytest.raises(ConfigError, match=rf"^{small_config}: run.rounds: must be an integer"):
        loads_config(
            small_config.read_text().replace("rounds = 12", 'rounds = "abc"'),
            source=str(small_config),
        )
    with pytest.raises(ConfigError, match=r"^override run.rounds='abc': must be an integer"):
        load_config(small_config, overrides={"run.rounds": "abc"})


def test_the_ranks_checkpoints_of_train_are_not_a_simulator_resume(tmp_path: Path) -> None:
    """A run interrupted under ``shrinkgrad train`` leaves its ranks' checkpoints; ``run`` in
    the same directory cannot resume from them (they hold each process's clients): it starts
    the run (not "resumed from checkpoints", as it used to say) and drops them when done."""
    cfg = loads_config(
        'name = "mixed"\nproblem = "synthetic_least_squares[n_clients=4,d=6]"\n'
        '[run]\nrounds = 8\nlog_every = 4\n[grid]\nmethods = ["gd"]\n',
        source="mixed.toml",
    )
    (run,) = expand(cfg)
    run_dir = tmp_path / "out" / "runs" / run.run_id
    run_dir.mkdir(parents=True)
    for r in range(2):
        (run_dir / f"checkpoint.pt.rank{r}-of-2").write_bytes(b"a rank's checkpoint")
    res = run_experiment(cfg, tmp_path / "out", jobs=1, progress=False)
    assert (res.ran, res.resumed) == (1, 0)
    assert not list(run_dir.glob("checkpoint.pt*"))
    assert (run_dir / "done.json").exists()
