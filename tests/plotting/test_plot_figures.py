"""Figures fit for a paper, checked on the matplotlib objects and the files written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image
from plot_tables import make_table

from shrinkgrad.compressors import make_compressor
from shrinkgrad.plotting import aggregate, plot_results
from shrinkgrad.plotting.axes import axis_of

METHODS = ("ef21", "ef21_w")
COMPRESSORS = ("top_k[k=1]", "top_k[k=2]", "top_k[k=5]", "rand_k[k=3]", "qsgd[s=4]", "identity")
MANY = [(m, c) for m in METHODS for c in COMPRESSORS]  # 12 curves: more than tab10's colours


def legends(fig: object) -> int:
    return len(fig.legends) + sum(ax.get_legend() is not None for ax in fig.axes)  # type: ignore[attr-defined]


def test_one_legend_per_figure(tmp_path: Path) -> None:
    t = make_table(MANY[:4], problems=("dataset=a", "dataset=b", "dataset=c"))
    fig, _ = plot_results(t, "rounds", "grad_norm_sq", tmp_path / "f", formats=["png"])
    assert legends(fig) == 1 and len(fig.legends) == 1  # below the three panels
    assert len(fig.legends[0].get_texts()) == 4  # each curve once, not once per panel
    one, _ = plot_results(t[t["problem_label"] == "dataset=a"], "rounds", "grad_norm_sq")
    assert legends(one) == 1 and one.axes[0].get_legend() is not None  # inside the one panel


def test_line_styles_separate_methods_when_colours_are_shared() -> None:
    fig, _ = plot_results(make_table(MANY), "rounds", "grad_norm_sq")
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label()[:1] != "_"]
    assert len(lines) == 12
    style = {}
    for ln in lines:
        method = ln.get_label().split(" · ")[0]
        style[ln.get_label()] = (method, ln.get_color(), ln.get_linestyle(), ln.get_marker())
    # the palette has 10 colours: some curves share one ...
    colours = [s[1] for s in style.values()]
    assert len(set(map(str, colours))) < len(colours)
    # ... and still no two curves look alike, and the two methods never share a line style
    assert len({(str(c), ls, mk) for _, c, ls, mk in style.values()}) == 12
    per_method = {m: {ls for mm, _, ls, _ in style.values() if mm == m} for m in METHODS}
    assert all(len(v) == 1 for v in per_method.values())
    assert per_method["ef21"] != per_method["ef21_w"]


def test_short_log_axes_have_readable_tick_labels(tmp_path: Path) -> None:
    # the loss stays within [0.3, 0.6]: less than a decade
    t = make_table(MANY[:2])
    fig, _ = plot_results(t, "rounds", "loss", tmp_path / "l", formats=["png"])
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    lo, hi = ax.get_ylim()
    assert hi / lo < 10
    labels = [
        (tick.get_position()[1], tick.get_text())
        for tick in ax.get_yticklabels()
        if lo <= tick.get_position()[1] <= hi
    ]
    texts = [text for _, text in labels if text]
    assert len(texts) >= 3, labels
    for text in texts:  # plain numbers, not 10^k mathtext
        assert re.fullmatch(r"[0-9.e+-]+", text), text
    assert {float(x) for x in texts} >= {0.4, 0.5}


def test_png_resolution_is_for_print(tmp_path: Path) -> None:
    _, paths = plot_results(make_table(MANY[:2]), "rounds", "grad_norm_sq", tmp_path / "r")
    png = next(p for p in paths if p.suffix == ".png")
    dpi = Image.open(png).info["dpi"]
    assert all(150 <= round(v) <= 300 for v in dpi)
    _, paths = plot_results(make_table(MANY[:2]), "rounds", "loss", tmp_path / "s", dpi=300)
    assert round(Image.open(paths[0]).info["dpi"][0]) == 300


def test_y_limits_are_not_dominated_by_a_numerical_floor() -> None:
    def value(method: str, comp: str, seed: int, r: int, p: str) -> float:
        if comp == "identity":  # reaches the float64 floor (and exactly zero)
            return 0.0 if r == 7 else max(0.5 ** (20 * r), 1e-30)
        return 0.5**r  # the others end at 0.5^7 ≈ 8e-3

    t = make_table([("ef21", "top_k[k=1]"), ("ef21", "identity")], value=value)
    fig, _ = plot_results(t, "rounds", "grad_norm_sq")
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert ax.get_yscale() == "log"
    assert lo >= 1e-14 * hi  # 12 decades and a margin: 1e-30 would squash everything
    assert lo < 0.5**7  # every value of the other curve is inside
    floor_line = next(ln for ln in ax.get_lines() if "identity" in ln.get_label())
    y = np.asarray(floor_line.get_ydata())
    assert np.all(y > 0) and y[-1] < lo  # exactly 0 is drawn below the bottom, not dropped


@pytest.mark.parametrize(
    "bad, suffix, partial_note",
    [
        ("diverged", "— diverged", "1/3 seeds diverged, left out"),
        # ended above its starting loss: its ‖∇f‖² may be the smallest of all
        (
            "no_progress",
            "— no progress (ended above f(x⁰))",
            "(1/3 seeds made no progress, left out)",
        ),
    ],
)
def test_a_failed_run_is_never_drawn_as_the_best_curve(
    bad: str, suffix: str, partial_note: str
) -> None:
    # the failed run's ‖∇f‖² is tiny (saturated sigmoids): it must not look like the best
    def value(method: str, comp: str, seed: int, r: int, p: str) -> float:
        if comp == "qsgd[s=4]":
            return 1e-9 * (1 + r)
        if comp == "rand_k[k=3]" and seed == 0:
            return 1e-12  # one failed seed of an otherwise fine curve
        return (1 + 0.1 * seed) * 0.5**r

    def status(method: str, comp: str, seed: int, p: str) -> str:
        failed = comp == "qsgd[s=4]" or (comp == "rand_k[k=3]" and seed == 0)
        return bad if failed else "completed"

    curves = [("ef21", "top_k[k=1]"), ("ef21", "qsgd[s=4]"), ("ef21", "rand_k[k=3]")]
    t = make_table(curves, value=value, status=status)
    fig, _ = plot_results(t, "rounds", "grad_norm_sq")
    ax = fig.axes[0]
    by = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_label()[:1] != "_"}
    failed = next(ln for k, ln in by.items() if "qsgd" in k)
    assert failed.get_label().endswith(suffix)
    assert failed.get_linestyle() == ":" and failed.get_color() == "0.55"
    assert ax.get_ylim()[0] > 1e-8  # the limits follow the good curves only
    partial = next(ln for k, ln in by.items() if "rand_k" in k)
    assert partial_note in partial.get_label()
    ok = t[(t["compressor"] == "rand_k[k=3]") & (t["seed_index"] > 0)]
    np.testing.assert_allclose(
        partial.get_ydata(), ok.groupby("round")["grad_norm_sq"].median().to_numpy()
    )
    agg = aggregate(t, "rounds", "grad_norm_sq")
    assert set(agg.loc[agg["compressor"] == "qsgd[s=4]", "all_diverged"]) == {True}
    rand = agg[agg["compressor"] == "rand_k[k=3]"]
    other = "diverged" if bad == "no_progress" else "no_progress"
    assert set(rand[bad]) == {1} and set(rand[other]) == {0}


def test_a_panel_whose_every_run_diverged_keeps_its_log_axis() -> None:
    # the diverged runs' ‖∇f‖² grows 1e2 → 1e26 and then 0 (saturated): on a linear axis it
    # would look like a clean descent to 0; the documented log axis shows what happened
    def value(method: str, comp: str, seed: int, r: int, p: str) -> float:
        if p == "dataset=b":
            return 0.0 if r == 7 else 10.0 ** (2 + 4 * r)
        return (1 + 0.1 * seed) * 0.5**r

    t = make_table(
        [("ef21", "top_k[k=1]")],
        problems=("dataset=a", "dataset=b"),
        value=value,
        status=lambda m, c, s, p: "diverged" if p == "dataset=b" else "completed",
    )
    fig, _ = plot_results(t, "rounds", "grad_norm_sq")
    fine, bad = fig.axes[:2]
    assert fine.get_yscale() == "log" and bad.get_yscale() == "log"
    lo, hi = bad.get_ylim()
    assert hi > 1e26 and 1e13 < lo < 1e14  # at most 12 decades below the top, as elsewhere
    (line,) = [ln for ln in bad.get_lines() if ln.get_label()[:1] != "_"]
    assert line.get_label().endswith("— diverged") and line.get_linestyle() == ":"
    assert np.all(np.asarray(line.get_ydata()) > 0)  # the 0 is drawn below the floor
    # --linear-y still gives a linear axis
    fig, _ = plot_results(t, "rounds", "grad_norm_sq", logy=False)
    assert fig.axes[1].get_yscale() == "linear"


@pytest.mark.parametrize("facet", ["method", "compressor"])
def test_facet_by_a_curve_key(facet: str) -> None:
    t = make_table(MANY[:3] + MANY[6:9])  # 2 methods × 3 compressors
    fig, _ = plot_results(t, "rounds", "grad_norm_sq", facet=facet)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == t[facet].nunique()
    for ax in axes:
        panel = ax.get_title().splitlines()[0]
        lines = [ln for ln in ax.get_lines() if ln.get_label()[:1] != "_"]
        # one line per value of the other key, labelled without the panel's own value
        assert len(lines) == t.loc[t[facet] == panel].drop(columns=[facet])["run_id"].nunique() // 3
        assert all(panel not in ln.get_label().split(" · ") for ln in lines)


def test_facet_errors_and_none() -> None:
    t = make_table(MANY[:2], problems=("dataset=a", "dataset=b"))
    with pytest.raises(ValueError, match=r"cannot facet by 'colour': .*; use none or one of round"):
        plot_results(t, "rounds", "grad_norm_sq", facet="colour")
    fig, _ = plot_results(t, "rounds", "grad_norm_sq", facet="none")
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 1


def test_curves_never_mix_problems_when_the_panels_are_not_the_problems() -> None:
    def value(method: str, comp: str, seed: int, r: int, p: str) -> float:
        return (10.0 if p == "dataset=b" else 1.0) * 0.5**r

    t = make_table(MANY[:2] + MANY[6:8], problems=("dataset=a", "dataset=b"), value=value)
    fig, _ = plot_results(t, "rounds", "grad_norm_sq", facet="method")
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if ln.get_label()[:1] != "_"]
        assert len(lines) == 4  # 2 problems × 2 compressors, each its own curve
        for ln in lines:
            problem = ln.get_label().split(" · ")[0]
            assert problem in ("dataset=a", "dataset=b")
            scale = 10.0 if problem == "dataset=b" else 1.0
            np.testing.assert_allclose(ln.get_ydata(), scale * 0.5 ** np.arange(8))
    fig, _ = plot_results(t, "rounds", "grad_norm_sq", facet="none")
    assert len([ln for ln in fig.axes[0].get_lines() if ln.get_label()[:1] != "_"]) == 8


def test_held_out_metrics(tmp_path: Path) -> None:
    def extra(method: str, comp: str, seed: int, r: int, p: str) -> dict[str, float]:
        return {"test_loss": 0.7 * 0.9**r, "test_accuracy": 0.5 + 0.05 * r}

    t = make_table(MANY[:2], extra=extra)
    fig, _ = plot_results(t, "rounds", "test_accuracy", tmp_path / "a", formats=["png"])
    ax = fig.axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylabel() == "held-out accuracy"
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), 0.5 + 0.05 * np.arange(8))
    fig, _ = plot_results(t, "rounds", "test_loss")
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_ylabel() == "held-out loss"
    with pytest.raises(
        ValueError, match=r"no column 'test_accuracy' \(the problem has no held-out"
    ):
        plot_results(make_table(MANY[:1]), "rounds", "test_accuracy")


def test_the_bits_label_says_what_the_column_counts() -> None:
    label = " ".join(axis_of("bits_up_paper").label.split())
    assert "32 per float sent" in label and "levels at their width" in label
    assert "indices free" in label
    d = 100
    # what the column sums per round, compressor by compressor (Compressor.paper_bits):
    assert make_compressor("top_k[k=3]").paper_bits(d) == 32 * 3  # floats; indices free
    assert make_compressor("qsgd[s=4]").paper_bits(d) == 32 + d * (1 + 3)  # norm; levels, signs
    assert make_compressor("identity").paper_bits(d) == 32 * d
    # the plotting docs say the same as the label
    docs = Path(__file__).resolve().parents[2] / "docs" / "experiments.md"
    if docs.exists():
        assert label in " ".join(docs.read_text(encoding="utf-8").split())


def test_figure_draws_without_a_canvas_error(tmp_path: Path) -> None:
    fig, _ = plot_results(make_table(MANY), "bits", "grad_norm_sq")
    FigureCanvasAgg(fig).draw()  # layout of the outside legend and wrapped labels works
