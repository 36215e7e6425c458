"""The DDP communication hook: :class:`CompressionState` and :func:`compression_hook`.

Two lines in any training loop (``model`` is a ``DistributedDataParallel``)::

    state = CompressionState("top_k", ratio=0.01, method="ef21")
    model.register_comm_hook(state, compression_hook)

The state ties the package together: its :mod:`configuration <.config>`, the :mod:`bucket plans
<.plan>`, the :mod:`method adapter <.adapter>`, the :mod:`memory <.memory>` (method states,
snapshot, checkpoints), the :mod:`collectives <.collectives>`; :mod:`.exchange` runs one bucket's
iteration. It also keeps the iteration counter, the byte counters and the loss-scaler protocol.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at runtime
# (``bucket: dist.GradBucket``, return exactly ``torch.futures.Future[torch.Tensor]``), and string
# annotations fail that check.
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # = torch.distributed.GradBucket

from ...compressors import Compressor
from ...methods.base import Method, State
from ...methods.ef21_sgdm import ClientMomentum
from .adapter import Adapter, HookConfig
from .collectives import Comm
from .config import ErrorFeedback, Granularity, Mode, Settings, StateDtype, Summation
from .encoders import fresh_encoder
from .exchange import exchange
from .memory import STATE_FORMAT, Memory
from .plan import Plan, Planner, Unit

__all__ = ["CompressionState", "compression_hook"]


class CompressionState:
    """State of :func:`compression_hook`: the method, its per-tensor states, byte counters.

    Parameters
    ----------
    compressor:
        a compressor or its name (``"top_k[k=1000]"``, ``"qsgd[s=4]"``,
        ``"rand_k[shared_seed=true]"``, ...).
    method:
        a registered method (or its name) that runs in a hook (``methods_for("hook")``: gd, dcgd,
        ef, ef21, ef21_w, ef21_sgdm[beta=...], ...; ``shrinkgrad list methods``). Each tensor runs
        it as one client per rank: its memory is the method's client state, the hook's
        aggregate goes to the method's server part, and DDP receives the method's direction
        (EF21: its estimator g; DCGD, EF: the aggregate). Default: ``dcgd[biased=true]``
        (compressed gradients without error feedback, any compressor).
    ratio:
        for compressors with a ``k`` parameter (top_k, rand_k, rand_k_scaled, strat_k), also
        inside ``scaled(...)``: keep k = ⌈ratio · d⌉ of the d entries of every tensor
        (``compressor`` then needs no ``k``).
    error_feedback:
        deprecated: ``"none"``, ``"ef"``, ``"ef21"``, ``"ef21_w"`` stand for
        ``method="dcgd[biased=true]"``, ``"ef"``, ``"ef21"``, ``"ef21_w"``.
    weights:
        the ranks' weights of a weighted method (``ef21_w`` needs them): one positive number per
        rank, e.g. the ranks' smoothness constants L_i ([EFR] Alg. 2: w_i = L_i / Σ_j L_j; the
        method normalises them).
    seed:
        seed of the keyed draws (random compressors): rank i's draw for tensor t at iteration r
        is a function of (seed, r, i, t) only, and of (seed, r, t) for ``shared_seed``
        compressors, which every rank then draws identically.
    warmup_steps:
        the first iterations are sent uncompressed: the method's initialisation, when it reads
        the gradient (EF21's ``init="full"``: g_i = ∇f_i), or its rounds with the identity
        compressor. A method whose initialisation reads the gradient spends iteration 0 on it
        (uncompressed) whatever this is.
    momentum:
        β of client-side momentum v_i ← β v_i + (1 − β) x_i (from v_i = 0), compressed instead
        of x_i: with ``method="ef21"`` this is ``ef21_sgdm[beta=β]`` (Fatkhullin, Tyurin,
        Richtárik, NeurIPS 2023), with other methods the same momentum in front of them. Use it
        with a momentum-free optimizer at a learning rate 1/(1 − β) times that of SGD with
        momentum β: with the identity compressor the two give the same iterates.
    min_numel:
        tensors with fewer entries are sent uncompressed (the method runs on them with the
        identity compressor).
    state_dtype:
        where the method states of bfloat16 / float16 gradients are kept: ``"float32"``
        (default: the method computes in float32 on a float32 copy of each bucket, 4 bytes per
        entry and state vector) or ``"gradient"`` (in the gradients' dtype: half the memory,
        but every error-feedback sum is rounded to 8 (bf16) or 11 (fp16) significant bits, so
        small corrections are lost). Either way the values travel in the gradients' dtype.
    granularity:
        the unit of compression: ``"tensor"`` (default: every parameter's gradient is
        compressed on its own, with its own k = ⌈ratio · d_tensor⌉, its own memory and draws;
        the results do not depend on DDP's bucket size) or ``"bucket"`` (every DDP bucket is one
        flat vector: one compressor call and one method step per bucket, k = ⌈ratio ·
        d_bucket⌉, so top-k selects across the bucket's tensors and the small ones — biases,
        norms — are compressed with the rest; ``min_numel`` then applies to the bucket). A
        bucket costs about as much Python as one tensor, so models with many tensors run a
        lighter hook; the results then depend on the bucket layout (``bucket_cap_mb``). The
        memory follows the parameters through DDP's bucket rebuild, and checkpoints hold one
        entry per parameter either way. Vector compressors only: low-rank ones (rank_k,
        power_sgd) act on each parameter's matrix and are refused.
    summation:
        how the ranks' summable messages (the identity's, a shared-seed sparsifier's k values,
        PowerSGD's factors) are added: ``"reduce"`` (one all-reduce in the gradients' dtype),
        ``"gather"`` (an all-gather of the same values, added in the method's dtype in rank
        order) or ``"auto"`` (default: ``"gather"`` for 16-bit gradients with the float32 state
        of a method whose server integrates the aggregates — EF21, EF21-W, EF21-SGDM, DIANA —
        ``"reduce"`` otherwise). A 16-bit all-reduce rounds the sum at every round, and such a
        method's server state drifts from its clients' (EF21: g from (1/n) Σ g_i), a random
        walk; the gathered sum is exact to float32 round-off. Both send the same 16-bit values;
        a rank receives n − 1 messages instead of a ring all-reduce's ≈ 2(n − 1)/n, so for large
        n and dense messages (the identity) ``"reduce"`` moves fewer bytes.
    process_group:
        the group to communicate in (default: the default group, which must be initialised).
    skip_communication:
        benchmarks only: do all the local work but no collective (every rank pretends all
        ranks sent what it sent), to separate compression from communication time.
    scaler:
        the ``torch.amp.GradScaler`` (anything with ``get_scale()``) that scales the loss of
        this training loop. The hook then divides each bucket by the scale before compressing
        (the memory holds true gradients, whatever the scale does) and multiplies the aggregate
        back for the scaler's ``unscale_``. A non-finite gradient on any rank no longer raises:
        every rank gets that bucket as NaN, so that ``scaler.step`` skips the step, and at the
        next iteration the hook's memory and ``iteration`` are put back to before the skipped
        one (counted in ``overflows``), as if it had not happened. Costs one finiteness pass
        over the bucket and its result, a copy of the memory per iteration, and one flag byte per
        all-gathered message. Without a scaler a non-finite gradient raises.

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
        method: str | Method[Any, Any] | None = None,
        ratio: float | None = None,
        error_feedback: ErrorFeedback | None = None,
        weights: Sequence[float] | torch.Tensor | None = None,
        seed: int = 0,
        warmup_steps: int = 1,
        momentum: float = 0.0,
        min_numel: int = 1024,
        state_dtype: StateDtype = "float32",
        granularity: Granularity = "tensor",
        summation: Summation = "auto",
        process_group: dist.ProcessGroup | None = None,
        skip_communication: bool = False,
        scaler: Any | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "CompressionState needs an initialised process group: call "
                "torch.distributed.init_process_group (or shrinkgrad.distributed."
                "init_process_group) before creating it"
            )
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(
                "scaler must be a torch.amp.GradScaler (an object with get_scale()), got "
                f"{type(scaler).__name__}"
            )
        self.settings = Settings.build(
            compressor,
            method=method,
            error_feedback=error_feedback,
            ratio=ratio,
            weights=weights,
            seed=seed,
            warmup_steps=warmup_steps,
            momentum=momentum,
            min_numel=min_numel,
            world_size=dist.get_world_size(process_group),
            rank=dist.get_rank(process_group),
            state_dtype=state_dtype,
            granularity=granularity,
            summation=summation,
        )
        self.scaler = scaler
        self.process_group = process_group
        self.adapter = Adapter(self.settings.method, self._constants, self.settings.seed)
        self.adapter.rank = self.settings.rank
        #: the adapter of the client steps run in a collective's callback (the factor path's,
        #: :mod:`.factors`): its own port and oracle, as the hook body may use the first one
        #: meanwhile, on another thread, for the next bucket
        self.callback_adapter = Adapter(self.settings.method, self._constants, self.settings.seed)
        self.callback_adapter.rank = self.settings.rank
        self.memory = Memory(self._template)
        self.planner = Planner(
            self.settings, self._check_unit, bool(self.settings.method.sparse_messages)
        )
        self.planner.own_output = scaler is None  # a scaler writes into what DDP receives
        self._units: dict[int, tuple[Unit, torch.dtype, torch.dtype, torch.device]] = {}
        self.comm = Comm(
            process_group, self.settings.world_size, self.settings.rank, bool(skip_communication)
        )
        # counters
        self.iteration = 0
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.last_step_bytes = 0
        self.overflows = 0
        # iteration bookkeeping: inside an iteration (between its first and last bucket), and
        # with a scaler the iteration at its start, put back if it overflowed
        self._open = False
        self._overflowed = False
        self._backup_iteration = 0

    # -- configuration ---------------------------------------------------------------------------
    @property
    def method(self) -> Method[Any, Any]:
        """The method every tensor runs (after the aliases and ``momentum=``)."""
        return self.settings.method

    @property
    def momentum(self) -> float:
        """β of the method's client momentum (0 without)."""
        m = self.settings.method
        return m.beta if isinstance(m, ClientMomentum) else 0.0

    @property
    def name(self) -> str:
        """The compressor's name as used in result tables (``top_k[ratio=0.01]`` style)."""
        return self.settings.name

    @property
    def collective(self) -> Mode:
        """How compressed messages travel: ``allreduce``, ``values`` or ``allgather``."""
        return self.settings.collective

    def gathers_sums(self, dtype: torch.dtype) -> bool:
        """Whether the summable messages of ``dtype`` gradients are all-gathered and added in
        the method's dtype (``summation``; :meth:`.config.Settings.gathers`)."""
        return self.settings.gathers(dtype, self.planner.work_dtype(dtype))

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    @world_size.setter
    def world_size(self, n: int) -> None:
        """Benchmarks only (with ``skip_communication``): act as one rank of an n-rank job."""
        if self.planner.plans:
            raise RuntimeError("the world size can only be changed before the first iteration")
        self.settings.world_size = self.comm.world_size = int(n)

    @property
    def rank(self) -> int:
        return self.settings.rank

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def ratio(self) -> float | None:
        return self.settings.ratio

    @property
    def min_numel(self) -> int:
        return self.settings.min_numel

    @property
    def warmup_steps(self) -> int:
        return self.settings.warmup_steps

    @property
    def skip_communication(self) -> bool:
        return self.comm.skip

    @skip_communication.setter
    def skip_communication(self, value: bool) -> None:
        self.comm.skip = bool(value)

    def keys(self, C: Compressor, uid: int, rank: int, iteration: int) -> Any:
        """The keys of ``rank``'s draw for tensor ``uid`` at ``iteration`` (None: deterministic)."""
        return self.settings.keys(C, uid, rank, iteration)

    def _constants(self, numel: int) -> Any:
        return self.settings.constants(numel)

    def config(self, u: Unit, plan: Plan, warm: bool = False) -> HookConfig:
        """The bound method of tensor ``u`` of ``plan``: with its compressor, or the identity for
        uncompressed tensors and warm-up rounds (``warm``), in the plan's dtypes."""
        return self._config(u, plan.wdtype, plan.dtype, plan.send.device, warm)

    def callback_config(self, u: Unit, plan: Plan) -> HookConfig:
        """:meth:`config` (compressed) for the client steps of :attr:`callback_adapter`."""
        C = u.compressor if u.compressor is not None else self.settings.identity()
        return self.callback_adapter.config(u.numel, C, plan.wdtype, plan.dtype, plan.send.device)

    def _config(
        self, u: Unit, wdtype: torch.dtype, wire: torch.dtype, device: torch.device, warm: bool
    ) -> HookConfig:
        C = u.compressor
        if C is None or warm:
            C = self.settings.identity()
        return self.adapter.config(u.numel, C, wdtype, wire, device)

    # -- memory ----------------------------------------------------------------------------------
    def _check_unit(self, u: Unit, buf: torch.Tensor, wdtype: torch.dtype) -> None:
        """A tensor of a new bucket plan: bound at once (the method checks its compressor when
        the bucket is first seen, even if the first iterations are uncompressed) and checked
        against the memory."""
        self._units[u.uid] = (u, wdtype, buf.dtype, buf.device)
        if u.members:
            self.memory.groups[u.uid] = u.members
        self._config(u, wdtype, buf.dtype, buf.device, False)
        self.memory.check(u)

    def _template(self, uid: int) -> State[Any, Any]:
        """A state of the method's structure for tensor ``uid`` (from its initialisation at a
        zero gradient), into which a checkpoint's tensors are copied."""
        u, wdtype, wire, device = self._units[uid]
        like = torch.zeros(u.numel, dtype=wdtype, device=device)
        cfg = self._config(u, wdtype, wire, device, False)
        C = cfg.compressor
        encoder = fresh_encoder(C, self.settings.keys(C, u.key, self.rank, 0))
        clients, msg, _ = self.adapter.init_clients(cfg, like, encoder, torch.empty_like(like))
        agg = None if msg.values is None else torch.zeros_like(like)
        server, _ = self.adapter.init_server(cfg, agg)
        return State(0, server, clients)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this rank's trajectory exactly (save one per rank)."""
        self._settle()
        return {
            "format": STATE_FORMAT,
            "config": self.settings.describe(),
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "last_step_bytes": self.last_step_bytes,
            "overflows": self.overflows,
            "memory": self.memory.to_dict(),
            "layout": self.planner.layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same configuration, rank and world size (and
        model dtype: a state tensor saved in another dtype, e.g. bfloat16 memory of
        ``state_dtype="gradient"`` into a float32 model, is refused when its tensor is first
        planned, never cast)."""
        Memory.check_format(state)
        # checkpoints from before state_dtype existed kept float32/float64 models only
        # (and before granularity existed, per tensor)
        # (and before summation existed, "auto")
        saved = {
            "state_dtype": "float32",
            "granularity": "tensor",
            "summation": "auto",
            **state["config"],
        }
        now = self.settings.describe()
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
        self.memory.load(state["memory"])
        # the units to compress while DDP's buckets hold them otherwise (checkpoints from
        # before the layout was saved have none: then every bucket is compressed as it is)
        self.planner.hint = tuple(tuple(int(m) for m in g) for g in state.get("layout", ()))
        for plan in self.planner.plans:
            for u in plan.units:
                self.memory.check(u)

    # -- iterations ------------------------------------------------------------------------------
    @property
    def flag_bytes(self) -> int:
        """Bytes of the overflow flag that ends every all-gathered block (1 with a scaler)."""
        return 1 if self.scaler is not None else 0

    def _plan(self, bucket: GradBucket) -> Plan:
        return self.planner.plan(bucket, self.flag_bytes)

    def _begin(self, buf: torch.Tensor) -> tuple[float, bool]:
        """At every bucket: (the loss scale, whether this rank's bucket is not finite), and the
        bucket divided by the scale. The first bucket of an iteration first settles the previous
        one and saves the memory. Without a scaler: (1.0, False) and nothing else."""
        if not self._open:
            self._settle()
            self._open = True
            if self.scaler is not None:
                self._backup_iteration = self.iteration
                self.memory.snapshot()
        if self.scaler is None:
            return 1.0, False
        scale = float(self.scaler.get_scale())
        if not bool(torch.isfinite(buf).all()):
            return scale, True
        if scale != 1.0:
            buf.div_(scale)
        return scale, False

    def _settle(self) -> None:
        """After an iteration in which some bucket overflowed: the memory and the iteration as
        they were before it (state created during it is dropped)."""
        if not self._overflowed:
            return
        self.memory.restore()
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

    def _end_bucket(self, bucket: GradBucket, dense_bytes: int) -> None:
        self.dense_bytes += dense_bytes
        if bucket.is_last():
            if not self.planner.sealed and not any(p.compressed for p in self.planner.plans):
                warnings.warn(
                    f"CompressionState: no {self.settings.granularity} of this model has "
                    f"min_numel={self.settings.min_numel} entries or more, so nothing is "
                    f"compressed (every gradient is sent dense by {self.method.name}); lower "
                    "min_numel to compress smaller tensors",
                    UserWarning,
                    stacklevel=2,
                )
            step = self.comm.step_bytes
            self.bytes_sent += step
            self.last_step_bytes = step
            self.comm.step_bytes = 0
            self.iteration += 1
            self._open = False
            self.planner.sealed = True


def compression_hook(
    state: CompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Compress, exchange and aggregate one DDP bucket (docs/distributed.md, section 1).

    Register with ``model.register_comm_hook(state, compression_hook)``. Returns a future of the
    bucket-sized tensor DDP writes into the gradients: the method's direction (the average of
    the ranks' compressed gradients for DCGD and EF, EF21's estimator g, ...).
    """
    buf = bucket.buffer()
    dense_bytes = buf.numel() * buf.element_size()
    scale, bad = state._begin(buf)
    plan = state._plan(bucket)
    fut = exchange(state, plan, plan.stage(buf), bad)
    if plan.staged is not None:  # the units a checkpoint saved, in another grouping or order
        fut = fut.then(functools.partial(plan.unstage, buf))
    if state.scaler is not None:
        fut = fut.then(functools.partial(state._finish_scaled, scale))
    state._end_bucket(bucket, dense_bytes)
    return fut
