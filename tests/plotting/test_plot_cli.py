"""``shrinkgrad plot``: facets, filters and output paths; every mistake is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plot_tables import make_table

from shrinkgrad.cli import main

CURVES = [("ef21", "top_k[k=1]"), ("ef21_w", "top_k[k=1]"), ("ef21", "qsgd[s=4]")]


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture
def results(tmp_path: Path) -> Path:
    d = tmp_path / "sweep"
    d.mkdir()
    make_table(CURVES, problems=("dataset=a", "dataset=b")).to_parquet(d / "results.parquet")
    return d


@pytest.mark.parametrize("facet", ["method", "compressor", "none", "n_clients"])
def test_facets(results: Path, facet: str, capsys: pytest.CaptureFixture[str]) -> None:
    stem = results / "f"
    assert (
        run_cli(["plot", str(results), "--facet", facet, "-o", str(stem), "--formats", "png"]) == 0
    )
    assert capsys.readouterr().out.split() == [str(stem) + ".png"]


def one_line_error(capsys: pytest.CaptureFixture[str], start: str) -> str:
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), cap.err
    assert "Traceback" not in cap.err
    return lines[0]


def test_an_unknown_facet_is_an_error(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["plot", str(results), "--facet", "colour"]) == 2
    err = one_line_error(capsys, "error: cannot facet by 'colour'")
    assert "method" in err and "problem_label" in err


def test_where_lists_columns_and_values(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["plot", str(results), "--where", "colour=red"]) == 2
    err = one_line_error(capsys, "error: --where 'colour=red': the results have no column")
    assert "columns: round, grad_norm_sq" in err and "method" in err
    assert run_cli(["plot", str(results), "--where", "method=ef2"]) == 2
    one_line_error(
        capsys, "error: --where 'method=ef2': no rows have method = 'ef2'; its values: ef21, ef21_w"
    )
    assert run_cli(["plot", str(results), "--where", "methodef21"]) == 2
    one_line_error(capsys, "error: --where 'methodef21': write COLUMN=VALUE")
    # numbers compare as numbers; conditions combine
    stem = results / "w"
    args = [
        "--where",
        "n_clients=10.0",
        "--where",
        "method=ef21",
        "-o",
        str(stem),
        "--formats",
        "png",
    ]
    assert run_cli(["plot", str(results), *args]) == 0 and (results / "w.png").exists()


def test_output_paths_that_cannot_be_created(
    results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("", encoding="utf-8")
    assert run_cli(["plot", str(results), "-o", str(blocker / "sub" / "fig")]) == 2
    err = one_line_error(capsys, "error: cannot write the figure")
    assert f"{str(blocker)!r} is a file, not a directory" in err and "choose another --out" in err
    assert run_cli(["plot", str(results), "-o", str(tmp_path / "x"), "--formats", "png,jpgx"]) == 2
    one_line_error(capsys, "error: cannot write figures as jpgx: give formats among")
    assert not list(tmp_path.glob("x.*"))  # nothing half-written


def test_held_out_axes_need_their_columns(
    results: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["plot", str(results), "--y", "test_accuracy"]) == 2
    one_line_error(capsys, "error: cannot plot y='test_accuracy': the results table has no column")


def test_a_sweep_without_a_finished_run_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a sweep stopped before its first run finished: its results table has no rows
    from shrinkgrad.experiments.config import loads_config
    from shrinkgrad.experiments.runner import run_experiment

    class StopAtOnce:  # an executor interrupted (Ctrl-C) before any run finished
        def describe(self) -> str:
            return "stop"

        def workers(self, tasks: int) -> int:
            return 1

        def run(self, tasks: list[object], emit: object) -> bool:
            return True

    cfg = loads_config(
        'problem = "logistic_regression[dataset=a1a,n_clients=3]"\n[run]\nrounds = 4\n'
        '[grid]\nmethods = ["ef21", "ef21_w"]\ncompressors = ["top_k[k=1]"]\n'
    )
    out = tmp_path / "sweep"
    res = run_experiment(
        cfg, out, executor=StopAtOnce(), progress=False, command=["shrinkgrad", "run", "c.toml"]
    )
    assert res.interrupted and res.table.empty
    assert run_cli(["plot", str(out)]) == 2
    one_line_error(
        capsys,
        f"error: {str(out)!r}: no run has finished yet (2 pending), so there is nothing to plot; "
        "run 'shrinkgrad run c.toml' again to resume it",
    )
    # a train sweep resumes under train (its ranks' checkpoints are not the simulator's)
    env = json.loads((out / "env.json").read_text())
    env["command"] = "shrinkgrad train c.toml --nproc 2"
    (out / "env.json").write_text(json.dumps(env))
    assert run_cli(["plot", str(out)]) == 2
    assert "run 'shrinkgrad train c.toml --nproc 2' again" in capsys.readouterr().err
    # killed before the first save: no results file at all, only the run directories
    (out / "results.parquet").unlink()
    (out / "env.json").unlink()
    assert run_cli(["plot", str(out)]) == 2
    one_line_error(
        capsys,
        f"error: {str(out)!r}: no run has finished yet (2 pending), so there is nothing to plot; "
        f"resume the sweep with 'shrinkgrad run {out / 'config.toml'} --out {out}'",
    )


def test_a_partial_sweep_is_plotted_with_a_note_and_in_the_configs_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep killed before all its runs finished: the figure shows the finished ones, a note
    says how many are missing, which arms have no curve, and how to resume; the table rebuilt
    from runs/ lists the runs in the config's order (the curves' order and styles), not by
    their hashed ids. runs.csv, a per-run summary, is not a results table (stop 34's plots
    audit: it drew an empty figure)."""
    import shutil

    from shrinkgrad.experiments import load_results
    from shrinkgrad.experiments.config import loads_config
    from shrinkgrad.experiments.grid import expand
    from shrinkgrad.experiments.runner import run_experiment

    cfg = loads_config(
        'problem = "logistic_regression[dataset=a1a,n_clients=3]"\n[run]\nrounds = 4\n'
        'seeds = 2\n[grid]\nmethods = ["ef21", "ef21_w", "ef21_plus"]\n'
        'compressors = ["top_k[k=1]"]\n'
    )
    out = tmp_path / "sweep"
    run_experiment(cfg, out, jobs=1, progress=False, command=["shrinkgrad", "run", "c.toml"])
    runs = expand(cfg)
    order = [r.run_id for r in runs]
    assert sorted(order) != order  # the hashed ids alone would reorder them
    # as a SIGKILL before the first save leaves it: no results file, two runs unfinished
    (out / "results.parquet").unlink()
    for r in runs[-2:]:  # ef21_plus, both seeds
        shutil.rmtree(out / "runs" / r.run_id)
    rebuilt = load_results(out)
    assert list(dict.fromkeys(rebuilt["run_id"])) == order[:-2]
    assert run_cli(["plot", str(out), "--out", str(tmp_path / "p"), "--formats", "png"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: 2 of 6 runs have not finished")
    assert "arms with no finished run, not drawn: ef21_plus · top_k[k=1] · γ=theory" in err[0]
    assert err[0].endswith("run 'shrinkgrad run c.toml' again to resume it")
    # a results file is plotted next to it (its default output was a path inside the file)
    load_results(out).to_parquet(out / "results.parquet")
    assert run_cli(["plot", str(out / "results.parquet"), "--formats", "png"]) == 0
    assert (out / "plots" / "grad_norm_sq_vs_bits.png").is_file()
    capsys.readouterr()
    # a truncated results file: the error says to delete it (runs/ rebuilds the table)
    data = (out / "results.parquet").read_bytes()
    (out / "results.parquet").write_bytes(data[: len(data) // 2])
    assert run_cli(["plot", str(out)]) == 2
    err = one_line_error(capsys, f"error: {out / 'results.parquet'}: cannot read it")
    assert err.endswith(
        f"delete it: the table is then rebuilt from the finished runs in {out / 'runs'}"
    )
    (out / "results.parquet").unlink()
    # a table without statuses is drawn, with a note that divergence cannot be told
    load_results(out).drop(columns=["status"]).to_csv(tmp_path / "old.csv", index=False)
    assert run_cli(["plot", str(tmp_path / "old.csv"), "--formats", "png"]) == 0
    assert "note: the table has no 'status' column" in capsys.readouterr().err
    # the per-run summary is refused in one line
    assert run_cli(["plot", str(out / "runs.csv")]) == 2
    one_line_error(capsys, f"error: {str(out / 'runs.csv')!r} is not a results table")
