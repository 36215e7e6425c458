"""The modelled wall clock of a simulated run: each round's traffic on a network.

The simulator (:mod:`shrinkgrad.sim`) hands every round's :class:`~shrinkgrad.methods.Traffic`
— the bits each client of the round sent up and received down, counted by the method from the
compressor's honest ``bits`` — and the round's measured wall time to a :class:`ModelClock`, which
asks the network for the round's cost (:meth:`~.topology.Network.round`) and keeps the sum: the
table's ``time_model_s`` column,

    time_model_s(T) = Σ_{r=0}^{T} max_{i active in round r} t_i(r)        (on a star)

with t_i = [D_i > 0](α_i + 8D_i/B↓_i) + c_i + [U_i > 0](α_i + 8U_i/B↑_i) (docs/network.md §2;
round 0 is the initialisation), where U_i and D_i are the bytes on the wire of client i's
messages of the round: ⌈bits/8⌉ each (:func:`~.traffic.wire_bytes`; the wire format pads every
message to a whole byte), not bits/8. On a ring a round is an all-reduce when its messages can be
summed — the run's compressor's are (:func:`~.traffic.summable`), or the round sent
uncompressed vectors (:func:`~.traffic.round_summable`: EF21's full initialisation) — and an
all-gather otherwise. PowerSGD's shared basis sends its factors in two stages, P then Q
(:func:`~.traffic.stage_shares`): two all-reduces on a ring, two round trips on a star
(docs/network.md §2). A round whose modelled time is not finite is a one-line ValueError that
blames the network (:func:`overflow_message`), not the step size. The active clients are those
that send or receive anything: with partial participation the sampled ones, so a round costs
what its slowest sampled client costs.

Compute time c_i is the network spec's ``compute`` when it gives one, else the round's measured
wall time divided by n (one client's share of the vectorised step, which computes every client on
one tensor axis: the share the simulator's ``time_s`` charges each of the n clients).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .topology import Network, RoundCost, make_network
from .traffic import round_stages, round_summable, stage_shares, summable, wire_bytes

if TYPE_CHECKING:
    import torch

    from ..methods.base import Traffic

__all__ = ["ModelClock", "network_of", "overflow_message"]


def network_of(value: Any, what: str = "network") -> Network | None:
    """``value`` as a :class:`~.topology.Network`: a network, a spec string, or None.

    A mistake is one ValueError line naming ``what`` and the allowed forms.
    """
    if value is None or isinstance(value, Network):
        return value
    if isinstance(value, str):
        try:
            return make_network(value)
        except (ValueError, TypeError, KeyError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{what}: {msg}") from None
    raise ValueError(
        f"{what} must be a network spec such as 'star[up=10mbit,down=100mbit,latency=20ms]' or "
        f"'ring[bandwidth=1gbit,latency=50us]', a shrinkgrad.network.Network, or None; got "
        f"{type(value).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class ModelClock:
    """The cost of a simulated round on ``network`` for ``n`` clients (module docstring).

    ``summable``: whether the compressed messages can be all-reduced (rings only; see
    :func:`~.traffic.summable`); a round of uncompressed vectors always can. ``stages``: the
    shares of a compressed message sent in successive exchanges (:func:`~.traffic.stage_shares`:
    PowerSGD's shared basis, P then Q; one exchange otherwise).
    """

    network: Network
    n: int
    summable: bool = False
    stages: tuple[float, ...] = (1.0,)

    @classmethod
    def of(cls, network: Network, n: int, compressor: Any, d: int) -> ModelClock:
        """The clock of a run of ``n`` clients with ``compressor`` on vectors of ``d`` entries
        (the shares of a compressor sent in stages follow from d: :func:`~.traffic.stage_shares`);
        checks now that the network's per-client lists fit ``n`` (one-line error otherwise)."""
        cls.check(network, n)
        return cls(network, int(n), summable(compressor), stage_shares(compressor, d))

    @staticmethod
    def check(network: Network, n: int) -> None:
        """Raise a one-line ValueError when ``network`` cannot describe ``n`` clients (a
        per-client list of another length)."""
        network.links(n)
        network.compute_times(n)

    def describe(self) -> str:
        """The network with its links for this run's clients (one line)."""
        return self.network.describe(self.n)

    def round(self, traffic: Traffic, ids: torch.Tensor, elapsed_s: float) -> RoundCost:
        """The cost of one round in which the clients ``ids`` moved ``traffic`` (bits) and the
        vectorised step took ``elapsed_s`` seconds."""
        up = np.zeros(self.n)
        down = np.zeros(self.n)
        idx = ids.detach().cpu().numpy()
        up[idx] = wire_bytes(traffic.up)  # ⌈bits/8⌉: every message is whole bytes on the wire
        down[idx] = wire_bytes(traffic.down)
        cost = self.network.round(
            up,
            down,
            compute=max(0.0, float(elapsed_s)) / self.n,
            summable=round_summable(traffic, self.summable),
            stages=round_stages(traffic, self.stages),
        )
        if not math.isfinite(cost.total_s):
            raise ValueError(overflow_message(cost.total_s, self.describe()))
        return cost

    def seconds(self, traffic: Traffic, ids: torch.Tensor, elapsed_s: float) -> float:
        """:meth:`round`'s total in seconds."""
        return self.round(traffic, ids, elapsed_s).total_s


def overflow_message(seconds: float, network: str) -> str:
    """The one line that blames an overflowing modelled time on the network (not on the step
    size or x⁰): a bandwidth so small, or a latency or compute time so large, that a round's
    seconds are not a finite number."""
    return (
        f"the network model's time of a round is {seconds} s: the network {network} has values "
        "out of any physical range (its latency, bandwidth or compute); give finite, realistic "
        "ones"
    )
