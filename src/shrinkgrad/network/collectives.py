"""Closed-form times of the collectives the runtimes use (the α–β model).

A message of ``S`` bytes over a link of bandwidth ``B`` bit/s and latency α s takes
``α + 8S/B`` (Hockney's model; Thakur, Rabenseifner, Gropp, *Optimization of collective
communication operations in MPICH*, IJHPCA 2005, §2). Every function returns a :class:`Cost`,
its bandwidth part and its latency part, for ``p`` ranks:

* ring all-reduce (reduce-scatter then all-gather, p − 1 steps each, chunks of S/p):
  ``2(p−1)/p · 8S/B + 2(p−1)·α`` (Thakur et al. §4.4; gloo's and NCCL's ring);
* ring all-gather of a block of ``b`` bytes per rank (p − 1 steps, each forwarding one block
  to the next rank: gloo's ``allgather`` receives from rank − 1 and sends to rank + 1):
  ``(p−1) · 8b/B + (p−1)·α`` — that is (p−1)/p · 8(p·b)/B of the gathered p·b bytes;
* a point-to-point message: ``8S/B + α``.

On a ring every step waits for its slowest link, so heterogeneous links enter through the
smallest bandwidth and the largest latency (:func:`slowest`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "Cost",
    "check_ranks",
    "point_to_point",
    "ring_allgather",
    "ring_allreduce",
    "slowest",
]


@dataclasses.dataclass(frozen=True)
class Cost:
    """Seconds of one communication: ``transfer_s`` (bytes / bandwidth) + ``latency_s``."""

    transfer_s: float = 0.0
    latency_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.latency_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.transfer_s + other.transfer_s, self.latency_s + other.latency_s)


def check_ranks(p: int) -> int:
    """``p`` as an int when it is a number of ranks (an integer >= 1), else a one-line
    ValueError."""
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)) or p < 1:
        raise ValueError(f"the number of ranks p must be an integer >= 1, got {p!r}")
    return int(p)


def _check(nbytes: float, p: int, bandwidth: float = math.inf, latency: float = 0.0) -> None:
    """One-line ValueErrors for what the α–β model has no meaning for: p < 1 ranks, a size that
    is not a finite number ≥ 0, a bandwidth that is not > 0 (inf: an infinitely fast link), a
    latency that is not a finite number ≥ 0."""
    check_ranks(p)
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"a message size must be a finite number of bytes >= 0, got {nbytes!r}")
    if not bandwidth > 0:  # NaN too
        raise ValueError(
            f"a bandwidth must be > 0 bit/s (inf: an infinitely fast link), got {bandwidth!r}"
        )
    if not (latency >= 0 and math.isfinite(latency)):
        raise ValueError(f"a latency must be a finite number of seconds >= 0, got {latency!r}")


def _seconds(nbytes: float, bandwidth: float) -> float:
    """8·nbytes / bandwidth, with 0 for an empty message or an infinitely fast link."""
    if nbytes == 0 or math.isinf(bandwidth):
        return 0.0
    return 8.0 * nbytes / bandwidth


def ring_allreduce(nbytes: float, p: int, bandwidth: float, latency: float) -> Cost:
    """All-reduce of ``nbytes`` per rank on a ring of ``p`` ranks: 2(p−1)/p·8S/B + 2(p−1)α."""
    _check(nbytes, p, bandwidth, latency)
    if p == 1 or nbytes == 0:
        return Cost()
    return Cost(2.0 * (p - 1) / p * _seconds(nbytes, bandwidth), 2.0 * (p - 1) * latency)


def ring_allgather(block: float, p: int, bandwidth: float, latency: float) -> Cost:
    """All-gather of a ``block`` of bytes from each of ``p`` ranks: (p−1)·8b/B + (p−1)α."""
    _check(block, p, bandwidth, latency)
    if p == 1 or block == 0:
        return Cost()
    return Cost((p - 1) * _seconds(block, bandwidth), (p - 1) * latency)


def point_to_point(nbytes: float, bandwidth: float, latency: float) -> Cost:
    """One message of ``nbytes`` over one link: 8S/B + α (nothing when the message is empty)."""
    _check(nbytes, 1, bandwidth, latency)
    if nbytes == 0:
        return Cost()
    return Cost(_seconds(nbytes, bandwidth), latency)


def slowest(bandwidths: np.ndarray, latencies: np.ndarray) -> tuple[float, float]:
    """The (smallest bandwidth, largest latency) of a ring's links: every step waits for both."""
    return float(np.min(bandwidths)), float(np.max(latencies))
