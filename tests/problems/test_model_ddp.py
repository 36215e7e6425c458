"""One implementation, two runtimes, on a network: EF21 in a DDP hook = EF21 in the simulator.

Two gloo ranks on 127.0.0.1 train an MLP with DDP and the EF21 communication hook; rank r holds
client r's rows of a model problem and computes its loss with plain autograd. The simulator runs
EF21 on the same model problem. The hook compresses every parameter tensor on its own, so the
MLP keeps its weights in one flat parameter (the simulator's x): Top-k then selects from the same
vector in both runtimes. (A multi-tensor MLP in the hook is EF21 with a block-wise Top-k, which
the simulator has no compressor for.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, preload, spawn
from shrinkgrad.problems import load, model_problem
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

D_IN, HIDDEN, D_OUT = 14, 8, 2
SPLIT = "dirichlet[alpha=1.0,seed=3]"  # unequal client sizes


class FlatMLP(torch.nn.Module):
    """Linear(14, 8) → tanh → Linear(8, 2), all weights in one flat parameter."""

    def __init__(self) -> None:
        super().__init__()
        d = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
        init = Keys.derive(9, stream="test").uniform(d).to(torch.float64) - 0.5
        self.theta = torch.nn.Parameter(init * 0.6)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        t = self.theta
        a = D_IN * HIDDEN
        W1, b1 = t[:a].view(HIDDEN, D_IN), t[a : a + HIDDEN]
        o = a + HIDDEN
        W2, b2 = t[o : o + HIDDEN * D_OUT].view(D_OUT, HIDDEN), t[o + HIDDEN * D_OUT :]
        out: torch.Tensor = torch.tanh(X @ W1.T + b1) @ W2.T + b2
        return out


def _ef21_hook(
    rank: int, world: int, rows: list[np.ndarray], k: int, gamma: float, steps: int
) -> list[torch.Tensor]:
    ds = load("australian_scale")
    X = torch.from_numpy(ds.X[rows[rank]].toarray())
    y = torch.from_numpy((np.asarray(ds.y)[rows[rank]] > 0).astype(np.int64))
    model = DDP(FlatMLP())
    state = CompressionState(f"top_k[k={k}]", error_feedback="ef21", min_numel=0, warmup_steps=1)
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=gamma)
    xs = []
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()
        xs.append(model.module.theta.detach().clone())
    return xs


def test_ef21_hook_on_an_mlp_follows_the_simulator() -> None:
    preload()
    world, k, gamma, steps = 2, 12, 0.5, 15
    problem = model_problem(FlatMLP(), "australian_scale", n_clients=world, split=SPLIT, test=0)
    assert problem.client_sizes[0] != problem.client_sizes[1]
    xs_sim: list[torch.Tensor] = []

    def record(r: int, state: Any) -> None:
        xs_sim.append(state.x.clone())

    simulate(problem, "ef21", f"top_k[k={k}]", stepsize=gamma, rounds=steps, callback=record)
    xs = spawn(_ef21_hook, world, (problem.parts, k, gamma, steps))
    assert len(xs_sim) == steps
    for t in range(steps):
        assert torch.equal(xs[0][t], xs[1][t])
        torch.testing.assert_close(xs[0][t], xs_sim[t], rtol=0, atol=1e-10)
    assert float((xs_sim[-1] - problem.x0()).norm()) > 1e-2  # the trajectory moves


# --------------------------------------------------------------------------------------------
# the multi-process runner: each rank holds its clients (restrict) of a registered network
# --------------------------------------------------------------------------------------------
# The logistic loss (one output): with two-class cross-entropy the output biases' gradients are
# exact opposites, a tie for Top-k that a 1e-17 difference in the order of the cross-rank sum
# (the runner all-reduces partial sums) breaks either way, after which the runs differ.
MLP = (
    "mlp[dataset=australian_scale,hidden=6,n_clients=6,split=dirichlet[alpha=1.0,seed=1],"
    "loss=logistic]"
)


def _runner(rank: int, world: int, method: str, compressor: str) -> dict[str, Any]:
    from shrinkgrad.distributed.runner import run_distributed

    xs: list[torch.Tensor] = []
    res = run_distributed(
        MLP,
        method,
        compressor,
        stepsize=0.5,
        rounds=8,
        seed=2,
        log_every=2,
        callback=lambda r, s: xs.append(s.x.clone()),
    )
    return {"xs": xs, "table": res.table}


@pytest.mark.parametrize("method", ["ef21", "ef21_sgd[b=3]"])
def test_the_runner_on_a_network_follows_the_simulator(method: str) -> None:
    preload()
    xs_sim: list[torch.Tensor] = []
    sim = simulate(
        MLP,
        method,
        "top_k[k=9]",
        stepsize=0.5,
        rounds=8,
        seed=2,
        log_every=2,
        callback=lambda r, s: xs_sim.append(s.x.clone()),
    )
    out = spawn(_runner, 3, (method, "top_k[k=9]"))
    for t, x in enumerate(xs_sim):
        assert torch.equal(out[0]["xs"][t], out[2]["xs"][t])
        assert float((out[0]["xs"][t] - x).abs().max()) <= 1e-10, f"round {t + 1}"
    for c in ("loss", "grad_norm_sq"):
        got, want = out[0]["table"][c].to_numpy(), sim.table[c].to_numpy()
        assert np.allclose(got, want, rtol=1e-9, atol=0)
    assert float((xs_sim[-1] - xs_sim[0]).norm()) > 1e-3
