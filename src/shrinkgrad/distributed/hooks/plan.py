"""Bucket planning: which tensors a DDP bucket holds, their canonical ids, where their messages go.

The unit of compression is one parameter's gradient (a *tensor*, GRACE's unit). A bucket's plan
lists its tensors (:class:`Unit`), their compressors (``None``: sent uncompressed) and message
sizes, and holds the preallocated send / receive buffers and two work vectors. Plans are keyed by
the bucket's index and rebuilt whenever the bucket's parameters change (DDP rebuilds its buckets
after the first iteration). A tensor's canonical id is the order in which the hook first saw it:
the first iteration of every process sees DDP's initial bucket layout, so the ids are the same in
every process of the same model and DDP settings, and they key the memory and the random draws.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch._C._distributed_c10d import GradBucket  # = torch.distributed.GradBucket

from ...compressors import Compressor
from .config import Mode, Settings

__all__ = ["FLOATS", "Plan", "Planner", "Unit"]

FLOATS = (torch.float32, torch.float64)


@dataclasses.dataclass
class Unit:
    """One parameter's gradient inside a bucket."""

    uid: int  # canonical id: order of first appearance (stable across processes)
    offset: int  # first element in the bucket buffer
    numel: int
    compressor: Compressor | None  # None: sent uncompressed (the method runs with the identity)
    nbytes: int = 0  # bytes of its message (payload, k values, or raw values)
    soff: int = 0  # offset of its message in the send buffer (bytes or elements)


@dataclasses.dataclass
class Plan:
    """How one bucket (by index) is compressed and exchanged; rebuilt when the layout changes."""

    signature: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    mode: Mode
    units: list[Unit]
    dense: list[Unit]
    compressed: list[Unit]
    send: torch.Tensor  # uint8 (allgather) or dtype (allreduce / values)
    recv: torch.Tensor | None = None
    #: two work vectors of the largest tensor's size (the client step's scratch, decoded
    #: messages): preallocated, so that no multi-megabyte tensor is created per step
    scratch: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def work(self, i: int, n: int) -> torch.Tensor:
        """The first ``n`` entries of work vector ``i``."""
        return self.scratch[i][:n]

    @property
    def dense_part(self) -> int:
        """Bytes of the raw values that open every all-gathered block."""
        return sum(u.nbytes for u in self.dense)


class Planner:
    """Builds and caches the plans of the buckets; assigns the canonical tensor ids."""

    def __init__(self, settings: Settings, check: Callable[[Unit, torch.Tensor], None]) -> None:
        self.settings = settings
        #: called for every unit of a new plan with the bucket buffer (the memory's size check)
        self._check = check
        self._plans: dict[int, Plan] = {}
        self._uids: dict[int, tuple[int, torch.Tensor]] = {}

    @property
    def plans(self) -> list[Plan]:
        return list(self._plans.values())

    def uid(self, p: torch.Tensor) -> int:
        """The canonical id of parameter ``p``: the order in which the hook first saw it."""
        entry = self._uids.get(id(p))
        if entry is None or entry[1] is not p:
            entry = (len(self._uids), p)
            self._uids[id(p)] = entry
        return entry[0]

    def plan(self, bucket: GradBucket, flag_bytes: int) -> Plan:
        buf = bucket.buffer()
        params = bucket.parameters()
        signature = tuple(id(p) for p in params)
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.signature == signature and plan.numel == buf.numel():
            return plan
        units: list[Unit] = []
        offset = 0
        for p in params:
            units.append(Unit(self.uid(p), offset, p.numel(), None))
            offset += p.numel()
        if offset != buf.numel():
            raise RuntimeError(
                f"bucket {bucket.index()}: its parameters have {offset} entries but its buffer "
                f"{buf.numel()}; shrinkgrad hooks need DDP's flat bucket layout"
            )
        if buf.dtype not in FLOATS:
            raise TypeError(
                f"the shrinkgrad hook works on float32/float64 gradients, got {buf.dtype}; keep "
                "the model in float32 (or use torch.autocast for mixed precision)"
            )
        settings = self.settings
        mode = settings.collective
        esize = buf.element_size()
        for u in units:
            u.compressor = settings.compressor_for(u.numel)
        if all(u.compressor is None for u in units):
            mode = "allreduce"  # nothing to compress: a plain (dense) all-reduce
        for u in units:
            C = u.compressor
            if C is None or mode == "allreduce":
                u.nbytes = u.numel * esize
            elif mode == "values":
                k = C.sparse_k(u.numel)
                if k is None:
                    raise ValueError(
                        f"{C.name}: shared_seed=true needs a fixed-size sparsifier (rand_k)"
                    )
                u.nbytes = k * esize
            else:
                u.nbytes = math.ceil(C.bits(u.numel, buf.dtype) / 8)
            self._check(u, buf)
        dense = [u for u in units if u.compressor is None]
        compressed = [u for u in units if u.compressor is not None]
        pos = 0
        if mode == "allgather":
            for u in dense + compressed:  # raw values first: they stay aligned
                u.soff, pos = pos, pos + u.nbytes
            send = torch.empty(pos + flag_bytes, dtype=torch.uint8, device=buf.device)
        else:
            for u in units:
                u.soff, pos = pos, pos + u.nbytes // esize
            send = torch.empty(pos, dtype=buf.dtype, device=buf.device)
        plan = Plan(signature, buf.numel(), buf.dtype, mode, units, dense, compressed, send)
        most = max((u.numel for u in units), default=0)
        plan.scratch = [torch.empty(most, dtype=buf.dtype, device=buf.device) for _ in range(2)]
        self._plans[bucket.index()] = plan
        return plan
