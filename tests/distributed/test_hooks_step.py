"""A bucket's iteration is fixed when its hook body starts.

DDP runs the hook body of every bucket during the backward pass, and the last bucket's body
advances ``CompressionState.iteration``; the all-gather callbacks of earlier buckets may run
after that (gloo completes them on its own threads). A keyed compressor (rand_k with a seed,
values only on the wire) decodes a peer's message from that peer's keys of the round the message
was encoded in, so the keys a callback asks for must be those of the bucket's own iteration.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from shrinkgrad.distributed.hooks.exchange import Step


class _Settings:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def keys(self, C: Any, uid: int, rank: int, iteration: int) -> tuple[Any, ...]:
        self.calls.append((C, uid, rank, iteration))
        return (uid, rank, iteration)


def test_keys_of_a_bucket_use_the_iteration_its_body_started_in() -> None:
    settings = _Settings()
    state = SimpleNamespace(iteration=7, rank=1, settings=settings)
    buf = torch.zeros(4)
    step = Step(state, None, buf, buf, False)  # type: ignore[arg-type]
    state.iteration = 8  # the last bucket's body has finished the iteration
    unit = SimpleNamespace(uid=3, key=3)  # (a bucket unit: key = its first tensor's id)
    assert step.iteration == 7
    assert step.keys(unit, "C") == (3, 1, 7)  # type: ignore[arg-type]
    assert step.keys(unit, "C", rank=0) == (3, 0, 7)  # type: ignore[arg-type]
