"""run_distributed: the library's methods with their clients on several gloo ranks."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from shrinkgrad.distributed import WorkerError, spawn
from shrinkgrad.distributed.runner import client_ids, run_distributed
from shrinkgrad.problems import LinearModelProblem, least_squares, load, logistic_regression
from shrinkgrad.sim import simulate

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

# built once in the test process; forked ranks inherit them
A9A = logistic_regression("a9a", n_clients=8, split="shuffled[seed=0]", lam=0.1)
A1A = logistic_regression("a1a", n_clients=6, split="contiguous", lam=0.1)


def _x0(d: int) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.1


def _run(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    xs: list[torch.Tensor] = []

    def record(r: int, state: Any) -> None:
        xs.append(state.x.clone())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_distributed(callback=record, **kwargs)
    return {
        "table": res.table,
        "xs": xs,
        "status": res.status,
        "message": res.message,
        "ids": res.state.clients.ids,
        "bits_up": res.bits_up,
        "rounds": res.rounds,
    }


def _simulate(kwargs: dict[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    xs: list[torch.Tensor] = []

    def record(r: int, state: Any) -> None:
        xs.append(state.x.clone())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return simulate(callback=record, **kwargs), xs


def _assert_same_run(dist_out: list[dict[str, Any]], sim: Any, sim_xs: list[torch.Tensor]) -> None:
    ref = dist_out[0]
    for other in dist_out[1:]:  # every rank holds the same iterate after every round
        assert len(other["xs"]) == len(ref["xs"])
        for a, b in zip(other["xs"], ref["xs"], strict=True):
            assert torch.equal(a, b)
        pd.testing.assert_frame_equal(other["table"], ref["table"])
    assert len(ref["xs"]) == len(sim_xs)
    for t, (a, b) in enumerate(zip(ref["xs"], sim_xs, strict=True)):
        assert float((a - b).abs().max()) <= 1e-10, f"round {t + 1}"
    got, want = ref["table"], sim.table
    assert list(got.columns) == list(want.columns)
    exact = [c for c in want.columns if c not in ("grad_norm_sq", "loss", "time_s")]
    pd.testing.assert_frame_equal(got[exact], want[exact])
    for c in ("grad_norm_sq", "loss"):
        torch.testing.assert_close(
            torch.tensor(got[c].to_numpy()), torch.tensor(want[c].to_numpy()), rtol=1e-9, atol=0
        )
    assert ref["status"] == sim.status
    assert torch.equal(ref["bits_up"], sim.bits_up)


def test_four_ranks_ef21_top_k_follow_the_simulators_trajectory() -> None:
    kwargs = dict(
        problem=A9A, method="ef21", compressor="top_k[k=3]", rounds=40, seed=0, x0=_x0(A9A.d)
    )
    out = spawn(_run, 4, (kwargs,))
    sim, xs = _simulate(kwargs)
    _assert_same_run(out, sim, xs)
    assert [o["ids"].tolist() for o in out] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (
        len(sim.table) == 41
        and sim.table["grad_norm_sq"].iloc[-1] < sim.table["grad_norm_sq"].iloc[0]
    )


@pytest.mark.parametrize(
    "method, compressor, stepsize",
    [
        ("ef21_w", "top_k[k=2]", "theory"),
        ("ef21_pp[p=0.5]", "top_k[k=2]", "theory"),  # keyed participation draws
        ("ef21_sgd[b=16]", "rand_k_scaled[k=4]", 0.5),  # keyed minibatches and compressor
        ("dcgd", "qsgd[s=2]", "theory"),
        ("ef", "top_k[k=2]", 0.3),
        ("iag", "rand_k[k=10]", "theory"),
        ("diana", "rand_k[k=10]", "theory"),  # keyed draws, shifts h_i on the ranks
        ("ef21_plus", "top_k[k=2]", "theory"),  # the reduction carries g_i⁺ − g_i
    ],
)
def test_every_method_runs_on_three_ranks_as_in_the_simulator(
    method: str, compressor: str, stepsize: Any
) -> None:
    kwargs = dict(
        problem=A1A,
        method=method,
        compressor=compressor,
        stepsize=stepsize,
        rounds=12,
        seed=7,
        log_every=3,
    )
    out = spawn(_run, 3, (kwargs,))
    sim, xs = _simulate(kwargs)
    _assert_same_run(out, sim, xs)


def test_a_problem_that_cannot_be_restricted_is_evaluated_in_full() -> None:
    # the method tests' independent least-squares Problem: every rank holds all of it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "methods"))
    from methods_fixtures import LeastSquares

    problem = LeastSquares(n=5, d=8, m=6, seed=2)
    kwargs = dict(problem=problem, method="ef21", compressor="top_k[k=2]", rounds=15, seed=3)
    out = spawn(_run, 2, (kwargs,))
    sim, xs = _simulate(kwargs)
    _assert_same_run(out, sim, xs)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    base = dict(problem=A1A, method="ef21", compressor="top_k[k=2]", seed=1, log_every=2)
    prefix = str(tmp_path / "ckpt")
    straight = spawn(_run, 2, (dict(base, rounds=12),))
    spawn(_run, 2, (dict(base, rounds=6, checkpoint=prefix, checkpoint_every=2),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.rank0-of-2", "ckpt.rank1-of-2"]
    resumed = spawn(_run, 2, (dict(base, rounds=12, checkpoint=prefix),))
    cols = [c for c in straight[0]["table"].columns if c != "time_s"]
    pd.testing.assert_frame_equal(resumed[0]["table"][cols], straight[0]["table"][cols])
    assert torch.equal(resumed[1]["xs"][-1], straight[1]["xs"][-1])
    assert torch.equal(resumed[0]["bits_up"], straight[0]["bits_up"])
    # a checkpoint set that the ranks do not share is refused on every rank
    (tmp_path / "ckpt.rank1-of-2").unlink()
    with pytest.raises(WorkerError, match="do not agree"):
        spawn(_run, 2, (dict(base, rounds=12, checkpoint=prefix),))


@pytest.mark.parametrize(
    "how",
    [
        dict(stepsize=5.0, rounds=60),  # grad_norm_sq grows past divergence_factor
        # non-finite metrics at a logged round: the state and the bit counters are those of the
        # last round before it, on every rank as in the simulator
        dict(stepsize=50.0, rounds=300, log_every=7, divergence_factor=None),
        # a saturated logistic loss: f grows, ‖∇f‖² does not (the loss test, issue 12.1)
        dict(stepsize=1e6, rounds=20, logistic=True),
    ],
)
def test_divergence_stops_every_rank_as_the_simulator_does(how: dict[str, Any]) -> None:
    how = dict(how)
    logistic = how.pop("logistic", False)
    problem = A1A if logistic else least_squares("a1a", n_clients=4)
    kwargs = dict(problem=problem, method="ef21", compressor="top_k[k=2]", **how)
    out = spawn(_run, 2, (kwargs,))
    sim, _ = _simulate(kwargs)
    assert sim.status == "diverged"
    assert [o["status"] for o in out] == ["diverged", "diverged"]
    assert out[0]["message"] == out[1]["message"] == sim.message
    assert out[0]["rounds"] == out[1]["rounds"] == sim.rounds
    assert torch.equal(out[0]["bits_up"], sim.bits_up)
    cols = [c for c in sim.table.columns if c not in ("time_s", "grad_norm_sq", "loss")]
    pd.testing.assert_frame_equal(out[0]["table"][cols], sim.table[cols])


class HeldOutA1A(LinearModelProblem):
    """a1a's first 1200 samples over 4 clients, the rest held out (PLAN interface 1)."""

    held_out_columns = ("test_loss",)

    def __init__(self) -> None:
        data = load("a1a")
        parts = np.array_split(np.arange(1200), 4)
        super().__init__(data.X, data.y, parts, loss="logistic", lam=0.1, dataset="a1a")
        self.test_X = torch.from_numpy(data.X[1200:].toarray())
        self.test_y = torch.from_numpy(data.y[1200:].astype(np.float64))

    def held_out(self, x: torch.Tensor) -> dict[str, float]:
        z = self.test_X @ x
        return {"test_loss": float(torch.nn.functional.softplus(-self.test_y * z).mean())}


HELD_OUT = HeldOutA1A()


def test_held_out_columns_are_evaluated_on_the_full_problem_by_every_rank() -> None:
    kwargs = dict(problem=HELD_OUT, method="ef21", compressor="top_k[k=2]", rounds=9, log_every=3)
    out = spawn(_run, 2, (kwargs,))
    sim, xs = _simulate(kwargs)
    _assert_same_run(out, sim, xs)
    assert "test_loss" in sim.table.columns
    pd.testing.assert_series_equal(out[0]["table"]["test_loss"], sim.table["test_loss"])


def test_more_ranks_than_clients_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="every rank needs at least one client"):
        client_ids(3, 4, 0)
    assert client_ids(10, 4, 1).tolist() == [3, 4, 5]
    small = logistic_regression("a1a", n_clients=2, lam=0.1)
    with pytest.raises(WorkerError, match="n=2 clients but the job has 3 ranks"):
        spawn(_run, 3, (dict(problem=small, method="ef21", compressor="top_k[k=1]", rounds=2),))
