"""DDP communication hooks: any shrinkgrad compressor, with or without error feedback.

Two lines in any training loop (``model`` is a ``DistributedDataParallel``)::

    state = CompressionState("top_k", ratio=0.01, error_feedback="ef21")
    model.register_comm_hook(state, compression_hook)

What happens to each bucket DDP hands to the hook
-------------------------------------------------
The unit of compression is one parameter's gradient (a *tensor*, as in GRACE): the hook splits the
bucket into its parameters' gradients, so the compressed messages, the error-feedback memory and
the random draws do not depend on how DDP groups parameters into buckets (DDP rebuilds its
buckets after the first iteration; a restarted job starts with the initial layout again).
Tensors with fewer than ``min_numel`` entries are sent uncompressed (biases, norms: they cost
little and compress badly).

For client (rank) i with local gradient x_i, weights w_i (1/n, or the EF21-W weights) and the
compressor C drawn with keys (seed, iteration, rank or shared, tensor):

==================  =========================================  ==========================
``error_feedback``  rank i sends                               the hook returns
==================  =========================================  ==========================
``"none"``          c_i = C(x_i)                               (1/n) Σ_i c_i
``"ef"`` [S14]      v_i = C(e_i + x_i); e_i ← e_i + x_i − v_i  (1/n) Σ_i v_i
``"ef21"`` [EF21]   c_i = C(x_i − g_i); g_i ← g_i + c_i        g ← g + (1/n) Σ_i c_i
``"ef21_w"`` [EFR]  c_i = C(x_i/(n w_i) − g_i); g_i ← g_i + c_i g ← g + Σ_i w_i c_i
==================  =========================================  ==========================

The client updates are :func:`shrinkgrad.methods.rules.ef21_update` and
:func:`~shrinkgrad.methods.rules.ef_update`, the functions the simulator's EF21/EF client steps
call. EF here is the learning-rate-free form (GRACE's residual memory): with a constant learning
rate γ and a positively homogeneous C it is [S14]'s EF with e/γ in place of e. EF21 returns the
server estimator g (the optimizer then takes x ← x − γ g, [EF21] Alg. 1); during the first
``warmup_steps`` iterations the hook all-reduces dense gradients and sets g_i = x_i (scaled for
EF21-W) and g = their average, EF21's ``init="full"``.

The collective follows the compressor
-------------------------------------
* ``collective == "allreduce"`` (identity, ...): the dense results C(·) are summable: one
  all-reduce of the bucket-sized buffer of w_i c_i.
* a fixed-size sparsifier with ``shared_seed=true`` (rand_k): every rank draws the same
  coordinates, so only the k values travel, summed by one all-reduce of Σ_tensors k values;
* otherwise (top_k, qsgd, natural, ...): every rank encodes its messages with the compressor's
  wire format (``encode``: exactly ⌈bits(d)/8⌉ bytes per tensor) into one preallocated byte
  buffer, one all-gather exchanges the buffers, and every rank decodes all n messages in rank
  order (so all ranks compute bit-identical sums). Variable-size messages (bernoulli) carry a
  header of their sizes and are padded to the largest buffer, whose size is all-gathered first.

Uncompressed small tensors travel in the same collective (raw values). The hook never blocks
inside a future callback (that deadlocks gloo with two buckets in flight).

Loss scaling (``scaler=``, e.g. ``torch.amp.GradScaler``)
--------------------------------------------------------
The hook compresses x_i / S (S = ``scaler.get_scale()``), so the memory holds true gradients, and
returns the aggregate times S. A rank whose bucket is not finite sends NaN (all-reduce paths) or
sets the flag byte that ends its all-gather block; every rank then returns the bucket as NaN (the
scaler skips the step) and, when the next iteration starts, restores its memory and iteration
from the copy taken at the start of the skipped one. Without a scaler non-finite input raises.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at runtime
# (``bucket: dist.GradBucket``, return exactly ``torch.futures.Future[torch.Tensor]``), and string
# annotations fail that check.
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # = torch.distributed.GradBucket

from ..compressors import COMPRESSORS, Compressor
from ..methods.rules import Compress, ef21_update, ef_update
from ..rng import Keys

__all__ = [
    "CollectiveError",
    "CompressionState",
    "ErrorFeedback",
    "compression_hook",
]

ErrorFeedback = Literal["none", "ef", "ef21", "ef21_w"]
_MODES = ("none", "ef", "ef21", "ef21_w")
#: stream of the hooks' keyed draws (see :mod:`shrinkgrad.rng`)
STREAM = "ddp_hook"
#: format tag of :meth:`CompressionState.state_dict`
STATE_FORMAT = "shrinkgrad.distributed.CompressionState/1"
_FLOATS = (torch.float32, torch.float64)

Mode = Literal["allreduce", "values", "allgather"]


class CollectiveError(RuntimeError):
    """A collective of the hook failed: a peer died, or it exceeded the process group timeout."""


@dataclasses.dataclass
class _Unit:
    """One parameter's gradient inside a bucket."""

    uid: int  # canonical id: order of first appearance (stable across processes)
    offset: int  # first element in the bucket buffer
    numel: int
    compressor: Compressor | None  # None: sent uncompressed
    nbytes: int  # bytes of its message (payload, k values, or raw values)
    soff: int = 0  # offset of its message in the send buffer (bytes or elements)


@dataclasses.dataclass
class _Plan:
    """How one bucket (by index) is compressed and exchanged; rebuilt when the layout changes."""

    signature: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    mode: Mode
    units: list[_Unit]
    dense: list[_Unit]
    compressed: list[_Unit]
    send: torch.Tensor  # uint8 (allgather) or dtype (allreduce / values)
    recv: torch.Tensor | None = None
    #: two work vectors of the largest compressed tensor's size (client difference, decoded
    #: messages): preallocated, so that no multi-megabyte tensor is created per step
    scratch: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def work(self, i: int, n: int) -> torch.Tensor:
        """The first ``n`` entries of work vector ``i``."""
        return self.scratch[i][:n]


class CompressionState:
    """State of :func:`compression_hook`: configuration, error-feedback memory, byte counters.

    Parameters
    ----------
    compressor:
        a compressor or its name (``"top_k[k=1000]"``, ``"qsgd[s=4]"``,
        ``"rand_k[shared_seed=true]"``, ...).
    ratio:
        for compressors with a ``k`` parameter (top_k, rand_k, rand_k_scaled): keep
        k = ⌈ratio · d⌉ of the d entries of every tensor (``compressor`` then needs no ``k``).
    error_feedback:
        ``"none"``, ``"ef"`` ([S14]), ``"ef21"`` ([EF21]) or ``"ef21_w"`` ([EFR], needs
        ``weights``). EF and EF21 need a contractive compressor (or an unbiased one with ω < 1).
    weights:
        EF21-W's weight w_i of every rank (e.g. proportional to the ranks' smoothness constants
        L_i, [EFR] Alg. 2): positive, normalised to sum to 1.
    seed:
        seed of the keyed draws (random compressors): rank i's draw for tensor t at iteration r
        is a function of (seed, r, i, t) only, and of (seed, r, t) for ``shared_seed``
        compressors, which every rank then draws identically.
    warmup_steps:
        the first iterations all-reduce dense gradients (EF21: they initialise g_i = x_i).
    momentum:
        β of client-side momentum: every rank replaces its gradient x_i by the moving average
        v_i ← β v_i + (1 − β) x_i (from v_i = 0) before compressing — with EF21 this is
        EF21-SGDM (Fatkhullin, Tyurin, Richtárik, *Momentum provably improves error feedback!*,
        NeurIPS 2023, Alg. 1 with η = 1 − β), which tames EF21's sensitivity to minibatch noise.
        Use it with a momentum-free optimizer at a learning rate 1/(1 − β) times that of SGD with
        momentum β: with the identity compressor the two give the same iterates.
    min_numel:
        tensors with fewer entries are sent uncompressed.
    process_group:
        the group to communicate in (default: the default group, which must be initialised).
    skip_communication:
        benchmarks only: do all the local work but no collective (every rank pretends all
        ranks sent what it sent), to separate compression from communication time.
    scaler:
        the ``torch.amp.GradScaler`` (anything with ``get_scale()``) that scales the loss of
        this training loop. The hook then divides each bucket by the scale before compressing
        (the error-feedback memory holds true gradients, whatever the scale does) and multiplies
        the aggregate back for the scaler's ``unscale_``. A non-finite gradient on any rank no
        longer raises: every rank gets that bucket as NaN, so that ``scaler.step`` skips the
        step, and at the next iteration the hook's memory and ``iteration`` are put back to
        before the skipped one (counted in ``overflows``), as if it had not happened. Costs one
        finiteness pass over the bucket and its result, a copy of the memory per iteration, and
        one flag byte per all-gathered message. Without a scaler a non-finite gradient raises.

    Counters (this rank): ``iteration`` (completed iterations), ``bytes_sent`` (bytes handed to
    collectives as this rank's own message, all iterations), ``last_step_bytes`` (the same, last
    completed iteration), ``dense_bytes`` (what DDP's dense all-reduce would have handed over),
    ``overflows`` (iterations skipped for a non-finite gradient, with a ``scaler``; a skipped
    iteration is undone, and counted, when the next one starts or at :meth:`state_dict`).
    """

    def __init__(
        self,
        compressor: str | Compressor,
        *,
        ratio: float | None = None,
        error_feedback: ErrorFeedback = "none",
        weights: Sequence[float] | torch.Tensor | None = None,
        seed: int = 0,
        warmup_steps: int = 1,
        momentum: float = 0.0,
        min_numel: int = 1024,
        process_group: dist.ProcessGroup | None = None,
        skip_communication: bool = False,
        scaler: Any | None = None,
    ) -> None:
        if error_feedback not in _MODES:
            raise ValueError(
                f"error_feedback must be one of {', '.join(_MODES)}, got {error_feedback!r}"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "CompressionState needs an initialised process group: call "
                "torch.distributed.init_process_group (or shrinkgrad.distributed."
                "init_process_group) before creating it"
            )
        for name, value in (("seed", seed), ("warmup_steps", warmup_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, (int, float))
            or not (0.0 <= float(momentum) < 1.0)
        ):
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if ratio is not None and (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 0.0 < float(ratio) <= 1.0
        ):
            raise ValueError(f"ratio must be a number in (0, 1] (e.g. 0.01 for 1%), got {ratio!r}")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(
                "scaler must be a torch.amp.GradScaler (an object with get_scale()), got "
                f"{type(scaler).__name__}"
            )
        self.scaler = scaler
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.error_feedback: ErrorFeedback = error_feedback
        self.ratio = None if ratio is None else float(ratio)
        self.seed = int(seed)
        self.warmup_steps = int(warmup_steps)
        self.momentum = float(momentum)
        self.min_numel = int(min_numel)
        self.skip_communication = bool(skip_communication)
        self.weights = self._weights(weights)
        self._template = compressor
        self.compressor = self._build(compressor, None)  # validates the name (k may be missing)
        # counters
        self.iteration = 0
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.last_step_bytes = 0
        self.overflows = 0
        self._step_bytes = 0
        # iteration bookkeeping: inside an iteration (between its first and last bucket), and
        # with a scaler the memory and iteration at its start, put back if it overflowed
        self._open = False
        self._overflowed = False
        self._backup: dict[int, dict[str, torch.Tensor]] = {}
        self._backup_iteration = 0
        # bucket plans by index, canonical ids of parameters, error-feedback memory by id
        self._plans: dict[int, _Plan] = {}
        self._uids: dict[int, tuple[int, torch.Tensor]] = {}
        self._memory: dict[int, dict[str, torch.Tensor]] = {}
        self._compressors: dict[int, Compressor | None] = {}

    # -- configuration ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The compressor's name as used in result tables (``top_k[ratio=0.01]`` style)."""
        base = self.compressor.name if self.compressor is not None else str(self._template)
        return f"{base}[ratio={self.ratio:g}]" if self.ratio is not None else base

    def _build(self, spec: str | Compressor, k: int | None) -> Compressor | None:
        """The compressor, with ``k`` substituted when a ratio is used (None: not yet known)."""
        if self.ratio is None:
            return COMPRESSORS.make(spec)
        text = spec.spec if isinstance(spec, Compressor) else spec
        if not text:
            raise ValueError(
                "ratio needs the compressor by name (e.g. 'top_k' or 'rand_k[shared_seed=true]')"
            )
        entry = COMPRESSORS.entry(str(text).split("[")[0].split("(")[0].strip())
        if "k" not in {p.name for p in entry.keyword}:
            raise ValueError(
                f"ratio={self.ratio:g} needs a compressor with a k parameter (top_k, rand_k, "
                f"rand_k_scaled), got {text!r}; drop ratio for this compressor"
            )
        if k is None:
            return None
        return COMPRESSORS.make(text, k=k)

    def _weights(self, weights: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
        n = self.world_size
        if self.error_feedback != "ef21_w":
            if weights is not None:
                raise ValueError(
                    f"weights are EF21-W's (error_feedback='ef21_w'); got weights with "
                    f"error_feedback={self.error_feedback!r}"
                )
            return torch.full((n,), 1.0 / n, dtype=torch.float64)
        if weights is None:
            raise ValueError(
                "error_feedback='ef21_w' needs weights: one positive number per rank, e.g. the "
                "ranks' smoothness constants L_i ([EFR] Alg. 2: w_i = L_i / Σ_j L_j)"
            )
        w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1).cpu()
        if w.numel() != n:
            raise ValueError(f"weights needs one entry per rank (world size {n}), got {w.numel()}")
        if not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
            raise ValueError(f"weights must be finite and > 0, got {w.tolist()}")
        return w / w.sum()

    def _compressor_for(self, numel: int) -> Compressor | None:
        """The compressor of a tensor with ``numel`` entries (None: sent uncompressed)."""
        if numel in self._compressors:
            return self._compressors[numel]
        C: Compressor | None = None
        if numel >= max(self.min_numel, 1):
            if self.ratio is not None:
                k = min(numel, max(1, math.ceil(self.ratio * numel)))
                C = self._build(self._template, k)
            else:
                C = self.compressor
            assert C is not None
            if self.error_feedback != "none" and C.kind == "unbiased" and C.omega(numel) >= 1.0:
                raise ValueError(
                    f"error_feedback={self.error_feedback!r} needs a contractive compressor; "
                    f"{C.name} is unbiased with ω = {C.omega(numel):g} >= 1 for a tensor of "
                    f"{numel} entries. Use scaled({C.name}), a contractive one such as top_k, or "
                    "error_feedback='none'"
                )
            try:
                C.bits(numel)
            except ValueError as e:
                raise ValueError(
                    f"cannot compress a tensor of {numel} entries with {C.name}: {e}; use ratio=, "
                    f"or min_numel > {numel} to send such tensors uncompressed"
                ) from None
        self._compressors[numel] = C
        return C

    @property
    def collective(self) -> Mode:
        """How compressed messages travel: ``allreduce`` (dense results, summable), ``values``
        (shared-seed sparsifiers: the k values, summable) or ``allgather`` (packed payloads)."""
        C = self.compressor if self.compressor is not None else self._build(self._template, 1)
        assert C is not None
        if C.collective == "allreduce":
            return "allreduce"
        if getattr(C, "shared_seed", False):
            return "values"
        return "allgather"

    # -- keys -----------------------------------------------------------------------------------
    def keys(self, C: Compressor, uid: int, rank: int, iteration: int) -> Keys | None:
        """The keys of ``rank``'s draw for tensor ``uid`` at ``iteration`` (None: deterministic).

        ``Keys.derive(seed, round=iteration, client=rank, stream="ddp_hook").fold(uid)``, with
        client 0 on every rank for ``shared_seed`` compressors.
        """
        if C.deterministic:
            return None
        client = 0 if getattr(C, "shared_seed", False) else rank
        return Keys.derive(self.seed, round=iteration, client=client, stream=STREAM).fold(uid)

    # -- bucket plans ---------------------------------------------------------------------------
    def _uid(self, p: torch.Tensor) -> int:
        """The canonical id of parameter ``p``: the order in which the hook first saw it.

        The first iteration of every process sees DDP's initial bucket layout (parameters in
        reverse order, cut by ``bucket_cap_mb``), so the ids are the same in every process of
        the same model and DDP settings: they key the saved error-feedback state.
        """
        entry = self._uids.get(id(p))
        if entry is None or entry[1] is not p:
            entry = (len(self._uids), p)
            self._uids[id(p)] = entry
        return entry[0]

    def _plan(self, bucket: GradBucket) -> _Plan:
        buf = bucket.buffer()
        params = bucket.parameters()
        signature = tuple(id(p) for p in params)
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.signature == signature and plan.numel == buf.numel():
            return plan
        units: list[_Unit] = []
        offset = 0
        for p in params:
            units.append(_Unit(self._uid(p), offset, p.numel(), None, 0))
            offset += p.numel()
        if offset != buf.numel():
            raise RuntimeError(
                f"bucket {bucket.index()}: its parameters have {offset} entries but its buffer "
                f"{buf.numel()}; shrinkgrad hooks need DDP's flat bucket layout"
            )
        mode = self.collective
        esize = buf.element_size()
        for u in units:
            u.compressor = self._compressor_for(u.numel)
        if all(u.compressor is None for u in units):
            mode = "allreduce"  # nothing to compress: a plain (dense) all-reduce
        for u in units:
            C = u.compressor
            if C is not None and buf.dtype not in _FLOATS:
                raise TypeError(
                    f"compressors work on float32/float64 gradients, got {buf.dtype}; keep "
                    "the model in float32, or raise min_numel to leave tensors uncompressed"
                )
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
            self._check_memory(u)
        dense = [u for u in units if u.compressor is None]
        compressed = [u for u in units if u.compressor is not None]
        pos = 0
        if mode == "allgather":
            for u in dense + compressed:  # raw values first: they stay aligned
                u.soff, pos = pos, pos + u.nbytes
            send = torch.empty(pos + self._flag_bytes, dtype=torch.uint8, device=buf.device)
        else:
            for u in units:
                u.soff, pos = pos, pos + u.nbytes // esize
            send = torch.empty(pos, dtype=buf.dtype, device=buf.device)
        plan = _Plan(signature, buf.numel(), buf.dtype, mode, units, dense, compressed, send)
        most = max((u.numel for u in compressed), default=0)
        plan.scratch = [torch.empty(most, dtype=buf.dtype, device=buf.device) for _ in range(2)]
        self._plans[bucket.index()] = plan
        return plan

    def _check_memory(self, u: _Unit) -> None:
        mem = self._memory.get(u.uid)
        if mem is None:
            return
        for name, t in mem.items():
            if t.numel() != u.numel:
                raise ValueError(
                    f"the error-feedback state {name!r} of tensor #{u.uid} has {t.numel()} entries "
                    f"but the model's gradient has {u.numel}: the checkpoint belongs to another "
                    "model (or another parameter order)"
                )

    def _mem(self, u: _Unit, name: str, like: torch.Tensor) -> torch.Tensor:
        mem = self._memory.setdefault(u.uid, {})
        t = mem.get(name)
        if t is None:
            t = torch.zeros(u.numel, dtype=like.dtype, device=like.device)
            mem[name] = t
        elif t.device != like.device or t.dtype != like.dtype:
            t = t.to(device=like.device, dtype=like.dtype)
            mem[name] = t
        return t

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this rank's trajectory exactly (save one per rank)."""
        self._settle()
        return {
            "format": STATE_FORMAT,
            "config": self._config(),
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "last_step_bytes": self.last_step_bytes,
            "overflows": self.overflows,
            "memory": {
                uid: {k: t.detach().cpu().clone() for k, t in mem.items()}
                for uid, mem in sorted(self._memory.items())
            },
        }

    def _config(self) -> dict[str, Any]:
        template = self._template.spec if isinstance(self._template, Compressor) else self._template
        return {
            "compressor": str(template),
            "ratio": self.ratio,
            "error_feedback": self.error_feedback,
            "weights": self.weights.tolist(),
            "seed": self.seed,
            "warmup_steps": self.warmup_steps,
            "momentum": self.momentum,
            "min_numel": self.min_numel,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same configuration, rank and world size."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                "not a CompressionState checkpoint (expected the dict of state_dict(), format "
                f"{STATE_FORMAT!r})"
            )
        saved, now = state["config"], self._config()
        diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diff:
            detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in diff)
            raise ValueError(f"the checkpoint was saved with another hook configuration ({detail})")
        self.iteration = int(state["iteration"])
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])
        self.last_step_bytes = int(state["last_step_bytes"])
        self.overflows = int(state.get("overflows", 0))
        self._open = self._overflowed = False
        self._memory = {
            int(uid): {k: t.clone() for k, t in mem.items()} for uid, mem in state["memory"].items()
        }
        for plan in self._plans.values():
            for u in plan.units:
                self._check_memory(u)

    # -- communication --------------------------------------------------------------------------
    def _count(self, t: torch.Tensor) -> None:
        self._step_bytes += t.numel() * t.element_size()

    def _all_reduce(self, t: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
        self._count(t)
        if self.skip_communication:
            t.mul_(self.world_size)  # as if every rank had sent the same
            return _done([t])
        work = dist.all_reduce(t, group=self.process_group, async_op=True)
        assert work is not None
        return cast(torch.futures.Future[list[torch.Tensor]], work.get_future())

    def _all_gather(
        self, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[list[torch.Tensor]]:
        self._count(t)
        if self.skip_communication:
            out.view(self.world_size, -1).copy_(t)
            return _done([out])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, t, group=self.process_group, async_op=True)
        assert work is not None
        return cast(torch.futures.Future[list[torch.Tensor]], work.get_future())

    def _end_bucket(self, bucket: GradBucket, dense_bytes: int) -> None:
        self.dense_bytes += dense_bytes
        if bucket.is_last():
            self.bytes_sent += self._step_bytes
            self.last_step_bytes = self._step_bytes
            self._step_bytes = 0
            self.iteration += 1
            self._open = False

    # -- overflows (with a scaler) --------------------------------------------------------------
    @property
    def _flag_bytes(self) -> int:
        """Bytes of the overflow flag that ends every all-gathered block (1 with a scaler)."""
        return 1 if self.scaler is not None else 0

    def _begin(self, buf: torch.Tensor) -> tuple[float, bool]:
        """At every bucket: (the loss scale, whether this rank's bucket is not finite), and the
        bucket divided by the scale. The first bucket of an iteration first settles the previous
        one and saves the memory. Without a scaler: (1.0, False) and nothing else."""
        if not self._open:
            self._settle()
            self._open = True
            if self.scaler is not None:
                self._snapshot()
        if self.scaler is None:
            return 1.0, False
        scale = float(self.scaler.get_scale())
        if not bool(torch.isfinite(buf).all()):
            return scale, True
        if scale != 1.0:
            buf.div_(scale)
        return scale, False

    def _snapshot(self) -> None:
        self._backup_iteration = self.iteration
        backup: dict[int, dict[str, torch.Tensor]] = {}
        for uid, mem in self._memory.items():
            old = self._backup.get(uid, {})
            saved = backup[uid] = {}
            for name, t in mem.items():
                b = old.get(name)
                if b is None or b.shape != t.shape or b.dtype != t.dtype or b.device != t.device:
                    b = torch.empty_like(t)
                saved[name] = b.copy_(t)
        self._backup = backup

    def _settle(self) -> None:
        """After an iteration in which some bucket overflowed: the memory and the iteration as
        they were before it (state created during it is dropped)."""
        if not self._overflowed:
            return
        for uid in list(self._memory):
            mem, saved = self._memory[uid], self._backup.get(uid, {})
            for name in list(mem):
                if name in saved:
                    mem[name].copy_(saved[name])
                else:
                    del mem[name]
            if not mem:
                del self._memory[uid]
        self.iteration = self._backup_iteration
        self.overflows += 1
        self._overflowed = False

    def _finish_scaled(self, scale: float, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        """The aggregate times the loss scale, or NaN everywhere (and the iteration marked for
        undoing) when it is not finite: some rank overflowed, or the sum did."""
        out = fut.value()
        if not bool(torch.isfinite(out).all()):
            out.fill_(float("nan"))
            self._overflowed = True
        elif scale != 1.0:
            out.mul_(scale)
        return out


def _done(value: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _result(fut: torch.futures.Future[list[torch.Tensor]], what: str, rank: int) -> torch.Tensor:
    """The (first) tensor of a collective's future, or a clear error (never blocks: the
    future is done). All-gather futures hold the per-rank chunks: use the output buffer."""
    try:
        return fut.value()[0]
    except Exception as e:
        raise CollectiveError(
            f"rank {rank}: the {what} of a shrinkgrad DDP hook failed — a peer process died or "
            f"stopped responding within the process group timeout ({type(e).__name__}: {e})"
        ) from e


def compression_hook(
    state: CompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Compress, exchange and aggregate one DDP bucket (see the module docstring).

    Register with ``model.register_comm_hook(state, compression_hook)``. Returns a future of the
    bucket-sized tensor DDP writes into the gradients: the average of the ranks' compressed
    gradients (``none``/``ef``) or EF21's estimator g (``ef21``/``ef21_w``).
    """
    buf = bucket.buffer()
    dense_bytes = buf.numel() * buf.element_size()
    scale, bad = state._begin(buf)
    if state.momentum > 0.0 and not bad:
        _momentum(state, state._plan(bucket), buf)
    if state.iteration < state.warmup_steps:
        fut = _warmup(state, bucket, buf)  # a non-finite bucket makes every rank's sum non-finite
    else:
        plan = state._plan(bucket)
        path = _gather if plan.mode == "allgather" else _reduce
        fut = path(state, plan, buf, bad)
    if state.scaler is not None:
        fut = fut.then(functools.partial(state._finish_scaled, scale))
    state._end_bucket(bucket, dense_bytes)
    return fut


# --------------------------------------------------------------------------------------------
# the paths: warm-up, summable messages, packed payloads
# --------------------------------------------------------------------------------------------
def _warmup(
    state: CompressionState, bucket: GradBucket, buf: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Dense all-reduce of the average; EF21 sets g_i = s_i x_i and g = the average."""
    # the plan also fixes the tensors' canonical ids in the first iteration of every process,
    # when DDP's bucket layout is the initial one (so a restarted job numbers them the same)
    plan = state._plan(bucket)
    units: list[_Unit] = []
    if state.error_feedback in ("ef21", "ef21_w"):
        units = plan.compressed
        s = _scale(state)
        for u in units:
            g_local = state._mem(u, "g_local", buf)
            g_local.copy_(buf[u.offset : u.offset + u.numel])
            if s != 1.0:
                g_local.mul_(s)
    buf.div_(state.world_size)
    fut = state._all_reduce(buf)
    rank = state.rank

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = _result(f, "all-reduce (warm-up)", rank)
        for u in units:
            state._mem(u, "g", out).copy_(out[u.offset : u.offset + u.numel])
        return out

    return fut.then(finish)


def _momentum(state: CompressionState, plan: _Plan, buf: torch.Tensor) -> None:
    """Client-side momentum: v_i ← β v_i + (1 − β) x_i from v_i = 0; the bucket then carries
    v_i in place of x_i."""
    beta = state.momentum
    for u in plan.units:
        x = buf[u.offset : u.offset + u.numel]
        v = state._mem(u, "v", x)
        v.mul_(beta).add_(x, alpha=1.0 - beta)
        x.copy_(v)


def _scale(state: CompressionState) -> float:
    """EF21-W's s_i = 1/(n w_i) of this rank (1 for the other modes)."""
    if state.error_feedback != "ef21_w":
        return 1.0
    return float(1.0 / (state.world_size * state.weights[state.rank]))


def _client(
    state: CompressionState, plan: _Plan, u: _Unit, x: torch.Tensor, compress: Compress
) -> None:
    """This rank's client update of tensor ``u`` with gradient ``x``; ``compress(p)`` sends
    C(p) and returns it as a dense tensor (the shared rules of :mod:`shrinkgrad.methods.rules`).
    EF21's difference goes into the plan's work vector 0."""
    mode = state.error_feedback
    if mode == "none":
        compress(x)
    elif mode == "ef":
        ef_update(state._mem(u, "e", x), x, compress, inplace=True)
    else:
        target = x if mode == "ef21" else x * _scale(state)
        g = state._mem(u, "g_local", x)
        ef21_update(g, target, compress, inplace=True, scratch=plan.work(0, u.numel))


def _reduce(
    state: CompressionState, plan: _Plan, buf: torch.Tensor, bad: bool = False
) -> torch.futures.Future[torch.Tensor]:
    """Summable messages: one all-reduce of w_i c_i (dense results, or shared-index values).
    A rank whose bucket is not finite (``bad``, with a scaler) sends NaN instead: the sums, and
    so the result, are then NaN on every rank (:meth:`CompressionState._finish_scaled`)."""
    n, rank, it = state.world_size, state.rank, state.iteration
    send, esize = plan.send, buf.element_size()
    ef21 = state.error_feedback in ("ef21", "ef21_w")
    w_self = float(state.weights[rank])
    values = plan.mode == "values"
    if bad:
        send.fill_(float("nan"))
    for u in plan.units if not bad else ():
        x = buf[u.offset : u.offset + u.numel]
        seg = send[u.soff : u.soff + u.nbytes // esize]
        C = u.compressor
        if C is None:
            torch.div(x, n, out=seg)
            continue
        keys = state.keys(C, u.uid, rank, it)
        if values:
            dec = plan.work(1, u.numel) if state.error_feedback != "none" else None
            compress = _values_encoder(C, keys, seg, dec)
        else:
            compress = _dense_encoder(C, keys, seg)
        _client(state, plan, u, x, compress)
        if ef21:
            seg.mul_(w_self)
        else:
            seg.div_(n)
    fut = state._all_reduce(send)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = _result(f, "all-reduce", rank)
        for u in plan.units:
            seg = total[u.soff : u.soff + u.nbytes // esize]
            out = buf[u.offset : u.offset + u.numel]
            C = u.compressor
            agg = seg
            if C is not None and values:
                payload = seg.view(torch.uint8)
                keys = state.keys(C, u.uid, rank, it)
                agg = C.decode(payload, u.numel, buf.dtype, keys, out=plan.work(1, u.numel))
            if C is not None and ef21:
                g = state._mem(u, "g", out)
                g.add_(agg)
                agg = g
            out.copy_(agg)
        return buf

    return fut.then(finish)


def _dense_encoder(C: Compressor, keys: Keys | None, seg: torch.Tensor) -> Compress:
    """``compress`` for summable dense results: C(p) goes into ``seg`` and is returned."""

    def compress(p: torch.Tensor) -> torch.Tensor:
        return C(p, keys, out=seg)

    return compress


def _values_encoder(
    C: Compressor, keys: Keys | None, seg: torch.Tensor, dec: torch.Tensor | None
) -> Compress:
    """``compress`` for shared-seed sparsifiers: the payload is the k values, encoded straight
    into ``seg``; returns C(p) decoded into ``dec`` (when error feedback needs it, else p)."""

    def compress(p: torch.Tensor) -> torch.Tensor:
        nbytes = seg.numel() * seg.element_size()
        payload = C.encode(p, keys, out=seg.view(torch.uint8))
        if payload.numel() != nbytes:
            raise RuntimeError(
                f"{C.name} sent {payload.numel()} bytes for {seg.numel()} values: with "
                "shared_seed=true a message must be the values only"
            )
        return p if dec is None else C.decode(payload, p.numel(), p.dtype, keys, out=dec)

    return compress


def _payload_encoder(
    C: Compressor,
    keys: Keys | None,
    box: list[torch.Tensor],
    dest: torch.Tensor | None,
    dec: torch.Tensor | None,
) -> Compress:
    """``compress`` for packed payloads: the payload is encoded into ``dest`` (fixed-size
    messages: their slot of the send buffer) or a new tensor, and put into ``box``; returns
    C(p) decoded into ``dec`` (when error feedback needs it, else p itself)."""

    def compress(p: torch.Tensor) -> torch.Tensor:
        payload = C.encode(p, keys, out=dest)
        box.append(payload)
        return p if dec is None else C.decode(payload, p.numel(), p.dtype, keys, out=dec)

    return compress


def _gather(
    state: CompressionState, plan: _Plan, buf: torch.Tensor, bad: bool = False
) -> torch.futures.Future[torch.Tensor]:
    """Packed payloads: one all-gather of every rank's byte buffer, decoded in rank order.

    Layout of a rank's buffer: the raw values of the uncompressed tensors, then (variable-size
    compressors only) one int32 size per compressed tensor, then the payloads; variable-size
    buffers are zero-padded to the largest one, whose size is all-gathered first. With a scaler
    every buffer ends with one more byte, 1 when the rank's bucket was not finite (``bad``: it
    sends nothing else, and no rank decodes anything).
    """
    rank, it = state.rank, state.iteration
    flag = state._flag_bytes
    variable = any(u.compressor is not None and u.compressor.variable_size for u in plan.compressed)
    if bad:
        return _gather_overflow(state, plan, buf, variable)
    dense_part = sum(u.nbytes for u in plan.dense)
    payloads: list[torch.Tensor] = []
    need = state.error_feedback != "none"
    for u in plan.dense:
        x = buf[u.offset : u.offset + u.numel]
        plan.send[u.soff : u.soff + u.nbytes].view(buf.dtype).copy_(x)
    for u in plan.compressed:
        C = u.compressor
        assert C is not None
        box: list[torch.Tensor] = []
        x = buf[u.offset : u.offset + u.numel]
        # fixed-size messages are encoded in place, into their slot of the send buffer
        dest = None if variable else plan.send[u.soff : u.soff + u.nbytes]
        dec = plan.work(1, u.numel) if need else None
        keys = state.keys(C, u.uid, rank, it)
        _client(state, plan, u, x, _payload_encoder(C, keys, box, dest, dec))
        if not C.variable_size and box[0].numel() != u.nbytes:
            raise RuntimeError(
                f"{C.name} encoded {u.numel} entries into {box[0].numel()} bytes, but its bits "
                f"formula gives {u.nbytes}: its wire format and bits() disagree"
            )
        payloads.append(box[0])
    if variable:
        header = torch.tensor([p.numel() for p in payloads], dtype=torch.int32)
        size = dense_part + header.numel() * 4 + sum(p.numel() for p in payloads)
        block = _max_size(state, size + flag)
        if plan.send.numel() < block:
            grown = torch.zeros(block, dtype=torch.uint8, device=buf.device)
            grown[:dense_part].copy_(plan.send[:dense_part])
            plan.send = grown
        send = plan.send[:block]
        send[size:].zero_()
        send[dense_part : dense_part + header.numel() * 4].copy_(header.view(torch.uint8))
        pos = dense_part + header.numel() * 4
        for p in payloads:
            send[pos : pos + p.numel()].copy_(p)
            pos += p.numel()
    else:  # the payloads are already in place
        send = plan.send
        block = send.numel()
    if flag:
        send[block - 1] = 0
    return _exchange(state, plan, buf, send, block, variable, it)


def _gather_overflow(
    state: CompressionState, plan: _Plan, buf: torch.Tensor, variable: bool
) -> torch.futures.Future[torch.Tensor]:
    """The all-gather of a rank whose bucket is not finite: zeros and the flag byte set."""
    block = _max_size(state, 1) if variable else plan.send.numel()
    if plan.send.numel() < block:
        plan.send = torch.zeros(block, dtype=torch.uint8, device=buf.device)
    send = plan.send[:block]
    send.zero_()
    send[block - 1] = 1
    return _exchange(state, plan, buf, send, block, variable, state.iteration)


def _exchange(
    state: CompressionState,
    plan: _Plan,
    buf: torch.Tensor,
    send: torch.Tensor,
    block: int,
    variable: bool,
    it: int,
) -> torch.futures.Future[torch.Tensor]:
    """All-gather ``send`` (``block`` bytes per rank) and decode the ranks' messages into buf."""
    n, rank = state.world_size, state.rank
    if plan.recv is None or plan.recv.numel() < n * block:
        plan.recv = torch.empty(n * block, dtype=torch.uint8, device=buf.device)
    recv = plan.recv[: n * block]
    fut = state._all_gather(recv, send)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        _result(f, "all-gather", rank)  # raises a clear error if the collective failed
        if state.scaler is not None and bool(recv.view(n, block)[:, block - 1].any()):
            return buf.fill_(float("nan"))  # some rank overflowed: nothing to decode
        return _combine(state, plan, buf, recv, block, variable, it)

    return fut.then(finish)


def _max_size(state: CompressionState, size: int) -> int:
    """The largest ``size`` over the ranks (a small blocking all-gather in the hook body)."""
    mine = torch.tensor([size], dtype=torch.int64)
    if state.skip_communication:
        state._count(mine)
        return size
    sizes = torch.empty(state.world_size, dtype=torch.int64)
    fut = state._all_gather(sizes, mine)
    fut.wait()  # in the hook body, not in a callback: safe
    _result(fut, "all-gather (message sizes)", state.rank)
    return int(sizes.max())


def _combine(
    state: CompressionState,
    plan: _Plan,
    buf: torch.Tensor,
    recv: torch.Tensor,
    block: int,
    variable: bool,
    it: int,
) -> torch.Tensor:
    """Decode every rank's block of ``recv`` (in rank order) and write the aggregate into buf."""
    n = state.world_size
    ef21 = state.error_feedback in ("ef21", "ef21_w")
    dense_part = sum(u.nbytes for u in plan.dense)
    m = len(plan.compressed)
    for j in range(n):
        base = j * block
        for u in plan.dense:
            raw = recv[base + u.soff : base + u.soff + u.nbytes].clone()  # aligned copy
            out = buf[u.offset : u.offset + u.numel]
            if j == 0:
                out.copy_(raw.view(buf.dtype))
            else:
                out.add_(raw.view(buf.dtype))
        if variable:
            header = recv[base + dense_part : base + dense_part + 4 * m].clone().view(torch.int32)
            sizes = [int(s) for s in header.tolist()]
            pos = base + dense_part + 4 * m
        else:
            sizes = [u.nbytes for u in plan.compressed]
            pos = base + dense_part
        for u, size in zip(plan.compressed, sizes, strict=True):
            C = u.compressor
            assert C is not None
            payload = recv[pos : pos + size]
            keys = state.keys(C, u.uid, j, it)
            pos += size
            out = buf[u.offset : u.offset + u.numel]
            if C.sparse_message:  # O(k): add the values at their indices
                idx, vals = C.decode_sparse(payload, u.numel, buf.dtype, keys)
                if ef21:
                    vals.mul_(float(state.weights[j]))
                if j == 0:
                    out.zero_()
                out.index_add_(0, idx, vals)
                continue
            c = C.decode(
                payload, u.numel, buf.dtype, keys, out=out if j == 0 else plan.work(1, u.numel)
            )
            if ef21:
                c.mul_(float(state.weights[j]))
            if j > 0:
                out.add_(c)
    for u in plan.dense:
        buf[u.offset : u.offset + u.numel].div_(n)
    for u in plan.compressed:
        out = buf[u.offset : u.offset + u.numel]
        if ef21:
            g = state._mem(u, "g", out)
            g.add_(out)
            out.copy_(g)
        else:
            out.div_(n)
    return buf
