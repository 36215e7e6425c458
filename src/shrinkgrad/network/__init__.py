"""A cost model of one round on a described network: "how long", not only "how many bits".

* :mod:`.units` — bandwidths (``10mbit``, ``1gbit``, ``12.5MB/s``) and durations (``20ms``);
* :mod:`.values` — per-client values: one, a list, or a seeded distribution (``loguniform[...]``);
* :mod:`.collectives` — closed forms of ring all-reduce, ring all-gather, point to point;
* :mod:`.traffic` — the bytes each runtime sends, from the compressor's ``bits`` and
  ``collective`` (the DDP hook's rules, the parameter server's messages);
* :mod:`.topology` — the networks (``star[...]``, ``ring[...]``, a registry) and the time of a
  server round, a DDP step and a parameter-server cycle (:class:`RoundCost`);
* :mod:`.clock` — the simulator's modelled wall clock (``simulate(network=...)``,
  the ``time_model_s`` column): each round's traffic on the network;
* :mod:`.estimate` — time to ε: the theory's rounds × the cost of a round.

Example::

    from shrinkgrad.network import make_network, hook_collectives
    net = make_network("ring[bandwidth=1gbit,latency=50us]")
    step = net.step(hook_collectives("top_k", [4096, 64], ratio=0.01), p=4, compute=0.02)
    step.total_s, step.transfer_s, step.latency_s

The formulas and the model's limits: docs/network.md.
"""

from __future__ import annotations

from .clock import ModelClock, network_of
from .collectives import Cost, point_to_point, ring_allgather, ring_allreduce
from .estimate import Estimate, measure_rounds  # network.estimate stays the module
from .topology import NETWORKS, Links, Network, Ring, RoundCost, Star, make_network
from .traffic import (
    Collective,
    PSMessages,
    hook_collectives,
    ps_messages,
    stage_shares,
    summable,
)
from .units import parse_bandwidth, parse_duration
from .values import DISTRIBUTIONS, Distribution, PerClient

__all__ = [
    "DISTRIBUTIONS",
    "NETWORKS",
    "Collective",
    "Cost",
    "Distribution",
    "Estimate",
    "Links",
    "ModelClock",
    "Network",
    "PSMessages",
    "PerClient",
    "Ring",
    "RoundCost",
    "Star",
    "hook_collectives",
    "make_network",
    "measure_rounds",
    "network_of",
    "parse_bandwidth",
    "parse_duration",
    "point_to_point",
    "ps_messages",
    "ring_allgather",
    "ring_allreduce",
    "stage_shares",
    "summable",
]
