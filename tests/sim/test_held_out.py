"""Held-out metrics in the table (PLAN interface 1): a problem's ``held_out_columns`` follow the
metric block, evaluated by ``held_out(x)`` at every logged round; checkpoints keep them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from shrinkgrad.problems import LinearModelProblem, load
from shrinkgrad.sim import COLUMNS, METRIC_COLUMNS, SimulationInterrupted, simulate, table_columns


class WithHeldOut(LinearModelProblem):
    """a1a logistic regression on its first 1200 samples; the other 405 are held out."""

    held_out_columns = ("test_loss", "test_accuracy")

    def __init__(self, n_clients: int = 6) -> None:
        data = load("a1a")
        train = np.arange(1200)
        parts = np.array_split(train, n_clients)
        super().__init__(data.X, data.y, parts, loss="logistic", lam=0.1, dataset="a1a")
        self.test_X = torch.from_numpy(data.X[1200:].toarray())
        self.test_y = torch.from_numpy(data.y[1200:].astype(np.float64))
        self.calls = 0

    def held_out(self, x: torch.Tensor) -> dict[str, float]:
        self.calls += 1
        z = self.test_X @ x
        loss = torch.nn.functional.softplus(-self.test_y * z).mean()
        acc = (torch.sign(z) == self.test_y).double().mean()
        return {"test_accuracy": float(acc), "test_loss": float(loss)}


def test_columns_follow_the_metric_block_and_equal_held_out_at_every_logged_round() -> None:
    p = WithHeldOut()
    xs: list[torch.Tensor] = []
    res = simulate(
        p, "ef21", "top_k[k=2]", "theory*8", rounds=17, log_every=4,
        callback=lambda r, s: xs.append(s.x.clone()),
    )  # fmt: skip
    t = res.table
    assert list(t.columns) == list(table_columns(("test_loss", "test_accuracy")))
    assert list(t.columns[: len(METRIC_COLUMNS) + 2]) == [
        *METRIC_COLUMNS,
        "test_loss",
        "test_accuracy",
    ]
    assert t["round"].tolist() == [0, 4, 8, 12, 16, 17]
    assert p.calls == len(t)  # once per logged row, never on the other rounds
    x_rows = [p.x0(), *xs]
    for row, x in zip(t.itertuples(), x_rows, strict=True):
        expect = p.held_out(x)
        assert row.test_loss == expect["test_loss"] and row.test_accuracy == expect["test_accuracy"]
    assert t["test_loss"].iloc[-1] < t["test_loss"].iloc[0]  # it learns
    assert "test_loss=" in repr(res)


def test_a_problem_without_held_out_metrics_keeps_the_columns() -> None:
    from shrinkgrad.problems import logistic_regression

    res = simulate(logistic_regression("a1a", n_clients=3), "gd", None, "theory", rounds=2)
    assert list(res.table.columns) == list(COLUMNS) == list(table_columns())


def test_a_checkpointed_run_resumes_with_its_held_out_columns(tmp_path: Path) -> None:
    p = WithHeldOut()
    args: dict[str, Any] = dict(rounds=12, log_every=3, seed=1)
    full = simulate(p, "ef21", "top_k[k=2]", "theory", **args)

    def stop(r: int, s: Any) -> None:
        if r == 6:
            raise KeyboardInterrupt

    path = tmp_path / "h.pt"
    with pytest.raises(SimulationInterrupted):
        simulate(p, "ef21", "top_k[k=2]", "theory", checkpoint=path, callback=stop, **args)
    resumed = simulate(p, "ef21", "top_k[k=2]", "theory", checkpoint=path, **args)
    cols = [c for c in full.table.columns if c != "time_s"]
    pd.testing.assert_frame_equal(resumed.table[cols], full.table[cols], check_exact=True)
    # a checkpoint of the same run without held-out columns is another run
    from shrinkgrad.problems import logistic_regression

    plain = logistic_regression("a1a", n_clients=3)
    simulate(plain, "gd", None, 0.1, rounds=2, checkpoint=tmp_path / "p.pt")
    saved = torch.load(tmp_path / "p.pt", weights_only=False)
    assert "held_out_columns" not in saved["fingerprint"]


class BadHeldOut(WithHeldOut):
    def held_out(self, x: torch.Tensor) -> dict[str, float]:
        return {"test_loss": 1.0}


class NaNHeldOut(WithHeldOut):
    def held_out(self, x: torch.Tensor) -> dict[str, float]:
        return {"test_loss": float("nan"), "test_accuracy": 0.5}


def test_held_out_mistakes_are_named() -> None:
    with pytest.raises(TypeError, match=r"exactly the keys of held_out_columns"):
        simulate(BadHeldOut(), "gd", None, 0.1, rounds=2)
    with pytest.raises(ValueError, match=r"test_loss=nan.*choose another starting point"):
        simulate(NaNHeldOut(), "gd", None, 0.1, rounds=2)
    clash = WithHeldOut()
    clash.held_out_columns = ("loss",)  # type: ignore[misc]
    with pytest.raises(ValueError, match="other than the simulator's columns"):
        simulate(clash, "gd", None, 0.1, rounds=2)
