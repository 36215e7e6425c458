"""Audit of the checkpoint fingerprint: two runs that differ in one thing only must not share a
checkpoint, and the same run built again must resume it bit for bit.

Each pair below differs in exactly one attribute that changes f or the run's table. The test
first checks that it does (the two uninterrupted runs give different tables), then that a
checkpoint of the first is refused by the second in one line naming the fingerprint entry that
tells them apart, and that the first run, built again from scratch, resumes it and ends with the
uninterrupted run's table. The pairs under "already identified" held before this audit; the
others (a linear problem's loss under a custom name, a model's own forward code, settings and
hooks, a custom loss, a model changed in place after its first run, a held-out pair changed by
its owner, the stopping rules, compressors built directly, EF21-W's weights) did not.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from shrinkgrad.compressors import RandK, TopK
from shrinkgrad.problems import (
    LinearModelProblem,
    ModelProblem,
    Problem,
    least_squares,
    model_problem,
)
from shrinkgrad.problems.base import digest_arrays
from shrinkgrad.problems.model_losses import LOSSES
from shrinkgrad.sim import Divergence, SimulationInterrupted, simulate
from shrinkgrad.sim.engine import setup_run
from shrinkgrad.sim.options import RunOptions

N, D, CLIENTS = 40, 6, 4
BASE: dict[str, Any] = dict(method="ef21", compressor="top_k[k=2]", stepsize=0.1, seed=0)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    y = np.where(rng.standard_normal(N) > 0, 1.0, -1.0)
    return X, y


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    X, y = _data()
    return torch.from_numpy(X), torch.from_numpy((y > 0).astype(np.int64))


def _model(net: torch.nn.Module, **kw: Any) -> Problem:
    return model_problem(net, _pair(), n_clients=CLIENTS, test=0, **kw)


# -- model classes: two of each pair share their class name, repr, parameters and x⁰ -----------
class _TanhNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc.forward(x))


class _ReluNet(_TanhNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc.forward(x))


class _HalfNet(_TanhNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc.forward(x) * 0.5


class _DoubleNet(_TanhNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc.forward(x) * 2.0


for _cls in (_TanhNet, _ReluNet, _HalfNet, _DoubleNet):  # a user's script edited between runs
    _cls.__name__ = _cls.__qualname__ = "Net"


class _Scaled(torch.nn.Module):
    """A setting kept as a plain attribute: not a parameter, a buffer, nor in ``repr``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(D, 2)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc.forward(x) * self.scale


def _sequential(hook: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    if hook:
        net[1].register_forward_hook(_double_output)
    return net


def _double_output(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return 2.0 * out


def _twice_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2.0 * F.cross_entropy(out, y, reduction="none")


#: cross-entropy under its own name, with another formula (the user's ModelLoss)
TWICE_CE = dataclasses.replace(LOSSES["cross_entropy"], per_sample=_twice_ce, output_grad=None)


def _linear(loss: str = "logistic", parts: Any = None, **kw: Any) -> LinearModelProblem:
    X, y = _data()
    parts = np.array_split(np.arange(N), CLIENTS) if parts is None else parts
    kw = {"lam": 0.1, **kw}
    return LinearModelProblem(X, y, parts, loss=loss, dataset="mine", **kw)  # type: ignore[arg-type]


#: another client split of the same rows (client sizes 4, 8, 12, 16)
OTHER_PARTS = np.split(np.random.default_rng(3).permutation(N), [4, 12, 24])


def _reweighted() -> Problem:
    p = _linear()
    assert p.L_i is not None
    return p.with_constants(p.L, p.L_i * torch.linspace(1.0, 4.0, CLIENTS, dtype=torch.float64))


def _diverging(**kw: Any) -> tuple[Problem, dict[str, Any]]:
    """GD at 2.5/L on least squares: the error grows 1.5× a round, so the default rule stops
    the run (the loss test), while a run without growth tests goes on (finite values)."""
    p = least_squares("australian_scale", n_clients=4)
    assert p.L is not None
    run = {"method": "gd", "compressor": None, "stepsize": 2.5 / p.L, "rounds": 60}
    return p, {**run, **kw}


# (label, build run A, build run B, the fingerprint entry that tells them apart); a build returns
# the problem (built afresh) and simulate's other arguments
Build = Callable[[], tuple[Problem, dict[str, Any]]]
NEW: list[tuple[str, Build, Build, str]] = [
    (
        "linear loss under a custom name",
        lambda: (_linear("logistic", name="mine"), {}),
        lambda: (_linear("squared", name="mine"), {}),
        "problem.loss",
    ),
    (
        "custom forward: another function",
        lambda: (_model(_TanhNet()), {}),
        lambda: (_model(_ReluNet()), {}),
        "problem.data",
    ),
    (
        "custom forward: another constant",
        lambda: (_model(_HalfNet()), {}),
        lambda: (_model(_DoubleNet()), {}),
        "problem.data",
    ),
    (
        "module setting as a plain attribute",
        lambda: (_model(_Scaled(0.5)), {}),
        lambda: (_model(_Scaled(2.0)), {}),
        "problem.data",
    ),
    (
        "forward hook",
        lambda: (_model(_sequential()), {}),
        lambda: (_model(_sequential(hook=True)), {}),
        "problem.data",
    ),
    (
        "custom loss under a registered name",
        lambda: (_model(_sequential()), {}),
        lambda: (_model(_sequential(), loss=TWICE_CE), {}),
        "problem.data",
    ),
    (
        "tolerance",
        lambda: (_linear(), {"tol": 1e-2, "rounds": 40}),
        lambda: (_linear(), {"rounds": 40}),
        "tol",
    ),
    (
        "divergence rule",
        lambda: _diverging(),
        lambda: _diverging(divergence_factor=None),
        "divergence",
    ),
    (
        "compressor built directly",
        lambda: (_linear(), {"compressor": TopK(2)}),
        lambda: (_linear(), {"compressor": TopK(4)}),
        "compressor.params",
    ),
    (
        "compressor built directly: shared seed",
        lambda: (_linear(), {"method": "dcgd", "compressor": RandK(2)}),
        lambda: (_linear(), {"method": "dcgd", "compressor": RandK(2, shared_seed=True)}),
        "compressor.params",
    ),
    (
        "EF21-W weights from other constants",
        lambda: (_linear(), {"method": "ef21_w"}),
        lambda: (_reweighted(), {"method": "ef21_w"}),
        "client_weights",
    ),
]

#: pairs the fingerprint told apart before this audit (kept as its coverage)
KNOWN: list[tuple[str, Build, Build, str]] = [
    (
        "seed",
        lambda: (_linear(), {"method": "dcgd", "compressor": "rand_k[k=2]"}),
        lambda: (_linear(), {"method": "dcgd", "compressor": "rand_k[k=2]", "seed": 1}),
        "seed",
    ),
    ("step size", lambda: (_linear(), {}), lambda: (_linear(), {"stepsize": 0.2}), "stepsize"),
    (
        "participation",
        lambda: (_linear(), {"method": "ef21_pp[p=0.5]"}),
        lambda: (_linear(), {"method": "ef21_pp[p=0.7]"}),
        "method",
    ),
    (
        "minibatch",
        lambda: (_linear(), {"method": "ef21_sgd[b=2]"}),
        lambda: (_linear(), {"method": "ef21_sgd[b=3]"}),
        "method",
    ),
    (
        "compressor parameter",
        lambda: (_linear(), {}),
        lambda: (_linear(), {"compressor": "top_k[k=3]"}),
        "compressor",
    ),
    ("regularisation", lambda: (_linear(), {}), lambda: (_linear(lam=0.2), {}), "problem.lam"),
    (
        "client split",
        lambda: (_linear(split="even"), {}),
        lambda: (_linear(parts=OTHER_PARTS, split="other"), {}),
        "problem.split",
    ),
    ("x0", lambda: (_linear(), {}), lambda: (_linear(), {"x0": np.full(D, 0.1)}), "x0_sha1"),
    (
        "initialisation of a network",
        lambda: (_model(_sequential()), {}),
        lambda: (_model(_reinit()), {}),
        "x0_sha1",
    ),
    ("log_every", lambda: (_linear(), {}), lambda: (_linear(), {"log_every": 2}), "log_every"),
    (
        "wire dtype",
        lambda: (_linear(), {}),
        lambda: (_linear(), {"wire_dtype": torch.float16}),
        "wire_dtype",
    ),
    ("dtype", lambda: (_linear(), {}), lambda: (_linear(dtype="float32"), {}), "dtype"),
]


def _reinit() -> torch.nn.Module:
    """The network of :func:`_sequential` with another initialisation of its first layer."""
    net = _sequential()
    torch.manual_seed(1)
    first = next(iter(net.children()))
    assert isinstance(first, torch.nn.Linear)
    first.reset_parameters()
    return net


def _run(build: Build, path: Path | None = None, **over: Any) -> Any:
    problem, kw = build()
    args = {**BASE, "rounds": 6, **kw, **over}
    return simulate(problem, checkpoint=path, **args)


def _equal_runs(a: Any, b: Any) -> bool:
    cols = [c for c in a.table.columns if c != "time_s"]
    same_shape = a.table.shape == b.table.shape
    return same_shape and a.table[cols].equals(b.table[cols]) and torch.equal(a.x, b.x)


def _same(a: Any, b: Any) -> None:
    cols = [c for c in a.table.columns if c != "time_s"]
    pd.testing.assert_frame_equal(a.table[cols], b.table[cols], check_exact=True)
    assert (a.status, a.message) == (b.status, b.message)
    assert torch.equal(a.x, b.x)


def _check_pair(a: Build, b: Build, key: str, tmp_path: Path) -> None:
    full_a, full_b = _run(a), _run(b)
    # the attribute matters: the two uninterrupted runs differ (their tables or their iterates)
    assert not _equal_runs(full_a, full_b)
    rounds = int(full_a.rounds)
    path = tmp_path / "run.pt"

    def stop(r: int, state: object) -> None:
        if r == min(3, rounds - 1):
            raise KeyboardInterrupt

    with pytest.raises(SimulationInterrupted):
        _run(a, path, callback=stop)
    with pytest.raises(ValueError, match=rf"belongs to a different run \(.*{key}: ") as e:
        _run(b, path)
    assert "\n" not in str(e.value) and "another checkpoint path" in str(e.value)
    # the run it belongs to, built again, resumes it to the uninterrupted run's end
    _same(_run(a, path), full_a)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(("label", "a", "b", "key"), NEW, ids=[p[0] for p in NEW])
def test_a_checkpoint_of_a_run_differing_in_one_thing_is_refused(
    label: str, a: Build, b: Build, key: str, tmp_path: Path
) -> None:
    _check_pair(a, b, key, tmp_path)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(("label", "a", "b", "key"), KNOWN, ids=[p[0] for p in KNOWN])
def test_what_the_fingerprint_already_told_apart(
    label: str, a: Build, b: Build, key: str, tmp_path: Path
) -> None:
    _check_pair(a, b, key, tmp_path)


def test_the_stopping_rules_decide_the_returned_result(tmp_path: Path) -> None:
    """Before the fix a run without tol returned the 'converged' checkpoint of a run with tol
    at once: a table that stops where the run asked for does not."""
    path = tmp_path / "run.pt"
    with_tol = simulate(_linear(), checkpoint=path, **{**BASE, "rounds": 40, "tol": 1e-2})
    assert with_tol.status == "converged" and with_tol.rounds < 40
    without = simulate(_linear(), **{**BASE, "rounds": 40})
    assert without.status == "completed" and without.rounds == 40
    with pytest.raises(ValueError, match=r"tol: saved 0\.01 vs now None"):
        simulate(_linear(), checkpoint=path, **{**BASE, "rounds": 40})


# -- a problem changed after its first run ----------------------------------------------------
def _bn_problem() -> Problem:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(D), torch.nn.Linear(D, 2))
    return _model(net)


_HANDLES: list[Any] = []  # the hook handles of "hook added"

CHANGES: dict[str, tuple[Callable[[], Problem], Callable[[Any], None], Callable[[Any], None]]] = {
    # (build, change it in place, change it back)
    "buffer changed in place": (
        _bn_problem,
        lambda p: p.module[0].running_mean.add_(0.5),
        lambda p: p.module[0].running_mean.zero_(),
    ),
    "module setting rebound": (
        lambda: _model(_Scaled(0.5)),
        lambda p: setattr(p.module, "scale", 2.0),
        lambda p: setattr(p.module, "scale", 0.5),
    ),
    "hook added": (
        lambda: _model(_Scaled(0.5)),
        lambda p: _HANDLES.append(p.module.register_forward_hook(_double_output)),
        lambda p: _HANDLES.pop().remove(),
    ),
}


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_a_model_problem_changed_after_its_first_run_is_told_apart(
    how: str, tmp_path: Path
) -> None:
    build, change, undo = CHANGES[how]
    p = build()
    path = tmp_path / "run.pt"
    args = {**BASE, "rounds": 3}
    simulate(p, checkpoint=path, **args)
    before = p.data_digest()
    change(p)
    # the changed problem is another f: its uninterrupted run differs from the original's
    assert not torch.equal(
        simulate(p, **{**args, "rounds": 5}).x, simulate(build(), **{**args, "rounds": 5}).x
    )
    assert p.data_digest() != before
    with pytest.raises(ValueError, match=r"belongs to a different run \(problem\.data: "):
        simulate(p, checkpoint=path, **{**args, "rounds": 5})
    # the digest is that of what the problem now is: the same as a problem built so
    undo(p)
    assert p.data_digest() == before == build().data_digest()
    resumed = simulate(p, checkpoint=path, **{**args, "rounds": 5})
    _same(resumed, simulate(build(), **{**args, "rounds": 5}))


def test_an_unchanged_problem_keeps_its_digest_without_hashing_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = digest_arrays

    def counting(items: Any) -> str:
        calls.append(1)
        return real(items)

    monkeypatch.setattr("shrinkgrad.problems.model.digest_arrays", counting)
    p = _model(_Scaled(0.5))
    assert isinstance(p, ModelProblem)
    first = p.data_digest()
    for _ in range(3):
        assert p.data_digest() == first
        p.loss(p.x0())  # evaluating the problem changes nothing it was computed from
    assert len(calls) == 1
    for w in p.module.parameters():  # the parameters are x, not part of the digest: unchanged
        w.add_(1.0)
    assert p.data_digest() == first


def test_a_held_out_pair_is_the_problems_own(tmp_path: Path) -> None:
    """A float64 test pair used to be kept by reference: changing it afterwards changed the
    problem's held-out metrics and left its digest stale."""
    X, y = _pair()
    Xt, yt = X[:8].clone(), y[:8].clone()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D, 2))
    p = model_problem(net, (X, y), n_clients=CLIENTS, test=(Xt, yt))
    x = p.x0()
    before, digest = p.held_out(x), p.data_digest()
    out = net.double()(Xt).detach()  # the held-out loss from its definition, at x0
    expect = float(F.cross_entropy(out, yt))
    assert before["test_loss"] == pytest.approx(expect, rel=1e-12)
    Xt.add_(1.0)
    yt.fill_(1)
    assert p.held_out(x) == before and p.data_digest() == digest


# -- identical runs ----------------------------------------------------------------------------
def test_a_default_run_records_none_of_the_new_entries() -> None:
    """Older checkpoints of runs with the default rules, registry compressors and equal weights
    lack these entries: such runs do not record them, so those checkpoints still resume."""
    from shrinkgrad.sim.engine import run_identity

    setup = setup_run(_linear(), "ef21", "top_k[k=2]", 0.1, 0, None, RunOptions(rounds=3))
    assert run_identity(setup.bound, setup.options) == {}
    assert not {"tol", "divergence", "compressor.params", "client_weights"} & set(setup.fingerprint)
    same = RunOptions(rounds=3, divergence=Divergence(1e8, 1e2, 1e8))
    assert run_identity(setup.bound, same) == {}


def test_a_model_of_torch_layers_keeps_the_documented_digest() -> None:
    """Without code of its own, settings, hooks or a custom loss, the digest is the documented
    one (groups, held-out part, buffers, repr), so checkpoints written before stay valid."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(D), torch.nn.Linear(D, 3), torch.nn.ReLU())
    p = model_problem(net, _pair(), n_clients=CLIENTS, loss="cross_entropy")
    items: list[tuple[str, Any]] = []
    for k, g in enumerate(p._groups):
        items += [
            (f"group{k}.members", g.members),
            (f"group{k}.sizes", g.batch.sizes),
            (f"group{k}.X", g.batch.X),
            (f"group{k}.y", g.batch.y),
        ]
    t = p._test
    assert t is not None
    items += [("test.X", t.X), ("test.y", t.y)]
    items += [(f"buffer.{k}", b) for k, b in p.module.named_buffers()]
    items += [("module", repr(p.module))]
    assert p.data_digest() == digest_arrays(items)


def test_custom_code_resumes_bit_for_bit_when_built_again(tmp_path: Path) -> None:
    def build() -> tuple[Problem, dict[str, Any]]:
        return _model(_Scaled(0.5), loss=TWICE_CE), {"compressor": TopK(2)}

    a, b = build()[0], build()[0]
    assert a.data_digest() == b.data_digest()
    full = _run(build)
    path = tmp_path / "run.pt"

    def stop(r: int, state: object) -> None:
        if r == 3:
            raise KeyboardInterrupt

    with pytest.raises(SimulationInterrupted):
        _run(build, path, callback=stop)
    _same(_run(build, path), full)


USER_MODULE = """
import numpy as np, torch
from shrinkgrad.problems import model_problem

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 2)
        self.modes = {"a", "b", "c", "d"}
        self.act = torch.tanh

    def forward(self, x):
        if "a" in {"a", "b", "c", "d"} and "a" in self.modes:
            return self.act(self.fc(x)) * 0.5
        return self.fc(x)

def digest():
    rng = np.random.default_rng(0)
    X = torch.from_numpy(rng.standard_normal((40, 6)))
    y = torch.from_numpy((rng.standard_normal(40) > 0).astype(np.int64))
    return model_problem(Net(), (X, y), n_clients=4, test=0).data_digest()
"""


def test_the_code_digest_is_the_same_in_another_process(tmp_path: Path) -> None:
    """Sets of strings are ordered by salted hashes (PYTHONHASHSEED): the digest must not be."""
    (tmp_path / "usernet_fp.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        import usernet_fp

        here = usernet_fp.digest()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("usernet_fp", None)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import usernet_fp as u"
    code += "; print(u.digest())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == here
