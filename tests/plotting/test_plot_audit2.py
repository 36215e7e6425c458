"""Legends, numbers in labels, and the figures of ``ef21w-synthetic`` and ``k18-quantizers``.

* a curve whose step-size rule reads differently per panel (a note on one problem) is one legend
  entry, each panel's rule said after the panel's name;
* a step size given as a number is written compactly (``1e+06``, not ``1000000.0``);
* ``ef21w-synthetic``'s figure draws what exists and names what is missing, without pair runs;
* ``k18-quantizers``: a run that completed no round has no bits/round (not 0); ties between
  levels are decided by the level, whatever the order of the table's rows; the trade-off
  panel's tick names match the points of every problem.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from plot_tables import make_table

from shrinkgrad.experiments.reproductions import ef21w_synthetic, k18_quantizers
from shrinkgrad.plotting import curve_label, plot_results


def _legend(fig: Any) -> list[str]:
    legends = fig.legends or [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [" ".join(t.get_text().split()) for t in legends[0].get_texts()]


# --------------------------------------------------------------------------------------------
# 1. one legend entry per curve when its rule differs per panel
# --------------------------------------------------------------------------------------------
RULE = "stepsize_dcgd"
NOTE = "stepsize_dcgd(f_i not convex: outside its theorem)"


def _rule_table(problems: tuple[str, ...], noted: tuple[str, ...]) -> pd.DataFrame:
    """Two curves on ``problems``; on the ``noted`` problems the theory rule carries a note,
    and the theory step's value differs per problem."""
    curves = [("dcgd", "rand_k[k=1]"), ("dcgd", "qsgd[s=2]")]

    def extra(m: str, c: str, s: int, r: int, p: str) -> dict[str, Any]:
        return {"stepsize_rule": NOTE if p in noted else RULE, "stepsize": 0.1 * (1 + len(p))}

    return make_table(curves, problems=problems, extra=extra)


def test_a_rule_that_differs_per_panel_gives_one_legend_entry_per_curve() -> None:
    t = _rule_table(("dataset=a", "dataset=b"), noted=("dataset=b",))
    fig, _ = plot_results(t, "rounds", "grad_norm_sq")
    labels = _legend(fig)
    assert len(labels) == t["compressor"].nunique() == 2, labels  # each curve once
    for comp in ("rand_k[k=1]", "qsgd[s=2]"):
        (entry,) = [lb for lb in labels if comp in lb]
        # each panel's rule after its name: b's note is not claimed for a, nor a's rule for b
        assert f"(dataset=a: {RULE}; dataset=b: {NOTE})" in entry, entry
    # the panels' own lines keep their own rule
    a, b = fig.axes[:2]
    assert all(NOTE not in str(ln.get_label()) for ln in a.get_lines())
    assert any(NOTE in str(ln.get_label()) for ln in b.get_lines())


def test_panels_that_share_a_rule_are_named_together_and_one_rule_is_said_once() -> None:
    t = _rule_table(("dataset=a", "dataset=b", "dataset=c"), noted=("dataset=b",))
    fig, _ = plot_results(t, "rounds", "grad_norm_sq")
    labels = _legend(fig)
    assert len(labels) == 2, labels
    assert all(f"(dataset=a, dataset=c: {RULE}; dataset=b: {NOTE})" in lb for lb in labels)
    # control: the same rule everywhere is said once, without panel names (and, with several
    # panels, without a γ value, which differs per problem)
    same = _rule_table(("dataset=a", "dataset=b"), noted=())
    labels = _legend(plot_results(same, "rounds", "grad_norm_sq")[0])
    assert len(labels) == 2 and all(lb.endswith(f"γ=theory ({RULE})") for lb in labels), labels


# --------------------------------------------------------------------------------------------
# 2. numbers in labels
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1e6, 1e-7, 0.5, 123456.0, 0.1, 2.5e-3, 1234567.0])
def test_a_numeric_step_size_is_written_compactly_and_exactly(value: float) -> None:
    """A config's ``stepsize = 1e6`` is recorded as the spec ``"1000000.0"`` (repr); the legend
    said ``γ=1000000.0``. Now the compact %g form, with the digits that give the value back."""
    for spec in (repr(value), value):  # a string spec, or a column read back as numbers
        text = curve_label({"method": "dcgd", "stepsize_spec": spec}).split("γ=")[1]
        assert float(text) == value, text  # exact: two step sizes never read alike
        short = f"{value:g}"
        if float(short) == value:  # %g is exact here: it is the form
            assert text == short, (text, short)
        assert not text.endswith(".0") and len(text) <= len(repr(value)), text
    assert curve_label({"stepsize_spec": "theory*2"}) == "γ=theory*2"  # specs stay as they are
    assert curve_label({"stepsize_spec": "0.1/L_max"}) == "γ=0.1/L_max"


def test_the_legend_of_a_large_numeric_step_says_1e06() -> None:
    t = make_table([("gd", "identity")], extra=lambda *_: {"stepsize_spec": repr(1e6)})
    (label,) = _legend(plot_results(t, "rounds", "grad_norm_sq")[0])
    assert "γ=1e+06" in label and "1000000" not in label, label


# --------------------------------------------------------------------------------------------
# 3. ef21w-synthetic: the figure without (some) pair runs
# --------------------------------------------------------------------------------------------
CONSTS = {"n_clients": 5, "d": 10, "L": 1.0, "L_max": 3.0}
XI = (1 + math.sqrt(0.9)) / 0.1 - 1  # ξ(α) of Top-1 on d = 10 (α = 1/d): (1 + √(1−α))/α − 1
#: (problem, L_AM, L_QM), L_var = L_QM² − L_AM²: 1.25, 0.44, 0.002
LVARS = (("a", 1.0, 1.5), ("b", 1.0, 1.2), ("c", 1.0, 1.001))


def _predicted(am: float, qm: float) -> float:
    return (CONSTS["L"] + qm * XI) / (CONSTS["L"] + am * XI)  # [EFR]: (L + L_QM ξ)/(L + L_AM ξ)


def _ef(
    run_id: str, problem: str, method: str, bits: list[float], status: str, **c: Any
) -> pd.DataFrame:
    n = len(bits)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "problem_label": problem,
            "problem_spec": problem,
            "method": method,
            "compressor": "top_k[k=1]",
            "stepsize_spec": "theory",
            "seed_index": 0,
            "round": np.arange(n),
            "grad_norm_sq": [10.0 ** (-i) for i in range(n)],
            "loss": np.linspace(1.0, 0.5, n),
            "bits_up_paper": bits,
            "bits_up": bits,
            "status": status,
            **c,
        }
    )


def _synthetic(diverged: tuple[str, ...] = ()) -> pd.DataFrame:
    """EF21 needs exactly the predicted ratio more bits than EF21-W on every L_var; on
    ``diverged`` both methods diverged."""
    parts = []
    for i, (p, am, qm) in enumerate(LVARS):
        c = {**CONSTS, "L_AM": am, "L_QM": qm, "L_var": qm**2 - am**2}
        pred = _predicted(am, qm)
        st = "diverged" if p in diverged else "completed"
        parts.append(_ef(f"b{i}", p, "ef21", [0, 10 * pred, 20 * pred, 30 * pred], st, **c))
        parts.append(_ef(f"w{i}", p, "ef21_w", [0.0, 10, 20, 30], st, **c))
    return pd.concat(parts, ignore_index=True)


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the reproductions save (their functions return only the paths)."""
    from matplotlib.figure import Figure

    figs: list[Any] = []
    save = Figure.savefig

    def keep(self: Any, *a: Any, **k: Any) -> None:
        if not figs or figs[-1] is not self:
            figs.append(self)
        save(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figs


def _ef21w_figure(table: pd.DataFrame, tmp_path: Path, drawn: list[Any]) -> tuple[Any, str]:
    paths = ef21w_synthetic.figures(table, ef21w_synthetic.DEFAULTS, tmp_path)
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.exists() for p in paths)
    (ax,) = drawn[-1].axes
    return ax, " ".join(" ".join(t.get_text() for t in ax.texts).split())


def _lines(ax: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        str(ln.get_label()): (np.asarray(ln.get_xdata(), float), np.asarray(ln.get_ydata(), float))
        for ln in ax.get_lines()
    }


def test_ef21w_synthetic_figure_without_pair_runs_draws_the_prediction_and_says_why(
    tmp_path: Path, drawn: list[Any]
) -> None:
    """No run of the pair with top_k[k=1] (the sweep was cut before one finished): figures()
    raised KeyError 'L_var'."""
    other = _synthetic().assign(compressor="top_k[k=2]")
    ax, note = _ef21w_figure(other, tmp_path, drawn)
    lines = _lines(ax)
    measured = next(v for k, v in lines.items() if k.startswith("measured"))
    assert measured[0].size == 0  # nothing measured, nothing drawn as measured
    (x, y) = next(v for k, v in lines.items() if k.startswith("(L + L_QM"))
    order = sorted(LVARS, key=lambda r: r[2] ** 2 - r[1] ** 2)
    np.testing.assert_allclose(x, [qm**2 - am**2 for _, am, qm in order])
    np.testing.assert_allclose(y, [_predicted(am, qm) for _, am, qm in order])
    assert "no runs of ef21 and ef21_w with top_k[k=1]" in note, note
    for _, am, qm in LVARS:
        assert f"{qm**2 - am**2:.3g}" in note, note


def test_ef21w_synthetic_figure_names_the_l_var_without_a_measurement(
    tmp_path: Path, drawn: list[Any]
) -> None:
    """Every run diverged on the middle L_var (or on all): the figure was drawn without a word
    about the missing points (or empty, silently)."""
    ax, note = _ef21w_figure(_synthetic(diverged=("b",)), tmp_path, drawn)
    x, y = next(v for k, v in _lines(ax).items() if k.startswith("measured"))
    kept = sorted((qm**2 - am**2, _predicted(am, qm)) for p, am, qm in LVARS if p != "b")
    np.testing.assert_allclose(x, [k[0] for k in kept])
    np.testing.assert_allclose(y, [k[1] for k in kept])  # the measured ratio is the predicted
    assert "L_var=0.44: every run diverged or made no progress" in note, note
    _, note = _ef21w_figure(_synthetic(diverged=("a", "b", "c")), tmp_path, drawn)
    assert "L_var=0.002, 0.44, 1.25: every run diverged" in note, note


# --------------------------------------------------------------------------------------------
# 4. k18-quantizers: bits per round of a run without a round; ties between levels
# --------------------------------------------------------------------------------------------
def _quant(
    run_id: str, compressor: str, bpr: float, rounds_to_eps: float, *, n: int | None = None
) -> pd.DataFrame:
    """A theory-step run on "logistic" with ``bpr`` uplink bits per round whose ‖∇f‖² falls
    geometrically to 1e-3 ‖∇f(x⁰)‖² at round ``rounds_to_eps`` (n rows: rounds 0 … n−1)."""
    n = int(2 * rounds_to_eps) + 2 if n is None else n
    rate = 10.0 ** (-3.0 / rounds_to_eps)
    r = np.arange(n)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "problem_label": "logistic",
            "method": "dcgd",
            "compressor": compressor,
            "stepsize_spec": "theory",
            "seed_index": 0,
            "round": r,
            "grad_norm_sq": rate**r,
            "loss": np.linspace(1.0, 0.5, n),
            "bits_up": bpr * r,
            "d": 20,
            "stepsize": 0.02,
            "status": "completed",
        }
    )


QSGD = {"families": {"qsgd": "s"}}
PER_ROUND = "more compression → fewer bits per round"
INTERIOR = "the total bits to ε have an interior optimum"


def _claim(table: pd.DataFrame, start: str, **params: Any) -> Any:
    out = k18_quantizers.claims(table, {**k18_quantizers.DEFAULTS, **params})
    return next(c for c in out if c.claim.startswith(start))


def test_k18_quantizers_a_run_without_a_completed_round_has_no_bits_per_round() -> None:
    """qsgd[s=1]'s run has only its round-0 row: its bits/round read 0 (Δbits ÷ max(0, 1)),
    the smallest of all, so 'fewer bits per round' passed on a run that sent nothing."""
    t = pd.concat(
        [
            _quant("s1", "qsgd[s=1]", 100.0, 40.0, n=1),
            _quant("s2", "qsgd[s=2]", 125.0, 16.0),
            _quant("id", "identity", 200.0, 5.0),
        ]
    )
    tr = k18_quantizers.tradeoff(t, {**k18_quantizers.DEFAULTS, **QSGD}).set_index("compressor")
    assert tr["bits_per_round"].isna().tolist() == [True, False, False]  # s=1, s=2, identity
    for comp, bpr in (("qsgd[s=2]", 125.0), ("identity", 200.0)):  # Δbits ÷ Δrounds
        run = t[t["compressor"] == comp]
        expected = (run["bits_up"].iloc[-1] - run["bits_up"].iloc[0]) / run["round"].iloc[-1]
        assert tr.loc[comp, "bits_per_round"] == pytest.approx(expected) == bpr
    c = _claim(t, PER_ROUND, **QSGD)
    assert c.passed is None, c.measured  # n/a: not a pass on a run without a result
    assert "no round completed: qsgd[s=1]" in c.measured, c.measured
    # the known levels already out of order: a failure, the missing level named
    t2 = pd.concat([t, _quant("s4", "qsgd[s=4]", 110.0, 10.0)])
    c = _claim(t2, PER_ROUND, **QSGD)
    assert c.passed is False and "no round completed: qsgd[s=1]" in c.measured, c.measured


def test_k18_quantizers_a_seed_without_a_round_is_left_out_of_the_median() -> None:
    """Two seeds of qsgd[s=2], one without a completed round: the median of 0 and 125 read
    62.5 bits per round; the seed that sent something says 125."""
    lone = _quant("s2b", "qsgd[s=2]", 125.0, 16.0, n=1).assign(seed_index=1)
    t = pd.concat([_quant("s2", "qsgd[s=2]", 125.0, 16.0), lone])
    tr = k18_quantizers.tradeoff(t, {**k18_quantizers.DEFAULTS, **QSGD})
    assert tr["bits_per_round"].tolist() == [125.0]


def test_k18_quantizers_a_tie_between_levels_does_not_depend_on_row_order() -> None:
    """rand_k[k=5] and rand_k[k=5,shared_seed=true] share a level and need the same bits to ε:
    the optimum named was the one whose rows came first."""
    levels = {
        "rand_k[k=1]": (100.0, 40.0),  # 4000 bits to ε
        "rand_k[k=5]": (125.0, 16.0),  # 2000
        "rand_k[k=5,shared_seed=true]": (100.0, 20.0),  # 2000
        "identity": (200.0, 50.0),  # 10000
    }
    t = pd.concat([_quant(c, c, *v) for c, v in levels.items()], ignore_index=True)
    params = {"families": {"rand_k": "k"}, "optimum_families": ["rand_k"]}
    seen = []
    for order in (t, t.iloc[::-1], t.sample(frac=1.0, random_state=3)):
        c = _claim(order, INTERIOR, **params)
        seen.append((c.measured, c.passed))
    assert seen[0] == seen[1] == seen[2], seen
    # named by the smallest level, then the compressor's name (',' sorts before ']')
    assert "min at rand_k[k=5,shared_seed=true] (tied with rand_k[k=5])" in seen[0][0], seen


@pytest.mark.parametrize("identity", [(400.0, 5.0), (200.0, 10.0)])
def test_k18_quantizers_an_optimum_tied_with_an_end_point_is_not_interior(
    identity: tuple[float, float],
) -> None:
    """qsgd[s=2] and identity need the same total bits (2000; exactly, or up to the rounding of
    the interpolated crossing of ε): argmin took whichever was a few ulps smaller, or the first
    (s=2) on an exact tie — then 'interior' passed though the uncompressed end does as well."""
    levels = {
        "qsgd[s=1]": (100.0, 40.0),  # 4000
        "qsgd[s=2]": (125.0, 16.0),  # 2000
        "qsgd[s=4]": (150.0, 20.0),  # 3000
        "identity": identity,  # 2000
    }
    t = pd.concat([_quant(c, c, *v) for c, v in levels.items()], ignore_index=True)
    tr = k18_quantizers.tradeoff(t, {**k18_quantizers.DEFAULTS, **QSGD}).set_index("compressor")
    assert tr.loc["qsgd[s=2]", "bits"] == pytest.approx(tr.loc["identity", "bits"], rel=1e-12)
    c = _claim(t, INTERIOR, **QSGD)
    assert c.passed is False, c.measured
    assert "min at qsgd[s=2] (tied with identity)" in c.measured, c.measured
    # control: identity 10 % worse, the optimum is interior
    worse = {**levels, "identity": (identity[0], 1.1 * identity[1])}
    t = pd.concat([_quant(c, c, *v) for c, v in worse.items()], ignore_index=True)
    c = _claim(t, INTERIOR, **QSGD)
    assert c.passed is True and c.measured.endswith("min at qsgd[s=2]"), c.measured


def test_k18_quantizers_tradeoff_ticks_name_the_points_of_every_problem(
    tmp_path: Path, drawn: list[Any]
) -> None:
    """The second problem has no qsgd[s=2] run: the ticks were named after the last problem's
    levels while the first problem's points sat at 0, 1, 2, 3 (its s=2 under "qsgd[s=4]")."""
    full = {"qsgd[s=1]": (100.0, 40.0), "qsgd[s=2]": (125.0, 16.0), "qsgd[s=4]": (150.0, 20.0)}
    full["identity"] = (200.0, 10.0)
    a = pd.concat([_quant(f"a{c}", c, *v) for c, v in full.items()])
    b = pd.concat([_quant(f"b{c}", c, *v) for c, v in full.items() if c != "qsgd[s=2]"])
    t = pd.concat([a, b.assign(problem_label="zero-residual")], ignore_index=True)
    params = {**k18_quantizers.DEFAULTS, **QSGD}
    k18_quantizers.figures(t, params, tmp_path)
    ax = drawn[-1].axes[0]
    ticks = {
        round(p): lb.get_text() for p, lb in zip(ax.get_xticks(), ax.get_xticklabels(), strict=True)
    }
    tr = k18_quantizers.tradeoff(t, params)
    for line in ax.get_lines():
        prob = str(line.get_label())
        g = tr[tr["problem"] == prob].sort_values("level")
        names = [c.replace("identity", "id") for c in g["compressor"]]
        assert [ticks.get(round(x)) for x in line.get_xdata()] == names, (prob, ticks)
        np.testing.assert_allclose(line.get_ydata(), g["bits"] / g["bits"].min())
