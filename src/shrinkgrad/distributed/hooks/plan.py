"""Bucket planning: which tensors a DDP bucket holds, their canonical ids, where their messages go.

The unit of compression is one parameter's gradient (a *tensor*, GRACE's unit), or with
``granularity="bucket"`` the whole bucket as one flat vector (one :class:`Unit` holding all its
parameters, :attr:`Unit.members`; its id is ``GROUP_BASE`` + the order in which the planner
first saw that group, its draws are keyed by its first parameter). A bucket's plan
lists its units (:class:`Unit`: shape, compressor — ``None``: sent uncompressed — message size,
whether its messages travel as sparse (index, value) pairs) and holds the preallocated buffers:

* ``x``: what the method reads as the gradient — the bucket itself, or for 16-bit buckets whose
  method state is kept in float32 (``state_dtype="float32"``, the default) a float32 copy
  (``wide``), filled tensor by tensor before the method reads it. For a bfloat16 bucket and a
  method whose first use of the gradient is its compressor call
  (``Method.compresses_gradient_first``: DCGD, EF21) a compressed tensor's copy is not filled
  at all: the compressor reads the bfloat16 gradient itself (:attr:`Plan.reads_half`; Top-k's
  fused C(∇f_i − g_i) and rand-k's gather widen each entry as they read it), and the copy is
  filled only if that call declines;
* ``send`` / ``recv``: the collective's buffers (``uint8`` payloads, or values in the bucket's
  dtype: the wire carries the gradient's dtype);
* ``out``: the tensor DDP receives (the method's direction D in the bucket's dtype). Without a
  loss scaler it is a buffer of the plan's own, which DDP only reads: a method whose direction
  is part of its state (EF21's g) then keeps that state in ``out`` itself (no copy per step),
  and a sparse direction only rewrites its k entries (the previous ones are zeroed, O(k));
  a 16-bit output of a float32 direction that the method reports changed only at some
  entries since the round before (``Method.direction_changes``: EF21's g at the aggregate's
  n·k indices) has only those entries converted (:meth:`Plan.write_changes`, O(n k) instead of
  a dense downcast); with a scaler it is the bucket (the scaler's unscaling writes into it);
* two work vectors of the largest tensor (the client step's scratch, decoded messages).

Plans are keyed by the bucket's index and rebuilt whenever the bucket's parameters change (DDP
rebuilds its buckets after the first iteration). A tensor's canonical id is the order in which
the hook first saw it: the first iteration of every process sees DDP's initial bucket layout, so
the ids are the same in every process of the same model and DDP settings, and they key the
memory and the random draws. A plan made for a bucket replaces those of other indices that held
any of its parameters, so the plans are always DDP's current layout (:meth:`Planner.layout`,
saved in checkpoints). At ``granularity="bucket"`` a restarted job's first bucket, DDP's
initial layout of all parameters in model order, holds the checkpoint's units in another
grouping and order: its plan compresses those units (:attr:`Planner.hint`) in a staged copy of
the bucket (:meth:`Plan.stage`, :meth:`Plan.unstage`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
from torch._C._distributed_c10d import GradBucket  # = torch.distributed.GradBucket

from ...compressors import Compressor
from ...compressors import _kernels as K
from ...methods.rules import Mirror
from .config import HALF, Mode, Settings

__all__ = ["DTYPES", "GROUP_BASE", "Plan", "Planner", "Unit"]

#: the gradient dtypes the hook takes
DTYPES = (torch.float32, torch.float64, *HALF)
#: the first id of a bucket unit (``granularity="bucket"``): above every parameter's id and
#: every 32-bit key word, so that it can never be taken for either
GROUP_BASE = 1 << 32


@dataclasses.dataclass
class Unit:
    """One parameter's gradient inside a bucket."""

    uid: int  # canonical id: order of first appearance (stable across processes)
    offset: int  # first element in the bucket buffer
    numel: int
    shape: tuple[int, ...]
    compressor: Compressor | None  # None: sent uncompressed (the method runs with the identity)
    nbytes: int = 0  # bytes of its message (payload, k values, or raw values)
    soff: int = 0  # offset of its message in the send buffer (bytes or elements)
    #: its compressed messages reach the method as SparseMessages (a sparse compressor and a
    #: method with ``sparse_messages``): O(k) updates, no dense compressed tensor
    sparse: bool = False
    #: the plan's ``out`` slice is zero except at these flat positions (None: unknown); a
    #: sparse direction then only zeroes those before writing its own
    zero_except: torch.Tensor | None = None
    #: the float32 direction whose conversion the plan's 16-bit ``out`` slice holds entry for
    #: entry (None: none known): a direction that is this tensor again, changed only where its
    #: method says (``Method.direction_changes``), is written at those entries only
    mirror: torch.Tensor | None = None
    #: a bucket unit (``granularity="bucket"``): the (canonical id, numel) of the parameters it
    #: holds, in the bucket's order; () for one parameter's gradient
    members: tuple[tuple[int, int], ...] = ()

    @property
    def key(self) -> int:
        """The id its random draws are keyed by: its own canonical id, or a bucket unit's first
        parameter's (the bucket units of one iteration hold disjoint parameters, so no two
        draw alike, and the id depends on the layout only, not on the order plans were made)."""
        return self.members[0][0] if self.members else self.uid

    @property
    def label(self) -> str:
        """How errors name it."""
        return bucket_label(self.members) if self.members else f"tensor #{self.uid}"

    def slice(self, t: torch.Tensor) -> torch.Tensor:
        """This tensor's part of a bucket-sized vector."""
        return t[self.offset : self.offset + self.numel]


def bucket_label(members: tuple[tuple[int, int], ...]) -> str:
    """How errors name a bucket unit: by its parameters' canonical ids."""
    return "the bucket of tensors #" + ", #".join(str(m) for m, _ in members)


@dataclasses.dataclass
class Plan:
    """How one bucket (by index) is compressed and exchanged; rebuilt when the layout changes."""

    signature: tuple[int, ...]
    numel: int
    dtype: torch.dtype  # the bucket's (the gradients' and the wire's values)
    wdtype: torch.dtype  # the method's arithmetic and state
    mode: Mode
    units: list[Unit]
    dense: list[Unit]
    compressed: list[Unit]
    send: torch.Tensor  # uint8 (allgather) or dtype (allreduce / values)
    out: torch.Tensor | None  # the direction DDP receives (None: the bucket itself)
    wide: torch.Tensor | None  # the method-dtype copy of the gradients (None: the bucket)
    recv: torch.Tensor | None = None
    #: the summed paths (``allreduce``, ``values``, ``factors``) all-gather the ranks' values
    #: into ``recv`` (n rows of the send buffer, the bucket's dtype) and add them into ``sums``
    #: (the method's dtype) in rank order, instead of one all-reduce in the bucket's dtype
    #: (``CompressionState(summation=)``, :meth:`.config.Settings.gathers`)
    gathered: bool = False
    sums: torch.Tensor | None = None
    #: two work vectors of the largest tensor (the client step's scratch, decoded messages):
    #: preallocated, so that no multi-megabyte tensor is created per step
    scratch: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: PowerSGD's factor path (:mod:`.factors`): the vectors each tensor's client step
    #: compresses (M_i), kept from the hook body to the P callback (bucket-sized, made at the
    #: first factor iteration)
    held: torch.Tensor | None = None
    #: the parameters' canonical ids as compressed: one group per unit of DDP's bucket
    #: (``granularity="bucket"``; per tensor, the bucket's parameters as one group), in the
    #: order their entries have in :meth:`stage`'s vector (what a checkpoint records)
    groups: tuple[tuple[int, ...], ...] = ()
    #: the bucket reordered into ``groups`` (:meth:`Planner.plan` with a layout hint): the
    #: (offset in the staged vector, offset in the bucket, numel) of every parameter, and the
    #: staged vector the exchange runs on; () / None: the bucket is compressed as it is
    moves: tuple[tuple[int, int, int], ...] = ()
    staged: torch.Tensor | None = None

    def work(self, i: int, n: int) -> torch.Tensor:
        """The first ``n`` entries of work vector ``i``."""
        return self.scratch[i][:n]

    def stage(self, buf: torch.Tensor) -> torch.Tensor:
        """What the exchange runs on: the bucket ``buf`` itself, or its parameters copied into
        the order of :attr:`groups` (a bucket that holds the saved units in another order)."""
        if self.staged is None:
            return buf
        for mine, theirs, n in self.moves:
            self.staged[mine : mine + n].copy_(buf[theirs : theirs + n])
        return self.staged

    def unstage(self, buf: torch.Tensor, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        """The exchange's result (in :meth:`stage`'s order) written back into DDP's layout, in
        the bucket ``buf`` (a future's callback: copies only, nothing waits)."""
        out = fut.value()
        for mine, theirs, n in self.moves:
            buf[theirs : theirs + n].copy_(out[mine : mine + n])
        return buf

    @property
    def dense_part(self) -> int:
        """Bytes of the raw values that open every all-gathered block."""
        return sum(u.nbytes for u in self.dense)

    #: the compressors of this plan may read its gradients in the bucket's own dtype instead of
    #: the method's copy (a bfloat16 bucket, float32 method: :mod:`.exchange` then leaves a
    #: compressed tensor's copy unfilled for methods that declare
    #: ``compresses_gradient_first``); float16 always widens (its widening is no bit shift)
    reads_half: bool = False
    #: convert only the changed entries of a float32 direction into a 16-bit output
    #: (:meth:`write_changes`); False: always the dense conversion
    sparse_downcast: bool = False
    #: with ``sparse_downcast``: offer a bfloat16 output slice that holds a float32 state
    #: tensor's conversion to the method as that tensor's mirror (:meth:`mirror_request`), so
    #: that its sparse update writes the changed entries in the same pass
    fused_mirror: bool = False

    def gradients(self, buf: torch.Tensor, fill: bool = True) -> torch.Tensor:
        """What the method reads as this iteration's gradients: the bucket, or its copy in the
        method's dtype — filled in one conversion pass, or (``fill=False``) left for the
        exchange to fill tensor by tensor (:meth:`fill`) where a compressor does not read the
        bucket itself."""
        if self.wide is None:
            return buf
        return self.wide.copy_(buf) if fill else self.wide

    def fill(self, u: Unit, buf: torch.Tensor) -> torch.Tensor:
        """``u``'s slice of the method-dtype copy, filled from the bucket ``buf``."""
        assert self.wide is not None
        return u.slice(self.wide).copy_(u.slice(buf))

    def output(self, buf: torch.Tensor) -> torch.Tensor:
        """The bucket-sized tensor DDP receives."""
        return buf if self.out is None else self.out

    def write(self, u: Unit, target: torch.Tensor, direction: torch.Tensor) -> None:
        """Put a dense direction into ``u``'s slice ``target`` of the output (no copy when it is
        there already)."""
        if direction.data_ptr() != target.data_ptr() or direction.dtype != target.dtype:
            target.copy_(direction.reshape(-1))
        u.zero_except = None
        # the output slice now holds the conversion of this direction, entry for entry
        u.mirror = direction if self.out is not None and direction.dtype != target.dtype else None

    def mirror_request(self, u: Unit, target: torch.Tensor) -> tuple[torch.Tensor, Mirror] | None:
        """(the float32 tensor whose conversion ``u``'s bfloat16 output slice ``target`` holds,
        a :class:`~shrinkgrad.methods.rules.Mirror` of it into ``target``) for the method's
        server part — the tensor is EF21's g when D = g — or None: no such tensor (a dense
        write has not run yet, or the conversion is not bfloat16 on CPU), or the fast paths
        are off. Whatever the method writes through it is the conversion of that tensor at
        the entries it changes, so ``target`` stays its conversion (:meth:`write_changes`)."""
        src = u.mirror
        if (
            not self.fused_mirror  # (set only with sparse_downcast)
            or self.out is None
            or src is None
            or src.dtype != torch.float32
            or target.dtype != torch.bfloat16
            or target.device.type != "cpu"
            or not target.is_contiguous()
            or src.numel() != target.numel()
        ):
            return None
        return src, Mirror(target)

    def write_changes(
        self,
        u: Unit,
        target: torch.Tensor,
        direction: torch.Tensor,
        changed: torch.Tensor,
        mirror: Mirror | None = None,
    ) -> bool:
        """Convert only the entries ``changed`` of ``direction`` into ``target`` (O(n k)),
        when ``target`` holds the conversion of this same tensor from the round before
        (:attr:`Unit.mirror`, set by a dense :meth:`write`) and its method reported that it
        changed at most there. Returns False (nothing written) when that is not known: the
        caller then writes it densely. The entries get the bits of the dense conversion:
        bfloat16 by the rounding of torch's conversion (numba, O(n k)), float16 by torch's
        own ``to``. Nothing is converted when the method's update wrote them already:
        ``mirror`` (of :meth:`mirror_request`) written at exactly ``changed``."""
        if (
            not self.sparse_downcast
            or self.out is None
            or u.mirror is not direction
            or direction.dtype == target.dtype
            or direction.dtype != torch.float32
        ):
            return False
        if (
            mirror is not None
            and mirror.target.data_ptr() == target.data_ptr()
            and mirror.target.numel() == target.numel()
            and mirror.target.dtype == target.dtype
            and _covers(mirror.written, changed)
        ):
            return True
        flat = direction.reshape(-1)
        idx = changed.reshape(-1)
        if (
            target.dtype == torch.bfloat16
            and target.device.type == "cpu"
            and flat.device.type == "cpu"
            and target.is_contiguous()
            and flat.is_contiguous()
            and idx.dtype == torch.int64
            and idx.is_contiguous()
        ):
            ok = K.bf16_at(
                K.bf16_patterns(target), flat.view(torch.int32).numpy().view(np.uint32), idx.numpy()
            )
            if not ok:
                raise IndexError(f"a direction's changed entries lie outside [0, {target.numel()})")
        else:
            target.index_copy_(0, idx, flat.index_select(0, idx).to(target.dtype))
        return True

    def write_sparse(
        self,
        u: Unit,
        target: torch.Tensor,
        indices: torch.Tensor,
        values: torch.Tensor,
        distinct: bool = False,
    ) -> None:
        """Put a sparse direction into ``target``: zeros with ``values`` added at ``indices``
        (repeated indices add up). On the plan's own output only the previous direction's
        entries are zeroed (O(k)); the bucket (with a scaler) is zeroed in full. ``distinct``
        (indices known to be distinct): the kernels store 0 + v at each index instead of
        reading the entry and adding (the same bits; a store, not a read-modify-write)."""
        values = values.to(target.dtype)
        if self.out is not None and u.zero_except is not None:
            if (
                target.dtype == torch.bfloat16
                and target.device.type == "cpu"
                and target.is_contiguous()
                and indices.is_contiguous()
                and values.is_contiguous()
            ):
                # the same kernel in bfloat16 arithmetic (each addition rounded, as index_add_)
                pats = K.bf16_patterns
                old = u.zero_except.numpy()
                if not K.sparse_replace_bf16(
                    pats(target), old, indices.numpy(), pats(values), distinct
                ):
                    raise IndexError(f"a sparse direction's index is outside [0, {target.numel()})")
                u.zero_except = indices
                u.mirror = None
                return
            if _kernel_dtype(target) and indices.is_contiguous() and values.is_contiguous():
                # one numba kernel: the old entries zeroed, the new ones added (O(k), serial:
                # the order of index_add_, so the same sums for repeated indices)
                old = u.zero_except.numpy()
                K.sparse_replace(target.numpy(), old, indices.numpy(), values.numpy(), distinct)
                u.zero_except = indices
                u.mirror = None
                return
            target.index_fill_(0, u.zero_except, 0.0)
        else:
            target.zero_()
        target.index_add_(0, indices, values)
        u.mirror = None
        if self.out is not None:
            u.zero_except = indices


def _covers(written: torch.Tensor | None, changed: torch.Tensor) -> bool:
    """Whether a mirror written at ``written`` was written at exactly ``changed``."""
    if written is None:
        return False
    return written is changed or (written.shape == changed.shape and torch.equal(written, changed))


def _kernel_dtype(t: torch.Tensor) -> bool:
    """Whether the CPU kernels take ``t`` (a contiguous float32/float64 CPU vector)."""
    return (
        t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and (t.is_contiguous())
    )


class Planner:
    """Builds and caches the plans of the buckets; assigns the canonical tensor ids."""

    def __init__(
        self,
        settings: Settings,
        check: Callable[[Unit, torch.Tensor, torch.dtype], None],
        sparse_method: bool,
    ) -> None:
        self.settings = settings
        #: called for every unit of a new plan with the bucket buffer and the method's dtype
        #: (the binding and the memory's size check)
        self._check = check
        self._sparse_method = sparse_method
        self._plans: dict[int, Plan] = {}
        self._uids: dict[int, tuple[int, torch.Tensor]] = {}
        #: the ids of the bucket units (``granularity="bucket"``) by their parameters' ids:
        #: ``GROUP_BASE`` + the order of first appearance (no parameter has such an id)
        self._groups: dict[tuple[int, ...], int] = {}
        #: a loss scaler writes into DDP's tensor: then the plans return the bucket itself
        self.own_output = True
        #: set after this process's first iteration: every parameter has been seen (DDP's later
        #: bucket rebuilds regroup the same parameters), so an unknown one is a mistake
        self.sealed = False
        #: the half-precision fast paths (for tests and A/B runs: False gives the paths before
        #: them, which compute the same bits): a bfloat16 bucket read by the compressors
        #: themselves (:attr:`Plan.reads_half`), and the changed entries of a direction only
        #: converted into a 16-bit output (:attr:`Plan.sparse_downcast`)
        self.direct_half = True
        self.sparse_downcast = True
        #: with ``sparse_downcast``: the changed entries written by the method's own sparse
        #: update, in its pass (:attr:`Plan.fused_mirror`); False: converted after it
        self.fused_mirror = True
        #: ``granularity="bucket"``: the units of a checkpoint's last iteration (their
        #: parameters' canonical ids, in order; :meth:`layout`). A bucket of DDP's initial
        #: layout (a restarted job's first iterations) that holds whole units of it in another
        #: grouping or order is compressed as those units; once DDP has rebuilt its buckets,
        #: every bucket is compressed as DDP groups it (the saved units again, unless the job
        #: changed ``bucket_cap_mb``)
        self.hint: tuple[tuple[int, ...], ...] = ()
        #: the buckets (their parameters' ids) of DDP's initial layout: those planned before
        #: this process's first iteration ended (two iterations' worth with ``static_graph``,
        #: whose DDP rebuilds after its second)
        self._initial: set[tuple[int, ...]] = set()

    @property
    def plans(self) -> list[Plan]:
        return list(self._plans.values())

    def uid(self, p: torch.Tensor) -> int:
        """The canonical id of parameter ``p``: the order in which the hook first saw it."""
        entry = self._uids.get(id(p))
        if entry is None or entry[1] is not p:
            if self.sealed:
                raise RuntimeError(
                    f"the shrinkgrad hook got a gradient of a parameter {tuple(p.shape)} it did "
                    "not see in its first iteration: one CompressionState serves one DDP model "
                    "with fixed parameters (registered on a second model, or the model's "
                    "parameters were replaced); give every model its own CompressionState (to "
                    "continue a run in a new model, load_state_dict into a fresh one)"
                )
            entry = (len(self._uids), p)
            self._uids[id(p)] = entry
        return entry[0]

    def layout(self) -> list[list[int]]:
        """The units of the current plans, by bucket index: every unit's parameters' canonical
        ids in the order it compresses them (what a checkpoint saves for :attr:`hint`)."""
        return [list(g) for i in sorted(self._plans) for g in self._plans[i].groups]

    def work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The method's dtype for gradients of ``dtype``: float32 for 16-bit gradients unless
        ``state_dtype="gradient"``, the gradients' own dtype otherwise."""
        if dtype in HALF and self.settings.state_dtype == "float32":
            return torch.float32
        return dtype

    def plan(self, bucket: GradBucket, flag_bytes: int) -> Plan:
        buf = bucket.buffer()
        params = bucket.parameters()
        signature = tuple(id(p) for p in params)
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.signature == signature and plan.numel == buf.numel():
            return plan
        if buf.dtype not in DTYPES:
            names = ", ".join(str(t).removeprefix("torch.") for t in DTYPES)
            raise TypeError(
                f"the shrinkgrad hook works on {names} gradients, got {buf.dtype}; convert the "
                "model (model.float()) or use torch.autocast for mixed precision"
            )
        units: list[Unit] = []
        offset = 0
        for p in params:
            units.append(Unit(self.uid(p), offset, p.numel(), tuple(p.shape), None))
            offset += p.numel()
        if offset != buf.numel():
            raise RuntimeError(
                f"bucket {bucket.index()}: its parameters have {offset} entries but its buffer "
                f"{buf.numel()}; shrinkgrad hooks need DDP's flat bucket layout"
            )
        settings = self.settings
        wdtype = self.work_dtype(buf.dtype)
        mode = settings.collective
        esize = buf.element_size()
        groups = [units]
        moves: tuple[tuple[int, int, int], ...] = ()
        if not self.sealed:
            self._initial.add(signature)
        if settings.granularity == "bucket":
            if signature in self._initial:
                groups = self._regroup(units) or groups
            if groups[0] is not units:  # the saved units, one after the other when staged
                offset = 0
                for u in (u for g in groups for u in g):
                    moves += ((offset, u.offset, u.numel),)
                    u.offset = offset
                    offset += u.numel
            units = [v for g in groups for v in self._bucket_unit(g, buf.dtype)]
        for u in units:
            if not u.members:
                u.compressor = settings.compressor_for(u.numel, u.shape, buf.dtype)
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
            u.sparse = C is not None and mode != "allreduce" and self._is_sparse(C)
            self._check(u, buf, wdtype)
        dense = [u for u in units if u.compressor is None]
        compressed = [u for u in units if u.compressor is not None]
        pos = 0
        device = buf.device
        if mode == "allgather":
            for u in dense + compressed:  # raw values first: they stay aligned
                u.soff, pos = pos, pos + u.nbytes
            send = torch.empty(pos + flag_bytes, dtype=torch.uint8, device=device)
        else:
            for u in units:
                u.soff, pos = pos, pos + u.nbytes // esize
            send = torch.empty(pos, dtype=buf.dtype, device=device)
        n = buf.numel()
        plan = Plan(
            signature,
            n,
            buf.dtype,
            wdtype,
            mode,
            units,
            dense,
            compressed,
            send,
            out=torch.zeros(n, dtype=buf.dtype, device=device) if self.own_output else None,
            wide=None if wdtype == buf.dtype else torch.empty(n, dtype=wdtype, device=device),
        )
        plan.gathered = mode != "allgather" and settings.gathers(buf.dtype, wdtype)
        plan.reads_half = self.direct_half and plan.wide is not None and buf.dtype == torch.bfloat16
        plan.sparse_downcast = self.sparse_downcast
        plan.fused_mirror = self.sparse_downcast and self.fused_mirror
        most = max((u.numel for u in units), default=0)
        plan.scratch = [torch.empty(most, dtype=wdtype, device=device) for _ in range(2)]
        for u in units:
            u.zero_except = torch.empty(0, dtype=torch.int64, device=device)  # out is zero
        plan.groups = tuple(tuple(u.uid for u in g) for g in groups)
        if moves:
            plan.moves = moves
            plan.staged = torch.empty(n, dtype=buf.dtype, device=device)
        # DDP regrouped the parameters: the plans of other indices that held any of them are
        # gone from its layout (their buffers are freed, and :meth:`layout` is this one's)
        held = {m for g in plan.groups for m in g}
        self._plans = {
            i: p
            for i, p in self._plans.items()
            if not held.intersection(m for g in p.groups for m in g)
        }
        self._plans[bucket.index()] = plan
        return plan

    def _regroup(self, units: list[Unit]) -> list[list[Unit]] | None:
        """The bucket's tensors grouped into the :attr:`hint`'s units, in the hint's order and
        each unit's own (None: no hint, the bucket is one of its units already, or it does not
        hold whole units of it — then it is compressed as DDP groups it)."""
        if not self.hint:
            return None
        by_id = {u.uid: u for u in units}
        groups = [g for g in self.hint if g[0] in by_id]
        ids = [m for g in groups for m in g]
        if len(ids) != len(units) or set(ids) != set(by_id):
            return None
        if len(groups) == 1 and groups[0] == tuple(by_id):
            return None
        return [[by_id[m] for m in g] for g in groups]

    def _bucket_unit(self, units: list[Unit], dtype: torch.dtype) -> list[Unit]:
        """``granularity="bucket"``: the bucket's tensors as one flat unit with the compressor
        of its total size (``min_numel`` applies to that size); the tensors themselves when
        the bucket is smaller (sent uncompressed)."""
        numel = sum(u.numel for u in units)
        C = self.settings.compressor_for(numel, (numel,), dtype)
        if C is None:
            return units
        members = tuple((u.uid, u.numel) for u in units)
        ids = tuple(m for m, _ in members)
        uid = self._groups.setdefault(ids, GROUP_BASE + len(self._groups))
        return [Unit(uid, units[0].offset, numel, (numel,), C, members=members)]

    def _is_sparse(self, C: Compressor) -> bool:
        return bool(C.sparse_message) and self._sparse_method
