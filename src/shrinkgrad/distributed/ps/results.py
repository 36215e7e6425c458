"""Results of a parameter-server run: the simulator's table, per-update staleness, a histogram.

:func:`build_result` evaluates the metrics of the server's snapshots of x *after* the run (the
full ∇f and f on the server's copy of the problem), so metric evaluation never perturbs the
asynchronous schedule, and returns a :class:`PSResult`:

* ``table``: the columns of :data:`shrinkgrad.sim.COLUMNS` (``round`` = server updates,
  ``grad_norm_sq`` of the full f at the server's x, ``loss``, cumulative bits per client as means
  over clients, ``time_s`` of the update loop, method, compressor, stepsize, stepsize_rule, seed,
  dataset, problem, n_clients, d) plus ``tau_max`` (the configured bound, or missing);
* ``staleness``: one row per applied message: update, worker, counter, version_computed,
  staleness (update − 1 − version_computed), delay (the [K18] delay of the update: the
  staleness, or, when the server keeps a memory per worker (IAG's table), the oldest entry's
  age), time_s, method, seed;
* ``events``: the initial messages, worker losses, the end of the initialisation, resumptions.

The saved directory (:meth:`PSResult.save`) is also the log that
``asynchronous[trace=DIR]`` replays in the simulator (:mod:`shrinkgrad.methods.asynchronous`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..._sums import squared_norm
from ...methods.asynchronous import EVENT_RESUMED, TRACE_FILES
from ...methods.base import UnknownConstantError
from ...problems import Problem
from ...sim import COLUMNS
from ...sim.engine import known_minimiser, lower_bound
from ...sim.options import Divergence, DivergenceReference
from .config import PSConfig
from .server import Plan, ServerLog

__all__ = [
    "EXIT_STATUSES",
    "STALENESS_COLUMNS",
    "TABLE_COLUMNS",
    "PSResult",
    "build_result",
    "exit_status",
    "plot_staleness",
]

#: columns of :attr:`PSResult.table`: the simulator's, then the configured staleness bound
TABLE_COLUMNS = (*COLUMNS, "tau_max")
#: columns of :attr:`PSResult.staleness`
STALENESS_COLUMNS = (
    "update",
    "worker",
    "counter",
    "version_computed",
    "staleness",
    "delay",
    "time_s",
    "method",
    "seed",
)
_EVENT_COLUMNS = ("time_s", "update", "worker", "event", "detail")


#: the message of a run whose metrics turned non-finite (its table stops at the row before)
NON_FINITE_METRICS = "non-finite metrics at update"

#: the exit status of ``shrinkgrad ps`` (and of rank 0 under torchrun) for each end status of a
#: run: 0 when the run is a result (every update made, or the time budget the user set used
#: up), 1 when it is not (the iterates diverged, or every worker was lost), 130 after Ctrl-C
#: (the command exits with 143 after SIGTERM). The parameter server has no tolerance, so no
#: ``converged`` status: a run ends ``completed`` after its updates.
EXIT_STATUSES = {
    "completed": 0,
    "time_limit": 0,
    "diverged": 1,
    "workers_lost": 1,
    "interrupted": 130,
}


def exit_status(status: str) -> int:
    """The exit status of a run that ended with ``status`` (:data:`EXIT_STATUSES`; 1 for a
    status it does not know, so that nothing unexpected passes for a success)."""
    return EXIT_STATUSES.get(status, 1)


@dataclasses.dataclass
class PSResult:
    """The outcome of a parameter-server run (see the module docstring for the tables).

    ``status``: ``completed`` (all updates), ``time_limit``, ``diverged``, ``workers_lost`` or
    ``interrupted`` (Ctrl-C: the updates up to then); the command's exit status for each is
    :data:`EXIT_STATUSES`;
    ``tau_bound``: the [K18] delay the step size was derived for (None when nothing bounds it);
    ``stepsize_bound_measured``, ``rule_holds``: the largest step the method's theory admits at
    the measured delay :attr:`delay_max` and whether γ is admitted (the method's
    ``async_admissible``; None when no theory covers that delay, e.g. EF21 with stale
    messages); ``wall_s``: the server's update-loop time; ``exit_codes``: every process's exit
    status (filled by the launcher: 0 normal, 3 a worker that lost its server, negative a
    signal).
    """

    table: pd.DataFrame
    staleness: pd.DataFrame
    events: pd.DataFrame
    status: str
    message: str
    stepsize: float
    stepsize_rule: str
    tau_bound: int | None
    L: float
    x: torch.Tensor
    bits_up: torch.Tensor
    bits_up_paper: torch.Tensor
    bits_down: torch.Tensor
    wall_s: float
    config: dict[str, Any]
    stepsize_bound_measured: float | None = None
    rule_holds: bool | None = None
    exit_codes: dict[str, int | None] = dataclasses.field(default_factory=dict)

    @property
    def updates(self) -> int:
        """Server updates applied: the update log's count. The table can end earlier: a run
        whose metrics turn non-finite keeps its rows up to the last finite one."""
        applied = int(self.staleness["update"].max()) if len(self.staleness) else 0
        return max(applied, int(self.table["round"].iloc[-1]) if len(self.table) else 0)

    @property
    def metrics_cut(self) -> bool:
        """Whether the table stops before the run did, at non-finite metrics (``diverged``)."""
        return self.status == "diverged" and self.message.startswith(NON_FINITE_METRICS)

    @property
    def updates_per_s(self) -> float:
        """Updates per second of the update loop."""
        return self.updates / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def staleness_max(self) -> int:
        """The largest measured staleness of an applied message."""
        return int(self.staleness["staleness"].max()) if len(self.staleness) else 0

    @property
    def delay_max(self) -> int:
        """The largest measured [K18] delay τ of an update (what the delay rule needs)."""
        return int(self.staleness["delay"].max()) if len(self.staleness) else 0

    def mean_staleness(self) -> pd.Series:
        """Mean staleness of each worker's applied messages (indexed by worker)."""
        return self.staleness.groupby("worker")["staleness"].mean()

    def time_to(self, tol: float) -> float | None:
        """time_s of the first logged row with grad_norm_sq ≤ tol (None if never)."""
        hit = self.table[self.table["grad_norm_sq"] <= tol]
        return float(hit["time_s"].iloc[0]) if len(hit) else None

    def updates_to(self, tol: float) -> int | None:
        """The first logged round with grad_norm_sq ≤ tol (None if never)."""
        hit = self.table[self.table["grad_norm_sq"] <= tol]
        return int(hit["round"].iloc[0]) if len(hit) else None

    def bits_to(self, tol: float, *, paper: bool = False) -> float | None:
        """Uplink bits per client (``bits_up``, or ``bits_up_paper``) when first ‖∇f‖² ≤ tol."""
        hit = self.table[self.table["grad_norm_sq"] <= tol]
        col = "bits_up_paper" if paper else "bits_up"
        return float(hit[col].iloc[0]) if len(hit) else None

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly digest (what ``shrinkgrad ps`` prints and saves)."""
        last = self.table.iloc[-1] if len(self.table) else None
        return {
            "status": self.status,
            "message": self.message,
            "method": str(self.table["method"].iloc[0])
            if last is not None
            else str(self.config.get("method", "")),
            "updates": self.updates,
            "wall_s": self.wall_s,
            "updates_per_s": self.updates_per_s,
            "stepsize": self.stepsize,
            "stepsize_rule": self.stepsize_rule,
            "tau_bound": self.tau_bound,
            "staleness_max": self.staleness_max,
            "delay_max": self.delay_max,
            "stepsize_bound_measured": self.stepsize_bound_measured,
            "rule_holds_at_measured_delay": self.rule_holds,
            "mean_staleness": {str(k): float(v) for k, v in self.mean_staleness().items()},
            "grad_norm_sq_first": float(self.table["grad_norm_sq"].iloc[0])
            if last is not None
            else None,
            # None when the metrics turned non-finite: the table's last row is not the run's
            "grad_norm_sq_last": float(last["grad_norm_sq"])
            if last is not None and not self.metrics_cut
            else None,
            "bits_up_per_client": float(self.bits_up.mean()),
            "workers_lost": [
                int(w) for w in self.events.loc[self.events["event"] == "worker_lost", "worker"]
            ],
            "resumed": [
                str(d) for d in self.events.loc[self.events["event"] == EVENT_RESUMED, "detail"]
            ],
            "exit_codes": self.exit_codes,
            "config": self.config,
        }

    def save(self, out: str | os.PathLike[str], *, plot: bool = True) -> dict[str, Path]:
        """Write table.csv, staleness.csv, events.csv, summary.json (and staleness.png)."""
        root = Path(out)
        root.mkdir(parents=True, exist_ok=True)
        paths = {
            "table": root / "table.csv",
            "staleness": root / TRACE_FILES["updates"],
            "events": root / TRACE_FILES["events"],
            "summary": root / TRACE_FILES["summary"],
        }
        _atomic(paths["table"], lambda p: self.table.to_csv(p, index=False))
        _atomic(paths["staleness"], lambda p: self.staleness.to_csv(p, index=False))
        _atomic(paths["events"], lambda p: self.events.to_csv(p, index=False))
        text = json.dumps(self.summary(), indent=2, default=str) + "\n"
        _atomic(paths["summary"], lambda p: p.write_text(text, encoding="utf-8"))
        if plot:
            paths["plot"] = plot_staleness(
                self.staleness,
                root / "staleness.png",
                tau_max=self.config.get("tau_max"),
                delay_bound=self.tau_bound,
                title=f"{self.summary()['method']}: {self.config.get('compressor')}, "
                f"γ={self.stepsize:.3g}",
            )
        return paths


def _atomic(path: Path, write: Any) -> None:
    """``write(tmp)``, fsync, then rename over ``path``: a crash leaves the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def build_result(log: ServerLog, config: PSConfig, plan: Plan, problem: Problem) -> PSResult:
    """Turn the server's record into tables, computing the metrics of every snapshot now."""
    meta: dict[str, Any] = {
        "method": config.run_method,
        "compressor": plan.compressor.name,
        "stepsize": plan.stepsize,
        "stepsize_rule": plan.cfg.stepsize_rule,
        "seed": config.seed,
        "dataset": str(problem.info().get("dataset", problem.dataset)),
        "problem": str(problem.info().get("problem", problem.name)),
        "n_clients": problem.n,
        "d": problem.d,
    }
    rows: list[dict[str, Any]] = []
    status, message = log.status, log.message
    # the simulator's divergence rule (sim.options.Divergence: ‖∇f‖² beyond divergence_factor ×
    # its initial value, the loss beyond 100× its initial distance to the lower bound, ‖x − x*‖²
    # beyond 1e8×), against the first snapshot's metrics
    rule = Divergence.of(config.divergence_factor)
    x_star = known_minimiser(problem, problem.dtype, torch.device("cpu"))
    ref: DivergenceReference | None = None
    for update, time_s, x, up, paper, down in log.snapshots:
        x = x.to(problem.dtype)
        g = problem.grad(x)
        gns, loss = squared_norm(g), float(problem.loss(x))  # the simulator's row values
        if not (math.isfinite(gns) and math.isfinite(loss)):
            status, message = "diverged", f"{NON_FINITE_METRICS} {update}"
            break
        rows.append(
            {
                "round": update,
                "grad_norm_sq": gns,
                "loss": loss,
                "bits_up": up,
                "bits_up_paper": paper,
                "bits_down": down,
                "time_s": time_s,
                **meta,
                "tau_max": config.tau_max,
            }
        )
        dist_sq = None if x_star is None else float(torch.sum((x.cpu() - x_star) ** 2))
        if ref is None:
            eps = float(torch.finfo(problem.dtype).eps)
            ref = DivergenceReference(gns, loss, lower_bound(problem), dist_sq, eps)
            continue
        why = rule.verdict(ref, gns, loss, dist_sq)
        if why is not None:
            status, message = "diverged", f"{why}, at update {update}"
            break
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    table = table.astype(
        {"round": "int64", "seed": "int64", "n_clients": "int64", "d": "int64", "tau_max": "Int64"}
    )
    staleness = pd.DataFrame(log.updates, columns=list(STALENESS_COLUMNS[:7]))
    staleness["method"] = config.run_method
    staleness["seed"] = config.seed
    staleness = staleness.astype(
        {
            "update": "int64",
            "worker": "int64",
            "counter": "int64",
            "version_computed": "int64",
            "staleness": "int64",
            "delay": "int64",
        }
    )
    events = pd.DataFrame(log.events, columns=list(_EVENT_COLUMNS))
    delay_max = int(staleness["delay"].max()) if len(staleness) else 0
    try:
        # a check of γ, not the choice of one: the rule's scope warning (DCGD's convexity) was
        # given when the step was chosen, if it was chosen by the theory
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            admissible = plan.inner.async_admissible(plan.cfg, plan.stepsize, delay_max)
    except UnknownConstantError:  # the rule needs L, which this problem (a network) lacks
        admissible = None
    return PSResult(
        table=table,
        staleness=staleness,
        events=events,
        status=status,
        message=message,
        stepsize=plan.stepsize,
        stepsize_rule=plan.cfg.stepsize_rule,
        tau_bound=plan.tau_bound,
        L=math.nan if problem.L is None else float(problem.L),
        x=log.x,
        bits_up=log.bits_up,
        bits_up_paper=log.bits_up_paper,
        bits_down=log.bits_down,
        wall_s=log.elapsed,
        config=dict(config.to_dict(), compressor=config.compressor_spec),
        stepsize_bound_measured=None if admissible is None else admissible[0],
        rule_holds=None if admissible is None else admissible[1],
    )


def plot_staleness(
    staleness: pd.DataFrame,
    path: str | os.PathLike[str],
    *,
    tau_max: int | None = None,
    delay_bound: int | None = None,
    title: str = "",
) -> Path:
    """Histogram of the measured staleness per worker (left) and of the [K18] delay (right).

    A pure function of the staleness table; the dashed lines mark ``tau_max`` (the staleness
    bound, left) and ``delay_bound`` (the delay the step size assumed, right: 2·tau_max for
    the IAG, whose table entries can be twice as old) when given.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    top = int(max(staleness["delay"].max(), staleness["staleness"].max())) if len(staleness) else 1
    bins = [b - 0.5 for b in range(top + 2)]
    ax = axes[0]
    for w, grp in staleness.groupby("worker"):
        ax.hist(
            grp["staleness"],
            bins=bins,
            histtype="step",
            linewidth=1.5,
            label=f"worker {w} (mean {grp['staleness'].mean():.1f}, {len(grp)} msgs)",
        )
    ax.set_xlabel("staleness τ = server version − version computed at")
    ax.set_ylabel("applied messages")
    ax = axes[1]
    ax.hist(staleness["delay"], bins=bins, color="0.5")
    ax.set_xlabel("[K18] delay of the update (IAG: oldest table entry)")
    ax.set_ylabel("updates")
    lines = ((axes[0], tau_max, "τ_max"), (axes[1], delay_bound, "delay bound"))
    for ax, at, name in lines:
        if at is not None:
            ax.axvline(at, color="k", linestyle="--", linewidth=1, label=f"{name} = {at}")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
