"""What a researcher reads off a sweep's outputs, against independent computations.

* the bit columns of ``results.parquet`` (``bits_up``, ``bits_up_paper``, ``bits_down``:
  cumulative, per client = the average over the n clients) equal the compressors' own
  ``bits(d)``/``paper_bits(d)`` times the messages sent: DCGD with rand-k and QSGD, EF21 with
  Top-k (a full first send), EF21-PP (only the round's participants send), ``log_every > 1``;
* ``load_results`` (what ``shrinkgrad plot`` draws) is the sweep's current table: it neither
  misses runs that finished after the last periodic flush of ``results.*`` (a sweep killed
  between two flushes) nor returns a stale table written with the other ``--format`` by an
  earlier sweep of the directory, nor mixes in runs of an earlier version of the config.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from plot_tables import make_table

from shrinkgrad.compressors import make_compressor
from shrinkgrad.experiments import expand, load_config, load_results, loads_config
from shrinkgrad.experiments.results import write_table
from shrinkgrad.methods import make_method
from shrinkgrad.plotting import plot_results
from shrinkgrad.problems import make_problem

PROBLEM = "logistic_regression[dataset=australian,n_clients=4]"
CONFIG = f"""
name = "output-audit"
problem = "{PROBLEM}"
[run]
rounds = {{rounds}}
log_every = 3
seeds = [1]
[[pairs]]
method = "dcgd"
compressors = ["rand_k[k=3]", "qsgd[s=4]"]
stepsize = "1/L"
[[pairs]]
method = "ef21"
compressor = "top_k[k=2]"
[[pairs]]
method = "ef21_pp[p=0.5]"
compressor = "top_k[k=2]"
"""
ROUNDS = 7


def _sweep(out: Path, rounds: int = ROUNDS, fmt: str = "parquet") -> pd.DataFrame:
    from shrinkgrad.experiments import run_experiment

    cfg = loads_config(CONFIG.format(rounds=rounds), source="output-audit.toml")
    return run_experiment(cfg, out, jobs=1, progress=False, fmt=fmt).table  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit") / "sweep"
    _sweep(out)
    return out


def _curves(table: pd.DataFrame) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """label → (x, y) of every drawn curve of the bits / ‖∇f‖² figure."""
    fig, _ = plot_results(table, "bits", "grad_norm_sq")
    return {
        str(ln.get_label()): (np.asarray(ln.get_xdata()), np.asarray(ln.get_ydata()))
        for ln in fig.axes[0].get_lines()
        if not str(ln.get_label()).startswith("_")
    }


def test_bit_columns_are_the_compressors_count_times_the_messages(sweep: Path) -> None:
    table = load_results(sweep)
    problem = make_problem(PROBLEM)
    n, d = problem.n, problem.d
    full = 32.0 * d  # a float32 vector: EF21's first send, the broadcast iterate
    runs = pd.read_csv(sweep / "runs.csv")
    assert table["run_id"].nunique() == len(runs) == 4
    for run_id, run in table.groupby("run_id"):
        run = run.sort_values("round")
        method, comp = str(run["method"].iloc[0]), str(run["compressor"].iloc[0])
        c = make_compressor(comp)
        rounds = run["round"].to_numpy()
        assert rounds.tolist() == [0, 3, 6, 7]  # log_every = 3, round 0 and the last
        # clients sending in rounds 1..t (all n but for EF21-PP), summed
        if method.startswith("ef21_pp"):
            bound = make_method(method).bind(problem, comp, "theory", seed=int(run["seed"].iloc[0]))
            ids = torch.arange(n)
            per_round = [
                int(bound.method.participants(bound.cfg, ids, r).sum())
                for r in range(1, ROUNDS + 1)
            ]
            assert 0 < sum(per_round) < n * ROUNDS  # partial participation did happen
        else:
            per_round = [n] * ROUNDS
        sent = np.array([sum(per_round[:t]) for t in rounds], dtype=np.float64)
        first = 1.0 if method.startswith("ef21") else 0.0  # EF21: ∇f_i(x⁰) in full, x⁰ received
        np.testing.assert_array_equal(run["bits_up"], first * full + sent * c.bits(d) / n)
        np.testing.assert_array_equal(
            run["bits_up_paper"], first * full + sent * c.paper_bits(d) / n
        )
        np.testing.assert_array_equal(run["bits_down"], first * full + sent * full / n)
        summary = runs.set_index("run_id").loc[run_id]
        assert summary["bits_up"] == run["bits_up"].iloc[-1]
    # the compressors' counts themselves (docs/methods.md §2, d = 14)
    assert make_compressor("rand_k[k=3]").bits(d) == 3 * (32 + 4)
    assert make_compressor("qsgd[s=4]").bits(d) == 32 + d * (1 + 3)
    assert make_compressor("top_k[k=2]").paper_bits(d) == 2 * 32


def test_runs_finished_after_the_last_flush_are_in_the_table_and_the_figure(
    sweep: Path, tmp_path: Path
) -> None:
    # a sweep killed between two flushes of results.* (every 10 s): the last runs to finish
    # have their done.json and table, but the results file predates them
    d = tmp_path / "killed"
    shutil.copytree(sweep, d)
    full = load_results(sweep)
    last = full["run_id"].unique()[-1]
    write_table(full[full["run_id"] != last], d / "results", "parquet")
    table = load_results(d)
    assert set(table["run_id"]) == set(full["run_id"])
    pd.testing.assert_frame_equal(table.reset_index(drop=True), full.reset_index(drop=True))
    # `plot` says every run finished (no note), and so draws one curve per run
    from shrinkgrad.cli.plot import unfinished_note

    assert unfinished_note(d) is None
    assert len(_curves(table)) == full["run_id"].nunique() == 4


def test_a_stale_results_file_of_the_other_format_is_not_read(sweep: Path, tmp_path: Path) -> None:
    # the sweep ran with parquet, then again (more rounds) with --format csv: results.csv is
    # the current table, results.parquet an earlier sweep's
    d = tmp_path / "both"
    shutil.copytree(sweep, d)
    t0 = (d / "results.parquet").stat().st_mtime_ns
    os.utime(d / "results.parquet", ns=(t0 - 10**9, t0 - 10**9))
    current = _sweep(d, rounds=ROUNDS + 2, fmt="csv")
    table = load_results(d)
    assert table["round"].max() == ROUNDS + 2
    assert set(table["run_id"]) == set(current["run_id"])
    # the same two files without runs/ to rebuild from: the newer one is the table
    alone = tmp_path / "files"
    alone.mkdir()
    for name in ("results.parquet", "results.csv"):
        shutil.copy2(d / name, alone / name)
    assert load_results(alone)["round"].max() == ROUNDS + 2
    # and a table rebuilt from runs/ holds the runs of the current config only (the earlier
    # config's runs/ directories stay there, with 7 rounds: never mixed into a curve's seeds)
    (d / "results.csv").unlink()
    (d / "results.parquet").unlink()
    rebuilt = load_results(d)
    ids = [r.run_id for r in expand(load_config(d / "config.toml"))]
    assert list(dict.fromkeys(rebuilt["run_id"])) == ids
    assert set(rebuilt.groupby("run_id")["round"].max()) == {ROUNDS + 2}
    curves = _curves(rebuilt)
    assert len(curves) == 4
    for x, _ in curves.values():  # one seed per curve: rounds 0, 3, 6, 9 of this config only
        assert x.size == 4


def test_the_legend_names_each_curve_once_and_says_in_which_panel_seeds_were_left_out() -> None:
    # one curve (ef21 · top_k[k=1]) over two problems: all seeds fine on a, 1/3 diverged on b;
    # another (ef21 · identity) failed on both, for different reasons
    def status(method: str, comp: str, seed: int, p: str) -> str:
        if comp == "identity":
            return "diverged" if p == "dataset=a" or seed == 0 else "no_progress"
        return "diverged" if p == "dataset=b" and seed == 0 else "completed"

    curves = [("ef21", "top_k[k=1]"), ("ef21", "identity")]
    t = make_table(curves, problems=("dataset=a", "dataset=b"), status=status)
    fig, _ = plot_results(t, "rounds", "grad_norm_sq")
    labels = [" ".join(x.get_text().split()) for x in fig.legends[0].get_texts()]
    top = [lb for lb in labels if "top_k" in lb]
    ident = [lb for lb in labels if "identity" in lb]
    assert len(top) == 1 and len(ident) == 1, labels  # each curve once, in its one style
    # the seed left out is b's: the entry does not claim it for a
    assert top[0].endswith("(dataset=b: 1/3 seeds diverged, left out)"), top[0]
    assert ident[0].endswith("— dataset=a: diverged; dataset=b: 1 diverged, 2 no progress"), ident[
        0
    ]
    # each panel's own lines still say what happened there
    a, b = fig.axes[:2]
    assert {str(ln.get_label()) for ln in a.get_lines() if "top_k" in str(ln.get_label())} == {
        "ef21 · top_k[k=1] · γ=theory (stepsize_ef21)"
    }
    assert any("(1/3 seeds diverged, left out)" in str(ln.get_label()) for ln in b.get_lines())
    # the median drawn on b leaves the diverged seed out, on a it does not
    for ax, seeds in ((a, [0, 1, 2]), (b, [1, 2])):
        (line,) = [ln for ln in ax.get_lines() if "top_k" in str(ln.get_label())]
        ok = t[(t["compressor"] == "top_k[k=1]") & (t["problem_label"] == ax.get_title()[:9])]
        ok = ok[ok["seed_index"].isin(seeds)]
        np.testing.assert_allclose(
            line.get_ydata(), ok.groupby("round")["grad_norm_sq"].median().to_numpy()
        )
