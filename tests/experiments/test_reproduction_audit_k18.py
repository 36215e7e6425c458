"""Claims of ``k18-delays``, ``k18-quantizers`` and ``ef21w-synthetic`` on runs that are no result.

Small synthetic results tables: a run that diverged, made no progress or ends with NaN must never
make a claim pass (nor, where the claim is that such runs fail, be read as a run that did not
fail), an L_var on which every run is no result must not drop out of the measurement, and a tie
or the table's row order must not change a verdict.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from run_tables import run_table

from shrinkgrad.experiments.claims import tail_mean
from shrinkgrad.experiments.execute import NO_PROGRESS
from shrinkgrad.experiments.reproductions import ef21w_synthetic, k18_delays, k18_quantizers
from shrinkgrad.experiments.reproductions.common import common_tolerance


def _claim(claims: list[Any], start: str) -> Any:
    return next(c for c in claims if c.claim.startswith(start))


# --------------------------------------------------------------------------------------------
# ef21w-synthetic (and common.common_tolerance / ef21w_ratios)
# --------------------------------------------------------------------------------------------
CONSTS = {"n_clients": 5, "d": 10, "L": 1.0, "L_max": 3.0}
XI = (1 + math.sqrt(0.9)) / 0.1 - 1  # ξ(α) of Top-1 on d = 10
#: three L_var, largest first: (problem, L_AM, L_QM)
LVARS = (("a", 1.0, 1.5), ("b", 1.0, 1.2), ("c", 1.0, 1.001))
MONO = "the advantage of EF21-W shrinks monotonically"
TRACK = "it tracks"
NEVER = "EF21-W is never worse than EF21"


def _ef(
    run_id: str, problem: str, method: str, g: list[float], bits: list[float], status: str, **c: Any
) -> pd.DataFrame:
    return run_table(run_id, problem, method, g, bits, status=status, **c)


def _synthetic(diverged: tuple[str, ...] = (), nan_final: tuple[str, ...] = ()) -> pd.DataFrame:
    """EF21 needs exactly the predicted ratio more bits than EF21-W on every L_var (every claim
    but 'shrinks substantially' holds); on ``diverged`` both methods diverged, on ``nan_final``
    EF21-W's last ‖∇f‖² is NaN (its status does not say so)."""
    parts = []
    for i, (p, am, qm) in enumerate(LVARS):
        c = {**CONSTS, "L_AM": am, "L_QM": qm, "L_var": qm**2 - am**2}
        pred = (1 + qm * XI) / (1 + am * XI)
        g = [1.0, 0.1, 0.01, 0.001]
        st = "diverged" if p in diverged else "completed"
        parts.append(_ef(f"b{i}", p, "ef21", g, [0, 10 * pred, 20 * pred, 30 * pred], st, **c))
        gw = [1.0, 0.1, 0.01, math.nan] if p in nan_final else g
        parts.append(_ef(f"w{i}", p, "ef21_w", gw, [0, 10, 20, 30], st, **c))
    return pd.concat(parts, ignore_index=True)


def test_ef21w_synthetic_control_every_l_var_a_result() -> None:
    out = ef21w_synthetic.claims(_synthetic(), ef21w_synthetic.DEFAULTS)
    assert _claim(out, MONO).passed and _claim(out, TRACK).passed and _claim(out, NEVER).passed


def test_ef21w_synthetic_an_l_var_where_both_methods_diverged_is_not_dropped() -> None:
    """Both methods diverged on the middle L_var: common_tolerance gave that problem no ε, so
    ef21w_ratios gave it no row, and 'shrinks monotonically', 'tracks' and 'never worse' passed
    on the two L_var left (the missing measurement was invisible in the measured text)."""
    out = ef21w_synthetic.claims(_synthetic(diverged=("b",)), ef21w_synthetic.DEFAULTS)
    for start in (MONO, TRACK, NEVER):
        c = _claim(out, start)
        assert c.passed is not True, (start, c.measured)
    assert "0.44: nan" in _claim(out, MONO).measured


def test_ef21w_synthetic_every_run_diverged_fails_and_does_not_crash() -> None:
    """Every run diverged: ef21w_ratios was an empty frame and the claims raised KeyError
    'L_var'; now every L_var is there with no ratio and no claim passes."""
    out = ef21w_synthetic.claims(_synthetic(diverged=("a", "b", "c")), ef21w_synthetic.DEFAULTS)
    assert len(out) == 4 and all(c.passed is not True for c in out), out
    # and a table without runs of the pair is n/a, not a crash
    other = _synthetic().assign(compressor="top_k[k=2]")
    (na,) = ef21w_synthetic.claims(other, ef21w_synthetic.DEFAULTS)
    assert na.passed is None


def test_common_tolerance_a_nan_final_is_not_skipped() -> None:
    """EF21-W ends with NaN on "b" (no status says so): groupby().last() skipped the NaN, so ε
    was its last *finite* value, EF21-W 'reached' it and 'never worse' passed."""
    table = _synthetic(nan_final=("b",))
    eps = common_tolerance(table)
    assert math.isnan(eps["b"]) and eps["a"] == 0.001
    out = ef21w_synthetic.claims(table, ef21w_synthetic.DEFAULTS)
    assert _claim(out, NEVER).passed is not True, _claim(out, NEVER).measured


# --------------------------------------------------------------------------------------------
# k18-delays
# --------------------------------------------------------------------------------------------
def _delay(
    run_id: str, method: str, spec: str, g: list[float], *, status: str = "completed"
) -> pd.DataFrame:
    n = len(g)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "problem_label": "p",
            "method": method,
            "compressor": "natural",
            "stepsize_spec": spec,
            "seed_index": 0,
            "round": 10 * np.arange(n),
            "grad_norm_sq": np.asarray(g, dtype=float),
            "loss": np.linspace(1.0, 0.5, n),
            "n_clients": 4,
            "stepsize": 0.1,
            "status": status,
        }
    )


CONVERGES = [1.0, 1e-3, 1e-6, 1e-9]
UNSTABLE = "at 1/L delays cause instability"


def test_k18_delays_a_large_delay_run_that_made_no_progress_fails() -> None:
    """At 1/L the τ = 5 run made no progress (its loss ended above its start; its ‖∇f‖² ended
    below its first): it failed, so 'delays cause instability' holds. It read as 'stalls' and
    the claim failed."""
    t = pd.concat(
        [
            _delay("a", "delayed_dcgd[tau=0]", "1/L", CONVERGES),
            _delay("b", "delayed_dcgd[tau=5]", "1/L", [1.0, 0.5, 0.6, 0.7], status=NO_PROGRESS),
            _delay("c", "iag", "1/L", [1.0, 5.0, 50.0], status="diverged"),
        ]
    )
    c = _claim(k18_delays.claims(t, k18_delays.DEFAULTS), UNSTABLE)
    assert c.passed is True, c.measured
    assert "τ=5: fails" in c.measured


def test_k18_delays_a_run_ending_with_nan_neither_converges_nor_reaches() -> None:
    """τ = 0 ends with NaN (its status does not say so) after passing ε: it 'converged' at 1/L
    and at the delay step, and both claims passed on it."""
    lost = [1.0, 1e-9, math.nan]
    t = pd.concat(
        [
            _delay("a", "delayed_dcgd[tau=0]", "1/L", lost),
            _delay("c", "iag", "1/L", [1.0, 5.0, 50.0], status="diverged"),
            _delay("d", "delayed_dcgd[tau=0]", "theory", lost),
            _delay("e", "iag", "theory", CONVERGES),
        ]
    )
    out = k18_delays.claims(t, k18_delays.DEFAULTS)
    assert _claim(out, UNSTABLE).passed is not True, _claim(out, UNSTABLE).measured
    conv = _claim(out, "at the delay step every τ")
    assert conv.passed is False, conv.measured


def test_k18_delays_a_tie_in_tau_does_not_depend_on_row_order() -> None:
    """Two delay models at τ = 5 (rounds to ε 158 and 83): τ_max/τ_min used the one that came
    last in the table (5.95 or 3.11), and the verdict flipped with the row order."""
    tables = []
    for tau, model, rate in (
        (0, "fixed", 0.5),
        (1, "fixed", 0.7),
        (5, "fixed", 0.89),
        (5, "random", 0.8),
    ):
        g = [rate**i for i in range(300)]
        r = _delay(f"{tau}{model}", f"delayed_dcgd[tau={tau},model={model}]", "theory", g)
        r["round"] = np.arange(300)
        tables.append(r)
    params = {**k18_delays.DEFAULTS, "rank_min": 0.5}
    a = _claim(k18_delays.claims(pd.concat(tables), params), "the slow-down grows")
    b = _claim(k18_delays.claims(pd.concat(tables[::-1]), params), "the slow-down grows")
    assert a.passed is b.passed and a.values == b.values, (a.measured, b.measured)


# --------------------------------------------------------------------------------------------
# k18-quantizers
# --------------------------------------------------------------------------------------------
def _quant(
    run_id: str,
    problem: str,
    compressor: str,
    spec: str,
    g: list[float],
    *,
    status: str = "completed",
    gamma: float = 0.02,
    bits_per_round: float = 100.0,
    seed: int = 0,
) -> pd.DataFrame:
    n = len(g)
    rounds = 10 * np.arange(n)
    return pd.DataFrame(
        {
            "run_id": run_id,
            "problem_label": problem,
            "method": "dcgd",
            "compressor": compressor,
            "stepsize_spec": spec,
            "seed_index": seed,
            "round": rounds,
            "grad_norm_sq": np.asarray(g, dtype=float),
            "loss": np.linspace(1.0, 0.5, n),
            "bits_up": bits_per_round * rounds,
            "d": 20,
            "stepsize": gamma,
            "status": status,
        }
    )


def _floor(level: float, n: int = 21) -> list[float]:
    return [1.0] + [level] * (n - 1)


CONTRACTING = [10.0 ** (-i) for i in range(21)]
FLOOR_SLOPE = "DCGD's error floor grows in proportion to γω"
VANISHES = "the floor disappears"


def _floor_table(noisy_status: str = "completed", diverged_k: int | None = None) -> pd.DataFrame:
    """rand_k[k=1, 2, 5] at γ = 0.02 on both problems: zero-residual runs contract, noisy runs
    sit on a floor ∝ γω (ω = 20/k − 1), with ``noisy_status``; the noisy rand_k[k=diverged_k]
    run diverged (its rows, cut before the blow-up, show the same floor)."""
    parts = []
    for k in (1, 2, 5):
        omega = 20 / k - 1
        parts.append(_quant(f"z{k}", "zero-residual", f"rand_k[k={k}]", "0.1/L_max", CONTRACTING))
        st = "diverged" if k == diverged_k else noisy_status
        g = _floor(1e-3 * 0.02 * omega)
        parts.append(_quant(f"n{k}", "noisy", f"rand_k[k={k}]", "0.1/L_max", g, status=st))
    return pd.concat(parts, ignore_index=True)


def test_k18_quantizers_floor_control() -> None:
    out = k18_quantizers.claims(_floor_table(), k18_quantizers.DEFAULTS)
    assert _claim(out, FLOOR_SLOPE).passed is True and _claim(out, VANISHES).passed is True


def test_k18_quantizers_the_floor_of_a_diverged_run_is_no_floor() -> None:
    """The noisy rand_k[k=1] run diverged; its rows before the blow-up lay on the line, and
    the slope (1.0) passed on them. A diverged run has no floor (tail_mean is inf)."""
    t = _floor_table(diverged_k=1)
    c = _claim(k18_quantizers.claims(t, k18_quantizers.DEFAULTS), FLOOR_SLOPE)
    assert c.passed is not True, c.measured
    assert "rand_k[k=1]" in c.measured.split(";")[-1]
    assert tail_mean(t[t["run_id"] == "n1"]) == math.inf


def test_k18_quantizers_diverged_noisy_runs_have_not_stalled() -> None:
    """Every noisy run diverged (‖∇f‖² growing until the divergence stop): its late/mid ratio
    (≫ 1) read as 'stalled on a floor' and 'the floor disappears when ∇f_i(x*) = 0' passed."""
    parts = []
    for k in (1, 5):
        parts.append(_quant(f"z{k}", "zero-residual", f"rand_k[k={k}]", "0.1/L_max", CONTRACTING))
        grow = [1.5**i for i in range(21)]
        parts.append(
            _quant(f"n{k}", "noisy", f"rand_k[k={k}]", "0.1/L_max", grow, status="diverged")
        )
    c = _claim(k18_quantizers.claims(pd.concat(parts), k18_quantizers.DEFAULTS), VANISHES)
    assert c.passed is not True, c.measured


def test_k18_quantizers_a_nan_ratio_does_not_depend_on_row_order() -> None:
    """Two seeds of the zero-residual run, one logged too coarsely for a mid-run mean (NaN):
    Python's max() kept the NaN (FAIL) or dropped it (pass) depending on the seeds' order."""
    coarse = _quant("z0", "zero-residual", "rand_k[k=1]", "0.1/L_max", [1.0, 0.1, 0.01, 1e-3])
    fine = _quant("z1", "zero-residual", "rand_k[k=1]", "0.1/L_max", CONTRACTING, seed=1)
    noisy = _quant("n1", "noisy", "rand_k[k=1]", "0.1/L_max", _floor(1e-3))
    verdicts = []
    for order in ([coarse, fine, noisy], [fine, coarse, noisy]):
        c = _claim(k18_quantizers.claims(pd.concat(order), k18_quantizers.DEFAULTS), VANISHES)
        verdicts.append(c.passed)
    assert verdicts[0] is verdicts[1] is False, verdicts


def _tradeoff(levels: dict[str, tuple[float, float]]) -> pd.DataFrame:
    """compressor → (bits per round, rounds to ε = 1e-3 ‖∇f(x⁰)‖²), geometric curves on the
    logistic problem at the theory step (total bits = their product)."""
    parts = []
    for comp, (bpr, rounds) in levels.items():
        rate = 10.0 ** (-3.0 / rounds)
        n = int(2 * rounds) + 2
        g = [rate**t for t in range(n)]
        r = _quant(comp, "logistic", comp, "theory", g, bits_per_round=bpr)
        r["round"] = np.arange(n)
        r["bits_up"] = bpr * r["round"]
        parts.append(r)
    return pd.concat(parts, ignore_index=True)


INTERIOR = "the total bits to ε have an interior optimum"


def test_k18_quantizers_interior_optimum_needs_the_identity_end() -> None:
    """Without the identity run the last QSGD level present read as the uncompressed end: the
    minimum at s=2 was 'interior' and the claim passed, where identity needs the fewest bits."""
    levels = {
        "qsgd[s=1]": (100.0, 40.0),  # 4000 bits
        "qsgd[s=2]": (125.0, 16.0),  # 2000
        "qsgd[s=4]": (150.0, 20.0),  # 3000
        "identity": (200.0, 5.0),  # 1000
    }
    params = {**k18_quantizers.DEFAULTS, "families": {"qsgd": "s"}}
    full = _claim(k18_quantizers.claims(_tradeoff(levels), params), INTERIOR)
    assert full.passed is False, full.measured  # with identity: the minimum is at identity
    del levels["identity"]
    part = _claim(k18_quantizers.claims(_tradeoff(levels), params), INTERIOR)
    assert part.passed is not True, part.measured
    assert "no identity run" in part.measured


def test_a_missing_arm_is_an_na_claim_not_a_missing_claim() -> None:
    """No run at 1/L (k18-delays), no zero-residual fixed-step run (k18-quantizers): the claim
    that needs the arm was left out of the table; it is there, n/a."""
    t = pd.concat(
        [
            _delay("a", "delayed_dcgd[tau=0]", "theory", CONVERGES),
            _delay("b", "delayed_dcgd[tau=5]", "theory", CONVERGES),
        ]
    )
    c = _claim(k18_delays.claims(t, k18_delays.DEFAULTS), UNSTABLE)
    assert c.passed is None, c.measured
    noisy = _floor_table().query("problem_label == 'noisy'")
    c = _claim(k18_quantizers.claims(noisy, k18_quantizers.DEFAULTS), VANISHES)
    assert c.passed is None, c.measured
