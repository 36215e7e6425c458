"""Audit of the network time model against first-principles computations written here.

Every expected time is computed in this file from the α–β model (Hockney; Thakur, Rabenseifner,
Gropp, IJHPCA 2005): a message of S bytes over a link of B bit/s and latency α takes α + 8S/B;
ring all-reduce 2(p−1)/p·8S/B + 2(p−1)α; ring all-gather (p−1)(8b/B + α); and the bytes of a
message are what the wire format sends — the length of ``C.encode(x)``, ⌈bits/8⌉ (the format
pads each message to a whole byte: :mod:`shrinkgrad.compressors._wire`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shrinkgrad.cli import main
from shrinkgrad.compressors import make_compressor
from shrinkgrad.network import (
    Collective,
    hook_collectives,
    make_network,
    parse_bandwidth,
    parse_duration,
    point_to_point,
    ring_allgather,
    ring_allreduce,
)
from shrinkgrad.network.estimate import estimate
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate

N, D = 3, 123  # ⌈log2 123⌉ = 7: a top_k[k=1] message is 32 + 7 = 39 bits, not whole bytes
PROBLEM = f"synthetic_least_squares[n_clients={N},d={D}]"
DENSE_BYTES = 4 * D  # one float32 d-vector (EF21's full initialisation)


def _payload_bytes(spec: str, d: int = D) -> int:
    """Bytes of the wire message of ``spec`` on a d-vector: the length of its encoding."""
    C = make_compressor(spec)
    x = torch.randn(d, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    keys = None if C.deterministic else Keys.derive(0, round=0, client=0)
    return int(C.encode(x, keys).numel())


# -- (a) whole bytes on the wire -------------------------------------------------------------------


def test_top_k_payload_is_whole_bytes() -> None:
    # the premise of the tests below: 39 bits travel as 5 bytes (40 bits), not 4.875
    bits = 32 + math.ceil(math.log2(D))
    assert make_compressor("top_k[k=1]").bits(D) == bits == 39
    assert _payload_bytes("top_k[k=1]") == math.ceil(bits / 8) == 5


@pytest.mark.parametrize(
    "spec", ["top_k[k=1]", "scaled_sign", "qsgd[s=4]", "rand_k[k=3]", "natural", "identity"]
)
def test_wire_bytes_is_the_encoded_length(spec: str) -> None:
    from shrinkgrad.network.traffic import wire_bytes

    bits = make_compressor(spec).bits(D)
    assert wire_bytes([bits, 0.0]).tolist() == [_payload_bytes(spec), 0.0]
    assert wire_bytes(torch.tensor([bits], dtype=torch.float64)).tolist() == [_payload_bytes(spec)]


def test_simulated_star_round_charges_the_wire_payload() -> None:
    B = 1000.0  # 1 kbit/s uplink, an infinitely fast downlink, no compute, no latency
    r = simulate(
        PROBLEM, "ef21", "top_k[k=1]", rounds=4, network="star[up=1kbit,down=inf,compute=0]"
    )
    S = _payload_bytes("top_k[k=1]")
    # round 0: the dense gradient up (4d bytes); then one top_k message per round
    want = [8 * DENSE_BYTES / B + k * 8 * S / B for k in range(5)]
    np.testing.assert_allclose(r.table["time_model_s"], want, rtol=1e-12)


def test_simulated_ring_round_is_the_hook_all_gather_of_the_payload() -> None:
    B, a = 1000.0, 0.005
    net = "ring[bandwidth=1kbit,latency=5ms,compute=0]"
    r = simulate(PROBLEM, "ef21", "top_k[k=1]", rounds=3, network=net)
    S = _payload_bytes("top_k[k=1]")
    init = 2 * (N - 1) / N * 8 * DENSE_BYTES / B + 2 * (N - 1) * a  # dense sums: all-reduce
    per_round = (N - 1) * (8 * S / B + a)  # top_k: ring all-gather of S bytes per rank
    want = [init + k * per_round for k in range(4)]
    np.testing.assert_allclose(r.table["time_model_s"], want, rtol=1e-12)
    # the DDP hook sends the same block for one tensor of d entries; a step costs the same
    colls = hook_collectives("top_k[k=1]", [D], min_numel=1)
    assert [(c.kind, c.nbytes) for c in colls] == [("allgather", S)]
    step = make_network(net).step(colls, N)
    assert step.total_s == pytest.approx(per_round, rel=1e-12)


def test_estimate_charges_the_wire_payload() -> None:
    B = 1000.0
    e = estimate(
        PROBLEM, "ef21", "top_k[k=1]", "star[up=1kbit,down=inf,compute=0]", rounds=10, measure=2
    )
    S = _payload_bytes("top_k[k=1]")
    assert e.per_round.transfer_s == pytest.approx(8 * S / B, rel=1e-12)
    assert e.init.transfer_s == pytest.approx(8 * DENSE_BYTES / B, rel=1e-12)
    assert e.time_s == pytest.approx(8 * DENSE_BYTES / B + 10 * 8 * S / B, rel=1e-12)
    assert e.bits_up_per_round == 39.0  # the bits column stays the exact bit count


# -- closed forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 8])
def test_ring_collectives_and_star_collectives_closed_forms(p: int) -> None:
    S, B, a = 4096, 1e9, 50e-6
    ar = ring_allreduce(S, p, B, a)
    ag = ring_allgather(S, p, B, a)
    assert ar.total_s == pytest.approx(2 * (p - 1) / p * 8 * S / B + 2 * (p - 1) * a, rel=1e-12)
    assert ag.total_s == pytest.approx((p - 1) * (8 * S / B + a), rel=1e-12)
    ring = make_network("ring[bandwidth=1gbit,latency=50us]")
    assert ring.collective(Collective("allreduce", S), p).total_s == pytest.approx(ar.total_s)
    # a parameter-server star: every rank uploads S, the server sends back the sum (S) or the
    # other ranks' blocks ((p − 1)S); the slowest link ends each phase
    up, down, lat = 10e6, 100e6, 0.02
    star = make_network("star[up=10mbit,down=100mbit,latency=20ms]")
    want_ar = 0.0 if p == 1 else (lat + 8 * S / up) + (lat + 8 * S / down)
    want_ag = 0.0 if p == 1 else (lat + 8 * S / up) + (lat + 8 * (p - 1) * S / down)
    assert star.collective(Collective("allreduce", S), p).total_s == pytest.approx(want_ar)
    assert star.collective(Collective("allgather", S), p).total_s == pytest.approx(want_ag)
    assert point_to_point(S, B, a).total_s == pytest.approx(8 * S / B + a, rel=1e-12)


# -- heterogeneous rounds: the slowest participant --------------------------------------------


def test_star_round_is_set_by_the_slowest_active_client() -> None:
    net = make_network(
        "star[up=[10mbit,10mbit,1mbit],down=100mbit,latency=[1ms,2ms,3ms],compute=[10ms,10ms,50ms]]"
    )
    up = np.array([1000.0, 3000.0, 1000.0])
    down = np.array([4000.0, 4000.0, 4000.0])
    Bu, Bd = [10e6, 10e6, 1e6], 100e6
    lat, comp = [1e-3, 2e-3, 3e-3], [10e-3, 10e-3, 50e-3]
    t = [lat[i] + 8 * down[i] / Bd + comp[i] + lat[i] + 8 * up[i] / Bu[i] for i in range(3)]
    cost = net.round(up, down)
    assert cost.total_s == pytest.approx(max(t), rel=1e-12) and cost.client == 2
    # the straggler not sampled: the others set the round
    cost = net.round(up, down, active=[True, True, False])
    assert cost.total_s == pytest.approx(max(t[:2]), rel=1e-12) and cost.client == 1


def test_ring_round_is_set_by_the_slowest_link_and_compute() -> None:
    net = make_network(
        "ring[bandwidth=[1gbit,100mbit,1gbit],latency=[50us,10us,80us],compute=[1ms,4ms,2ms]]"
    )
    S = 10_000.0
    cost = net.round([S, S, S], summable=True)
    want = 4e-3 + 2 * 2 / 3 * 8 * S / 100e6 + 2 * 2 * 80e-6
    assert cost.total_s == pytest.approx(want, rel=1e-12)


# -- (b) the network's draws: keyed by the distribution's seed, not the run's -----------------


def test_network_draws_are_keyed_by_the_spec_seed_not_the_run_seed() -> None:
    spec = "star[up=loguniform[low=1mbit,high=100mbit,seed={s}],compute=0]"
    lo, hi, n = 1e6, 1e8, 5
    for s in (0, 3):
        u = Keys.derive(s, client=np.arange(n), stream="network").uniform(1).numpy()[:, 0]
        want = lo * (hi / lo) ** u
        np.testing.assert_allclose(make_network(spec.format(s=s)).links(n).up, want, rtol=1e-12)
    # another spec seed is another network; more clients leave the first ones' links alone
    a, b = make_network(spec.format(s=0)), make_network(spec.format(s=3))
    assert not np.allclose(a.links(n).up, b.links(n).up)
    np.testing.assert_array_equal(a.links(n + 4).up[:n], a.links(n).up)
    # the run's seed does not redraw the network (documented: a fixed population of clients)
    runs = [simulate(PROBLEM, "gd", rounds=2, seed=s, network=spec.format(s=3)) for s in (0, 1)]
    np.testing.assert_array_equal(runs[0].table["time_model_s"], runs[1].table["time_model_s"])


# -- units and user mistakes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits_per_s"),
    [
        ("10mbit", 10e6),
        ("10Mbit/s", 10e6),
        ("10Mb", 10e6),
        ("10Mbps", 10e6),
        ("10MB", 80e6),
        ("10MB/s", 80e6),
        ("10MBps", 80e6),
        ("1gbit", 1e9),
        ("1GByte", 8e9),
        ("100kbit/s", 1e5),
        ("12.5MB/s", 100e6),
        ("2500", 2500.0),
    ],
)
def test_bandwidth_units(text: str, bits_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bits_per_s, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("20ms", 0.02), ("50us", 50e-6), ("50µs", 50e-6), ("0.05s", 0.05), ("3ns", 3e-9), ("2", 2.0)],
)
def test_duration_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-15)


def test_numpy_numbers_are_numbers() -> None:
    # the entries of a per-client numpy array are numbers, not unreadable text
    assert parse_bandwidth(np.int64(10)) == 10.0
    assert parse_duration(np.float32(0.5)) == 0.5
    net = make_network("star", up=np.array([1_000_000, 2_000_000]), latency=np.array([0, 1]))
    np.testing.assert_array_equal(net.links(2).up, [1e6, 2e6])
    with pytest.raises(ValueError, match="must be > 0"):
        parse_bandwidth(np.int64(0))
    with pytest.raises(ValueError, match="cannot read"):
        parse_bandwidth(np.bool_(True))


@pytest.mark.parametrize("bad", ["0", "0mbit", "-1mbit", "nan", float("nan"), 0.0, -5])
def test_a_bad_bandwidth_is_one_clear_line(bad: object) -> None:
    with pytest.raises(ValueError, match=r"must be > 0|cannot read") as e:
        parse_bandwidth(bad, "up")
    assert "\n" not in str(e.value) and "10mbit" in str(e.value)
    with pytest.raises(ValueError, match="bandwidth must be > 0") as e:
        ring_allreduce(100, 2, float(bad) if not isinstance(bad, str) else 0.0, 0.0)


def test_cli_refuses_a_zero_bandwidth_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--problem", PROBLEM, "--network", "star[up=0mbit]", "--rounds", "1"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'up' must be > 0" in err and "Traceback" not in err
