"""The method adapter: how the hook runs a registered method on one tensor of one rank.

Every tensor is its own problem: the method is bound (``Method.bind``, so its compressor check,
its weights and its constants are its own) to ``Constants(n=world size, d=numel, L=None,
L_i=weights)`` with step size 1 and the tensor's compressor, and runs one client, ``ids =
[rank]``. The pieces it talks to are the hook's:

* :class:`HookOracle` — ``oracle.grads(x, ids)`` is the bucket's slice of this tensor (a view the
  caller may overwrite, ``fresh``; a copy during the initialisation, which may keep it);
* :class:`HookConfig` — ``cfg.compress`` encodes into the plan's preallocated wire buffer
  (through the :class:`Port` the hook sets for each tensor) and returns the decoded message;
  ``cfg.scratch`` is a preallocated work vector; ``cfg.inplace`` is set, so the method updates
  its state tensors in place; bit counting is the hook's own (the traffic methods return zeros);
* the server state's ``x`` is the zero displacement: the hook's frame moves with the model, and
  :meth:`~shrinkgrad.methods.Method.server_direction` / ``init_direction`` give the direction D
  that the optimizer applies (x ← x − lr·D).

The optimizer's learning rate is the method's γ: a method's step size enters only through D,
except for the methods that apply it on the clients (EF), which then run learning-rate free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch

from ...methods.base import Config, Message, Method, State, Traffic
from ...methods.rules import LowRankMessage, Mirror, SparseMessage
from ...rng import Keys

__all__ = ["Adapter", "HookConfig", "HookOracle", "Port", "Probed", "StatefulEncoder"]

#: ``encode(p, sent_only) -> C(p)``: puts C(p)'s message on the wire, returns what the method
#: sees as C(p) — a dense tensor, or a :class:`~shrinkgrad.methods.rules.SparseMessage` for a
#: method with ``sparse_messages`` (``p`` itself is allowed when ``sent_only``)
Encoder = Callable[[torch.Tensor, bool], "torch.Tensor | SparseMessage"]
#: ``encode(p, q) -> (C(p), new state)``: a stateful compressor's message (PowerSGD's factors,
#: :mod:`.factors`) from the vector ``p`` and the compressor state ``q`` the method carries
StatefulEncoder = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Probed(Exception):
    """Raised by a probing encoder (:meth:`Adapter.probe`) once it has seen the vector the
    method compresses: the rest of the client step is not run."""


class Port:
    """Where ``cfg.compress`` of the tensor being processed sends its message (set per tensor)."""

    def __init__(self) -> None:
        self.encoder: Encoder | None = None
        self.stateful: StatefulEncoder | None = None
        self.scratch_vector: torch.Tensor | None = None
        self.result: torch.Tensor | SparseMessage | None = None  # what compress returned
        self.method = ""
        #: a gradient handed out unfilled (``lazy``, the method's dtype) and the 16-bit tensor
        #: it stands for (``source``): see :meth:`open`
        self.lazy: torch.Tensor | None = None
        self.source: torch.Tensor | None = None
        #: the mirrors the hook requests for the server parts running now, by the id of the
        #: state tensor they mirror (:meth:`mirror`; the callbacks of several buckets may run
        #: at once, each for its own tensors)
        self.mirrors: dict[int, tuple[torch.Tensor, Mirror]] = {}

    def mirror(self, x: torch.Tensor) -> Mirror | None:
        """The mirror requested for the state tensor ``x`` itself (:meth:`HookConfig.mirror`)."""
        entry = self.mirrors.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    def open(
        self,
        encoder: Encoder | None,
        scratch: torch.Tensor,
        method: str,
        stateful: StatefulEncoder | None = None,
        lazy: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Route the next compressor call to ``encoder``. ``lazy = (x, source)``: the oracle's
        gradient ``x`` is not filled yet; it holds ``source`` (the bucket's 16-bit slice, of
        x's shape), which ``encoder`` reads itself when the method compresses x (or x − b)
        directly — a method with ``compresses_gradient_first`` does so before anything else
        reads x. Any other use fills x first (:meth:`materialise`)."""
        self.encoder, self.scratch_vector, self.result, self.method = encoder, scratch, None, method
        self.stateful = stateful
        self.lazy, self.source = lazy if lazy is not None else (None, None)

    def materialise(self) -> None:
        """Fill the unfilled gradient from its 16-bit source (once)."""
        if self.lazy is not None and self.source is not None:
            self.lazy.copy_(self.source)
        self.lazy = self.source = None

    def _direct(self, t: torch.Tensor) -> torch.Tensor | None:
        """The 16-bit source when ``t`` is the unfilled gradient itself; else None, after
        filling it (whatever the method does next may read it)."""
        lazy, source = self.lazy, self.source
        if (
            lazy is not None
            and source is not None
            and t.data_ptr() == lazy.data_ptr()
            and t.shape == lazy.shape
            and t.dtype == lazy.dtype
        ):
            self.lazy = self.source = None  # the encoder reads the source: never filled
            return source
        self.materialise()
        return None

    def _once(self) -> None:
        if self.result is not None:
            raise ValueError(
                f"{self.method} compresses twice in one round; a DDP hook sends one message per "
                "tensor and round"
            )

    def compress(self, x: torch.Tensor, sent_only: bool) -> torch.Tensor | SparseMessage:
        if self.encoder is None:
            raise RuntimeError("the hook's compressor port is not open (internal error)")
        self._once()
        source = self._direct(x)
        if source is None:
            out = self.encoder(x, sent_only)
        else:  # the encoder reads the 16-bit gradient; "p itself" is the method's x
            out = self.encoder(source, sent_only)
            out = x if out is source else out
        self.result = out
        return out

    def compress_stateful(
        self, x: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A stateful compressor's message through the open stateful encoder."""
        if self.stateful is None:
            raise RuntimeError("the hook's port has no stateful encoder open (internal error)")
        self._once()
        self.materialise()
        out, new_state = self.stateful(x, state)
        self.result = out
        return out, new_state

    def compress_difference(
        self, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor | SparseMessage | None:
        """C(a − b) from an encoder that selects from the difference without forming it (its
        ``difference`` attribute), or None (the caller forms a − b and calls :meth:`compress`)."""
        fused = getattr(self.encoder, "difference", None)
        if fused is None:
            self.materialise()  # the method forms a − b itself
            return None
        if self.result is not None:
            raise ValueError(
                f"{self.method} compresses twice in one round; a DDP hook sends one message per "
                "tensor and round"
            )
        source = self._direct(a)
        out: torch.Tensor | SparseMessage | None = fused(a if source is None else source, b)
        if out is None and source is not None:  # declined: the method forms a − b from a
            a.copy_(source)
        self.result = out
        return out

    def sent(self, msg: Message) -> bool:
        """Whether the message's values are what ``compress`` returned (then it is on the wire)."""
        v, r = msg.values, self.result
        if v is None or r is None:
            return False
        if isinstance(r, (SparseMessage, LowRankMessage)) or isinstance(
            v, (SparseMessage, LowRankMessage)
        ):
            return v is r  # type: ignore[comparison-overlap]  # values may be a message object
        return v.data_ptr() == r.data_ptr() and v.shape == r.shape

    def close(self) -> None:
        self.encoder = self.scratch_vector = self.result = None
        self.stateful = None
        self.lazy = self.source = None


@dataclasses.dataclass(frozen=True, eq=False)
class HookConfig(Config):
    """A bound method's :class:`~shrinkgrad.methods.Config` in a DDP hook (module docstring)."""

    port: Port = dataclasses.field(default_factory=Port)
    #: the zero Traffic the client steps report (the hook counts bytes at the collectives)
    nothing: Traffic | None = None
    #: the reduction weights as floats, and whether they are all 1/n (then the hook sums and
    #: divides by n once, as DDP's own all-reduce does)
    w: tuple[float, ...] = ()
    uniform: bool = True

    def compress(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, *, sent_only: bool = False
    ) -> torch.Tensor:
        # a SparseMessage for methods that declare sparse_messages (they only hand the result
        # to the rules of methods.rules and to their Message; the contract suite checks them)
        return cast(torch.Tensor, self.port.compress(x, sent_only))

    def compress_with_state(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A stateful compressor (PowerSGD's shared basis) goes through the port's stateful
        encoder, with the state the method carries (its first Q when it carries none yet: the
        warm-up rounds ran with the identity); a stateless one through :meth:`compress`."""
        if not self.compressor.stateful:
            return self.compress(x, ids, round), state
        if state is None or state.numel() == 0:
            state = self.compressor_state(x, ids)
        return self.port.compress_stateful(x, state)

    def compress_difference(
        self, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, round: int
    ) -> torch.Tensor | None:
        # the sparse path's encoders select Top-k from a − b chunk by chunk (encoders.py)
        return cast("torch.Tensor | None", self.port.compress_difference(a, b))

    def mirror(self, x: torch.Tensor) -> Mirror | None:
        """The bfloat16 output slice that holds x's conversion, when the hook set one for x
        (:meth:`.plan.Plan.mirror_request`: a bfloat16 model's direction D = x, EF21's g)."""
        return self.port.mirror(x)

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        s = self.port.scratch_vector
        if s is None or s.numel() != like.numel():
            return torch.empty_like(like)
        return s.view(like.shape)

    def dense_traffic(self, m: int, *, down: bool = True) -> Traffic:
        assert self.nothing is not None
        return self.nothing

    def compressed_traffic(
        self, c: torch.Tensor, active: torch.Tensor | None = None, *, down: bool = True
    ) -> Traffic:
        assert self.nothing is not None
        return self.nothing

    def no_traffic(self, m: int) -> Traffic:
        assert self.nothing is not None
        return self.nothing


class HookOracle:
    """``oracle.grads(x, ids)``: this rank's gradient of the tensor being processed, (1, d)."""

    #: the caller may overwrite what grads returns (it is the bucket, about to be overwritten)
    fresh = True

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.copy = False
        self.read = False

    def load(self, x: torch.Tensor, *, copy: bool) -> None:
        self.x, self.copy, self.read = x.view(1, -1), copy, False

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.x is not None
        self.read = True
        return self.x.clone() if self.copy else self.x

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        raise TypeError(
            "a DDP hook has only the gradient that backward computed; a method that samples its "
            "own minibatches cannot run there"
        )


class Adapter:
    """Runs one method for every tensor: the bound configurations (per size and compressor), the
    oracle, the port, and the calls of the method's parts."""

    def __init__(self, method: Method[Any, Any], constants: Callable[[int], Any], seed: int):
        self.method = method
        self._constants = constants
        self._seed = seed
        self.port = Port()
        self.oracle = HookOracle()
        self._configs: dict[tuple[Any, ...], HookConfig] = {}
        self._zeros: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._pure: dict[int, HookConfig] = {}  # the inplace=False twins of the configs (probe)
        self.rank = 0
        #: set when the last user of this adapter that may run on another thread (a bucket's
        #: client steps in a collective's callback, :mod:`.factors`) is done with it; the next
        #: one runs from its callback, never waiting for it (None: nobody has used it yet)
        self.released: torch.futures.Future[None] | None = None

    def config(
        self, numel: int, compressor: Any, dtype: torch.dtype, wire: torch.dtype, device: Any
    ) -> HookConfig:
        """The method bound for a tensor of ``numel`` entries and ``compressor``, computing in
        ``dtype`` with its values sent in ``wire`` (cached)."""
        key = (numel, compressor.name, dtype, wire, device)
        cfg = self._configs.get(key)
        if cfg is None:
            # Method.bind takes the simulator's dtypes (float32/float64): a method kept in a
            # 16-bit dtype (state_dtype="gradient") is bound in float32 and given its dtype here
            bound = self.method.bind(
                self._constants(numel),
                compressor,
                stepsize=1.0,
                seed=self._seed,
                dtype=dtype if dtype in (torch.float32, torch.float64) else torch.float32,
                device=device,
                wire_dtype=wire,
            )
            base = {
                f.name: getattr(bound.cfg, f.name)
                for f in dataclasses.fields(Config)
                if not f.name.startswith("_")
            }
            z = torch.zeros(1, dtype=torch.float64, device=device)
            base.update(inplace=True, dtype=dtype)
            w = tuple(float(v) for v in bound.cfg.weights.tolist())
            cfg = HookConfig(
                **base,
                port=self.port,
                nothing=Traffic(z, z, z),
                w=w,
                uniform=len(set(w)) == 1,
            )
            self._configs[key] = cfg
        return cfg

    def x0(self, cfg: HookConfig) -> torch.Tensor:
        """The zero displacement (a broadcast zero: writing into it fails loudly)."""
        key = (cfg.d, cfg.dtype, cfg.device)
        z = self._zeros.get(key)
        if z is None:
            z = torch.zeros((), dtype=cfg.dtype, device=cfg.device).expand(cfg.d)
            self._zeros[key] = z
        return z

    def ids(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.rank], dtype=torch.int64, device=device)

    # -- the parts ---------------------------------------------------------------------------
    def init_clients(
        self, cfg: HookConfig, x: torch.Tensor, encoder: Encoder, scratch: torch.Tensor
    ) -> tuple[Any, Message, bool]:
        """The method's client initialisation on this rank's gradient ``x`` (d,): (client state,
        message, whether it read the gradient)."""
        self.oracle.load(x, copy=True)
        self.port.open(encoder, scratch, self.method.name)
        try:
            clients, msg = self.method.init_clients(
                cfg, self.x0(cfg), self.oracle, self.ids(x.device)
            )
        finally:
            self.port.close()
        return clients, msg, self.oracle.read

    def client_step(
        self,
        cfg: HookConfig,
        state: State[Any, Any],
        x: torch.Tensor,
        encoder: Encoder | None,
        scratch: torch.Tensor,
        *,
        stateful: StatefulEncoder | None = None,
        source: torch.Tensor | None = None,
    ) -> tuple[Any, Message, bool]:
        """One round of the method's client part on ``x`` (d,): (new client state, message,
        whether the message is on the wire already, i.e. it is what ``cfg.compress`` returned).
        A stateful compressor's call goes to ``stateful`` (:mod:`.factors`). ``source``: the
        16-bit gradient that ``x`` (unfilled) stands for, which ``encoder`` reads itself
        (only for methods with ``compresses_gradient_first``; :meth:`Port.open`)."""
        self.oracle.load(x, copy=False)
        lazy = None
        if source is not None:
            assert self.oracle.x is not None and self.method.compresses_gradient_first
            lazy = (self.oracle.x, source.view(self.oracle.x.shape))
        self.port.open(encoder, scratch, self.method.name, stateful, lazy)
        try:
            clients, msg = self.method.client_step(
                cfg, state.server, state.clients, self.oracle, state.round + 1
            )
            sent = self.port.sent(msg)
        finally:
            self.port.close()
        return clients, msg, sent

    def probe(
        self,
        cfg: HookConfig,
        state: State[Any, Any],
        x: torch.Tensor,
        encoder: StatefulEncoder,
        scratch: torch.Tensor,
    ) -> None:
        """Run the method's client part on ``x`` (d,) up to its compressor call, which hands the
        vector it compresses and its compressor state to ``encoder`` (which raises
        :class:`Probed`): the collective stage that needs every rank's vector (PowerSGD's
        P = Σ M_i Q) is formed before the client step itself can finish (:mod:`.factors`). The
        method runs as a pure function (``inplace=False``, an oracle whose result it must not
        overwrite), so nothing of its state changes; the step is then run in full
        (:meth:`client_step`) once the collective has returned, and, being deterministic,
        hands the encoder the same vector."""
        pure = self._pure.get(id(cfg))
        if pure is None:
            pure = dataclasses.replace(cfg, inplace=False)
            self._pure[id(cfg)] = pure
        self.oracle.load(x, copy=False)
        self.oracle.fresh = False
        self.port.open(None, scratch, self.method.name, encoder)
        try:
            self.method.client_step(pure, state.server, state.clients, self.oracle, state.round + 1)
        except Probed:
            return
        finally:
            self.port.close()
            self.oracle.fresh = True
        raise RuntimeError(
            f"{self.method.name} did not compress in its client step; the hook's factor "
            "all-reduce (power_sgd[shared=true]) needs one compressed message per tensor and round"
        )

    def init_server(
        self, cfg: HookConfig, aggregate: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor]:
        """(the server state of round 1 before its clients act, the direction D of iteration 0)."""
        return self.method.init_direction(cfg, self.x0(cfg), aggregate)

    def server_step(
        self,
        cfg: HookConfig,
        state: State[Any, Any],
        aggregate: torch.Tensor | SparseMessage | LowRankMessage | None,
    ) -> tuple[Any, torch.Tensor | SparseMessage]:
        """(the server state of the next round before its clients act, the direction D). A
        SparseMessage aggregate (methods with ``sparse_messages``) may give a sparse D."""
        agg = cast("torch.Tensor | None", aggregate)
        return self.method.server_direction(cfg, state.server, agg, state.round + 1)

    def direction_changes(
        self, cfg: HookConfig, aggregate: torch.Tensor | SparseMessage | LowRankMessage | None
    ) -> torch.Tensor | None:
        """Where the last :meth:`server_step`'s direction can differ from the round before's
        (``Method.direction_changes``), or None: anywhere."""
        return self.method.direction_changes(cfg, aggregate)
