"""One run of a sweep: prepare_run / finish_run / collect_results (shared by run and train)."""

from __future__ import annotations

from pathlib import Path

from shrinkgrad.experiments.config import loads_config
from shrinkgrad.experiments.execute import collect_results, finish_run, prepare_run, write_run
from shrinkgrad.experiments.grid import check_runs, expand
from shrinkgrad.experiments.results import RESULT_COLUMNS
from shrinkgrad.sim import simulate

CONFIG = """
problem = "logistic_regression[dataset=a1a,n_clients=3]"
[run]
rounds = 4
tol_rel = 1e-3
[[pairs]]
method = "ef"
compressor = "top_k[k=1]"
stepsize = "theory(ef21)*4"
[[pairs]]
method = "ef21"
compressors = ["top_k[k=1]", "top_k[k=2]"]
"""


def test_a_prepared_run_is_simulate_with_the_resolved_step_and_tolerance(tmp_path: Path) -> None:
    cfg = loads_config(CONFIG)
    runs, _, infos = check_runs(cfg, expand(cfg))
    ef, ef21, _ = runs
    prepared = prepare_run(ef)
    g0 = prepared.problem.grad(prepared.problem.x0())
    assert prepared.tol == 1e-3 * float(g0 @ g0)
    ef21_step = simulate(prepared.problem, "ef21", "top_k[k=1]", rounds=0).stepsize
    assert prepared.stepsize == "theory(ef21)*4"  # resolved by Method.bind, the one grammar
    plain = prepare_run(ef21, prepared.problem)  # a given problem is used as it is
    assert plain.problem is prepared.problem and plain.stepsize == "theory"

    result, wall = prepared.execute(simulate)
    assert wall > 0 and result.stepsize == 4 * ef21_step
    direct = simulate(
        prepared.problem,
        "ef",
        "top_k[k=1]",
        4 * ef21_step,
        4,
        ef.seed,
        tol=prepared.tol,
        log_every=ef.settings.log_every,
    )
    table, summary = finish_run(prepared, result, wall, infos[ef.problem.spec], "exp", world_size=3)
    assert list(table.columns) == list(RESULT_COLUMNS)
    assert table["grad_norm_sq"].tolist() == direct.table["grad_norm_sq"].tolist()
    assert set(table["stepsize_rule"]) == {"stepsize_ef21*4 of ef21"}
    assert set(table["experiment"]) == {"exp"} and set(table["run_id"]) == {ef.run_id}
    assert summary["stepsize_rule"] == "stepsize_ef21*4 of ef21" and summary["rounds"] == 4
    assert list(summary)[-2:] == ["wall_s", "world_size"] and summary["world_size"] == 3

    # collect: one finished, one with the simulator's checkpoint, one with the ranks', none
    out = tmp_path / "out"
    write_run(out / "runs" / ef.run_id, table, summary, "csv")
    for run, name in zip(runs[1:], ["checkpoint.pt", "checkpoint.pt.rank1-of-2"], strict=True):
        (out / "runs" / run.run_id).mkdir(parents=True)
        (out / "runs" / run.run_id / name).write_bytes(b"")
    results, summaries = collect_results(out, runs, "renamed")
    assert set(results["experiment"]) == {"renamed"} and len(results) == len(table)
    assert summaries["status"].tolist() == ["completed", "interrupted", "interrupted"]
    (out / "runs" / runs[2].run_id / "checkpoint.pt.rank1-of-2").unlink()
    assert collect_results(out, runs, "x")[1]["status"].tolist()[-1] == "pending"
