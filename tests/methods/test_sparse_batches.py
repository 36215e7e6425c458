"""Sparse message batches (issue 17): in the simulator and the runner (``Config.sparse_batches``)
EF21's fixed-size sparse messages reach the reduction as a :class:`SparseMessage` of shape
(m, d) instead of a dense (m, d) tensor, and ``weighted_sum`` adds their m·k weighted entries.

The reduction must be the in-order sum it documents (bit for bit), equal the dense gemv to
round-off, and the runs through it must follow the dense runs' trajectories and bit counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shrinkgrad.compressors import _kernels as K
from shrinkgrad.methods import ProblemOracle, make_method, weighted_sum
from shrinkgrad.methods.rules import SparseMessage
from shrinkgrad.problems import logistic_regression
from shrinkgrad.sim import simulate


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _batch(m: int, d: int, k: int, dtype: torch.dtype) -> tuple[SparseMessage, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * d + k)
    cols = torch.stack([torch.randperm(d, generator=gen)[:k] for _ in range(m)])
    flat = (cols + torch.arange(m).unsqueeze(1) * d).reshape(-1)
    vals = torch.randn(m * k, dtype=dtype, generator=gen) * 1e3
    w = torch.rand(m, dtype=dtype, generator=gen)
    return SparseMessage(flat, vals, (m, d)), w


def _in_order(c: SparseMessage, w: torch.Tensor) -> torch.Tensor:
    """The documented sum, written out: each product rounded, added in the order of c."""
    d = c.shape[1]
    out = torch.zeros(d, dtype=c.values.dtype)
    for f, v in zip(c.indices.tolist(), c.values, strict=True):
        r, q = divmod(f, d)
        out[q] = out[q] + w[r] * v
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("m", "d", "k"), [(50, 7, 1), (9, 30, 4), (1, 5, 5)])
def test_weighted_sum_of_a_sparse_batch_is_the_in_order_sum(
    dtype: torch.dtype, m: int, d: int, k: int
) -> None:
    c, w = _batch(m, d, k, dtype)
    out = weighted_sum(c, w)
    assert torch.equal(_bits(out), _bits(_in_order(c, w)))
    # the dense batch's gemv: the same sum in another order
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, weighted_sum(c.dense(), w), rtol=tol, atol=tol * 1e3)
    # the torch fallback (int32 positions) gives the kernel's bits
    c32 = SparseMessage(c.indices.to(torch.int32), c.values, c.shape)
    assert torch.equal(_bits(weighted_sum(c32, w)), _bits(out))


def test_weighted_sum_refuses_a_position_outside_the_batch() -> None:
    c, w = _batch(4, 6, 2, torch.float64)
    bad = SparseMessage(
        torch.cat([c.indices, torch.tensor([24])]), torch.ones(9, dtype=torch.float64), (4, 6)
    )
    with pytest.raises(IndexError, match=r"outside its shape \(4, 6\)"):
        weighted_sum(bad, w)


def _dense_run(problem: Any, method: str, comp: str, rounds: int) -> tuple[list[torch.Tensor], Any]:
    """The method bound without sparse batches (``Config.sparse_batches`` False: dense (m, d)
    messages and the gemv), run by hand."""
    bound = make_method(method).bind(problem, comp, "theory", 0)
    assert not bound.cfg.sparse_batches
    oracle = ProblemOracle(problem)
    state, traffic = bound.init(problem.x0(), oracle)
    xs, ups = [state.server.x.clone()], [traffic.up.clone()]
    for _ in range(rounds):
        state, traffic = bound.step(state, oracle)
        xs.append(state.server.x.clone())
        ups.append(traffic.up.clone())
    return xs, ups


@pytest.mark.parametrize(
    ("method", "comp"),
    [
        ("ef21", "top_k[k=1]"),  # the fused Top-1 pass's sparse form
        ("ef21", "top_k[k=3]"),  # the default shifted_sparse
        ("ef21_w", "top_k[k=1]"),
        ("ef21", "scaled(rand_k[k=2])"),  # keyed draws
        # random-size messages: the bits counted from the pairs made dense (message_bits)
        ("ef21", "compose(top_k[k=6],bernoulli[p=0.7])"),
        ("ef21_sgdm", "top_k[k=2]"),
    ],
)
def test_simulated_runs_through_sparse_batches_follow_the_dense_runs(
    method: str, comp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    kernel = K.weighted_rows_sum

    def counted(*args: Any) -> bool:
        calls["n"] += 1
        return bool(kernel(*args))

    monkeypatch.setattr(K, "weighted_rows_sum", counted)
    p = logistic_regression("a1a", n_clients=9)
    rounds = 25
    xs: list[torch.Tensor] = []
    res = simulate(
        p, method, comp, "theory", rounds=rounds, callback=lambda r, s: xs.append(s.x.clone())
    )
    assert calls["n"] >= rounds  # the sparse reduction was used every round
    dense_xs, dense_ups = _dense_run(p, method, comp, rounds)
    for a, b in zip(xs, dense_xs[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    up = res.table["bits_up"].to_numpy()
    assert up[-1] == pytest.approx(float(sum(u.mean() for u in dense_ups)), rel=1e-12)


def test_partial_participation_keeps_dense_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """EF21-PP zeroes the absent clients' rows of c (``c[part] = ...``): its client step does
    not ask for the sparse form, and runs as before."""
    p = logistic_regression("a1a", n_clients=6)
    res = simulate(p, "ef21_pp[p=0.5]", "top_k[k=1]", "theory", rounds=10)
    bound = make_method("ef21_pp[p=0.5]").bind(p, "top_k[k=1]", "theory", 0)
    oracle = ProblemOracle(p)
    state, _ = bound.init(p.x0(), oracle)
    for _ in range(10):
        state, _ = bound.step(state, oracle)
    torch.testing.assert_close(res.x, state.server.x, rtol=1e-12, atol=1e-14)
