"""Neural networks as problems (issue 15): exact batched oracles, held-out data, unknown constants.

The reference for every gradient is the plainest computation there is: a copy of the module with
``vector_to_parameters(x)``, the client's rows, the loss written from its formula, and
``torch.autograd.grad`` over the module's own parameters, one client at a time.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shrinkgrad.methods import METHODS, Constants, make_method
from shrinkgrad.methods.base import UNKNOWN_L, UnknownConstantError
from shrinkgrad.problems import (
    ModelProblem,
    estimate_smoothness,
    least_squares,
    load,
    logistic_regression,
    make_problem,
    model_problem,
)
from shrinkgrad.problems.model_zoo import keyed_init_, mlp_module
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate


class Custom(torch.nn.Module):
    """A user's module: LayerNorm, GELU, a residual block reusing one matrix twice, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.inp = torch.nn.Linear(5, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.mix = torch.nn.Parameter(torch.randn(7, 7, generator=gen) * 0.3)
        self.out = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.inp(x)))
        h = h + torch.tanh(h @ self.mix) @ self.mix.T
        out: torch.Tensor = self.out(h)
        return out


def custom_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    X = torch.randn(60, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=gen)
    return X, y


#: explicit, unequal and overlapping client index lists (rows of the data)
CUSTOM_PARTS = [list(range(0, 9)), list(range(9, 30)), [31, 2, 44, 5], list(range(32, 44))]


def custom_problem(**kw: object) -> ModelProblem:
    torch.manual_seed(0)
    return model_problem(Custom(), custom_data(), split=CUSTOM_PARTS, test=[50, 51, 52, 59], **kw)  # type: ignore[arg-type]


def per_client_loop(
    p: ModelProblem,
    model: torch.nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    points: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, gradients) of every client with plain autograd on a copy of ``model``."""
    losses, grads = [], []
    for i, x in enumerate(points):
        net = copy.deepcopy(model).double().eval().requires_grad_(True)
        torch.nn.utils.vector_to_parameters(x.clone(), net.parameters())
        rows = torch.from_numpy(p.parts[i])
        out = net(X[rows])
        if p.loss_kind == "cross_entropy":
            loss = F.cross_entropy(out, y[rows])
        elif p.loss_kind == "logistic":
            loss = F.softplus(-y[rows] * out.reshape(-1)).mean()
        else:
            loss = ((out.reshape(-1) - y[rows]) ** 2).mean()
        g = torch.autograd.grad(loss, list(net.parameters()))
        losses.append(loss.detach())
        grads.append(torch.cat([t.reshape(-1) for t in g]))
    return torch.stack(losses), torch.stack(grads)


def dataset_arrays(name: str, shape: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    ds = load(name)
    X = torch.from_numpy(ds.X.toarray())
    if shape:
        X = X.reshape(len(X), *shape)
    y = torch.from_numpy(np.array(ds.y))
    return X, ((y > 0).long() if ds.n_classes == 2 else y.long())


def cases() -> list[tuple[str, ModelProblem, torch.nn.Module, torch.Tensor, torch.Tensor]]:
    mlp = make_problem(
        "mlp[dataset=australian_scale,hidden=6,n_clients=5,split=dirichlet[alpha=0.5,seed=1]]"
    )
    assert isinstance(mlp, ModelProblem)
    cnn = make_problem("cnn[channels=3,n_clients=4,split=dirichlet[alpha=0.3,seed=0],test=0.8]")
    assert isinstance(cnn, ModelProblem)
    user = custom_problem()
    X, y = custom_data()
    return [
        ("mlp", mlp, mlp.module, *dataset_arrays("australian_scale")),
        ("cnn", cnn, cnn.module, *dataset_arrays("digits", (1, 8, 8))),
        ("user module", user, Custom(), X, y),
    ]


@pytest.fixture(scope="module", params=[0, 1, 2], ids=["mlp", "cnn", "user module"])
def case(
    request: pytest.FixtureRequest,
) -> tuple[str, ModelProblem, torch.nn.Module, torch.Tensor, torch.Tensor]:
    return cases()[request.param]


def _points(p: ModelProblem, seed: int) -> torch.Tensor:
    noise = Keys.derive(seed, client=torch.arange(p.n), stream="test").uniform(p.d) - 0.5
    return p.x0() + 0.2 * noise.to(p.dtype)


# --------------------------------------------------------------------------------------------
# the batched oracles equal a per-client autograd loop (float64, 1e-10)
# --------------------------------------------------------------------------------------------
def test_client_grads_equal_a_per_client_autograd_loop(
    case: tuple[str, ModelProblem, torch.nn.Module, torch.Tensor, torch.Tensor],
) -> None:
    _, p, model, X, y = case
    sizes = p.client_sizes.tolist()
    assert len(set(sizes)) > 1, "the case must have unequal client sizes"
    x = _points(p, 0)[0]
    losses, grads = per_client_loop(p, model, X, y, [x] * p.n)
    torch.testing.assert_close(p.client_grads(x), grads, rtol=0, atol=1e-10)
    torch.testing.assert_close(p.client_losses(x), losses, rtol=0, atol=1e-12)
    torch.testing.assert_close(p.grad(x), grads.mean(0), rtol=0, atol=1e-10)
    assert p.loss(x) == pytest.approx(float(losses.mean()), abs=1e-12)
    # a different point per client
    P = _points(p, 1)
    _, at = per_client_loop(p, model, X, y, list(P))
    torch.testing.assert_close(p.client_grads_at(P), at, rtol=0, atol=1e-10)
    # equal rows: client_grads_at is client_grads
    torch.testing.assert_close(
        p.client_grads_at(x.expand(p.n, p.d)), p.client_grads(x), rtol=1e-13, atol=1e-15
    )


def test_chunked_evaluation_equals_one_batch() -> None:
    p = custom_problem()
    q = custom_problem(batch_size=25)  # chunks of 1 client (21 padded rows each)
    x = p.x0()
    torch.testing.assert_close(q.client_grads(x), p.client_grads(x), rtol=1e-13, atol=1e-15)
    assert q.held_out(x) == pytest.approx(p.held_out(x), rel=1e-13)


def test_explicit_split_gives_the_clients_those_rows() -> None:
    p = custom_problem()
    assert p.n == 4 and p.client_sizes.tolist() == [len(r) for r in CUSTOM_PARTS]
    assert [list(r) for r in p.parts] == CUSTOM_PARTS
    assert p.split == "explicit[n_clients=4]" and p.n_test == 4


def test_restricted_problem_is_exact_and_chunked_layouts_too() -> None:
    for bs in (None, 25, 45):
        p = custom_problem(batch_size=bs)
        ids = torch.tensor([3, 1])
        sub = p.restrict(ids)
        x = p.x0()
        assert torch.equal(sub.client_grads(x), p.client_grads(x)[ids])
        assert torch.equal(sub.restrict(torch.tensor([1])).client_grads(x), p.client_grads(x)[1:2])


# --------------------------------------------------------------------------------------------
# the fast path of Linear/activation stacks equals the generic vmap path
# --------------------------------------------------------------------------------------------
def _stack(kind: str) -> tuple[torch.nn.Sequential, str]:
    """Linear/activation stacks on australian_scale (14 features), with the loss they use."""
    L, nn = torch.nn.Linear, torch.nn
    stacks = {
        "relu, cross-entropy": (nn.Sequential(L(14, 6), nn.ReLU(), L(6, 2)), "cross_entropy"),
        "tanh-sigmoid, deep, logistic": (
            nn.Sequential(L(14, 5), nn.Tanh(), L(5, 4, bias=False), nn.Sigmoid(), L(4, 1)),
            "logistic",
        ),
        "dropout, identity, output activation, mse": (
            nn.Sequential(L(14, 3), nn.Dropout(0.5), nn.ReLU(), nn.Identity(), L(3, 1), nn.Tanh()),
            "mse",
        ),
        "one bias-free layer": (nn.Sequential(L(14, 1, bias=False)), "logistic"),
    }
    net, loss = stacks[kind]
    return keyed_init_(net, 4), loss


STACKS = [
    "relu, cross-entropy",
    "tanh-sigmoid, deep, logistic",
    "dropout, identity, output activation, mse",
    "one bias-free layer",
]


@pytest.mark.parametrize("kind", STACKS)
def test_linear_stack_path_equals_the_generic_path(kind: str) -> None:
    net, loss = _stack(kind)
    kw: dict[str, object] = {"split": "dirichlet[alpha=0.5,seed=2]", "n_clients": 7, "loss": loss}
    fast = model_problem(net, "australian_scale", **kw)  # type: ignore[arg-type]
    slow = model_problem(net, "australian_scale", evaluation="vmap", **kw)  # type: ignore[arg-type]
    assert fast.evaluation == "linear_stack" and slow.evaluation == "vmap"
    assert len(set(fast.client_sizes.tolist())) > 1 and len(fast._groups) > 1
    x, P = _points(fast, 6)[0], _points(fast, 7)

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

    close(fast.client_grads(x), slow.client_grads(x))
    strided = torch.stack([x, torch.zeros_like(x)], dim=1)[:, 0]  # a non-contiguous x
    assert not strided.is_contiguous()
    assert torch.equal(fast.client_grads(strided), fast.client_grads(x))
    close(fast.client_grads_at(P), slow.client_grads_at(P))
    close(fast.client_losses(x), slow.client_losses(x))
    for a, b in zip(fast.client_grads_and_losses(x), slow.client_grads_and_losses(x), strict=True):
        close(a, b)
    keys = Keys.derive(1, round=3, client=torch.arange(fast.n), stream="minibatch")
    close(fast.client_stoch_grads(x, 3, keys), slow.client_stoch_grads(x, 3, keys))
    close(fast.client_stoch_grads(P, 2, keys), slow.client_stoch_grads(P, 2, keys))
    # against plain autograd, one client at a time (float64, 1e-10)
    X, y = dataset_arrays("australian_scale")
    yy = y if loss == "cross_entropy" else y.double() * 2 - 1  # the labels ±1 as targets
    _, want = per_client_loop(fast, net, X, yy, list(P))
    torch.testing.assert_close(fast.client_grads_at(P), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("batch_size", [None, 100, 250])
def test_linear_stack_path_chunked_and_restricted_is_exact(batch_size: int | None) -> None:
    """Chunks write into the result in place; a restricted problem's calls keep the full
    layout, so its rows are the full problem's to the bit, on both paths."""
    net, _ = _stack("relu, cross-entropy")
    for split in ("contiguous", "dirichlet[alpha=0.5,seed=2]"):
        p = model_problem(net, "australian_scale", n_clients=7, split=split, batch_size=batch_size)
        assert p.evaluation == "linear_stack"
        q = model_problem(
            net, "australian_scale", n_clients=7, split=split, batch_size=batch_size,
            evaluation="vmap",
        )  # fmt: skip
        assert q.evaluation == "vmap"
        x = p.x0()
        G = p.client_grads(x)
        torch.testing.assert_close(G, q.client_grads(x), rtol=0, atol=1e-12)
        torch.testing.assert_close(G, p.restrict(torch.arange(7)).client_grads(x), rtol=0, atol=0)
        ids = torch.tensor([5, 0, 3])
        sub = p.restrict(ids)
        assert torch.equal(sub.client_grads(x), G[ids])
        assert torch.equal(
            sub.client_grads_at(x.expand(3, p.d)), p.client_grads_at(x.expand(7, p.d))[ids]
        )


def test_only_plain_linear_stacks_take_the_fast_path() -> None:
    L, nn = torch.nn.Linear, torch.nn
    shared = L(14, 14)

    class Subclass(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = super().forward(x) * 2
            return out

    generic = {
        "a layer used twice": nn.Sequential(shared, nn.ReLU(), shared, L(14, 2)),
        "an activation first": nn.Sequential(nn.ReLU(), L(14, 2)),
        "two activations in a row": nn.Sequential(L(14, 4), nn.ReLU(), nn.Tanh(), L(4, 2)),
        "another layer": nn.Sequential(L(14, 4), nn.GELU(), L(4, 2)),
        "a normalisation": nn.Sequential(L(14, 4), nn.BatchNorm1d(4), L(4, 2)),
        "a Sequential subclass": Subclass(L(14, 4), nn.ReLU(), L(4, 2)),
    }
    for why, net in generic.items():
        p = model_problem(net, "australian_scale", n_clients=3, test=0)
        assert p.evaluation == "vmap", why
        X, y = dataset_arrays("australian_scale")
        _, want = per_client_loop(p, net, X, y, [p.x0()] * 3)
        torch.testing.assert_close(p.client_grads(p.x0()), want, rtol=0, atol=1e-10)
    cnn = make_problem("cnn[channels=2,n_clients=2]")
    assert isinstance(cnn, ModelProblem) and cnn.evaluation == "vmap"
    mlp = make_problem("mlp[dataset=australian_scale,hidden=3,depth=2,activation=tanh,n_clients=2]")
    assert isinstance(mlp, ModelProblem) and mlp.evaluation == "linear_stack"
    assert mlp.to(dtype=torch.float32).evaluation == "linear_stack"


# --------------------------------------------------------------------------------------------
# minibatches
# --------------------------------------------------------------------------------------------
def test_minibatches_draw_the_linear_problems_rows() -> None:
    """A bias-free Linear + logistic model problem is logistic regression without regularizer:
    with the same keys both draw the same rows, so their minibatch gradients agree."""
    lin = logistic_regression("australian_scale", n_clients=6, split="shuffled[seed=3]", lam=0.0)
    net = torch.nn.Linear(14, 1, bias=False)
    mod = model_problem(
        net, "australian_scale", n_clients=6, split="shuffled[seed=3]", loss="logistic", test=0
    )
    x = _points(mod, 2)[0]
    keys = Keys.derive(4, round=7, client=torch.arange(6), stream="minibatch")
    b = torch.tensor([1, 2, 3, 5, 8, 13])
    torch.testing.assert_close(
        mod.client_stoch_grads(x, b, keys),
        lin.client_stoch_grads(x, b, keys),
        rtol=1e-12,
        atol=1e-14,
    )
    torch.testing.assert_close(mod.client_grads(x), lin.client_grads(x), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"batch size 0 for client 0 must be in \[1, m_i"):
        mod.client_stoch_grads(x, 0, keys)


# --------------------------------------------------------------------------------------------
# held-out metrics
# --------------------------------------------------------------------------------------------
def test_held_out_metrics_on_the_rows_kept_back() -> None:
    p = make_problem("mlp[dataset=australian_scale,hidden=4,n_clients=3,test=0.25,seed=5]")
    assert isinstance(p, ModelProblem)
    assert p.held_out_columns == ("test_loss", "test_accuracy")
    held = np.concatenate(p.parts)
    assert p.n_test == round(0.25 * 690) and p.n_samples + p.n_test == 690
    X, y = dataset_arrays("australian_scale")
    test_rows = np.setdiff1d(np.arange(690), held)
    assert test_rows.size == p.n_test  # clients and test rows partition the data
    x = _points(p, 3)[0]
    net = copy.deepcopy(p.module)
    torch.nn.utils.vector_to_parameters(x.clone(), net.parameters())
    with torch.no_grad():
        out = net(X[test_rows])
    m = p.held_out(x)
    assert set(m) == set(p.held_out_columns)
    assert m["test_loss"] == pytest.approx(float(F.cross_entropy(out, y[test_rows])), rel=1e-12)
    assert m["test_accuracy"] == float((out.argmax(1) == y[test_rows]).double().mean())
    # another seed keeps other rows back
    q = make_problem("mlp[dataset=australian_scale,hidden=4,n_clients=3,test=0.25,seed=6]")
    assert not np.array_equal(np.concatenate(q.parts), held)


def test_test_rows_as_indices_as_a_pair_or_none() -> None:
    X, y = custom_data()
    p = model_problem(Custom(), (X, y), n_clients=3, test=[0, 1, 2, 3])
    assert p.n_test == 4 and p.n_samples == 56 and 0 not in np.concatenate(p.parts)
    Xt, yt = X[:10] * 2, y[:10]
    q = model_problem(Custom(), (X, y), n_clients=3, test=(Xt, yt))
    assert q.n_test == 10 and q.n_samples == 60
    net = copy.deepcopy(q.module)
    with torch.no_grad():
        want = float(F.cross_entropy(net(Xt), yt))
    assert q.held_out(q.x0())["test_loss"] == pytest.approx(want, rel=1e-12)
    r = model_problem(Custom(), (X, y), n_clients=3, test=0)
    assert r.held_out_columns == () and r.held_out(r.x0()) == {} and r.n_samples == 60
    s = model_problem(torch.nn.Linear(5, 1), (X, X[:, 0]), n_clients=2, loss="mse")
    assert s.held_out_columns == ("test_loss",)
    # a fractional test set with explicit client lists comes from the rows no client holds
    t = model_problem(Custom(), (X, y), split=CUSTOM_PARTS, test=0.05)
    assert t.n_test == 3 and not np.isin(t._test.rows, np.concatenate(CUSTOM_PARTS)).any()  # type: ignore[union-attr]


def test_held_out_labels_outside_the_models_classes_are_refused_when_built() -> None:
    """A held-out label the model has no output for would make every held-out evaluation (so
    every simulate) fail inside torch; the problem refuses it when it is built, naming the
    range."""
    X, y = custom_data()
    classes = 3  # Custom's outputs
    bad = y[:10].clone()
    bad[3] = classes + 2
    with pytest.raises(
        ValueError, match=rf"held-out labels run from 0 to {classes + 2}.*0..{classes - 1}"
    ):
        model_problem(Custom(), (X, y), n_clients=3, test=(X[:10], bad))
    bad[3] = -1
    with pytest.raises(ValueError, match=r"the test pair: cross_entropy needs integer class"):
        model_problem(Custom(), (X, y), n_clients=3, test=(X[:10], bad))


def test_test_rows_that_a_client_holds_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"test rows and the explicit client index lists overlap"):
        model_problem(Custom(), custom_data(), split=CUSTOM_PARTS, test=[5, 50])
    with pytest.raises(ValueError, match=r"test=0.5 asks for 30 held-out rows but only 16 rows"):
        model_problem(Custom(), custom_data(), split=CUSTOM_PARTS, test=0.5)


# --------------------------------------------------------------------------------------------
# unknown and estimated constants
# --------------------------------------------------------------------------------------------
def test_unknown_constants_are_a_state() -> None:
    p = custom_problem()
    assert p.L is None and p.L_i is None and not p.constants_known
    for attr in ("L_AM", "L_QM", "L_max", "L_var"):
        with pytest.raises(
            UnknownConstantError, match=UNKNOWN_L.replace("(", r"\(").replace(")", r"\)")
        ):
            getattr(p, attr)
    info = p.info()
    assert info["problem"] == "custom" and info["n_clients"] == 4 and info["d"] == p.d
    assert "L unknown" in repr(p)
    with pytest.raises(UnknownConstantError, match="L is not known for this problem"):
        simulate(p, "ef21", "top_k[k=3]", stepsize="theory", rounds=1)
    c = Constants.of(p)
    assert c.L is None and c.L_i is None and not c.estimated


def test_smoothness_estimate_equals_the_exact_L_i_of_least_squares() -> None:
    """A bias-free Linear layer with mse is least squares: its Hessian 2A_iᵀA_i/m_i is constant,
    and the estimate at any x must be the exact L_i (and L) of the linear problem."""
    lin = least_squares("australian_scale", n_clients=6, split="dirichlet[alpha=1.0,seed=4]")
    net = torch.nn.Linear(14, 1, bias=False)
    mod = model_problem(
        net,
        "australian_scale",
        n_clients=6,
        split="dirichlet[alpha=1.0,seed=4]",
        loss="mse",
        test=0,
    )
    assert mod.client_sizes.tolist() == lin.client_sizes.tolist()
    est = estimate_smoothness(mod, _points(mod, 5)[0], iters=500, tol=1e-10)
    assert est.method == "hvp" and est.converged
    assert lin.L_i is not None and lin.L is not None
    torch.testing.assert_close(est.L_i, lin.L_i, rtol=1e-2, atol=0)
    assert pytest.approx(lin.L, rel=1e-2) == est.L
    # the estimate is exact here up to the power iteration's convergence (far below 1%)
    torch.testing.assert_close(est.L_i, lin.L_i, rtol=1e-6, atol=0)


def test_finite_difference_estimate_on_a_linear_problem() -> None:
    """Problems without client_hvps use central differences; at x = 0 the logistic Hessian
    A_iᵀA_i/(4m_i) + 2λI attains L_i (docs/problems.md §4), elsewhere it is below."""
    lin = logistic_regression("australian_scale", n_clients=4)
    assert lin.L_i is not None
    est = estimate_smoothness(lin, torch.zeros(lin.d, dtype=torch.float64), iters=500, tol=1e-10)
    assert est.method == "finite differences"
    torch.testing.assert_close(est.L_i, lin.L_i, rtol=1e-5, atol=0)
    far = estimate_smoothness(lin, torch.full((lin.d,), 2.0, dtype=torch.float64))
    assert bool((far.L_i <= lin.L_i * (1 + 1e-6)).all()) and bool((far.L_i < 0.9 * lin.L_i).any())


def test_estimated_constants_drive_theory_steps_and_ef21_w_weights() -> None:
    p = make_problem("mlp[dataset=australian_scale,hidden=6,n_clients=5,split=by_label]")
    est = estimate_smoothness(p)
    q = est.apply(p)
    assert q.constants_estimated and not p.constants_estimated and p.L_i is None
    assert q.L == est.L and torch.equal(q.L_i, est.L_i)  # type: ignore[arg-type]
    bound = make_method("ef21_w").bind(q, "top_k[k=8]", "theory")
    assert bound.cfg.stepsize_rule.endswith("(estimated L)")
    torch.testing.assert_close(bound.cfg.weights, est.L_i / est.L_i.sum(), rtol=1e-15, atol=0)
    run = simulate(q, "ef21_w", "top_k[k=8]", stepsize="theory*4", rounds=60, log_every=20)
    assert run.status == "completed"
    assert run.table["loss"].iloc[-1] < run.table["loss"].iloc[0]
    assert set(run.table["stepsize_rule"]) == {"stepsize_ef21_reloaded*4(estimated L)"}
    # the problem without estimates refuses EF21-W (its weights need L_i)
    with pytest.raises(UnknownConstantError, match="ef21_w weighs the clients"):
        make_method("ef21_w").bind(p, "top_k[k=8]", 0.1)


# --------------------------------------------------------------------------------------------
# every registered method runs on a model problem with a numeric step
# --------------------------------------------------------------------------------------------
def _compressor_for(requires: str, d: int) -> str | None:
    return {"none": None, "unbiased": f"rand_k[k={d // 4}]", "contractive": "top_k[k=10]"}[requires]


def test_every_registered_method_runs_on_a_model_problem() -> None:
    p = make_problem("mlp[dataset=australian_scale,hidden=6,n_clients=4]")
    q = estimate_smoothness(p, iters=30).apply(p)  # for the methods that weigh by L_i
    ran = []
    for name in METHODS.names():
        method = make_method(name)
        comp = _compressor_for(method.requires, p.d)
        try:
            method.bind(p, comp, 0.05)
            target = p
        except UnknownConstantError:
            target = q  # EF21-W and its variants: weights from the estimated L_i
        res = simulate(target, name, comp, stepsize=0.05, rounds=6, log_every=3)
        assert res.status == "completed" and np.isfinite(res.table["loss"]).all(), name
        assert not torch.equal(res.x, p.x0()), f"{name} did not move"
        ran.append(name)
    assert ran == METHODS.names()


# --------------------------------------------------------------------------------------------
# registry, keyed initialisation, conversion
# --------------------------------------------------------------------------------------------
def test_registered_specs_are_keyed_and_canonical() -> None:
    spec = "mlp[dataset=australian_scale,n_clients=4,hidden=5]"
    torch.manual_seed(123)  # the global generator plays no part
    a = make_problem(spec)
    torch.manual_seed(7)
    b = make_problem(spec)
    assert torch.equal(a.x0(), b.x0()) and a.info()["spec"] == spec
    c = make_problem("mlp[dataset=australian_scale,n_clients=4,hidden=5,seed=1]")
    assert not torch.equal(a.x0(), c.x0())
    net = mlp_module(14, 2, 5)
    assert torch.equal(
        torch.nn.utils.parameters_to_vector(keyed_init_(net, 0).parameters()), a.x0()
    )
    w = a.module[0].weight  # type: ignore[index]
    assert float(w.abs().max()) <= 1 / np.sqrt(14)
    cnn = make_problem("cnn[n_clients=20,split=by_label]")
    assert cnn.d == 1898 and cnn.n == 20 and cnn.info()["loss"] == "cross_entropy"


def test_float32_copy_and_simulate_with_a_dtype() -> None:
    p = custom_problem()
    q = p.to(dtype=torch.float32)
    assert q.dtype == torch.float32 and q.client_grads(q.x0()).dtype == torch.float32
    torch.testing.assert_close(
        q.client_grads(q.x0()).double(), p.client_grads(p.x0()), rtol=1e-4, atol=1e-5
    )
    res = simulate(p, "gd", None, stepsize=0.1, rounds=3, dtype="float32")
    assert res.x.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# user mistakes: one clear line each
# --------------------------------------------------------------------------------------------
def test_user_mistakes_are_clear_errors() -> None:
    X, y = custom_data()
    with pytest.raises(ValueError, match=r"loss must be one of 'cross_entropy', 'logistic', 'mse'"):
        model_problem(Custom(), (X, y), n_clients=2, loss="hinge")
    with pytest.raises(
        ValueError, match=r"the logistic loss needs two classes \(±1\); this dataset has 10"
    ):
        model_problem(torch.nn.Linear(64, 1), "digits", n_clients=2, loss="logistic")
    with pytest.raises(ValueError, match="mse on class indices of a 10-class dataset"):
        model_problem(torch.nn.Linear(64, 1), "digits", n_clients=2, loss="mse")
    with pytest.raises(ValueError, match=r"the logistic loss needs labels −1 or \+1"):
        model_problem(torch.nn.Linear(5, 1), (X, y), n_clients=2, loss="logistic")
    with pytest.raises(
        ValueError, match=r"the model fails on a batch of inputs of shape \(2, 64\)"
    ):
        model_problem(make_problem("cnn[n_clients=2]").module, "digits", n_clients=2)
    with pytest.raises(
        ValueError, match="output does not fit the loss: the logistic loss needs one"
    ):
        model_problem(torch.nn.Linear(14, 2), "australian_scale", n_clients=2, loss="logistic")
    with pytest.raises(ValueError, match="the model has 2 outputs but the labels have 3 classes"):
        model_problem(torch.nn.Linear(5, 2), (X, y), n_clients=2)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        model_problem(lambda a: a, (X, y), n_clients=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the model has no parameters"):
        model_problem(torch.nn.ReLU(), (X, y), n_clients=2)
    with pytest.raises(ValueError, match=r"test must be a fraction in \[0, 1\)"):
        model_problem(Custom(), (X, y), n_clients=2, test=1.5)
    with pytest.raises(ValueError, match="n_clients is required with split 'contiguous'"):
        model_problem(Custom(), (X, y))
    with pytest.raises(ValueError, match=r"batch_size .* must be a positive integer"):
        model_problem(Custom(), (X, y), n_clients=2, batch_size=0)
    with pytest.raises(ValueError, match=r"cnn needs image data; dataset 'a1a' has no image shape"):
        make_problem("cnn[dataset=a1a,n_clients=2]")
    p = custom_problem()
    with pytest.raises(ValueError, match=rf"x must have shape \({p.d},\)"):
        p.client_grads(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="x contains NaN or inf"):
        p.client_grads(torch.full((p.d,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"input_shape=.* does not fit the 64 values"):
        model_problem(torch.nn.Linear(64, 10), "digits", n_clients=2, input_shape=(1, 7, 7))


# --------------------------------------------------------------------------------------------
# a sweep config names a model problem like any other
# --------------------------------------------------------------------------------------------
SWEEP = """
name = "mlp-sweep"
[problem]
name = "mlp"
dataset = "australian_scale"
hidden = 4
n_clients = 3
[problem.sweep]
split = ["contiguous", "by_label"]
[run]
rounds = 4
log_every = 2
[grid]
methods = ["ef21", "dcgd[biased=true]"]
compressors = ["top_k[k=5]"]
stepsizes = [0.1]
"""


def test_a_sweep_config_runs_a_model_problem(tmp_path: Path) -> None:
    from shrinkgrad.experiments import run_experiment
    from shrinkgrad.experiments.config import loads_config

    res = run_experiment(loads_config(SWEEP), tmp_path / "out", jobs=1, progress=False)
    table = res.table
    assert res.complete and set(table["method"]) == {"ef21", "dcgd[biased=true]"}
    assert len(set(table["problem_label"])) == 2 and set(table["round"]) == {0, 2, 4}
    assert table["L"].isna().all() and table["L_AM"].isna().all()  # unknown, not invented
    assert np.isfinite(table["loss"]).all()
    theory = loads_config(SWEEP.replace("stepsizes = [0.1]", 'stepsizes = ["theory"]'))
    with pytest.raises(ValueError, match=r"ef21: L is not known for this problem; pass a number"):
        run_experiment(theory, tmp_path / "theory", jobs=1, progress=False)


def test_an_unknown_evaluation_is_refused_in_one_line_and_vmap_survives_a_copy() -> None:
    net, _ = _stack("relu, cross-entropy")
    with pytest.raises(ValueError, match=r"evaluation must be one of 'auto', 'vmap', got 'fast'"):
        model_problem(net, "australian_scale", n_clients=3, evaluation="fast")
    p = model_problem(net, "australian_scale", n_clients=3, evaluation="vmap")
    assert p.evaluation == "vmap" and p.to(dtype="float32").evaluation == "vmap"
    assert model_problem(net, "australian_scale", n_clients=3).to(dtype="float32").evaluation == (
        "linear_stack"
    )


def test_too_many_clients_for_the_training_rows_names_the_held_out_part() -> None:
    """digits has 1797 rows; test=0.999 leaves 2 for the clients: the message says test= holds
    the others back, so that the user sees which setting to change."""
    with pytest.raises(ValueError, match=r"exceeds the 2 samples.*test=0.999 holds back 1795 of"):
        make_problem("mlp[dataset=digits,n_clients=3,test=0.999]")


def test_a_model_with_non_finite_parameters_is_refused_naming_the_parameter() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 3))
    torch.nn.init.constant_(net[0].weight, float("inf"))
    with pytest.raises(ValueError, match=r"parameter '0.weight' has non-finite entries"):
        model_problem(net, custom_data(), n_clients=2)
