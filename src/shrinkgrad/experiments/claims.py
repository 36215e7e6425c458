"""Claims: measured quantities computed from a results table, and helpers to measure them.

A reproduction's claims function takes the results table (and the ``[claims]`` parameters of
its config) and returns a list of :class:`Claim` — the paper's claim in words, the number
measured from the table, what it was compared with, and whether it holds. Nothing here is tuned
to pass: a claim whose measurement does not support it is reported as failing.

Helpers measure per run (one seed of one curve) and summarise over seeds with the median:

* :func:`reach` — the first x (bits, rounds) at which a run's ‖∇f‖² falls to a tolerance;
* :func:`runs_of` — the table grouped into runs with their identifying columns;
* :func:`rank_correlation` — Spearman's ρ (ties averaged), for "grows with" claims.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .execute import NO_PROGRESS

__all__ = [
    "NOT_A_RESULT",
    "Claim",
    "claims_table",
    "diverged",
    "final_value",
    "median",
    "no_result",
    "rank_correlation",
    "reach",
    "runs_of",
    "tail_mean",
]

#: statuses of runs whose numbers are not results: stopped by the divergence rule, or ended
#: above their starting loss (``no_progress``, docs/experiments.md "Run statuses")
NOT_A_RESULT = ("diverged", NO_PROGRESS)


@dataclasses.dataclass(frozen=True)
class Claim:
    """One line of a claim table.

    ``claim``: the paper's statement being checked (short); ``measured``: the measured
    number(s), formatted; ``criterion``: what counts as support; ``passed``: True / False, or
    None when the claim could not be measured (then ``measured`` says why); ``values``: the raw
    numbers behind ``measured`` (for summary.json).
    """

    claim: str
    measured: str
    criterion: str
    passed: bool | None
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.passed]

    def as_dict(self) -> dict[str, Any]:
        return {
            "claim": self.claim,
            "measured": self.measured,
            "criterion": self.criterion,
            "result": self.verdict,
            "passed": self.passed,
            "values": {k: _jsonable(v) for k, v in self.values.items()},
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else str(f)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_jsonable(x) for x in v]
    return v


def claims_table(claims: Sequence[Claim]) -> pd.DataFrame:
    """The claims as a table with the columns claim, measured, criterion, result."""
    return pd.DataFrame(
        [
            {
                "claim": c.claim,
                "measured": c.measured,
                "criterion": c.criterion,
                "result": c.verdict,
            }
            for c in claims
        ],
        columns=["claim", "measured", "criterion", "result"],
    )


# --------------------------------------------------------------------------------------------
# measuring runs
# --------------------------------------------------------------------------------------------
RUN_KEYS = ("problem_label", "method", "compressor", "stepsize_spec", "seed_index")


def runs_of(table: pd.DataFrame) -> Iterable[tuple[dict[str, Any], pd.DataFrame]]:
    """Each run of ``table`` (sorted by round) with its identifying columns."""
    for run_id, df in table.groupby("run_id", sort=False):
        df = df.sort_values("round")
        first = df.iloc[0]
        keys = {k: first[k] for k in RUN_KEYS if k in df.columns}
        keys["run_id"] = run_id
        yield keys, df


def reach(
    run: pd.DataFrame, eps: float, x: str = "bits_up_paper", y: str = "grad_norm_sq"
) -> float:
    """The first logged ``x`` at which ``y ≤ eps`` (inf when the run never gets there).

    Between two logged rows the crossing is placed by log-linear interpolation of ``y``, so the
    measurement does not jump by a whole logging interval. A diverged run, or one that made no
    progress (its ``status`` column, :func:`no_result`), reaches nothing: a saturated loss can
    show a small ‖∇f‖² while it blows up.
    """
    if no_result(run):
        return math.inf
    xs = run[x].to_numpy(dtype=np.float64)
    ys = run[y].to_numpy(dtype=np.float64)
    hit = np.flatnonzero(ys <= eps)
    if hit.size == 0:
        return math.inf
    j = int(hit[0])
    if j == 0:
        return float(xs[0])
    y0, y1 = ys[j - 1], ys[j]
    if y0 > 0 and y1 > 0 and y0 != y1:
        t = (math.log(y0) - math.log(eps)) / (math.log(y0) - math.log(y1))
    else:
        t = 1.0
    return float(xs[j - 1] + min(max(t, 0.0), 1.0) * (xs[j] - xs[j - 1]))


def diverged(run: pd.DataFrame) -> bool:
    """Whether the run's ``status`` column (when the table has one) says it diverged."""
    return "status" in run.columns and bool((run["status"] == "diverged").any())


def no_result(run: pd.DataFrame) -> bool:
    """Whether the run's ``status`` column says its numbers are not a result: it diverged or
    made no progress (:data:`NOT_A_RESULT`). Such a run is never the best of anything."""
    return "status" in run.columns and bool(run["status"].isin(NOT_A_RESULT).any())


def final_value(run: pd.DataFrame, y: str = "grad_norm_sq") -> float:
    """The last logged value of ``y`` (inf for a run that diverged or made no progress,
    whatever its last row shows: it is never chosen as the best run)."""
    if no_result(run):
        return math.inf
    return float(run.sort_values("round")[y].iloc[-1])


def tail_mean(run: pd.DataFrame, y: str = "grad_norm_sq", fraction: float = 0.25) -> float:
    """The mean of ``y`` over the last ``fraction`` of the logged rows (an error floor); inf for
    a run that diverged or made no progress, as :func:`final_value` (the rows of a diverged run
    stop at its last finite one, before the blow-up: they are no floor)."""
    if no_result(run):
        return math.inf
    vals = run.sort_values("round")[y].to_numpy(dtype=np.float64)
    k = max(1, math.ceil(fraction * vals.size))
    return float(np.mean(vals[-k:]))


def median(values: Iterable[float]) -> float:
    """The median (inf-aware: a majority of inf gives inf); NaN for no values."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return math.nan
    return float(np.median(arr))


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (average ranks for ties); NaN if constant."""
    ra = pd.Series(list(a), dtype="float64").rank().to_numpy()
    rb = pd.Series(list(b), dtype="float64").rank().to_numpy()
    if ra.size < 2 or np.std(ra) == 0 or np.std(rb) == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def fmt(v: float, digits: int = 3) -> str:
    """A number for a claim table (``inf`` and ``nan`` spelled out)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "never" if v == math.inf else str(v)
    return f"{v:.{digits}g}"
