"""Networks: a registry of link models with the time of one round, step or message.

Spelled like every other component (:mod:`shrinkgrad.registry`)::

    star[up=10mbit,down=100mbit,latency=20ms]          # clients ↔ a server (federated, PS)
    star[up=loguniform[low=1mbit,high=100mbit,seed=0],latency=50ms,compute=20ms]
    star[up=[10mbit,10mbit,1mbit],compute=[50ms,50ms,200ms]]   # one value per client
    ring[bandwidth=1gbit,latency=50us]                 # ranks in a ring (DDP on gloo / NCCL)

Every parameter takes one value, a list (one per client) or a seeded distribution
(:mod:`.values`); bandwidths and durations carry units (:mod:`.units`). ``compute`` is a client's
compute time per round; when a spec gives none, the caller's measured time is used (e.g. the
simulator's ``time_s`` scaled to one client's share), else 0.

The time of a round (:class:`RoundCost`, its compute, transfer and latency parts):

* a **server round** (:meth:`Network.round`, the simulator's rounds: every active client
  receives ``down`` bytes, computes, sends ``up`` bytes): on a star each client i takes
  t_i = [D_i > 0](α_i + 8D_i/B↓_i) + c_i + [U_i > 0](α_i + 8U_i/B↑_i), and the round takes
  max_i t_i over the active (sampled) clients — the slowest one, stragglers included; on a ring
  the active ranks compute (max_i c_i) and then all n ranks all-reduce (summable messages) or
  all-gather (padded to the largest message) what the active ones send — every rank holds a
  replica of x and needs the aggregate, so the inactive ranks take part with empty blocks, and
  nothing comes down; a message sent in stages (``stages``: PowerSGD's shared basis, P then Q)
  is one collective per stage on a ring, and on a star one more round trip per stage (the sum
  of the previous stage down, the next share up, after the slowest client: docs/network.md §2);
* a **DDP step** (:meth:`Network.step`): max_i c_i and then the hook's collectives
  (:func:`~.traffic.hook_collectives`) one after the other — no overlap of computation and
  communication;
* a **parameter-server cycle** (:meth:`Network.ps_cycle`): worker i receives the model, computes,
  sends its messages, each point to point over its own link.

Collectives on a ring follow :mod:`.collectives` (slowest link per step); on a star they go
through the server: every rank uploads its part (the slowest upload ends the phase), then the
server sends the result down (the slowest download ends it). The server's own link is not a
bottleneck in this model (docs/network.md, "Limits").
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from ..registry import Registry
from .collectives import (
    Cost,
    check_ranks,
    point_to_point,
    ring_allgather,
    ring_allreduce,
    slowest,
)
from .traffic import Collective, PSMessages
from .units import format_bandwidth, format_duration, parse_bandwidth, parse_duration
from .values import BandwidthValue, DurationValue, PerClient, per_client

__all__ = [
    "NETWORKS",
    "Links",
    "Network",
    "Ring",
    "RoundCost",
    "Star",
    "make_network",
]


@dataclasses.dataclass(frozen=True)
class RoundCost:
    """Seconds of one round: ``compute_s + transfer_s + latency_s`` = :attr:`total_s`.

    Under the slowest-client rule the parts are those of the client that sets the round
    (``client``; None when every rank waits for the same collectives).
    """

    compute_s: float = 0.0
    transfer_s: float = 0.0
    latency_s: float = 0.0
    client: int | None = None

    @property
    def total_s(self) -> float:
        return self.compute_s + self.transfer_s + self.latency_s

    @property
    def communication_s(self) -> float:
        return self.transfer_s + self.latency_s

    def __add__(self, other: RoundCost) -> RoundCost:
        return RoundCost(
            self.compute_s + other.compute_s,
            self.transfer_s + other.transfer_s,
            self.latency_s + other.latency_s,
        )

    def scaled(self, factor: float) -> RoundCost:
        """The cost of ``factor`` such rounds."""
        return RoundCost(
            self.compute_s * factor, self.transfer_s * factor, self.latency_s * factor, self.client
        )

    @staticmethod
    def total(costs: Iterable[RoundCost]) -> RoundCost:
        """The sum of ``costs`` (e.g. a run's rounds)."""
        out = RoundCost()
        for c in costs:
            out = out + c
        return out


@dataclasses.dataclass(frozen=True)
class Links:
    """Every client's uplink and downlink bandwidth (bit/s) and latency (s), shape ``(n,)``."""

    up: np.ndarray
    down: np.ndarray
    latency: np.ndarray


def _vector(x: float | Sequence[float] | np.ndarray, n: int, what: str) -> np.ndarray:
    """``x`` as a float64 vector of length ``n`` (a scalar is broadcast)."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{what} needs one value per client ({n}), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{what} must be finite and >= 0, got {arr.tolist()}")
    return arr


class Network(abc.ABC):
    """Base class of the link models (see the module docstring)."""

    __registry__: ClassVar[Registry[Network]]
    #: canonical name, e.g. ``"star[up=10mbit]"``; set by the registry when built from a name
    spec: str = ""
    compute: PerClient | None = None

    @property
    def name(self) -> str:
        return self.spec or type(self).__name__.lower()

    def __repr__(self) -> str:
        return f"<network {self.name}>"

    def _param(self, raw: Any, parse: Any, key: str) -> PerClient:
        return per_client(raw, parse, f"{type(self).__name__.lower()} parameter {key!r}")

    def _compute(self, raw: Any) -> PerClient | None:
        return None if raw is None else self._param(raw, parse_duration, "compute")

    def _check_counts(self, params: dict[str, PerClient | None]) -> None:
        """Lists given for several parameters must agree on the number of clients."""
        counts = {k: v.count for k, v in params.items() if v is not None and v.count is not None}
        if len(set(counts.values())) > 1:
            listing = ", ".join(f"{k!r} has {c}" for k, c in counts.items())
            raise ValueError(
                f"{type(self).__name__.lower()}: the per-client lists differ in length "
                f"({listing}); give every list one value per client"
            )

    # -- per-client values --------------------------------------------------------------------
    @abc.abstractmethod
    def links(self, n: int) -> Links:
        """The links of ``n`` clients (ranks)."""

    def compute_times(
        self, n: int, measured: float | Sequence[float] | np.ndarray | None = None
    ) -> np.ndarray:
        """Every client's compute time per round: the spec's ``compute`` when given, else
        ``measured`` (one number or one per client), else 0."""
        if self.compute is not None:
            return self.compute.values(n)
        if measured is None:
            return np.zeros(n)
        return _vector(measured, n, "the measured compute time")

    # -- costs --------------------------------------------------------------------------------
    @abc.abstractmethod
    def collective(self, c: Collective, p: int) -> Cost:
        """The time of collective ``c`` among ``p`` ranks."""

    def round(
        self,
        up: Sequence[float] | np.ndarray,
        down: Sequence[float] | np.ndarray | None = None,
        *,
        compute: float | Sequence[float] | np.ndarray | None = None,
        active: Sequence[bool] | np.ndarray | None = None,
        summable: bool = False,
        stages: Sequence[float] | None = None,
    ) -> RoundCost:
        """A server round: client i receives ``down[i]`` bytes, computes, sends ``up[i]`` bytes.

        ``active`` marks the clients that take part (default: those that send or receive
        anything); ``summable`` says the messages can be all-reduced (rings only);
        ``compute`` is the measured compute time (used when the spec gives none); ``stages``
        the shares of every up message sent in successive synchronous exchanges (default one;
        PowerSGD's shared basis two, P then Q: :func:`~.traffic.stage_shares`; summable only).
        """
        u, d = _traffic(up, down)
        shares = _stages(stages, summable)
        act = _active(u, d, active)
        if not act.any():
            return RoundCost()
        return self._round(u, d, act, self.compute_times(u.size, compute), summable, shares)

    @abc.abstractmethod
    def _round(
        self,
        up: np.ndarray,
        down: np.ndarray,
        active: np.ndarray,
        compute: np.ndarray,
        summable: bool,
        stages: tuple[float, ...] = (1.0,),
    ) -> RoundCost:
        """:meth:`round` of checked per-client bytes, flags, compute times (some active) and
        stage shares."""

    def step(
        self,
        collectives: Sequence[Collective],
        p: int,
        *,
        compute: float | Sequence[float] | np.ndarray | None = None,
    ) -> RoundCost:
        """One synchronous step of ``p`` ranks: the slowest compute, then every collective."""
        p = check_ranks(p)
        c = float(np.max(self.compute_times(p, compute)))
        comm = Cost()
        for coll in collectives:
            comm = comm + self.collective(coll, p)
        return RoundCost(c, comm.transfer_s, comm.latency_s)

    def ps_cycle(
        self,
        messages: PSMessages,
        client: int,
        n: int,
        *,
        compute: float | Sequence[float] | np.ndarray | None = None,
    ) -> RoundCost:
        """One cycle of parameter-server worker ``client`` of ``n``: the model down, compute,
        the messages up, each point to point over the worker's own link."""
        if isinstance(client, bool) or not isinstance(client, int) or not 0 <= client < n:
            raise ValueError(f"client must be an integer in [0, {n}), got {client!r}")
        links = self.links(n)
        lat = float(links.latency[client])
        cost = Cost()
        for nbytes in messages.down:
            cost = cost + point_to_point(nbytes, float(links.down[client]), lat)
        for nbytes in messages.up:
            cost = cost + point_to_point(nbytes, float(links.up[client]), lat)
        c = float(self.compute_times(n, compute)[client])
        return RoundCost(c, cost.transfer_s, cost.latency_s, client)

    def describe(self, n: int) -> str:
        """One line: the links of ``n`` clients in words."""
        links = self.links(n)

        def span(v: np.ndarray, fmt: Any) -> str:
            lo, hi = float(v.min()), float(v.max())
            return fmt(lo) if lo == hi else f"{fmt(lo)} … {fmt(hi)}"

        parts = [
            f"up {span(links.up, format_bandwidth)}",
            f"down {span(links.down, format_bandwidth)}",
            f"latency {span(links.latency, format_duration)}",
        ]
        if self.compute is not None:
            parts.append(f"compute {span(self.compute.values(n), format_duration)}")
        return f"{self.name} ({n} clients: " + ", ".join(parts) + ")"


NETWORKS: Registry[Network] = Registry("network", base=Network)
Network.__registry__ = NETWORKS


def make_network(spec: str | Network, **params: Any) -> Network:
    """Build a network from its spec, e.g. ``make_network("star[up=10mbit,latency=20ms]")``
    or ``make_network("star", up="10mbit", latency="20ms")``."""
    return NETWORKS.make(spec, **params)


def _active(
    up: np.ndarray, down: np.ndarray, active: Sequence[bool] | np.ndarray | None
) -> np.ndarray:
    if active is None:
        return np.asarray((up > 0) | (down > 0))
    a = np.asarray(active, dtype=bool)
    if a.shape != up.shape:
        raise ValueError(f"active needs one flag per client ({up.size}), got shape {a.shape}")
    return a


def _traffic(
    up: Sequence[float] | np.ndarray, down: Sequence[float] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    u = np.asarray(up, dtype=np.float64).reshape(-1)
    if u.size == 0:
        raise ValueError("up needs one message size (bytes) per client, got none")
    d = np.zeros_like(u) if down is None else np.asarray(down, dtype=np.float64).reshape(-1)
    if d.shape != u.shape:
        raise ValueError(f"down needs one size per client ({u.size}), got {d.size}")
    for what, v in (("up", u), ("down", d)):
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"{what} message sizes must be finite and >= 0 bytes")
    return u, d


def _stages(stages: Sequence[float] | None, summable: bool) -> tuple[float, ...]:
    """The checked stage shares of :meth:`Network.round` (default: one exchange)."""
    if stages is None:
        return (1.0,)
    shares = tuple(float(s) for s in stages)
    if not shares or any(not (math.isfinite(s) and s > 0) for s in shares):
        raise ValueError(f"stages must be shares > 0 of a message, got {list(stages)!r}")
    if abs(sum(shares) - 1.0) > 1e-9:
        raise ValueError(f"stages must be shares of a message that add up to 1, got {shares}")
    if len(shares) > 1 and not summable:
        raise ValueError(
            "a message in several stages is summed stage by stage (PowerSGD's shared basis: "
            "P, then Q); give summable=True with more than one stage"
        )
    return shares


def _seconds(nbytes: np.ndarray, bandwidth: np.ndarray) -> np.ndarray:
    """8·nbytes/bandwidth per client (0 for empty messages and infinitely fast links)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = 8.0 * nbytes / bandwidth  # an overflow is inf, refused by the callers
    return np.where((nbytes == 0) | np.isinf(bandwidth), 0.0, t)


def _slowest_phase(nbytes: np.ndarray, bandwidth: np.ndarray, latency: np.ndarray) -> Cost:
    """The phase in which every client sends ``nbytes[i]`` at once: the slowest one ends it."""
    transfer = _seconds(nbytes, bandwidth)
    lat = np.where(nbytes > 0, latency, 0.0)
    i = int(np.argmax(transfer + lat))
    return Cost(float(transfer[i]), float(lat[i]))


@NETWORKS.register("star")
class Star(Network):
    """Clients linked to a server by their own uplink/downlink (federated learning, PS).

    t_i = α_i + 8D_i/B↓_i + c_i + α_i + 8U_i/B↑_i per active client; a round takes max_i t_i.
    ``down`` defaults to ``up`` (a symmetric link).
    """

    def __init__(
        self,
        up: BandwidthValue,
        down: BandwidthValue | None = None,
        latency: DurationValue = 0.0,
        compute: DurationValue | None = None,
    ) -> None:
        self.up = self._param(up, parse_bandwidth, "up")
        self.down = self.up if down is None else self._param(down, parse_bandwidth, "down")
        self.latency = self._param(latency, parse_duration, "latency")
        self.compute = self._compute(compute)
        self._check_counts(
            {"up": self.up, "down": self.down, "latency": self.latency, "compute": self.compute}
        )

    def links(self, n: int) -> Links:
        return Links(self.up.values(n), self.down.values(n), self.latency.values(n))

    def _round(
        self,
        up: np.ndarray,
        down: np.ndarray,
        active: np.ndarray,
        compute: np.ndarray,
        summable: bool,
        stages: tuple[float, ...] = (1.0,),
    ) -> RoundCost:
        links = self.links(up.size)
        with np.errstate(over="ignore"):  # an overflow is inf, refused by the callers
            return self._phases(up, down, active, compute, stages, links)

    @staticmethod
    def _phases(
        up: np.ndarray,
        down: np.ndarray,
        active: np.ndarray,
        compute: np.ndarray,
        stages: tuple[float, ...],
        links: Links,
    ) -> RoundCost:
        """:meth:`_round`'s exchanges: the first (down, compute, the first share up), then
        one per further stage (the previous stage's sum down, the next share up)."""
        first = up if len(stages) == 1 else stages[0] * up
        t_down, t_up = _seconds(down, links.down), _seconds(first, links.up)
        lat = links.latency * ((down > 0).astype(float) + (first > 0).astype(float))
        total = np.where(active, compute + t_down + t_up + lat, -np.inf)
        i = int(np.argmax(total))
        cost = RoundCost(float(compute[i]), float(t_down[i] + t_up[i]), float(lat[i]), i)
        for prev, share in itertools.pairwise(stages):
            # the next exchange waits for every client's part of the previous one: the server
            # sends each the sum (as large as one part), then each sends its next part
            back = np.full(up.size, prev * float(np.max(up[active])))
            part = share * up
            t = _seconds(back, links.down) + _seconds(part, links.up)
            lat = links.latency * ((back > 0).astype(float) + (part > 0).astype(float))
            j = int(np.argmax(np.where(active, t + lat, -np.inf)))
            cost = dataclasses.replace(cost + RoundCost(0.0, float(t[j]), float(lat[j])), client=i)
        return cost

    def collective(self, c: Collective, p: int) -> Cost:
        p = check_ranks(p)
        if p == 1 or c.nbytes == 0:
            return Cost()
        links = self.links(p)
        size = np.full(p, float(c.nbytes))
        # every rank uploads its part; the server sends back the sum, or the others' blocks
        back = size if c.kind == "allreduce" else size * (p - 1)
        return _slowest_phase(size, links.up, links.latency) + _slowest_phase(
            back, links.down, links.latency
        )


@NETWORKS.register("ring")
class Ring(Network):
    """Ranks in a ring (DDP on gloo or NCCL): ring all-reduce 2(p−1)/p·8S/B + 2(p−1)α, ring
    all-gather (p−1)·8b/B + (p−1)α, with the slowest link's B and α.

    ``shared`` is the number of ranks that share one link (one token bucket, one NIC, one
    switch port): in a ring step every rank sends at once, so each gets B/shared and every
    formula above uses that per-rank bandwidth. ``ring[bandwidth=1gbit,shared=4]`` is four
    ranks behind one 1 Gbit/s link — exactly how ``benchmarks/ddp.py`` emulates a link with
    ``tc`` (one bucket on the namespace's loopback that all ranks pass through;
    docs/distributed.md §4.1a) — and equals ``ring[bandwidth=250mbit]``. The default 1 is a
    link per rank (a cluster).
    """

    def __init__(
        self,
        bandwidth: BandwidthValue,
        latency: DurationValue = 0.0,
        compute: DurationValue | None = None,
        shared: int = 1,
    ) -> None:
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise ValueError(
                f"ring parameter 'shared' must be an integer >= 1 (the number of ranks that "
                f"share one link), got {shared!r}"
            )
        self.shared = shared
        self.bandwidth = self._param(bandwidth, parse_bandwidth, "bandwidth")
        self.latency = self._param(latency, parse_duration, "latency")
        self.compute = self._compute(compute)
        self._check_counts(
            {"bandwidth": self.bandwidth, "latency": self.latency, "compute": self.compute}
        )

    def links(self, n: int) -> Links:
        """Every rank's share of its link: B/shared (see the class docstring)."""
        if self.shared > n:
            raise ValueError(
                f"ring parameter 'shared' is {self.shared}, but the ring has {n} ranks: at most "
                f"{n} ranks can share one link (shared <= {n})"
            )
        b = self.bandwidth.values(n) / self.shared
        return Links(b, b, self.latency.values(n))

    def collective(self, c: Collective, p: int) -> Cost:
        p = check_ranks(p)
        links = self.links(p)
        bw, lat = slowest(links.up, links.latency)
        if c.kind == "allreduce":
            return ring_allreduce(c.nbytes, p, bw, lat)
        return ring_allgather(c.nbytes, p, bw, lat)

    def _round(
        self,
        up: np.ndarray,
        down: np.ndarray,
        active: np.ndarray,
        compute: np.ndarray,
        summable: bool,
        stages: tuple[float, ...] = (1.0,),
    ) -> RoundCost:
        idx = np.flatnonzero(active)
        # every rank holds a replica of x, so every rank takes part in the collective, the
        # ranks that sent nothing with empty (all-reduce: zero) blocks: a ring of all n ranks,
        # set by its slowest link; only the active ranks compute
        links = self.links(up.size)
        bw, lat = slowest(links.up, links.latency)
        block, n = float(np.max(up[idx])), int(up.size)
        collective = ring_allreduce if summable else ring_allgather
        comm = Cost()
        for share in stages:  # one collective per stage, one after the other
            comm = comm + collective(block if len(stages) == 1 else share * block, n, bw, lat)
        return RoundCost(float(np.max(compute[idx])), comm.transfer_s, comm.latency_s)
