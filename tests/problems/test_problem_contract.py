"""The problem contract, for every registered problem (issue 13; design.md principle 15).

Every name in ``PROBLEMS`` gets a small instance in :data:`CASES`; a registered problem missing
there fails :func:`test_every_registered_problem_is_covered`, and a problem class without an
independent reference loss in :data:`REFERENCES` fails the autograd check. Properties:

* the mean of the client gradients is ``grad``;
* the gradients equal torch.autograd on the loss written independently here, and the
  directional derivative of ``client_losses`` (a functional check of the pair);
* ``restrict`` is exact to the bit (losses, gradients, gradients at points, minibatches);
* L_i (and L) are upper bounds on random pairs when the problem knows them;
* ``client_grads_at`` with equal rows is ``client_grads``; a fused ``client_grads_and_losses``
  (optional) is the separate evaluation, bit for bit;
* minibatch gradients are unbiased: Monte-Carlo over keys, the error measured in units of the
  sample's own standard error (a χ²-like ratio per client), and exact when b_i = m_i.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shrinkgrad.problems import (
    PROBLEMS,
    LinearModelProblem,
    ModelProblem,
    Problem,
    load,
    make_problem,
)
from shrinkgrad.rng import Keys

#: one small instance per registered problem (unequal client sizes where the split allows)
CASES: dict[str, str] = {
    "logistic_regression": (
        "logistic_regression[dataset=australian_scale,n_clients=5,split=dirichlet[alpha=0.5,seed=0]]"
    ),
    "least_squares": "least_squares[dataset=australian_scale,n_clients=4,lam=0.1,reg=l2]",
    "synthetic_least_squares": "synthetic_least_squares[n_clients=6,d=5,m=4,L_var=10,lam=0.1]",
    "mlp": "mlp[dataset=australian_scale,hidden=5,n_clients=4,split=dirichlet[alpha=1.0,seed=2]]",
    "cnn": "cnn[channels=2,n_clients=3,split=by_label,test=0.85]",
}


@pytest.fixture(scope="module", params=sorted(CASES))
def problem(request: pytest.FixtureRequest) -> Problem:
    return make_problem(CASES[request.param])


def _point(p: Problem, seed: int = 0, scale: float = 0.3) -> torch.Tensor:
    noise = Keys.derive(seed, stream="contract_test").uniform(p.d).to(p.dtype) - 0.5
    return p.x0() + scale * noise


def test_every_registered_problem_is_covered() -> None:
    missing = sorted(set(PROBLEMS.names()) - set(CASES))
    assert not missing, f"registered problems without a contract case: {missing} (add to CASES)"
    assert not set(CASES) - set(PROBLEMS.names()), "CASES names a problem that is not registered"


# --------------------------------------------------------------------------------------------
# independent reference losses (f_i written here from the problem's data)
# --------------------------------------------------------------------------------------------
def _linear_losses(p: LinearModelProblem, x: torch.Tensor) -> torch.Tensor:
    A = p.data_matrix()
    A = torch.from_numpy(A.toarray() if hasattr(A, "toarray") else np.asarray(A))
    y = torch.from_numpy(np.asarray(p._y64))  # targets in client order (float64)
    out = []
    for i in range(p.n):
        lo, hi = int(p.offsets[i]), int(p.offsets[i + 1])
        z = A[lo:hi] @ x
        phi = F.softplus(-y[lo:hi] * z) if p.loss_kind == "logistic" else (z - y[lo:hi]) ** 2
        if p.lam == 0:
            reg = torch.zeros((), dtype=x.dtype)
        elif p.reg == "nonconvex":
            reg = p.lam * (x * x / (1 + x * x)).sum()
        else:
            reg = 0.5 * p.lam * (x * x).sum()
        out.append(phi.mean() + reg)
    return torch.stack(out)


def model_rows(p: ModelProblem, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client i's inputs and targets read from the dataset itself (not from the problem)."""
    ds = load(p.dataset)
    rows = p.parts[i]
    X = torch.from_numpy(ds.X[rows].toarray()).reshape(len(rows), *p.input_shape)
    y = torch.from_numpy(np.array(ds.y)[rows])
    if p.loss_kind == "cross_entropy":
        y = (y > 0).long() if ds.n_classes == 2 else y.long()
    return X, y


def model_sample_losses(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ per sample, from the formulas (not the problem's loss functions)."""
    if kind == "cross_entropy":
        return torch.logsumexp(out, dim=1) - out.gather(1, y[:, None])[:, 0]
    if kind == "logistic":
        return torch.log1p(torch.exp(-y * out.reshape(-1)))
    return ((out.reshape(y.shape) - y) ** 2).reshape(len(y), -1).sum(1)


def _model_losses(p: ModelProblem, x: torch.Tensor) -> torch.Tensor:
    net, out, offset = p.module, [], 0
    params: dict[str, torch.Tensor] = {}
    for name, q in net.named_parameters():  # x as the model's parameters, autograd reaching x
        params[name] = x[offset : offset + q.numel()].view(q.shape)
        offset += q.numel()
    for i in range(p.n):  # a plain loop over the clients
        Xi, yi = model_rows(p, i)
        logits = torch.func.functional_call(net, params, (Xi,))
        out.append(model_sample_losses(p.loss_kind, logits, yi).mean())
    return torch.stack(out)


#: problem class → f(problem, x) = the (n,) client losses written independently
REFERENCES: dict[type, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    LinearModelProblem: _linear_losses,
    ModelProblem: _model_losses,
}


def test_gradients_equal_autograd_on_an_independent_loss(problem: Problem) -> None:
    ref = REFERENCES.get(type(problem))
    assert ref is not None, f"no independent reference loss for {type(problem).__name__}"
    x = _point(problem)
    xr = x.clone().requires_grad_()
    losses = ref(problem, xr)
    torch.testing.assert_close(problem.client_losses(x), losses.detach(), rtol=1e-12, atol=1e-13)
    rows = [torch.autograd.grad(losses[i], xr, retain_graph=True)[0] for i in range(problem.n)]
    torch.testing.assert_close(problem.client_grads(x), torch.stack(rows), rtol=0, atol=1e-10)


def test_directional_derivatives_of_the_losses_match_the_gradients(problem: Problem) -> None:
    x = _point(problem, seed=1)
    v = Keys.derive(2, stream="contract_test").uniform(problem.d).to(problem.dtype) - 0.5
    v = v / v.norm()
    eps = 1e-5
    fd = (problem.client_losses(x + eps * v) - problem.client_losses(x - eps * v)) / (2 * eps)
    torch.testing.assert_close(problem.client_grads(x) @ v, fd, rtol=1e-6, atol=1e-8)


def test_mean_of_client_gradients_is_grad(problem: Problem) -> None:
    x = _point(problem)
    torch.testing.assert_close(
        problem.grad(x), problem.client_grads(x).mean(0), rtol=1e-12, atol=1e-15
    )
    assert problem.loss(x) == pytest.approx(float(problem.client_losses(x).mean()), rel=1e-13)


def test_a_fused_gradient_and_loss_pass_is_the_separate_evaluation(problem: Problem) -> None:
    fused = getattr(problem, "client_grads_and_losses", None)
    if fused is None:
        return  # optional (the simulator's metrics then take a separate pass)
    x = _point(problem)
    G, losses = fused(x)
    assert torch.equal(G, problem.client_grads(x))
    assert torch.equal(losses, problem.client_losses(x))


def test_client_grads_at_with_equal_rows_is_client_grads(problem: Problem) -> None:
    x = _point(problem)
    torch.testing.assert_close(
        problem.client_grads_at(x.expand(problem.n, problem.d).clone()),
        problem.client_grads(x),
        rtol=1e-12,
        atol=1e-15,
    )


def test_restrict_is_exact_to_the_bit(problem: Problem) -> None:
    ids = torch.tensor([problem.n - 1, 0])
    sub = problem.restrict(ids)
    assert sub is not None and sub.n == 2
    assert torch.equal(sub.client_sizes, problem.client_sizes[ids])
    x = _point(problem)
    assert torch.equal(sub.client_grads(x), problem.client_grads(x)[ids])
    assert torch.equal(sub.client_losses(x), problem.client_losses(x)[ids])
    X = torch.stack([_point(problem, seed=s) for s in range(problem.n)])
    assert torch.equal(sub.client_grads_at(X[ids]), problem.client_grads_at(X)[ids])
    keys = Keys.derive(5, round=3, client=torch.arange(problem.n), stream="minibatch")
    b = torch.ones(problem.n, dtype=torch.int64) * 2
    full = problem.client_stoch_grads(X, b, keys)[ids]
    assert torch.equal(sub.client_stoch_grads(X[ids], b[ids], keys[ids]), full)


def test_known_smoothness_constants_bound_random_pairs(problem: Problem) -> None:
    if problem.L_i is None or problem.constants_estimated:
        assert problem.L is None or problem.constants_estimated
        return  # unknown constants (a network): nothing to bound
    assert problem.L is not None
    L_i = problem.L_i.to(problem.dtype)
    for s in range(4):
        x, y = _point(problem, seed=10 + s, scale=2.0), _point(problem, seed=20 + s, scale=2.0)
        dist = float((x - y).norm())
        diff = (problem.client_grads(x) - problem.client_grads(y)).norm(dim=1)
        assert bool((diff <= L_i * dist * (1 + 1e-9)).all())
        assert float((problem.grad(x) - problem.grad(y)).norm()) <= problem.L * dist * (1 + 1e-9)


def test_minibatch_gradients_are_unbiased(problem: Problem) -> None:
    x = _point(problem)
    n, K = problem.n, 300
    b = torch.full((n,), 2, dtype=torch.int64)
    exact = problem.client_grads(x)
    draws = torch.stack(
        [
            problem.client_stoch_grads(
                x, b, Keys.derive(7, round=k, client=torch.arange(n), stream="minibatch")
            )
            for k in range(K)
        ]
    )
    mean, var = draws.mean(0), draws.var(0)
    # per client: T_i = ‖mean − ∇f_i‖² / (Σ_c var_c / K), whose expectation is ≈ 1 when the
    # estimator is unbiased (a χ²-like ratio; > 12 has probability < 1e-3 even with one degree
    # of freedom); clients whose minibatches never vary must give the exact gradient
    se2 = var.sum(1) / K
    err2 = ((mean - exact) ** 2).sum(1)
    noisy = se2 > 1e-24 * (1 + (exact**2).sum(1))
    assert bool(noisy.any()), "minibatches of 2 samples never vary: the test would be empty"
    T = err2[noisy] / se2[noisy]
    assert float(T.max()) < 12.0, f"largest T_i = {float(T.max()):.2f}"
    assert bool((err2[~noisy] <= 1e-24 * (1 + (exact[~noisy] ** 2).sum(1))).all())
    # the statistic sees a bias of 4 standard errors per coordinate
    biased = mean + 4.0 * torch.sign(mean - exact) * var.sqrt() / math.sqrt(K)
    assert float((((biased - exact) ** 2).sum(1)[noisy] / se2[noisy]).min()) > 12.0
    # b_i = m_i is the exact gradient
    full = problem.client_stoch_grads(
        x, problem.client_sizes, Keys.derive(1, client=torch.arange(n))
    )
    torch.testing.assert_close(full, exact, rtol=1e-12, atol=1e-15)
