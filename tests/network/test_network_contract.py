"""Every registered network and distribution meets the same contract (a new registration
without an example here fails the suite)."""

from __future__ import annotations

import numpy as np
import pytest

from shrinkgrad.network import DISTRIBUTIONS, NETWORKS, Collective, make_network
from shrinkgrad.network.units import parse_bandwidth

#: name → (a spec with latency 0, the same network infinitely fast)
NETWORK_EXAMPLES = {
    "star": ("star[up=[1mbit,2mbit,4mbit],down=8mbit]", "star[up=inf,compute=[1ms,2ms,3ms]]"),
    "ring": ("ring[bandwidth=[1gbit,2gbit,1gbit]]", "ring[bandwidth=inf,compute=[1ms,2ms,3ms]]"),
}
DISTRIBUTION_EXAMPLES = {
    "uniform": "uniform[low=1mbit,high=9mbit,seed=2]",
    "loguniform": "loguniform[low=1mbit,high=9mbit,seed=2]",
    "lognormal": "lognormal[median=3mbit,sigma=0.5,seed=2]",
}


def test_every_registered_component_has_an_example() -> None:
    assert set(NETWORK_EXAMPLES) == set(NETWORKS.names())
    assert set(DISTRIBUTION_EXAMPLES) == set(DISTRIBUTIONS.names())


@pytest.mark.parametrize("name", sorted(NETWORK_EXAMPLES))
def test_network_contract(name: str) -> None:
    spec, fast_spec = NETWORK_EXAMPLES[name]
    net, fast = make_network(spec), make_network(fast_spec)
    assert make_network(net.spec).spec == net.spec  # the canonical spec round-trips
    up, down = np.array([100.0, 250.0, 50.0]), np.array([400.0, 400.0, 400.0])
    for summable in (False, True):
        r1 = net.round(up, down, summable=summable)
        r2 = net.round(2 * up, 2 * down, summable=summable)
        # latency 0: the time is linear in the bytes; nothing sent costs nothing
        assert r2.transfer_s == pytest.approx(2 * r1.transfer_s, rel=1e-12) and r1.transfer_s > 0
        assert r1.latency_s == 0 and r1.compute_s == 0
        assert net.round(np.zeros(3), np.zeros(3), summable=summable).total_s == 0
        # infinitely fast: exactly the slowest active client's compute
        assert fast.round(up, down, summable=summable).total_s == 0.003
        assert fast.round(up, down, active=[1, 1, 0], summable=summable).total_s == 0.002
    for kind in ("allreduce", "allgather"):
        c = net.collective(Collective(kind, 1000), 3)  # type: ignore[arg-type]
        assert c.transfer_s > 0 and c.latency_s == 0
        assert net.collective(Collective(kind, 2000), 3).transfer_s == pytest.approx(
            2 * c.transfer_s, rel=1e-12
        )
        assert fast.collective(Collective(kind, 1000), 3).total_s == 0
    assert net.describe(3).startswith(net.spec)


@pytest.mark.parametrize("name", sorted(DISTRIBUTION_EXAMPLES))
def test_distribution_contract(name: str) -> None:
    spec = DISTRIBUTION_EXAMPLES[name]
    dist = DISTRIBUTIONS.make(spec)
    a = dist.draw(64, parse_bandwidth, "up")
    assert a.shape == (64,) and a.dtype == np.float64 and np.all(np.isfinite(a)) and np.all(a > 0)
    np.testing.assert_array_equal(dist.draw(10, parse_bandwidth, "up"), a[:10])  # keyed by client
    np.testing.assert_array_equal(DISTRIBUTIONS.make(dist.spec).draw(64, parse_bandwidth, "up"), a)
    other = DISTRIBUTIONS.make(spec.replace("seed=2", "seed=5")).draw(64, parse_bandwidth, "up")
    assert not np.array_equal(a, other)
