"""Model problems: hooks, the exact logistic loss, a dtype-free init, the theory report and the
CNN's size (stop 35's model-problem audit). Every reference is computed here from its
formula."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shrinkgrad.cli.theory import theory_report
from shrinkgrad.compressors import make_compressor
from shrinkgrad.problems import (
    ModelProblem,
    estimate_smoothness,
    logistic_regression,
    make_problem,
    model_problem,
    model_zoo,
)
from shrinkgrad.rng import Keys

nn = torch.nn


# --------------------------------------------------------------------------------------------
# finding 2: hooks send a Linear stack to the generic path
# --------------------------------------------------------------------------------------------
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(40, 6, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (40,), generator=gen
    )


PARTS = [np.arange(0, 15), np.arange(15, 40)]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def _scale_output(m: nn.Module, inputs: object, out: torch.Tensor) -> torch.Tensor:
    return 2.0 * out


def _shift_input(m: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (inputs[0] + 0.5,)


def _global_scale(m: nn.Module, inputs: object, out: object) -> object:
    return 2.0 * out if isinstance(m, nn.Linear) else None  # type: ignore[operator]


def _hook(kind: str, net: nn.Sequential) -> Callable[[], None]:
    """Register the hook ``kind`` names; return what removes a global one (the others live on
    ``net`` and its copies only)."""
    if kind == "a forward hook on a layer":
        net[0].register_forward_hook(_scale_output)
    elif kind == "a forward pre-hook on the Sequential":
        net.register_forward_pre_hook(_shift_input)
    else:
        return nn.modules.module.register_module_forward_hook(_global_scale).remove
    return lambda: None


@contextmanager
def _hooked(kind: str, net: nn.Sequential) -> Iterator[None]:
    undo = _hook(kind, net)
    try:
        yield
    finally:
        undo()


def _autograd_loop(
    net: nn.Module, X: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per client: the module itself called on its rows (so its hooks run), autograd."""
    losses, grads = [], []
    for rows in PARTS:
        model = copy.deepcopy(net)
        loss = F.cross_entropy(model(X[rows]), y[rows])
        grads.append(
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
        )
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(grads)


@pytest.mark.parametrize(
    "kind",
    ["a forward hook on a layer", "a forward pre-hook on the Sequential", "a global forward hook"],
)
def test_a_hooked_linear_stack_computes_the_modules_function(kind: str) -> None:
    X, y = _data()
    net = _net()
    with _hooked(kind, net):
        p = model_problem(net, (X, y), split=PARTS, test=0)
        assert p.evaluation == "vmap"
        want_f, want_g = _autograd_loop(net, X, y)
        x = p.x0()
        torch.testing.assert_close(p.client_losses(x), want_f, rtol=0, atol=1e-12)
        torch.testing.assert_close(p.client_grads(x), want_g, rtol=0, atol=1e-12)
        assert p.loss(x) == pytest.approx(float(want_f.mean()), rel=0, abs=1e-12)
    # the hook changes the function (so the checks above can tell the paths apart) ...
    if kind == "a global forward hook":
        plain_f, _ = _autograd_loop(net, X, y)
        assert float((plain_f - want_f).abs().max()) > 1e-3
        # ... and once the global hook is gone the plain stack takes the fast path again
        assert model_problem(net, (X, y), split=PARTS, test=0).evaluation == "linear_stack"
    else:
        plain_f, _ = _autograd_loop(_net(), X, y)
        assert float((plain_f - want_f).abs().max()) > 1e-3
    assert model_problem(_net(), (X, y), split=PARTS, test=0).evaluation == "linear_stack"


# --------------------------------------------------------------------------------------------
# finding 4: the logistic loss is log(1 + e^{−y h}) at every margin, on both paths
# --------------------------------------------------------------------------------------------
def _exact_softplus(z: float) -> float:
    """log(1 + e^z) in float64 without overflow or a linear branch."""
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def test_logistic_loss_is_exact_beyond_softplus_threshold() -> None:
    # margins −y·h from −40 to 40, most beyond softplus's threshold 20 on either side
    a = np.array([-40.0, -30.0, -25.0, -21.0, -19.0, -3.0, 0.5, 3.0, 19.0, 21.0, 25.0, 30.0, 40.0])
    y = np.where(np.arange(len(a)) % 2 == 0, 1.0, -1.0)
    X = torch.tensor(a, dtype=torch.float64).reshape(-1, 1)
    net = nn.Sequential(nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0)
    kw: dict[str, object] = {"split": [np.arange(len(a))], "loss": "logistic", "test": 0}
    fast = model_problem(net, (X, torch.tensor(y)), **kw)  # type: ignore[arg-type]
    slow = model_problem(net, (X, torch.tensor(y)), evaluation="vmap", **kw)  # type: ignore[arg-type]
    assert fast.evaluation == "linear_stack" and slow.evaluation == "vmap"
    x = fast.x0()
    # f = mean log(1 + e^{−y a w}), ∇f = mean −y a σ(−y a w) at w = 1
    z = -y * a
    f = float(np.mean([_exact_softplus(v) for v in z]))
    g = float(np.mean([-yy * aa * _sigmoid(v) for yy, aa, v in zip(y, a, z, strict=True)]))
    for p in (fast, slow):
        assert float(p.client_losses(x)[0]) == pytest.approx(f, rel=1e-15, abs=0)
        assert p.loss(x) == pytest.approx(f, rel=1e-15, abs=0)
        assert float(p.client_grads(x)[0, 0]) == pytest.approx(g, rel=1e-14, abs=1e-15)
    # docs/problems.md §10: the two paths agree to 1e-12, here where softplus was linear
    torch.testing.assert_close(fast.client_grads(x), slow.client_grads(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(fast.client_losses(x), slow.client_losses(x), rtol=0, atol=1e-12)
    # and the Hessian-vector products (forward over reverse mode) still work: f'' = mean a² σ σ'
    h = float(
        np.mean([aa * aa * _sigmoid(v) * (1 - _sigmoid(v)) for aa, v in zip(a, z, strict=True)])
    )
    hv = slow.client_hvps(x, torch.ones(1, 1, dtype=torch.float64))
    assert float(hv.reshape(-1)[0]) == pytest.approx(h, rel=1e-12, abs=1e-15)


# --------------------------------------------------------------------------------------------
# finding 5: the registered networks' x0 does not depend on torch's default dtype
# --------------------------------------------------------------------------------------------
def _keyed_x0(module: nn.Module, seed: int) -> torch.Tensor:
    """docs/problems.md §10: parameter k uniform on ±1/√fan_in from Keys.derive(seed, client=k,
    stream="model_init"), stored in float32."""
    out = []
    for k, (name, p) in enumerate(module.named_parameters()):
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        fan_in = owner.weight[0].numel()  # type: ignore[index]
        u = Keys.derive(seed, client=k, stream="model_init").uniform(p.numel())
        out.append(((2.0 * u - 1.0) / math.sqrt(fan_in)).to(torch.float32).to(torch.float64))
    return torch.cat(out)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize(
    "spec",
    ["mlp[dataset=australian_scale,n_clients=4,hidden=5,seed=3]", "cnn[n_clients=4,channels=2]"],
)
def test_the_registered_networks_x0_ignores_the_default_dtype(spec: str) -> None:
    p32 = make_problem(spec)
    with _default_dtype(torch.float64):
        p64 = make_problem(spec)
    assert isinstance(p32, ModelProblem) and isinstance(p64, ModelProblem)
    seed = 3 if "seed=3" in spec else 0
    want = _keyed_x0(p32.module, seed)
    assert torch.equal(p32.x0(), want)  # the values the networks have always had
    assert torch.equal(p64.x0(), want)


# --------------------------------------------------------------------------------------------
# finding 3: the theory report takes a compressor spec, as its error message suggests
# --------------------------------------------------------------------------------------------
def test_theory_report_takes_a_compressor_spec_string() -> None:
    lin = logistic_regression("australian_scale", n_clients=4)
    assert theory_report(lin, "top_k[k=1]") == theory_report(lin, make_compressor("top_k[k=1]"))
    net = make_problem("mlp[dataset=australian_scale,n_clients=4,hidden=3]")
    est = estimate_smoothness(net).apply(net)
    report = theory_report(est, "top_k[k=1]")
    assert report == theory_report(est, make_compressor("top_k[k=1]"))
    assert report["compressor"]["compressor"] == "top_k[k=1]"


# --------------------------------------------------------------------------------------------
# finding 6: the CNN's parameter count in model_zoo's docstring
# --------------------------------------------------------------------------------------------
def test_the_documented_cnn_size_is_its_size() -> None:
    doc = model_zoo.__doc__ or ""
    m = re.search(r"\(([\d,]+) parameters at channels = 8 on 8×8 digits", doc)
    assert m is not None
    c, classes = 8, 10
    # conv 3×3 1→c, conv 3×3 c→2c, linear 2c·2·2 → 10, each with biases
    d = (9 * 1 * c + c) + (9 * c * 2 * c + 2 * c) + (2 * c * 2 * 2 * classes + classes)
    assert int(m.group(1).replace(",", "")) == d == make_problem("cnn[n_clients=4]").d
