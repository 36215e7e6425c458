"""The shared contract of every registered method (design.md principle 15), driven by METHODS.

Every method of the registry is run through the contract in its default configuration and in
the example configurations of ``method_examples.EXAMPLES``; a method that nobody can build (a
required parameter without an example) fails ``test_every_method_has_a_configuration``, naming
it. So a method added in any module (EF21-SGDM, the parameter server's methods, ...) is covered
on its own:

* names round-trip through the registry, and every runtime gets a one-line answer;
* the identity compressor gives gradient descent's iterates, for every configuration whose
  ``identity_is_gd`` says so (a declared property of the method, not a list here);
* a group of clients plus the reduction equals the full batch (design.md principle 1, the
  distributed runner's contract): the clients split into 2 or 3 groups, each running
  ``init``/``step`` on its own clients with a reduction that sums the groups' weighted sums,
  give the full batch's iterates and client states, at initialisation and for several steps.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from method_examples import EXAMPLES
from methods_fixtures import LeastSquares, rand_k, run, trajectory

from shrinkgrad.methods import METHODS, ProblemOracle, make_method
from shrinkgrad.methods.base import RUNTIMES, Method
from shrinkgrad.registry import parse_spec

ROUNDS = 12
GROUPS = [[[3, 0], [1, 4, 2]], [[0], [1, 2], [3, 4]]]


def _build(name: str) -> tuple[Method[Any, Any] | None, str]:
    try:
        return make_method(name), ""
    except (TypeError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def configurations() -> list[str]:
    """Every method's default configuration (when it has one) and its examples."""
    out: list[str] = []
    for name in METHODS.names():
        method, _ = _build(name)
        specs = ([method.name] if method is not None else []) + EXAMPLES.get(name, [])
        out += [s for s in specs if s not in out]
    return out


CONFIGS = configurations()
RUNNER_CONFIGS = [s for s in CONFIGS if make_method(s).unsupported("runner") is None]


def compressor_for(method: Method[Any, Any]) -> Any:
    """A compressor the method accepts, random (keyed per client and round) where possible."""
    if method.requires == "none":
        return None
    return rand_k(3) if method.requires == "unbiased" else rand_k(3, scaled=True)


# --------------------------------------------------------------------------------------------
# completeness
# --------------------------------------------------------------------------------------------
def test_every_method_has_a_configuration() -> None:
    missing = []
    for name in METHODS.names():
        method, why = _build(name)
        if method is None and not EXAMPLES.get(name):
            missing.append(
                f"method {name!r} cannot be built from its name alone ({why}): add an example "
                "configuration for it to tests/methods/method_examples.py EXAMPLES"
            )
    assert not missing, "\n".join(missing)
    stale = sorted(set(EXAMPLES) - set(METHODS.names()))
    assert not stale, f"EXAMPLES lists methods that are not registered: {stale}"
    for name, specs in EXAMPLES.items():
        for spec in specs:
            assert make_method(spec).name.startswith(name), f"{spec!r} does not build {name!r}"


def test_the_contract_covers_every_method() -> None:
    covered = {parse_spec(spec).name for spec in CONFIGS}
    missing = sorted(set(METHODS.names()) - covered)
    assert not missing, f"methods without a configuration in the contract suite: {missing}"
    runner = {parse_spec(spec).name for spec in RUNNER_CONFIGS}
    assert runner, "no method runs in the multi-process runner"


# --------------------------------------------------------------------------------------------
# names and runtimes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", CONFIGS)
def test_names_round_trip_and_runtimes_answer_in_one_line(spec: str) -> None:
    m = make_method(spec)
    again = make_method(m.name)
    assert again.name == m.name and type(again) is type(m)
    for rt in RUNTIMES:
        reason = m.unsupported(rt)
        assert reason is None or (
            isinstance(reason, str) and reason.strip() and "\n" not in reason
        ), f"{spec}: unsupported({rt!r}) must be None or one line, got {reason!r}"
    assert isinstance(m.identity_is_gd, bool)
    assert m.theory_formula().strip(), f"{spec}: theory_formula() says nothing"


# --------------------------------------------------------------------------------------------
# the identity compressor gives gradient descent
# --------------------------------------------------------------------------------------------
GD_CONFIGS = [s for s in CONFIGS if make_method(s).identity_is_gd]


def test_identity_claims_are_made() -> None:
    """The reduction is declared where the maths gives it (and not where it cannot hold)."""
    declared = {make_method(s).name for s in GD_CONFIGS}
    for spec in ("gd", "dcgd", "ef", "ef21", "ef21_w", "ef21_pp[p=1.0]", "delayed_dcgd[tau=0]"):
        assert make_method(spec).name in declared, spec
    for spec in ("iag", "ef21_pp[p=0.5]", "ef21[init=zero]", "delayed_dcgd[tau=2]"):
        assert not make_method(spec).identity_is_gd, spec


@pytest.mark.parametrize("spec", GD_CONFIGS)
def test_identity_compressor_gives_gd(lsq: LeastSquares, spec: str) -> None:
    gamma = 0.7 / lsq.L
    x0 = torch.linspace(-1.0, 1.0, lsq.d, dtype=torch.float64)
    _, gd = run("gd", lsq, None, gamma, 30, x0=x0)
    _, other = run(spec, lsq, "identity", gamma, 30, x0=x0)
    torch.testing.assert_close(trajectory(other), trajectory(gd), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# groups of clients plus the reduction equal the full batch
# --------------------------------------------------------------------------------------------
class FakeAllReduce:
    """``k`` threads each call ``reduce(values, weights)``; every one gets the global weighted sum.

    Partial sums are added in group order, so the result is deterministic.
    """

    def __init__(self, k: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * k
        self.total: torch.Tensor | None = None
        self.barrier = threading.Barrier(k)

    def for_group(self, j: int):  # type: ignore[no-untyped-def]
        def reduce(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            self.parts[j] = weights @ values  # this group's Σ_j w_j v_j
            if self.barrier.wait() == 0:
                total = self.parts[0]
                for part in self.parts[1:]:
                    total = total + part  # type: ignore[operator]
                self.total = total
            self.barrier.wait()
            out = self.total
            assert out is not None
            self.barrier.wait()  # nobody overwrites parts before all have read the total
            return out.clone()

        return reduce


def run_in_groups(
    spec: str, problem: LeastSquares, C: Any, groups: list[list[int]], rounds: int, seed: int
) -> list[list[Any]]:
    """Every group's states (init and each step), the groups playing the ranks of a runner."""
    bound = make_method(spec).bind(problem, C, 0.01, seed)
    oracle = ProblemOracle(problem)
    ar = FakeAllReduce(len(groups))
    states: list[list[Any]] = [[] for _ in groups]
    errors: list[BaseException] = []

    def worker(j: int) -> None:
        try:
            ids = torch.tensor(groups[j])
            state, _ = bound.init(problem.x0(), oracle, ids=ids, reduce=ar.for_group(j))
            states[j].append(state)
            for _ in range(rounds):
                state, _ = bound.step(state, oracle, reduce=ar.for_group(j))
                states[j].append(state)
        except BaseException as e:  # reported below
            errors.append(e)
            ar.barrier.abort()

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return states


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("groups", GROUPS, ids=["2 groups", "3 groups"])
@pytest.mark.parametrize("spec", RUNNER_CONFIGS)
def test_client_groups_with_reduction_equal_full_batch(spec: str, groups: list[list[int]]) -> None:
    p5 = LeastSquares(n=5, d=9, m=7, seed=3, spread=6.0)
    C = compressor_for(make_method(spec))
    _, full = run(spec, p5, C, 0.01, ROUNDS, seed=13)
    per_group = run_in_groups(spec, p5, C, groups, ROUNDS, seed=13)
    for g, states in zip(groups, per_group, strict=True):
        assert len(states) == ROUNDS + 1
        for r, (mine, ref) in enumerate(zip(states, full, strict=True)):
            assert mine.round == r
            for name in ref.server._fields:
                _close(getattr(mine.server, name), getattr(ref.server, name), f"round {r} {name}")
            assert torch.equal(mine.clients.ids, torch.tensor(g))
            _same_rows(mine.clients, ref.clients, torch.tensor(g), p5.n, f"round {r} clients")


def _same_rows(ours: Any, theirs: Any, g: torch.Tensor, n: int, what: str) -> None:
    """A group's client state holds the full batch's rows of its clients: a field with one row per
    client of the group equals those rows; one with a row per client of the problem (a memory
    the method keeps for all n) agrees on them; nested states are compared field by field."""
    if ours is None or theirs is None:
        assert ours is None and theirs is None, f"{what}: None in one state only"
    elif isinstance(theirs, tuple) and hasattr(theirs, "_fields"):
        for name in theirs._fields:
            _same_rows(getattr(ours, name), getattr(theirs, name), g, n, f"{what}.{name}")
    elif isinstance(theirs, torch.Tensor) and theirs.ndim >= 1 and theirs.shape[0] == n:
        mine = ours if ours.shape[0] == g.numel() else ours[g]
        _close(mine, theirs[g], what)
    else:
        raise AssertionError(f"{what}: a client-state field that is not per client: {theirs!r}")
