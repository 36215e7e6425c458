"""A checkpoint resumes only the problem on the data it was written for.

Two problems built from user arrays (``model_problem(net, (X, y))``, ``LinearModelProblem(A, y,
parts)``) on different data but with the same shapes, model, split and x⁰ agree on everything
else the fingerprint records (name, data set, n, d, ``info()``, x⁰): only ``problem.data``, the
problem's :meth:`~shrinkgrad.problems.Problem.data_digest`, tells them apart.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from methods_fixtures import LeastSquares

import shrinkgrad.problems.base as problems_base
from shrinkgrad.problems import LinearModelProblem, Problem, model_problem
from shrinkgrad.sim import SimulationInterrupted, load_checkpoint, save_checkpoint, simulate
from shrinkgrad.sim.engine import problem_identity

N, D, CLIENTS = 40, 6, 4
ARGS = dict(method="ef21", compressor="top_k[k=2]", stepsize=0.1)


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    y = np.where(rng.standard_normal(N) > 0, 1.0, -1.0)
    return X, y


def _linear_dense(X: np.ndarray, y: np.ndarray, **kw: Any) -> Problem:
    parts = np.array_split(np.arange(N), CLIENTS)
    return LinearModelProblem(X, y, parts, loss="logistic", lam=0.1, dataset="mine", **kw)


def _linear_sparse(X: np.ndarray, y: np.ndarray, **kw: Any) -> Problem:
    return _linear_dense(sp.csr_matrix(np.where(np.abs(X) > 0.5, X, 0.0)), y, **kw)


def _model(X: np.ndarray, y: np.ndarray, **kw: Any) -> Problem:
    torch.manual_seed(0)  # the same network, so the same x⁰
    net = torch.nn.Sequential(torch.nn.Linear(D, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    labels = torch.from_numpy((y > 0).astype(np.int64))
    return model_problem(net, (torch.from_numpy(X), labels), n_clients=CLIENTS, **kw)


BUILDERS: dict[str, Callable[..., Problem]] = {
    "linear_dense": _linear_dense,
    "linear_sparse": _linear_sparse,
    "model": _model,
}


def _run(problem: Problem, path: Path | None = None, **kw: Any) -> Any:
    args = {**ARGS, "rounds": 3, **kw}
    return simulate(problem, checkpoint=path, **args)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_problems_on_other_data_of_the_same_shapes_are_told_apart(
    kind: str, tmp_path: Path
) -> None:
    build = BUILDERS[kind]
    pa, pb = build(*_data(0)), build(*_data(1))
    # what the fingerprint held before: all of it agrees
    assert pa.info() == pb.info()
    assert torch.equal(pa.x0(), pb.x0())
    ia, ib = problem_identity(pa), problem_identity(pb)
    assert {k for k in ia if ia[k] != ib.get(k)} == {"problem.data"}
    path = tmp_path / "run.pt"
    _run(pa, path)
    with pytest.raises(ValueError, match=r"belongs to a different run \(problem\.data: ") as e:
        _run(pb, path, rounds=5)
    assert "\n" not in str(e.value) and "another checkpoint path" in str(e.value)
    # the problem it was written for, built again from the same values, resumes it
    assert _run(build(*_data(0)), path, rounds=5).rounds == 5


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_the_same_data_built_twice_resumes_bit_for_bit(kind: str, tmp_path: Path) -> None:
    build = BUILDERS[kind]
    X, y = _data(0)
    first, again = build(X, y), build(X.copy(), y.copy())
    assert first.data_digest() == again.data_digest()
    assert len(first.data_digest()) == 40 and int(first.data_digest(), 16) >= 0
    full = _run(first, rounds=6)

    def stop(r: int, state: object) -> None:
        if r == 3:
            raise KeyboardInterrupt

    path = tmp_path / "run.pt"
    with pytest.raises(SimulationInterrupted):
        _run(first, path, rounds=6, callback=stop)
    resumed = _run(again, path, rounds=6)
    cols = [c for c in full.table.columns if c != "time_s"]
    pd.testing.assert_frame_equal(resumed.table[cols], full.table[cols], check_exact=True)
    assert torch.equal(resumed.x, full.x)


def _bump(a: np.ndarray, i: int, j: int | None = None) -> np.ndarray:
    out = a.copy()
    where = (i,) if j is None else (i, j)
    out[where] = np.nextafter(out[where], np.inf)  # the smallest change there is
    return out


@pytest.mark.parametrize("kind", ["linear_dense", "model"])
def test_one_changed_entry_changes_the_digest(kind: str) -> None:
    build = BUILDERS[kind]
    X, y = _data(0)
    base = build(X, y).data_digest()
    digests = {
        build(_bump(X, N - 1, D - 1), y).data_digest(),  # one feature of the last sample
        build(X, np.where(np.arange(N) == 7, -y, y)).data_digest(),  # one label
    }
    assert base not in digests and len(digests) == 2


def test_one_changed_entry_of_sparse_data_changes_the_digest() -> None:
    X, y = _data(0)
    A = sp.csr_matrix(np.where(np.abs(X) > 0.5, X, 0.0))
    base = _linear_dense(A, y).data_digest()
    value = A.copy()
    value.data[3] = np.nextafter(value.data[3], np.inf)
    moved = A.tolil()
    _, col = A[0].nonzero()
    free = next(c for c in range(D) if c not in set(col))
    moved[0, free], moved[0, col[0]] = A[0, col[0]], 0.0  # the same value in another column
    moved = moved.tocsr()
    moved.eliminate_zeros()
    digests = {_linear_dense(value, y).data_digest(), _linear_dense(moved, y).data_digest()}
    assert base not in digests and len(digests) == 2


def test_the_split_and_the_held_out_part_enter_the_model_digest() -> None:
    X, y = _data(0)
    base = _model(X, y)
    assert base.n_test > 0
    other_split = _model(X, y, split=[np.arange(0, 5), np.arange(5, 16), [16, 17], [18, 19]])
    own_test = _model(X, y, test=(torch.from_numpy(X[:5]), torch.zeros(5, dtype=torch.int64)))
    moved_test = _model(X, y, test=(torch.from_numpy(X[:5]), torch.ones(5, dtype=torch.int64)))
    digests = {p.data_digest() for p in (base, other_split, own_test, moved_test)}
    assert len(digests) == 4


def test_model_buffers_enter_the_digest() -> None:
    """Running statistics define f in eval mode but are not parameters, so not in x⁰."""
    X, y = _data(0)
    labels = torch.from_numpy((y > 0).astype(np.int64))

    def build(mean: float) -> Problem:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.BatchNorm1d(D), torch.nn.Linear(D, 2))
        assert net[0].running_mean is not None
        net[0].running_mean.fill_(mean)
        return model_problem(net, (torch.from_numpy(X), labels), n_clients=CLIENTS)

    a, b = build(0.0), build(0.5)
    assert torch.equal(a.x0(), b.x0())
    assert a.data_digest() != b.data_digest()
    assert a.data_digest() == build(0.0).data_digest()


def test_the_model_architecture_enters_the_digest(tmp_path: Path) -> None:
    """Equal parameter shapes and x⁰, another activation: another f, refused on resume."""
    X, y = _data(0)
    labels = torch.from_numpy((y > 0).astype(np.int64))

    def build(act: type[torch.nn.Module]) -> Problem:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(D, 3), act(), torch.nn.Linear(3, 2))
        return model_problem(net, (torch.from_numpy(X), labels), n_clients=CLIENTS)

    tanh, relu = build(torch.nn.Tanh), build(torch.nn.ReLU)
    assert torch.equal(tanh.x0(), relu.x0())
    assert tanh.data_digest() != relu.data_digest()
    assert tanh.data_digest() == build(torch.nn.Tanh).data_digest()
    path = tmp_path / "run.pt"
    _run(tanh, path)
    with pytest.raises(ValueError, match=r"belongs to a different run \(problem\.data: "):
        _run(relu, path, rounds=5)


def test_how_a_problem_is_computed_does_not_change_its_digest() -> None:
    X, y = _data(0)
    A = sp.csr_matrix(np.where(np.abs(X) > 0.5, X, 0.0))
    linear = {
        _linear_dense(A, y, storage=s, dtype=dt, threads=t).data_digest()
        for s in ("sparse", "dense")
        for dt in ("float64", "float32")
        for t in (1, 2)
    }
    assert len(linear) == 1
    m64 = _model(X, y)
    m32 = _model(X, y, dtype="float32")
    assert m64.to(device="cpu").data_digest() == m64.data_digest()
    assert m64.to(dtype=torch.float32).data_digest() == m32.data_digest()
    assert m32.data_digest() != m64.data_digest()  # rounded values (the fingerprint's dtype too)


def test_the_digest_is_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = problems_base.digest_arrays

    def counting(items: Any) -> str:
        calls.append(1)
        return real(items)

    for module in ("shrinkgrad.problems.linear", "shrinkgrad.problems.model"):
        monkeypatch.setattr(f"{module}.digest_arrays", counting)
    X, y = _data(0)
    for build in BUILDERS.values():
        p = build(X, y)
        calls.clear()
        first = p.data_digest()
        assert problem_identity(p)["problem.data"] == first
        assert problem_identity(p.with_constants(1.0))["problem.data"] == first
        assert len(calls) == 1
    restricted = _model(X, y).restrict(torch.tensor([2, 0]))
    assert restricted.data_digest() != _model(X, y).data_digest()


def test_a_checkpoint_without_the_data_digest_is_refused_in_one_line(tmp_path: Path) -> None:
    """A checkpoint of the version before ``problem.data``: it cannot tell the data apart."""
    X, y = _data(0)
    path = tmp_path / "old.pt"
    _run(_model(X, y), path)
    saved = load_checkpoint(path)
    assert saved is not None and "problem.data" in saved["fingerprint"]
    old = {k: v for k, v in saved["fingerprint"].items() if k != "problem.data"}
    save_checkpoint(path, {**saved, "fingerprint": old})
    refusal = r"earlier version .*record the problem's data.*delete"
    with pytest.raises(ValueError, match=refusal) as e:
        _run(_model(X, y), path, rounds=5)
    assert "\n" not in str(e.value)


def test_a_user_problem_chooses_its_digest(tmp_path: Path) -> None:
    """``data_digest()`` None (the default of Problem): no entry; a string: the entry."""

    class Named(LeastSquares):
        def __init__(self, tag: str | None) -> None:
            super().__init__(n=3, d=4, m=5, seed=1)
            self.tag = tag

        def data_digest(self) -> str | None:
            return self.tag

    assert LeastSquares(n=3, d=4, m=5).data_digest() is None
    assert "problem.data" not in problem_identity(Named(None))
    assert problem_identity(Named("abc"))["problem.data"] == "abc"
    path = tmp_path / "run.pt"
    simulate(Named("abc"), "gd", stepsize=0.01, rounds=2, checkpoint=path)
    with pytest.raises(ValueError, match=r"problem\.data: saved 'abc' vs now 'xyz'"):
        simulate(Named("xyz"), "gd", stepsize=0.01, rounds=3, checkpoint=path)
