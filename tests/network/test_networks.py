"""The network cost model: closed forms on hand-computed cases, the slowest-client rule,
infinitely fast links, zero compute, per-client values, and one-line errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shrinkgrad.network import (
    DISTRIBUTIONS,
    NETWORKS,
    Collective,
    Cost,
    PSMessages,
    RoundCost,
    make_network,
    point_to_point,
    ring_allgather,
    ring_allreduce,
)
from shrinkgrad.sim import simulate


def close(cost: Cost | RoundCost, transfer: float, latency: float) -> None:
    assert cost.transfer_s == pytest.approx(transfer, rel=1e-12, abs=1e-15)
    assert cost.latency_s == pytest.approx(latency, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------------------------
def test_ring_allreduce_closed_form() -> None:
    # S = 1 MB, p = 4, 1 Gbit/s, 50 µs: 2·3/4 · 8e6/1e9 = 12 ms; 2·3·50 µs = 300 µs
    close(ring_allreduce(1e6, 4, 1e9, 50e-6), 0.012, 300e-6)
    close(ring_allreduce(1e6, 1, 1e9, 50e-6), 0.0, 0.0)  # one rank sends nothing
    close(ring_allreduce(0, 4, 1e9, 50e-6), 0.0, 0.0)


def test_ring_allgather_closed_form() -> None:
    # b = 1000 B per rank, p = 4, 100 Mbit/s, 1 ms: 3 · 8000/1e8 = 240 µs; 3 ms
    close(ring_allgather(1000, 4, 100e6, 1e-3), 240e-6, 3e-3)
    # = (p−1)/p · 8(p·b)/B: the gathered p·b bytes at (p−1)/p of the bandwidth
    c = ring_allgather(1000, 4, 100e6, 0.0)
    assert c.transfer_s == pytest.approx(3 / 4 * 8 * 4000 / 100e6, rel=1e-15)


def test_point_to_point_closed_form() -> None:
    close(point_to_point(1250, 1e6, 5e-3), 0.01, 5e-3)
    close(point_to_point(0, 1e6, 5e-3), 0.0, 0.0)  # nothing sent, no latency


def test_ring_network_uses_the_slowest_link() -> None:
    net = make_network("ring[bandwidth=[1gbit,100mbit,1gbit],latency=[10us,1ms,10us]]")
    # all-reduce of 3000 B on 3 ranks at 100 Mbit/s, 1 ms: 2·2/3·24000/1e8, 2·2·1e-3
    close(net.collective(Collective("allreduce", 3000), 3), 2 * 2 / 3 * 24000 / 1e8, 4e-3)
    close(net.collective(Collective("allgather", 3000), 3), 2 * 24000 / 1e8, 2e-3)


def test_a_shared_link_gives_each_rank_its_share() -> None:
    # 4 ranks behind one 1 Gbit/s bucket (benchmarks/ddp.py's tc emulation): each gets 250 Mbit/s.
    # All-reduce of S = 1 MB: 2·3/4 · 8e6/2.5e8 = 48 ms = 2(p−1)·8S/B, every byte all ranks send
    # over B; latency is not shared: 2·3·50 µs
    net = make_network("ring[bandwidth=1gbit,latency=50us,shared=4]")
    close(net.collective(Collective("allreduce", 1e6), 4), 0.048, 300e-6)
    assert net.collective(Collective("allreduce", 1e6), 4).transfer_s == pytest.approx(
        2 * 3 * 8e6 / 1e9, rel=1e-15
    )
    # all-gather of 1000 B per rank: 3 · 8000/2.5e8 = 96 µs, 3 latencies
    close(net.collective(Collective("allgather", 1000), 4), 96e-6, 150e-6)
    assert np.array_equal(net.links(4).up, np.full(4, 2.5e8))
    # the same numbers as writing the share by hand, and shared=1 (the default) is a link per rank
    by_hand = make_network("ring[bandwidth=250mbit,latency=50us]")
    for kind in ("allreduce", "allgather"):
        c = Collective(kind, 12345)  # type: ignore[arg-type]
        assert net.collective(c, 4) == by_hand.collective(c, 4)
    assert make_network("ring[bandwidth=1gbit,shared=1]").links(2).up.tolist() == [1e9, 1e9]
    assert make_network("ring[bandwidth=1gbit]").shared == 1
    # a server round on the ring uses the share too: all-gather of 1000 B among 4 active ranks
    close(net.round([1000.0] * 4), 96e-6, 150e-6)


def test_star_collectives_go_through_the_server() -> None:
    net = make_network("star[up=8mbit,down=[8mbit,8mbit,4mbit],latency=0]")
    # all-gather of 1000 B: every rank uploads 8000 bits (1 ms); the server then sends each rank
    # the other two blocks: 16000 bits, 4 ms to the slowest download
    close(net.collective(Collective("allgather", 1000), 3), 1e-3 + 4e-3, 0.0)
    # all-reduce: the sum (1000 B) comes back: 1 ms + 2 ms
    close(net.collective(Collective("allreduce", 1000), 3), 1e-3 + 2e-3, 0.0)


def test_a_ddp_step_is_the_slowest_compute_plus_every_collective() -> None:
    net = make_network("ring[bandwidth=1gbit,latency=50us,compute=[10ms,30ms,20ms,10ms]]")
    colls = [Collective("allreduce", 1_000_000), Collective("allgather", 1000)]
    step = net.step(colls, 4)
    assert step.compute_s == 0.03
    close(step, 0.012 + 3 * 8000 / 1e9, 300e-6 + 150e-6)
    assert step.total_s == pytest.approx(0.03 + 0.012 + 24e-6 + 450e-6, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# a server round: the slowest (sampled) client
# ---------------------------------------------------------------------------------------------
def test_star_round_is_set_by_the_slowest_client() -> None:
    net = make_network("star[up=[10mbit,1mbit],down=100mbit,latency=20ms,compute=[10ms,5ms]]")
    up, down = [1250, 1250], [12500, 12500]  # 10⁴ bits up, 10⁵ bits down
    # client 0: 1 ms down + 10 ms + 1 ms up + 2·20 ms = 52 ms
    # client 1: 1 ms down +  5 ms + 10 ms up + 40 ms = 56 ms  <- the round
    r = net.round(up, down)
    assert r.client == 1
    assert (r.compute_s, r.total_s) == (0.005, pytest.approx(0.056, rel=1e-12))
    close(r, 0.011, 0.04)
    # partial participation: only client 0 sampled -> 52 ms
    r0 = net.round(up, down, active=[True, False])
    assert r0.client == 0 and r0.total_s == pytest.approx(0.052, rel=1e-12)
    # a client that sends and receives nothing is not sampled (the default)
    assert net.round([1250, 0], [12500, 0]).client == 0


def test_stragglers_count_through_per_client_compute() -> None:
    net = make_network("star[up=1gbit,latency=1ms,compute=[1ms,1ms,1ms,200ms]]")
    r = net.round([100] * 4, [100] * 4)
    assert r.client == 3 and r.compute_s == 0.2
    # not sampled, the straggler costs nothing
    assert net.round([100] * 4, [100] * 4, active=[1, 1, 1, 0]).compute_s == 0.001


def test_ring_round_all_gathers_the_largest_message_or_all_reduces() -> None:
    net = make_network("ring[bandwidth=1mbit,latency=1ms]")
    up = [100, 300, 200, 0]  # client 3 not sampled: still in the ring, it needs the aggregate
    close(net.round(up, compute=0.0), 3 * 8 * 300 / 1e6, 3e-3)  # padded to 300 B, 4 ranks
    close(net.round(up, summable=True), 2 * 3 / 4 * 8 * 300 / 1e6, 6e-3)
    # one sampled rank (IAG's rounds) still has to reach the other three: not free
    close(net.round([0, 72, 0, 0], compute=0.0), 3 * 8 * 72 / 1e6, 3e-3)
    # the slowest link of the ring sets it, sampled or not
    slow = make_network("ring[bandwidth=[1mbit,1mbit,1mbit,100kbit],latency=1ms]")
    close(slow.round(up, compute=0.0), 3 * 8 * 300 / 1e5, 3e-3)


def test_parameter_server_cycle_is_point_to_point_over_the_workers_link() -> None:
    net = make_network("star[up=[1mbit,2mbit],down=10mbit,latency=5ms]")
    msgs = PSMessages(down=(1016,), up=(72, 66))
    c = net.ps_cycle(msgs, 0, 2, compute=0.002)
    close(c, 8 * 1016 / 1e7 + 8 * 138 / 1e6, 3 * 5e-3)
    assert c.compute_s == 0.002 and c.client == 0
    c1 = net.ps_cycle(msgs, 1, 2, compute=0.002)
    assert c1.transfer_s == pytest.approx(8 * 1016 / 1e7 + 8 * 138 / 2e6, rel=1e-12)
    with pytest.raises(ValueError, match=r"client must be an integer in \[0, 2\)"):
        net.ps_cycle(msgs, 2, 2)


# ---------------------------------------------------------------------------------------------
# limits: infinitely fast network, zero compute
# ---------------------------------------------------------------------------------------------
ROUNDS = [([1250.0, 2500.0, 0.0], [12500.0, 12500.0, 0.0]), ([5000.0, 1.0, 7.0], [0.0, 1.0, 9.0])]


@pytest.mark.parametrize("spec", ["star[up=inf,latency=0]", "ring[bandwidth=inf]"])
def test_an_infinitely_fast_network_costs_the_compute_time(spec: str) -> None:
    net = make_network(spec)
    compute = [0.01, 0.05, 0.03]
    for up, down in ROUNDS:
        r = net.round(up, down, compute=compute)
        active = [i for i in range(3) if up[i] > 0 or down[i] > 0]
        assert r.total_s == max(compute[i] for i in active)
        assert r.transfer_s == 0.0 and r.latency_s == 0.0
    given = make_network(spec.replace("]", ",compute=50ms]"))
    total = RoundCost.total(given.round(up, down, compute=compute) for up, down in ROUNDS)
    assert total.total_s == pytest.approx(2 * 0.05, rel=1e-15)  # the spec's compute wins


def test_zero_compute_costs_bytes_over_bandwidth_plus_latency_per_message() -> None:
    net = make_network("star[up=[1mbit,2mbit,4mbit],down=10mbit,latency=[1ms,2ms,3ms]]")
    bw_up, bw_down, lat = [1e6, 2e6, 4e6], 1e7, [1e-3, 2e-3, 3e-3]
    total = 0.0
    for up, down in ROUNDS:
        r = net.round(up, down)
        per = [
            (8 * up[i] / bw_up[i] + lat[i] if up[i] else 0.0)
            + (8 * down[i] / bw_down + lat[i] if down[i] else 0.0)
            for i in range(3)
        ]
        assert r.compute_s == 0.0 and r.total_s == pytest.approx(max(per), rel=1e-12)
        total += r.total_s
    ring = make_network("ring[bandwidth=1mbit,latency=1ms]")
    colls = [Collective("allreduce", 4000), Collective("allgather", 100)]
    steps = [ring.step(colls, 4) for _ in range(5)]
    per_step = (2 * 3 / 4 * 32000 / 1e6 + 6e-3) + (3 * 800 / 1e6 + 3e-3)
    assert RoundCost.total(steps).total_s == pytest.approx(5 * per_step, rel=1e-12)


def test_measured_compute_is_used_when_the_spec_gives_none() -> None:
    net = make_network("star[up=inf]")
    assert net.round([1, 1], compute=0.25).total_s == 0.25
    assert net.round([1, 1], compute=[0.25, 0.5]).total_s == 0.5
    assert net.round([1, 1]).total_s == 0.0
    with pytest.raises(ValueError, match=r"one value per client \(2\)"):
        net.round([1, 1], compute=[1.0, 2.0, 3.0])


# ---------------------------------------------------------------------------------------------
# per-client values and distributions
# ---------------------------------------------------------------------------------------------
def test_per_client_lists_and_single_values() -> None:
    net = make_network("star[up=[10mbit,1mbit],latency=20ms]")
    links = net.links(2)
    np.testing.assert_array_equal(links.up, [10e6, 1e6])
    np.testing.assert_array_equal(links.down, links.up)  # down defaults to up
    np.testing.assert_array_equal(links.latency, [0.02, 0.02])


@pytest.mark.parametrize(
    "dist",
    [
        "loguniform[low=1mbit,high=100mbit,seed=3]",
        "uniform[low=1mbit,high=100mbit,seed=3]",
        "lognormal[median=20mbit,sigma=1,seed=3]",
    ],
)
def test_distributions_are_keyed_by_seed_and_client(dist: str) -> None:
    net = make_network(f"star[up={dist}]")
    a = net.links(50).up
    # client i's value depends on (seed, i) only: more clients never change the first ones
    np.testing.assert_array_equal(net.links(20).up, a[:20])
    np.testing.assert_array_equal(make_network(f"star[up={dist}]").links(50).up, a)
    other = make_network(f"star[up={dist.replace('seed=3', 'seed=4')}]").links(50).up
    assert not np.array_equal(a, other)
    assert np.all(a > 0) and len(np.unique(a)) == 50
    if "uniform" in dist:
        assert a.min() >= 1e6 and a.max() <= 100e6


def test_distribution_shapes() -> None:
    n = 20001
    lu = make_network("star[up=loguniform[low=1mbit,high=100mbit]]").links(n).up
    # log10 is uniform on [6, 8]: mean 7, quartiles 6.5 and 7.5 (tolerance ≈ 6σ)
    logs = np.log10(lu)
    assert abs(logs.mean() - 7.0) < 6 * (2 / math.sqrt(12)) / math.sqrt(n)
    assert abs(np.quantile(logs, 0.25) - 6.5) < 0.03
    ln = make_network("star[up=lognormal[median=20mbit,sigma=0.5]]").links(n).up
    z = np.log(ln / 20e6) / 0.5  # standard normal
    assert abs(z.mean()) < 6 / math.sqrt(n) and abs(z.std() - 1.0) < 0.03
    assert abs(np.median(ln) / 20e6 - 1.0) < 0.03


def test_registries_list_the_components() -> None:
    assert NETWORKS.names() == ["ring", "star"]
    assert DISTRIBUTIONS.names() == ["lognormal", "loguniform", "uniform"]
    net = make_network("star", up="10mbit", latency="20ms")  # keyword arguments
    assert net.spec == "star[up=10mbit,latency=20ms]"
    assert make_network(net.spec).links(3).up.tolist() == [10e6] * 3


# ---------------------------------------------------------------------------------------------
# mistakes: one line naming the parameter and the allowed form
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("star[up=-1mbit]", r"^star parameter 'up' must be > 0, got '-1mbit'; give a bandwidth"),
        ("star[up=10mbat]", r"^star parameter 'up': cannot read '10mbat'; give a bandwidth"),
        ("star[up=1mbit,down=0]", r"^star parameter 'down' must be > 0"),
        ("ring[bandwidth=1gbit,latency=-2ms]", r"^ring parameter 'latency' must be >= 0"),
        ("ring[bandwidth=1gbit,latency=2parsecs]", r"^ring parameter 'latency': cannot read"),
        ("star[up=1mbit,compute=fast]", r"^star parameter 'compute': cannot read 'fast'"),
        ("star[up=[1mbit,-2mbit]]", r"^star parameter 'up'\[1\] must be > 0"),
        ("star[up=[]]", r"^star parameter 'up': an empty list"),
        ("star[up=[1mbit,2mbit],latency=[1ms]]", r"^star: the per-client lists differ"),
        ("star[up=gauss[mean=1]]", r"^star parameter 'up': unknown distribution 'gauss'"),
        ("star[up=uniform[low=5mbit,high=1mbit]]", r"^star parameter 'up': uniform needs"),
        ("star[up=loguniform[low=0,high=1mbit]]", r"^star parameter 'up'.*must be > 0"),
        (
            "star[up=loguniform[low=100mbit,high=1mbit]]",
            r"^star parameter 'up': loguniform needs finite low <= high",
        ),
        ("star[latency=1ms]", r"^network 'star' needs parameter 'up'"),
        ("star[up=1mbit,bw=2]", r"^network 'star' has no parameter 'bw'; allowed: up \(a band"),
        ("stra[up=1mbit]", r"^unknown network 'stra'; known: ring, star \(did you mean 'star'"),
        ("ring[bandwidth=1gbit,shared=0]", r"^ring parameter 'shared' must be an integer >= 1"),
        ("ring[bandwidth=1gbit,shared=-2]", r"^ring parameter 'shared' must be an integer >= 1"),
        ("ring[bandwidth=1gbit,shared=2.5]", r"parameter 'shared' must be an integer, got 2.5"),
        ("ring[bandwidth=1gbit,shared=all]", r"parameter 'shared' must be an integer"),
    ],
)
def test_config_mistakes_are_one_line_errors(spec: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as e:
        make_network(spec)
    assert "\n" not in str(e.value)


def test_more_ranks_sharing_a_link_than_the_ring_has_is_an_error() -> None:
    net = make_network("ring[bandwidth=1gbit,shared=5]")
    assert net.links(5).up.tolist() == [2e8] * 5
    with pytest.raises(ValueError, match=r"'shared' is 5, but the ring has 3 ranks"):
        net.round([100, 100, 100])
    with pytest.raises(ValueError, match=r"'shared' is 5, but the ring has 3 ranks"):
        simulate("synthetic_least_squares[n_clients=3,d=4]", "gd", rounds=1, network=net)


def test_a_list_of_the_wrong_length_names_the_parameter_and_the_count() -> None:
    net = make_network("star[up=[10mbit,10mbit,1mbit]]")
    with pytest.raises(ValueError) as e:
        net.round([100, 100, 100, 100])
    assert str(e.value) == (
        "star parameter 'up': a list of 3 values for 4 clients; give one value per client "
        "(4 values) or a single value"
    )
    with pytest.raises(ValueError, match="star parameter 'up': a list of 3 values for 2"):
        net.collective(Collective("allreduce", 10), 2)
