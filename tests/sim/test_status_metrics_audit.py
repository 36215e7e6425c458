"""Audit of how the simulator labels and measures a run when a checkpoint is resumed with
another ``rounds``: the status decided at a last round off the logging grid, and the last row of
a run whose checkpoint was saved at exactly the round now asked for (docs/simulator.md,
"Checkpoints and resume": the table equals a run made with those rounds from the start)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from methods_fixtures import LeastSquares

from shrinkgrad.sim import Divergence, SimulationInterrupted, load_checkpoint, simulate


def same_table(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.drop(columns="time_s"), b.drop(columns="time_s"))


def gns_and_loss(p: LeastSquares, x: torch.Tensor) -> tuple[float, float]:
    """‖∇f(x)‖² and f(x) from the problem's definition, in numpy."""
    A, y, xn = p.A.numpy(), p.y.numpy(), x.numpy()
    r = A @ xn - y
    g = np.einsum("nmd,nm->d", A, r) / (p.m * p.n)
    return float(g @ g), float((r**2).sum() / (2 * p.m * p.n))


def trajectory(p: LeastSquares, step: float, rounds: int) -> pd.Series:
    """‖∇f(xᵗ)‖² of GD at every round t (no stopping rule)."""
    res = simulate(p, "gd", None, step, rounds=rounds, divergence_factor=None)
    return res.table.set_index("round")["grad_norm_sq"]


def _stopping_rule(kind: str, p: LeastSquares) -> tuple[float, dict[str, Any]]:
    """A step size and options that stop GD exactly at round 23 when 23 is logged (the last round
    of a 23-round run), and at round 25 on the grid of log_every=5 otherwise."""
    if kind == "tol":
        g = trajectory(p, 1.0 / p.L, 30)
        assert g[20] > g[23] > g[25]
        return 1.0 / p.L, {"tol": float(g[23])}
    if kind == "growth":
        g = trajectory(p, 3.0 / p.L, 30)
        factor = 0.999 * float(g[23] / g[0])
        assert g[20] < factor * g[0] < g[23] < g[25]
        return 3.0 / p.L, {
            "divergence_factor": Divergence(factor, loss_factor=None, iterate_factor=None)
        }
    return 1.0 / p.L, {"callback": lambda r, state: r >= 23}


@pytest.mark.parametrize("kind", ["tol", "growth", "callback"])
def test_extending_a_run_stopped_at_its_last_off_grid_round_equals_a_longer_run(
    lsq: LeastSquares, tmp_path: Path, kind: str
) -> None:
    """A 23-round run logged every 5 rounds logs round 23 only because it is its last; a status
    decided there (tolerance, growth test, callback) is not that of a 30-round run, which logs
    round 25 next. Before the fix the extension returned the 23-round run's table and status
    (converged/diverged/stopped at round 23) instead of the 30-round run's (at round 25)."""
    step, rule = _stopping_rule(kind, lsq)
    path = tmp_path / "run.pt"
    args: dict[str, Any] = {"log_every": 5, **rule}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        short = simulate(lsq, "gd", None, step, rounds=23, checkpoint=path, **args)
        assert short.status != "completed" and short.table["round"].tolist()[-1] == 23
        longer = simulate(lsq, "gd", None, step, rounds=30, checkpoint=path, **args)
        fresh = simulate(lsq, "gd", None, step, rounds=30, **args)
    assert fresh.table["round"].tolist() == [0, 5, 10, 15, 20, 25]
    assert fresh.status == short.status and "round 25" in fresh.message
    assert (longer.status, longer.message, longer.rounds) == (fresh.status, fresh.message, 25)
    same_table(longer.table, fresh.table)


def test_extending_a_run_stopped_by_non_finite_values_keeps_it(
    lsq: LeastSquares, tmp_path: Path
) -> None:
    """A non-finite stop happens at the same round in any longer run: the extension keeps it,
    with the last finite round's off-grid row."""
    path = tmp_path / "run.pt"
    args: dict[str, Any] = {"log_every": 7, "divergence_factor": None}
    with pytest.warns(RuntimeWarning, match="non-finite"):
        short = simulate(lsq, "gd", None, 1e150, rounds=40, checkpoint=path, **args)
    assert short.status == "diverged" and short.rounds < 40
    longer = simulate(lsq, "gd", None, 1e150, rounds=50, checkpoint=path, **args)
    assert (longer.status, longer.message, longer.rounds) == (
        short.status,
        short.message,
        short.rounds,
    )
    same_table(longer.table, short.table)


class KilledAt(LeastSquares):
    """The fixture problem, interrupted (KeyboardInterrupt) when a gradient at ``stop_at`` is
    requested: inside the step that leaves that point."""

    stop_at: torch.Tensor | None = None

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        if self.stop_at is not None and torch.equal(x, self.stop_at):
            raise KeyboardInterrupt
        return super().client_grads(x)


@pytest.mark.parametrize("converges", [False, True])
def test_a_checkpoint_saved_at_the_rounds_asked_for_ends_with_that_round(
    tmp_path: Path, converges: bool
) -> None:
    """A 23-round run (log_every=5) is interrupted inside round 13 and saves round 12; run again
    with rounds=12 it is a finished 12-round run, whose last row is round 12 with its verdict
    (here also the tolerance reached exactly there). Before the fix the result was
    ``completed`` with the table ending at round 10."""
    p = KilledAt(n=6, d=8, m=5, seed=4, spread=8.0)
    step = 1.0 / p.L
    g = trajectory(p, step, 12)
    args: dict[str, Any] = {"log_every": 5, "tol": float(g[12]) if converges else None}
    fresh = simulate(p, "gd", None, step, rounds=12, **args)
    assert fresh.table["round"].tolist() == [0, 5, 10, 12]
    assert fresh.status == ("converged" if converges else "completed")
    path = tmp_path / "run.pt"
    p.stop_at = fresh.x.clone()
    with pytest.raises(SimulationInterrupted):
        simulate(p, "gd", None, step, rounds=23, checkpoint=path, **args)
    p.stop_at = None
    saved = load_checkpoint(path)
    assert saved is not None and saved["state"].round == 12 and saved["last_logged"] == 10
    resumed = simulate(p, "gd", None, step, rounds=12, checkpoint=path, **args)
    assert (resumed.status, resumed.message) == (fresh.status, fresh.message)
    same_table(resumed.table, fresh.table)
    last = resumed.table.iloc[-1]
    gns, loss = gns_and_loss(p, resumed.x)
    assert last["grad_norm_sq"] == pytest.approx(gns, rel=1e-12)
    assert last["loss"] == pytest.approx(loss, rel=1e-12)
    # the finished checkpoint now returns that result at once
    again = simulate(p, "gd", None, step, rounds=12, checkpoint=path, **args)
    assert again.status == fresh.status
    same_table(again.table, fresh.table)
