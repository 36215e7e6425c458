"""The simulator's modelled wall clock (``simulate(network=...)``, the ``time_model_s`` column).

Each expectation is computed here by hand from the α–β formulas of docs/network.md and the
compressor's own ``bits``, independently of :mod:`shrinkgrad.network.clock`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shrinkgrad.compressors import make_compressor
from shrinkgrad.methods import make_method
from shrinkgrad.methods.oracle import ProblemOracle
from shrinkgrad.network import make_network
from shrinkgrad.network.clock import ModelClock
from shrinkgrad.problems import make_problem
from shrinkgrad.sim import COLUMNS, RunOptions, simulate

N, D = 4, 10
PROBLEM = f"synthetic_least_squares[n_clients={N},d={D}]"
DENSE_BITS = 32.0 * D  # one float32 d-vector


def test_without_network_the_table_keeps_its_columns() -> None:
    r = simulate(PROBLEM, "gd", rounds=2)
    assert tuple(r.table.columns) == COLUMNS
    assert "time_model_s" not in r.table.columns


def test_the_column_sits_after_time_s() -> None:
    r = simulate(PROBLEM, "gd", rounds=2, network="star[up=1gbit]")
    cols = list(r.table.columns)
    assert cols[cols.index("time_s") + 1] == "time_model_s"
    assert [c for c in cols if c != "time_model_s"] == list(COLUMNS)
    assert r.table["time_model_s"].dtype == np.float64


def test_infinitely_fast_network_costs_the_given_compute() -> None:
    # EF21 (init="full"): every client sends in every round, round 0 included
    r = simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=7, network="star[up=inf,compute=5ms]")
    t = r.table
    np.testing.assert_allclose(t["time_model_s"], 0.005 * (t["round"] + 1), rtol=1e-12)


def test_infinitely_fast_network_costs_the_measured_share_of_time_s() -> None:
    # no compute in the spec: each client is charged the round's measured time / n
    r = simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=6, network="star[up=inf,latency=0]")
    t = r.table
    np.testing.assert_allclose(t["time_model_s"], t["time_s"] / N, rtol=1e-9, atol=1e-15)
    assert float(t["time_model_s"].iloc[-1]) > 0


def test_zero_compute_star_is_bytes_over_bandwidth_plus_latency() -> None:
    up, down, lat = 10e6, 100e6, 0.020
    rounds = 5
    r = simulate(
        PROBLEM,
        "ef21",
        "top_k[k=2]",
        rounds=rounds,
        network="star[up=10mbit,down=100mbit,latency=20ms,compute=0]",
    )
    bits = make_compressor("top_k[k=2]").bits(D, torch.float32)
    assert bits < DENSE_BITS
    # round 0 (init="full"): each client receives x⁰ and sends its dense gradient
    t0 = (lat + DENSE_BITS / down) + (lat + DENSE_BITS / up)
    # rounds ≥ 1: receive the dense iterate, send the compressed difference
    t1 = (lat + DENSE_BITS / down) + (lat + bits / up)
    want = [t0 + k * t1 for k in range(rounds + 1)]
    np.testing.assert_allclose(r.table["time_model_s"], want, rtol=1e-12)


def test_zero_compute_ring_all_reduces_summable_messages() -> None:
    # GD sends dense, summable vectors: one ring all-reduce of S = 4d bytes per round;
    # its initialisation sends nothing (costs nothing)
    B, a = 1e9, 50e-6
    r = simulate(PROBLEM, "gd", rounds=4, network="ring[bandwidth=1gbit,latency=50us,compute=0]")
    S = 4 * D
    step = 2 * (N - 1) / N * 8 * S / B + 2 * (N - 1) * a
    np.testing.assert_allclose(r.table["time_model_s"], step * r.table["round"], rtol=1e-12)


@pytest.mark.parametrize(
    ("method", "comp"), [("ef21", "top_k[k=2]"), ("diana[init=full]", "qsgd[s=4]")]
)
def test_zero_compute_ring_all_reduces_a_dense_initialisation(method: str, comp: str) -> None:
    # these methods' round 0 sends every ∇f_i(x⁰) uncompressed: dense, summable vectors, one
    # all-reduce of S = 4d bytes, whatever the compressor; their compressed rounds (Top-k's
    # index-value pairs, QSGD's codes) cannot be summed, so the ring all-gathers the largest
    # message: (p − 1)·8·⌈bits/8⌉/B + (p − 1)α
    B, a = 1e9, 50e-6
    net = "ring[bandwidth=1gbit,latency=50us,compute=0]"
    r = simulate(PROBLEM, method, comp, 0.01, rounds=3, network=net)
    init = 2 * (N - 1) / N * 8 * (4 * D) / B + 2 * (N - 1) * a
    block = math.ceil(make_compressor(comp).bits(D, torch.float32) / 8)
    step = (N - 1) * 8 * block / B + (N - 1) * a
    want = [init + k * step for k in range(4)]
    np.testing.assert_allclose(r.table["time_model_s"], want, rtol=1e-12)


def test_zero_compute_ring_rounds_of_one_sender_reach_every_rank() -> None:
    # the IAG's rounds: one client sends its compressed gradient; on a ring the other n − 1
    # ranks must still receive it (padded all-gather of all n ranks), so no round is free
    B, a = 1e9, 50e-6
    net = "ring[bandwidth=1gbit,latency=50us,compute=0]"
    r = simulate(PROBLEM, "iag[init=full]", "qsgd[s=4]", 0.01, rounds=3, network=net)
    init = 2 * (N - 1) / N * 8 * (4 * D) / B + 2 * (N - 1) * a
    block = math.ceil(make_compressor("qsgd[s=4]").bits(D, torch.float32) / 8)
    step = (N - 1) * 8 * block / B + (N - 1) * a
    assert r.table["bits_up"].diff().iloc[1:].tolist() == [block * 8 / N] * 3  # one sender
    want = [init + k * step for k in range(4)]
    np.testing.assert_allclose(r.table["time_model_s"], want, rtol=1e-12)


def test_partial_participation_pays_for_the_slowest_sampled_client() -> None:
    # client 0 is a straggler (1 Mbit/s against 100 Mbit/s); a round costs the slowest
    # *sampled* client: 8(D_i + U_i)/B_i over the clients that took part
    bw = [1e6, 100e6, 100e6, 100e6]
    net = "star[up=[1mbit,100mbit,100mbit,100mbit],compute=0]"
    rounds, spec, comp = 30, "ef21_pp[p=0.5]", "top_k[k=2]"
    r = simulate(PROBLEM, spec, comp, rounds=rounds, seed=3, network=net)

    # the participants, read from each round's own traffic (what the clients sent)
    prob = make_problem(PROBLEM)
    bound = make_method(spec).bind(prob, comp, "theory", 3)
    oracle = ProblemOracle(prob)
    state, tr = bound.init(prob.x0(), oracle)
    traffic = [tr]
    for _ in range(rounds):
        state, tr = bound.step(state, oracle)
        traffic.append(tr)
    per_round, with_straggler, without = [], 0, 0
    for tr in traffic:
        bits = (tr.up + tr.down).numpy()
        sampled = [i for i in range(N) if bits[i] > 0]
        if 0 in sampled:
            with_straggler += 1
        elif sampled:
            without += 1
        per_round.append(max((bits[i] / bw[i] for i in sampled), default=0.0))
    assert with_straggler > 2 and without > 2  # both cases occur in this run
    np.testing.assert_allclose(r.table["time_model_s"], np.cumsum(per_round), rtol=1e-12)


def test_clock_round_slowest_sampled_client_hand_case() -> None:
    # star, per-client links and compute; client 1 does not take part
    net = make_network(
        "star[up=[1mbit,0.5mbit,10mbit],down=[10mbit,10mbit,100mbit],latency=[10ms,1ms,100ms],"
        "compute=[0.1s,2s,0.05s]]"
    )
    clock = ModelClock.of(net, 3, make_compressor("top_k[k=1]"), 10)
    from shrinkgrad.methods.base import Traffic

    up = torch.tensor([8e4, 0.0, 8e5], dtype=torch.float64)  # bits: 10 kB, 0, 100 kB
    down = torch.tensor([8e4, 0.0, 8e5], dtype=torch.float64)
    cost = clock.round(Traffic(up, up, down), torch.arange(3), elapsed_s=123.0)
    t0 = 0.01 + 8e4 / 10e6 + 0.1 + 0.01 + 8e4 / 1e6  # 0.208
    t2 = 0.1 + 8e5 / 100e6 + 0.05 + 0.1 + 8e5 / 10e6  # 0.338
    assert cost.total_s == pytest.approx(max(t0, t2), rel=1e-12)
    assert cost.client == 2
    # the clients of a group (ids) land at their own index: only client 0 now
    part = clock.round(Traffic(up[:1], up[:1], down[:1]), torch.tensor([0]), elapsed_s=0.0)
    assert part.total_s == pytest.approx(t0, rel=1e-12)


def test_resuming_a_checkpoint_continues_the_clock(tmp_path) -> None:  # type: ignore[no-untyped-def]
    net = "star[up=10mbit,latency=5ms,compute=1ms]"
    full = simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=6, network=net)
    path = tmp_path / "c.pt"
    simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=3, network=net, checkpoint=path)
    resumed = simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=6, network=net, checkpoint=path)
    np.testing.assert_allclose(resumed.table["time_model_s"], full.table["time_model_s"])
    with pytest.raises(ValueError, match="network"):
        simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=6, network="star[up=1mbit]", checkpoint=path)


def test_run_options_carry_the_network() -> None:
    opts = RunOptions(rounds=2, network="star[up=inf,compute=1s]")  # type: ignore[arg-type]
    r = simulate(PROBLEM, "ef21", "top_k[k=1]", options=opts)
    np.testing.assert_allclose(r.table["time_model_s"], [1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    ("network", "words"),
    [
        ("star[up=-1mbit]", ["'up'", "must be > 0", "10mbit"]),
        ("star[up=10mbat]", ["'up'", "cannot read '10mbat'", "10mbit"]),
        ("star[up=[1mbit,2mbit]]", ["'up'", "a list of 2 values for 4 clients", "one value"]),
        ("star[latency=5parsec,up=1mbit]", ["'latency'", "20ms"]),
        ("tree[up=1mbit]", ["unknown network 'tree'", "ring, star"]),
        (3, ["network must be a network spec", "star["]),
    ],
)
def test_mistakes_are_one_line_errors(network: object, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        simulate(PROBLEM, "gd", rounds=1, network=network)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_a_modelled_time_that_overflows_blames_the_network_not_x0() -> None:
    # every metric of x0 is finite; 2 × latency overflows the clock of round 0
    with pytest.raises(ValueError, match=r"^the network model's time of a round is inf s") as e:
        simulate(PROBLEM, "ef21", "top_k[k=2]", rounds=1, network="star[up=1kbit,latency=1e308]")
    assert "starting point" not in str(e.value) and "\n" not in str(e.value)


def test_a_later_round_that_overflows_blames_the_network_not_the_step_size() -> None:
    # DCGD sends nothing in round 0 (a finite clock), then 8·bits/B overflows for B = 1e-310:
    # before stop 35 the run ended "diverged ... step size too large?" (the table's
    # time_model_s was inf); now it is the network's one-line error
    with pytest.raises(ValueError, match=r"^the network model's time of a round is inf s") as e:
        simulate(PROBLEM, "dcgd", "rand_k[k=2]", rounds=3, network="star[up=1e-310,compute=0]")
    msg = str(e.value)
    assert "star[up=1e-310" in msg and "step size" not in msg and "\n" not in msg
