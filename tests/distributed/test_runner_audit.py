"""run_distributed against simulate, case by case (the runner audit).

The runner asks the method for every client step and reduces across 2 gloo ranks; for the same
seed it must follow the simulator's trajectory (to round-off in float64, to float32 round-off in
float32) and write the simulator's table: the same logged rounds, the same metrics, the bit
counters bit for bit, the same stop status and message. Each test runs its cases in one 2-rank
launch on tiny problems; n = 7 clients split 4 + 3 over the ranks (more clients than ranks,
blocks of unequal size).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from shrinkgrad.compressors import make_compressor
from shrinkgrad.distributed import spawn
from shrinkgrad.distributed.runner import run_distributed
from shrinkgrad.methods.base import NonFiniteError
from shrinkgrad.methods.ef21 import EF21
from shrinkgrad.problems import least_squares, logistic_regression
from shrinkgrad.problems.synthetic import synthetic_least_squares
from shrinkgrad.rng import KeyStream
from shrinkgrad.sim import simulate

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

# built once in the test process; forked ranks inherit them
A1A = logistic_regression("a1a", n_clients=7, split="shuffled[seed=1]", lam=0.1)
A1A_F32 = logistic_regression(
    "a1a", n_clients=7, split="shuffled[seed=1]", lam=0.1, dtype="float32"
)
LSQ = least_squares("a1a", n_clients=4)
#: heterogeneous smoothness constants L_i: EF21-W's weights w_i = L_i / Σ L_j are far from 1/n
SYN = synthetic_least_squares(n_clients=6, d=10, m=6, L_var=100.0)

Case = dict[str, Any]


def _stop_at_4(r: int, state: Any) -> bool:
    return r >= 4


def _one(run: Callable[..., Any], case: Case) -> dict[str, Any]:
    """One run of ``case`` (simulate or run_distributed): its table, iterates and counters."""
    xs: list[torch.Tensor] = []
    stop = case.get("callback")

    def record(r: int, state: Any) -> bool:
        xs.append(state.x.clone())
        return bool(stop(r, state)) if stop is not None else False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run(**dict(case, callback=record))
    return {
        "table": res.table,
        "xs": xs,
        "status": res.status,
        "message": res.message,
        "rounds": res.rounds,
        "bits": (res.bits_up, res.bits_up_paper, res.bits_down),
        "ids": res.state.clients.ids,
        "state": res.state,
    }


def _ranks(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    return [_one(run_distributed, c) for c in cases]


def _runner(cases: list[Case]) -> list[list[dict[str, Any]]]:
    """Every case on 2 ranks in one launch: ``out[case][rank]``."""
    per_rank = spawn(_ranks, 2, (cases,))
    return [[per_rank[r][k] for r in range(2)] for k in range(len(cases))]


def _assert_same(
    name: str,
    ranks: list[dict[str, Any]],
    sim: dict[str, Any],
    *,
    rtol: float = 0.0,
    values: bool = True,
) -> None:
    """The runner's run (every rank) is the simulator's: iterates to 1e-10 (float64) or to
    ``rtol`` relative, metrics to 1e-9 (or ``rtol``), rounds, bit counters, status exactly.
    ``values=False`` (a diverging run, which amplifies round-off: docs/distributed.md): the
    rounds, bit counters and status only."""
    ref = ranks[0]
    for other in ranks[1:]:  # every rank holds the same iterate and logs the same table
        assert all(torch.equal(a, b) for a, b in zip(other["xs"], ref["xs"], strict=True)), name
        pd.testing.assert_frame_equal(other["table"], ref["table"], obj=name)
    assert len(ref["xs"]) == len(sim["xs"]), name
    for t, (a, b) in enumerate(zip(ref["xs"], sim["xs"], strict=True)):
        if not values:
            break
        tol = 1e-10 + rtol * float(b.abs().max())
        assert float((a - b).abs().max()) <= tol, f"{name}: iterate {t}"
    got, want = ref["table"], sim["table"]
    assert list(got.columns) == list(want.columns), name
    exact = [c for c in want.columns if c not in ("grad_norm_sq", "loss", "time_s")]
    pd.testing.assert_frame_equal(got[exact], want[exact], obj=name)  # rounds, bits, ids
    for c in ("grad_norm_sq", "loss") if values else ():
        torch.testing.assert_close(
            torch.tensor(got[c].to_numpy()),
            torch.tensor(want[c].to_numpy()),
            rtol=max(rtol, 1e-9),
            atol=0,
            msg=lambda m, c=c: f"{name}: {c}: {m}",
        )
    assert (ref["status"], ref["message"], ref["rounds"]) == (
        sim["status"],
        sim["message"],
        sim["rounds"],
    ), name
    for a, b in zip(ref["bits"], sim["bits"], strict=True):  # per-client cumulative counters
        assert torch.equal(a, b), name


def _check(
    cases: list[Case], *, rtol: float = 0.0, diverging: int = 0
) -> list[list[dict[str, Any]]]:
    """Run ``cases`` on the ranks and in the simulator and compare them; the last
    ``diverging`` cases diverge (their values are not compared)."""
    out = _runner(cases)
    for j, (case, ranks) in enumerate(zip(cases, out, strict=True)):
        name = f"{case['method']} + {case['compressor']}"
        values = j < len(cases) - diverging
        _assert_same(name, ranks, _one(simulate, case), rtol=rtol, values=values)
    return out


def _case(**kw: Any) -> Case:
    return dict({"problem": A1A, "rounds": 10, "seed": 3, "log_every": 1}, **kw)


def _client_ids(ranks: list[dict[str, Any]]) -> list[list[int]]:
    return [r["ids"].tolist() for r in ranks]


# --------------------------------------------------------------------------------------------
# the bit counters
# --------------------------------------------------------------------------------------------
def test_fractional_bit_counters_are_the_simulators_to_the_bit() -> None:
    # lazy_bernoulli[p=0.3] counts 32·p·d = 1180.8 paper bits a message: the table's mean over
    # the n clients is the simulator's sum in client order / n, not a sum of per-rank partial
    # sums (before the fix: 3542.3999999999996 instead of 3542.4 at round 3 on 2 ranks)
    p, d, n, rounds = 0.3, A1A.d, A1A.n, 12
    cases = [
        _case(method="dcgd", compressor=f"lazy_bernoulli[p={p}]", stepsize=0.1, rounds=rounds),
        _case(method="diana", compressor="bernoulli[p=0.13]", stepsize=0.1, rounds=rounds),
        _case(
            method="ef21_pp[p=0.37]",
            compressor="scaled(lazy_bernoulli[p=0.3])",
            stepsize=0.1,
            rounds=rounds,
        ),
    ]
    out = _check(cases)
    assert _client_ids(out[0]) == [[0, 1, 2, 3], [4, 5, 6]]
    # the paper convention charges every client 32·p·d a round (dcgd sends nothing at round 0):
    # after r rounds each client's counter is r additions of it, the row their mean in order
    per_message = 32 * p * d
    assert make_compressor(f"lazy_bernoulli[p={p}]").paper_bits(d) == per_message
    client, want = 0.0, []
    for _ in range(rounds + 1):
        total = 0.0
        for _ in range(n):
            total += client
        want.append(total / n)
        client += per_message
    got = out[0][0]["table"]["bits_up_paper"].tolist()
    assert got == want
    assert any(v != round(v) for v in got)  # the case that a sum in another order rounds off


def test_partial_participation_is_the_keyed_draw_of_every_client() -> None:
    p, seed, rounds, k = 0.4, 5, 9, 2
    cases = [
        _case(method=f"ef21_pp[p={p}]", compressor=f"top_k[k={k}]", seed=seed, rounds=rounds),
        _case(method="ef21_w_pp[p=0.5]", compressor="top_k[k=2]", log_every=3),
        _case(
            method=EF21(p=[0.2, 0.9, 0.5, 0.5, 0.1, 1.0, 0.7]),
            compressor="top_k[k=2]",
            stepsize=0.3,
            log_every=2,
        ),
        _case(method="ef21_pp[p=0.5,init=zero]", compressor="top_k[k=3]", stepsize=0.3),
        _case(
            method="ef21_pp[p=0.5,init=compressed]", compressor="power_sgd[rank=1]", stepsize=0.3
        ),
    ]
    out = _check(cases)
    # client i takes part in round r when its keyed uniform (seed, "participation", i, r) is
    # below p ([BW] Alg. 4); it then sends k values and indices, k·(32 + ⌈log₂ d⌉) bits, and at
    # round 0 every client sends ∇f_i(x⁰) dense, 32·d bits
    d = A1A.d
    message = k * (32 + math.ceil(math.log2(d)))
    want, sent = [], 0
    for i in range(A1A.n):
        draws = KeyStream(seed, [i], stream="participation")
        took = sum(float(draws.at(r).uniform(1)[0, 0]) < p for r in range(1, rounds + 1))
        want.append(32.0 * d + message * took)
        sent += took
    assert 0 < sent < A1A.n * rounds  # some clients sat some rounds out
    for rank in out[0]:  # every rank counts all n clients' bits (the other ranks' summed in)
        assert rank["bits"][0].tolist() == want


def test_ef21_w_reduces_with_the_global_weights() -> None:
    cases = [
        dict(problem=SYN, method="ef21_w", compressor="top_k[k=2]", rounds=12, seed=1),
        dict(
            problem=SYN,
            method="ef21_w_sgd[b=3]",
            compressor="top_k[k=2]",
            stepsize=0.01,
            rounds=8,
            seed=2,
            log_every=3,
        ),
    ]
    out = _check(cases)
    # g = Σ_i w_i g_i over all n clients with w_i = L_i / Σ_j L_j ([EFR] Alg. 2): a rank that
    # normalised the weights over its own clients would hold another g
    L_i = SYN.L_i.to(torch.float64)
    w = L_i / L_i.sum()
    for ranks in out:
        ids = torch.cat([r["ids"] for r in ranks])
        g_i = torch.cat([r["state"].clients.g for r in ranks])
        assert sorted(ids.tolist()) == list(range(SYN.n))
        want = (w[ids].unsqueeze(1) * g_i).sum(dim=0)
        for r in ranks:
            torch.testing.assert_close(r["state"].server.g, want, rtol=1e-9, atol=1e-12)


def test_minibatches_are_the_keyed_minibatches_of_every_client() -> None:
    _check(
        [
            _case(method="ef21_sgd[b=4]", compressor="rand_k_scaled[k=5]", stepsize=0.3),
            _case(method=EF21(batch=[1, 2, 3, 4, 5, 6, 7]), compressor="top_k[k=3]", stepsize=0.3),
            _case(method="ef21_w_sgd[b=4]", compressor="top_k[k=3]", stepsize=0.3, log_every=4),
        ]
    )


def test_shared_seed_and_per_client_draws() -> None:
    k, d, rounds = 5, A1A.d, 8
    cases = [
        _case(
            method="dcgd", compressor=f"rand_k[k={k},shared_seed=true]", stepsize=0.2, rounds=rounds
        ),
        _case(method="dcgd", compressor=f"rand_k[k={k}]", stepsize=0.2, rounds=rounds),
        _case(method="diana", compressor=f"rand_k[k={k},shared_seed=true]", rounds=rounds),
        _case(
            method="ef21",
            compressor=f"scaled(strat_k[k={k},shared_seed=true])",
            stepsize=0.3,
            rounds=rounds,
        ),
        _case(method="ef21", compressor=f"scaled(strat_k[k={k}])", stepsize=0.3, rounds=rounds),
    ]
    out = _check(cases)
    # a shared draw sends the k values only (the receiver redraws the indices): 32·k bits; a
    # per-client rand_k sends its indices too, k·(32 + ⌈log₂ d⌉)
    shared, own = out[0][0]["table"], out[1][0]["table"]
    assert shared["bits_up"].tolist() == [32.0 * k * r for r in range(rounds + 1)]
    idx = math.ceil(math.log2(d))
    assert own["bits_up"].tolist() == [k * (32.0 + idx) * r for r in range(rounds + 1)]
    # and the shared draw is one draw: every client of a round kept the same coordinates, the
    # per-client draws did not (the iterate moves on k resp. up to n·k coordinates a round)
    moved = [
        (b - a != 0).sum().item()
        for a, b in zip(out[0][0]["xs"][:-1], out[0][0]["xs"][1:], strict=True)
    ]
    assert max(moved) <= k
    moved = [
        (b - a != 0).sum().item()
        for a, b in zip(out[1][0]["xs"][:-1], out[1][0]["xs"][1:], strict=True)
    ]
    assert max(moved) > k


def test_delayed_and_asynchronous_methods() -> None:
    _check(
        [
            _case(method=f"delayed_dcgd[tau=2,model={m}]", compressor="rand_k[k=10]", stepsize=0.1)
            for m in ("random", "speeds", "cyclic")
        ]
        + [
            _case(method="iag[order=random]", compressor="rand_k[k=10]", stepsize=0.3),
            _case(
                method="asynchronous(iag)",
                compressor="rand_k[k=10]",
                stepsize=0.3,
                rounds=16,
                log_every=5,
            ),
            _case(method="asynchronous(ef21)", compressor="top_k[k=3]", stepsize=0.3),
        ]
    )


def test_float32_runs_follow_the_simulator_to_float32_round_off() -> None:
    eps = float(torch.finfo(torch.float32).eps)
    _check(
        [
            _case(problem=A1A_F32, method="ef21", compressor="top_k[k=2]"),
            _case(problem=A1A_F32, method="ef21_pp[p=0.5]", compressor="top_k[k=2]"),
            _case(problem=A1A_F32, method="dcgd", compressor="rand_k[k=5]", stepsize=0.1),
        ],
        rtol=100 * eps,
    )


# --------------------------------------------------------------------------------------------
# rows, stops and resumption
# --------------------------------------------------------------------------------------------
def test_logged_rows_and_stop_statuses() -> None:
    diverging = dict(problem=LSQ, compressor="top_k[k=2]", divergence_factor=None, rounds=300)
    out = _check(
        [
            _case(method="ef21", compressor="top_k[k=2]", rounds=11, log_every=4),
            _case(
                method="ef21_pp[p=0.3]",
                compressor="top_k[k=2]",
                stepsize=0.5,
                tol=0.1,
                rounds=200,
                log_every=3,
            ),
            _case(method="ef21_pp[p=0.5]", compressor="top_k[k=2]", callback=_stop_at_4),
            dict(
                diverging, method="ef21_pp[p=0.5]", stepsize=5.0, rounds=60, divergence_factor=1e8
            ),
            dict(diverging, method="ef21_pp[p=0.5]", stepsize=1e3, log_every=13),
            dict(
                diverging,
                method="dcgd",
                compressor="rand_k[k=3,shared_seed=true]",
                stepsize=50.0,
                log_every=7,
            ),
        ],
        diverging=3,
    )
    rows = [o[0]["table"]["round"].tolist() for o in out]
    assert rows[0] == [0, 4, 8, 11]
    assert [o[0]["status"] for o in out] == [
        "completed",
        "converged",
        "stopped",
        "diverged",
        "diverged",
        "diverged",
    ]
    gns = out[1][0]["table"]["grad_norm_sq"].tolist()
    assert gns[-1] <= 0.1 < min(gns[:-1]) and rows[1][-1] % 3 == 0  # the first row below tol
    assert rows[2] == [0, 1, 2, 3, 4]


def test_a_resumed_partial_participation_run_is_the_simulators(tmp_path: Path) -> None:
    runs = []
    for j, (method, comp, log_every, short, every) in enumerate(
        [
            ("ef21_pp[p=0.4]", "top_k[k=2]", 4, 6, 3),  # saved off the logging grid
            ("delayed_dcgd[tau=2,model=random]", "rand_k[k=5]", 3, 5, 5),  # the iterate ring
        ]
    ):
        base = _case(method=method, compressor=comp, stepsize=0.1, seed=4, log_every=log_every)
        prefix = str(tmp_path / f"ckpt{j}")
        runs.append(
            (
                dict(base, rounds=13),
                dict(base, rounds=short, checkpoint=prefix, checkpoint_every=every),
                dict(base, rounds=13, checkpoint=prefix, checkpoint_every=every),
            )
        )
    out = _runner([c for triple in runs for c in triple])
    for j, (straight, _, _) in enumerate(runs):
        sim = _one(simulate, straight)
        _assert_same(f"straight {j}", out[3 * j], sim)
        resumed = out[3 * j + 2]
        # the callback (which records the iterates) sees the rounds run after the resumption
        tail = sim["xs"][len(sim["xs"]) - len(resumed[0]["xs"]) :]
        assert 0 < len(tail) < len(sim["xs"])
        _assert_same(f"resumed {j}", resumed, dict(sim, xs=tail))


def _first_round_error(rank: int, world: int, case: Case) -> tuple[bool, str] | None:
    """(is it a NonFiniteError, its message) of a run that fails, caught as a sweep that goes
    on to its next run would."""
    try:
        run_distributed(**case)
    except Exception as e:
        return isinstance(e, NonFiniteError), str(e)
    return None


def test_non_finite_values_at_round_0_on_one_rank_stop_every_rank() -> None:
    # x0 is huge on a feature that only clients 2 and 3 (rank 1's) hold: their least-squares
    # gradients overflow, and compressing them for the initial g_i = C(∇f_i(x0)) fails there
    # only. The simulator raises NonFiniteError; every rank must too, at once, instead of rank 0
    # waiting in the initial all-reduce for a rank that gave up (before the fix: rank 0 got
    # gloo's "Connection closed by peer", or waited for the timeout when rank 1 went on)
    A = LSQ.data_matrix()
    held = [bool(abs(A[LSQ.offsets[i] : LSQ.offsets[i + 1], 91]).sum() > 0) for i in range(4)]
    assert held == [False, False, True, True]
    x0 = torch.zeros(LSQ.d, dtype=torch.float64)
    x0[91] = 1e308
    case = dict(
        problem=LSQ,
        method="ef21[init=compressed]",
        compressor="top_k[k=2]",
        stepsize=0.1,
        rounds=3,
        x0=x0,
    )
    with pytest.raises(NonFiniteError) as sim:
        simulate(**case)
    got = spawn(_first_round_error, 2, (case,), pg_timeout=10.0, timeout=60.0)
    assert [g is not None and g[0] for g in got] == [True, True], got
    assert got[1] is not None and got[1][1] == str(sim.value)
    assert got[0] is not None and "another rank" in got[0][1] and "round 0" in got[0][1]
