"""Plots are pure functions of a results table: files written, plotted data = the medians."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from shrinkgrad.plotting import aggregate, plot_results


def tiny_table(random_bits: bool = False) -> pd.DataFrame:
    """Two problems × two curves × three seeds, rounds 0..4, made up by hand."""
    rows = []
    for p, (lvar, am, qm) in {"dataset=a": (0.5, 2.0, 2.5), "dataset=b": (1e6, 1.0, 9.0)}.items():
        for method, rule, rate in (
            ("ef21", "stepsize_ef21", 0.5),
            ("ef21_w", "stepsize_ef21_reloaded", 0.25),
        ):
            for seed in range(3):
                for r in range(5):
                    bits = 100.0 * r + (7.0 * seed * r if random_bits else 0.0)
                    rows.append(
                        {
                            "round": r,
                            "grad_norm_sq": (1.0 + 0.1 * seed) * rate**r,
                            "loss": 1.0 + rate**r,
                            "bits_up": bits,
                            "bits_up_paper": 32.0 * r,
                            "time_s": 0.01 * r * (1 + seed),
                            "method": method,
                            "compressor": "top_k[k=1]",
                            "stepsize": 0.1 if method == "ef21" else 0.2,
                            "stepsize_rule": rule,
                            "stepsize_spec": "theory",
                            "seed_index": seed,
                            "problem_label": p,
                            "n_clients": 10,
                            "d": 5,
                            "L_var": lvar,
                            "L_AM": am,
                            "L_QM": qm,
                        }
                    )
    return pd.DataFrame(rows)


def test_aggregate_equals_the_median_and_quantiles_over_seeds() -> None:
    t = tiny_table()
    agg = aggregate(t, "rounds", "grad_norm_sq", quantiles=(0.25, 0.75))
    ref = t.groupby(["problem_label", "method", "round"])["grad_norm_sq"]
    for _, row in agg.iterrows():
        vals = ref.get_group((row["problem_label"], row["method"], row["x"]))
        assert row["median"] == np.median(vals)
        assert row["lo"] == pytest.approx(np.quantile(vals, 0.25), rel=1e-15)
        assert row["hi"] == pytest.approx(np.quantile(vals, 0.75), rel=1e-15)
        assert row["seeds"] == 3
    assert len(agg) == 2 * 2 * 5


def test_unequal_x_are_interpolated_inside_each_seeds_range() -> None:
    t = pd.DataFrame(
        {
            "round": [0, 1, 0, 1],
            "grad_norm_sq": [1.0, 1e-2, 1.0, 1e-4],
            "bits_up": [0.0, 2.0, 0.0, 4.0],
            "method": "m",
            "compressor": "c",
            "stepsize_spec": "theory",
            "seed_index": [0, 0, 1, 1],
        }
    )
    agg = aggregate(t, "bits", "grad_norm_sq")
    assert agg["x"].tolist() == [0.0, 2.0, 4.0]
    # at x = 2: seed 0 has 1e-2 exactly; seed 1 is log-interpolated half way: 1e-2 → median 1e-2
    assert agg["median"].iloc[1] == pytest.approx(1e-2)
    # at x = 4 only seed 1 has data (seed 0 stopped at 2)
    assert agg["seeds"].tolist() == [2, 2, 1] and agg["median"].iloc[2] == 1e-4


def test_plot_files_and_line_data_are_the_table_medians(tmp_path: Path) -> None:
    t = tiny_table()
    fig, paths = plot_results(t, "rounds", "grad_norm_sq", tmp_path / "fig" / "g")
    assert [p.name for p in paths] == ["g.png", "g.pdf"]
    assert all(p.stat().st_size > 1000 for p in paths)
    assert (
        paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[1].read_bytes()[:4] == b"%PDF"
    )
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2
    med = t.groupby(["problem_label", "method", "round"])["grad_norm_sq"].median()
    for ax in axes:
        title = ax.get_title()
        panel = title.splitlines()[0]
        assert ax.get_yscale() == "log"
        assert "L_var=" in title and "L_QM/L_AM=" in title
        lines = ax.get_lines()
        assert len(lines) == 2
        for line in lines:
            label = line.get_label()
            method = label.split(" · ")[0]
            assert label.startswith(f"{method} · top_k[k=1] · γ=theory (stepsize_ef21")
            np.testing.assert_array_equal(line.get_xdata(), np.arange(5.0))
            np.testing.assert_array_equal(line.get_ydata(), med.loc[(panel, method)].to_numpy())
    t2 = tiny_table()
    t2.loc[0, "grad_norm_sq"] = 123.0  # the figure follows the table, nothing else
    fig2, _ = plot_results(t2, "rounds", "grad_norm_sq")
    assert fig2.axes[0].get_lines()[0].get_ydata()[0] == np.median([123.0, 1.1, 1.2])


def test_bits_axes_and_quantile_band(tmp_path: Path) -> None:
    t = tiny_table(random_bits=True)
    fig, paths = plot_results(t, "bits", "loss", tmp_path / "b", formats=["png"])
    assert [p.suffix for p in paths] == [".png"]
    ax = fig.axes[0]
    assert "honest" in ax.get_xlabel()
    assert ax.collections, "a quantile band is drawn where seeds differ"
    fig, _ = plot_results(t, "bits_paper", "grad_norm_sq")
    assert "papers' count" in fig.axes[0].get_xlabel()


def test_bad_axes_are_clear_errors() -> None:
    t = tiny_table()
    with pytest.raises(ValueError, match="cannot plot x='watts'"):
        plot_results(t, "watts", "grad_norm_sq")
    with pytest.raises(ValueError, match=r"column 'method' is not numeric"):
        plot_results(t, "rounds", "method")
    with pytest.raises(ValueError, match="quantiles"):
        aggregate(t, quantiles=(0.6, 0.9))


def test_logx_gives_a_log_x_axis_even_when_the_curves_start_at_zero() -> None:
    # time_model / bits start at 0 (round 0: nothing sent yet), which a log axis cannot show:
    # logx must still give a log axis (it used to stay linear), leaving out the x = 0 points
    t = tiny_table()
    assert (t["bits_up"] == 0).any()
    fig, _ = plot_results(t, "bits", "grad_norm_sq", logx=True)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2 and all(ax.get_xscale() == "log" for ax in axes)
    med = t.groupby(["problem_label", "method", "round"])["grad_norm_sq"].median()
    for ax in axes:
        panel = ax.get_title().splitlines()[0]
        for line in ax.get_lines():
            method = str(line.get_label()).split(" · ")[0]
            np.testing.assert_array_equal(line.get_xdata(), 100.0 * np.arange(1, 5))
            np.testing.assert_array_equal(line.get_ydata(), med.loc[(panel, method)].to_numpy()[1:])
    fig, _ = plot_results(t, "bits", "grad_norm_sq")
    assert all(ax.get_xscale() == "linear" for ax in fig.axes if ax.get_visible())
    t0 = t.assign(bits_up=0.0)
    with pytest.raises(ValueError, match=r"^cannot draw x='bits' on a log axis: it has no value"):
        plot_results(t0, "bits", "grad_norm_sq", logx=True)


def test_the_figure_says_how_seeds_are_combined() -> None:
    """The caption names the median, the band's quantiles and the seeds per curve, counting a
    diverged seed (left out of the median) and a curve of diverged seeds only; one seed per
    curve says so (stop 34's plots audit: no figure said it)."""
    from plot_tables import make_table

    def caption(table: pd.DataFrame, **kw: object) -> str:
        fig, _ = plot_results(table, "rounds", "grad_norm_sq", None, **kw)  # type: ignore[arg-type]
        return str(fig._suptitle.get_text())  # type: ignore[union-attr]

    curves = [("ef21", "top_k[k=1]"), ("ef21_w", "top_k[k=1]")]
    three = make_table(curves, seeds=3)
    assert caption(three) == "median over 3 seeds per curve, band: 10–90 % quantiles"
    assert caption(three, quantiles=(0.25, 0.75)).endswith("band: 25–75 % quantiles")
    assert caption(make_table(curves, seeds=1)) == "one seed per curve"
    assert caption(three, title="T") == "T\nmedian over 3 seeds per curve, band: 10–90 % quantiles"

    # one seed of ef21 diverged, and every seed of ef21_w: still 3 seeds per curve
    def status(method: str, compressor: str, seed: int, problem: str) -> str:
        return "diverged" if method == "ef21_w" or seed == 0 else "completed"

    assert caption(make_table(curves, seeds=3, status=status)).startswith("median over 3 seeds")
