"""The method abstraction: init/step pairs over explicit state, split into server and client parts.

Every method of methods.md §3 is written once, as three pure functions over explicit state
(optax-style; design.md principle 1):

1. ``server_pre(cfg, server, r)``: what the server does before the clients act in round ``r``
   (EF21: x^r = x^{r-1} − γ g^{r-1}; DCGD: nothing);
2. ``client_step(cfg, server, clients, oracle, r)``: what *any subset* of clients does, on a
   leading tensor axis. The subset is given by the global client ids stored in ``clients.ids``;
   the ids alone determine every random draw (keyed by (seed, stream, client, round)), so a
   client computes the same thing whether it runs alone, in a group on one rank, or in the full
   simulator batch. It returns the new client state and a :class:`Message`: the clients'
   vectors ``values`` (m, d) and their reduction ``weights`` (m,) (1/n, or w_i for EF21-W);
3. a **reduction** ``reduce(values, weights) -> (d,)``, the weighted sum over clients. The
   default :func:`weighted_sum` computes Σ_j weights[j] · values[j] over the local client axis;
   a distributed runner passes a function that does the same on its local clients and then
   ``all_reduce``-s (sums) the result across ranks;
4. ``server_post(cfg, server, aggregate, r)``: the server's update from the aggregate
   (EF21: g^r = g^{r-1} + Σ_i weight_i c_i).

:meth:`BoundMethod.step` composes the four; :meth:`BoundMethod.init` does the same for the
initialisation (round 0). The server state is small and replicated: every rank of a distributed
run applies ``server_pre`` / ``server_post`` to the same aggregate and so holds the same x.

Randomness convention: the draws of the step that produces round ``r`` (from state ``r − 1``)
use ``KeyStream(seed, ids, stream).at(r)``; the initialisation draws at round 0. Streams:
"compressor", "participation", "minibatch", "delay", "order".
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Literal, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from ..compressors import Compressor, ConstantUnknownError, make_compressor
from ..compressors import _kernels as K
from ..compressors._wire import HALF_DTYPES, paper_width
from ..registry import Registry
from ..rng import Keys, KeyStream
from .rules import Mirror, SparseMessage, kernel_ready
from .stepsize import StepSize, parse_stepsize

__all__ = [
    "METHODS",
    "RUNTIMES",
    "BoundMethod",
    "Config",
    "Constants",
    "DenseTraffic",
    "GradientOracle",
    "HasIds",
    "HasX",
    "Init",
    "Message",
    "Method",
    "NonFiniteError",
    "ProblemLike",
    "Reduce",
    "Runtime",
    "State",
    "Traffic",
    "UnknownConstantError",
    "make_method",
    "methods_for",
    "weighted_sum",
]

#: initial g_i of the EF21 family (and the table of IAG): ∇f_i(x⁰), C(∇f_i(x⁰)) or 0
Init = Literal["full", "compressed", "zero"]
#: which compressors a method accepts
Requirement = Literal["none", "unbiased", "contractive"]

#: where a method can run (docs/architecture.md, "runtimes"): the vectorised simulator, the
#: multi-process runner (:mod:`shrinkgrad.distributed.runner`), a DDP communication hook (one
#: client per rank, one tensor at a time) and the asynchronous parameter server
Runtime = Literal["simulator", "runner", "hook", "ps"]
RUNTIMES: tuple[Runtime, ...] = ("simulator", "runner", "hook", "ps")

#: ``reduce(values (m, d), weights (m,)) -> (d,)``: Σ_j weights[j] · values[j] over all clients
Reduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteError(ValueError):
    """A method produced non-finite values (it diverged): raised instead of computing with NaN."""


class UnknownConstantError(ValueError):
    """A step-size rule (or EF21-W's weights) needs a smoothness constant the problem does not
    know (a neural network): design.md principle 14, unknown constants are a state."""


def weighted_sum(values: torch.Tensor | SparseMessage, weights: torch.Tensor) -> torch.Tensor:
    """The default reduction: Σ_j weights[j] · values[j] over the local client axis (one gemv).

    With weights 1/n this is the average (1/n) Σ_i c_i of [EF21]; with w_i, Σ_i w_i c_i of [EFR].

    ``values`` may be a :class:`~.rules.SparseMessage` of shape (m, d) (a runtime with
    ``Config.sparse_batches``: EF21's Top-k messages in the simulator and the runner): the
    products w_j · c_j[q] of its kept entries are added in the order of its positions, row by
    row (:func:`~shrinkgrad.compressors._kernels.weighted_rows_sum`): O(m·k) instead of a
    pass over m·d entries, the same sum in another order than the gemv's (round-off).
    """
    if isinstance(values, SparseMessage):
        return _sparse_weighted_sum(values, weights)
    return weights @ values


def _sparse_weighted_sum(c: SparseMessage, weights: torch.Tensor) -> torch.Tensor:
    m, d = c.shape
    v, f = c.values, c.indices
    out = torch.empty(d, dtype=v.dtype, device=v.device)
    if kernel_ready(f, v, weights):
        if not K.weighted_rows_sum(f.numpy(), v.numpy(), weights.numpy(), out.numpy()):
            raise IndexError(f"a sparse message has a position outside its shape ({m}, {d})")
        return out
    rows = torch.div(f, d, rounding_mode="floor")
    return out.zero_().index_add_(0, f - rows * d, v * weights[rows])


# --------------------------------------------------------------------------------------------
# What flows between the parts
# --------------------------------------------------------------------------------------------
class Traffic(NamedTuple):
    """Bits moved in one round, one entry per client of the group (float64 tensors, shape (m,)).

    ``up`` counts the actual messages honestly (values, indices, norms: the compressor's
    :meth:`~shrinkgrad.compressors.Compressor.message_bits` in the wire dtype; a full vector costs
    d × bits of the wire dtype); ``up_paper`` uses the papers' convention (32 bits per sent float,
    indices free: ``paper_bits``); ``down`` counts the vector each client had to receive (the
    broadcast iterate). Clients that send nothing count 0.
    """

    up: torch.Tensor
    up_paper: torch.Tensor
    down: torch.Tensor


class DenseTraffic(Traffic):
    """The :class:`Traffic` of a round in which every sender sent one uncompressed vector (a
    method's full initialisation, :meth:`Config.dense_traffic`): sums of such messages need no
    decoding, so a ring all-reduces them whatever the run's compressor
    (:mod:`shrinkgrad.network.clock`). Its fields and arithmetic are Traffic's."""

    __slots__ = ()


class Message(NamedTuple):
    """What a group of clients hands to the reduction.

    ``values`` has shape (m, d): row j is client ``ids[j]``'s vector (zero for a client that sent
    nothing); ``weights`` (m,) are the clients' reduction weights (1/n, or w_i for the weighted
    methods). Both are ``None`` when the round has nothing to aggregate (e.g. DCGD's
    initialisation). ``traffic`` is what it cost.
    """

    values: torch.Tensor | None
    weights: torch.Tensor | None
    traffic: Traffic


class HasX(Protocol):
    """A server state exposes the current iterate ``x`` (shape (d,))."""

    @property
    def x(self) -> torch.Tensor: ...


class HasIds(Protocol):
    """A client state exposes the global ids of its clients (int64, shape (m,))."""

    @property
    def ids(self) -> torch.Tensor: ...


ServerT = TypeVar("ServerT", bound=HasX)
ClientT = TypeVar("ClientT", bound=HasIds)


@dataclasses.dataclass(frozen=True)
class State(Generic[ServerT, ClientT]):
    """The full explicit state after ``round`` rounds: server part and a group of clients."""

    round: int
    server: ServerT
    clients: ClientT

    @property
    def x(self) -> torch.Tensor:
        """The current iterate x^round."""
        return self.server.x


# --------------------------------------------------------------------------------------------
# Problem constants and gradient oracles
# --------------------------------------------------------------------------------------------
class ProblemLike(Protocol):
    """What binding a method needs from a problem: sizes and smoothness constants (read
    only: a problem's attributes and the frozen :class:`Constants` both qualify)."""

    @property
    def n(self) -> int:
        """The number of clients."""
        ...

    @property
    def d(self) -> int:
        """The dimension."""
        ...

    @property
    def L(self) -> float | None:
        """Smoothness constant of f; None when unknown (a neural network)."""
        ...

    @property
    def L_i(self) -> torch.Tensor | None:
        """The clients' smoothness constants (n,); None when unknown."""
        ...

    @property
    def mu(self) -> float | None: ...


#: the message of every rule that needs an unknown constant
UNKNOWN_L = (
    "L is not known for this problem; pass a number or estimate it "
    "(shrinkgrad.problems.estimate_smoothness)"
)


@dataclasses.dataclass(frozen=True)
class Constants:
    """The constants of f = (1/n) Σ f_i that step-size rules use (methods.md §1).

    A distributed runner whose ranks only hold part of the data builds this from the global
    constants; a :class:`~shrinkgrad.problems.Problem` carries them itself. ``L`` and ``L_i``
    may be ``None`` (unknown, as for a neural network: design.md principle 14): numeric step
    sizes then work for every method, and whatever needs them (``stepsize="theory"``, EF21-W's
    weights) raises :class:`UnknownConstantError` saying so. ``estimated`` marks constants that
    are estimates (``shrinkgrad.problems.estimate_smoothness``), not bounds; a theory step
    computed from them records ``(estimated L)`` in its rule.
    """

    n: int
    d: int
    L: float | None = None
    L_i: torch.Tensor | None = None
    mu: float | None = None
    estimated: bool = False
    #: whether every f_i is convex (``problem.convex``; None: not known)
    convex: bool | None = None

    def __post_init__(self) -> None:
        n, d = self.n, self.d
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TypeError(f"the number of clients n must be an integer >= 1, got {n!r}")
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise TypeError(f"the dimension d must be an integer >= 1, got {d!r}")
        if self.L is not None:
            L = float(self.L)
            if not math.isfinite(L) or L <= 0:
                raise ValueError(f"the smoothness constant L must be finite and > 0, got {L}")
            object.__setattr__(self, "L", L)
        if self.L_i is not None:
            L_i = torch.as_tensor(self.L_i, dtype=torch.float64).reshape(-1).cpu()
            if L_i.numel() != n:
                raise ValueError(f"L_i must have one entry per client (n={n}), got {L_i.numel()}")
            if not bool(torch.isfinite(L_i).all()) or bool((L_i < 0).any()):
                raise ValueError(
                    "the clients' smoothness constants L_i must be finite and >= 0 (L_i = 0: "
                    "a client whose f_i is constant, e.g. all its data rows are zero)"
                )
            object.__setattr__(self, "L_i", L_i)
        if self.mu is not None:
            object.__setattr__(self, "mu", float(self.mu))
        object.__setattr__(self, "estimated", bool(self.estimated))

    @classmethod
    def of(cls, problem: ProblemLike) -> Constants:
        """Read (and validate) the constants of ``problem`` (``None`` where it knows none)."""
        try:
            n, d = problem.n, problem.d
        except AttributeError as e:
            raise TypeError(
                f"{type(problem).__name__} is not a problem: it lacks {e.name!r} (a problem has "
                "n, d, and when known L, L_i and mu)"
            ) from None
        return cls(
            n,
            d,
            getattr(problem, "L", None),
            getattr(problem, "L_i", None),
            getattr(problem, "mu", None),
            bool(getattr(problem, "constants_estimated", False)),
            getattr(problem, "convex", None),
        )

    @property
    def known(self) -> bool:
        """True when L and every L_i are known (the theory step sizes need both)."""
        return self.L is not None and self.L_i is not None

    def smoothness(self) -> tuple[float, torch.Tensor]:
        """(L, L_i), or :class:`UnknownConstantError` when the problem does not know them."""
        if self.L is None or self.L_i is None:
            raise UnknownConstantError(UNKNOWN_L)
        return self.L, self.L_i

    @property
    def L_AM(self) -> float:
        """(1/n) Σ L_i."""
        return float(self.smoothness()[1].mean())

    @property
    def L_QM(self) -> float:
        """√((1/n) Σ L_i²)."""
        return math.sqrt(float((self.smoothness()[1] ** 2).mean()))


class GradientOracle(Protocol):
    """Client gradients for a group of clients given by their global ids.

    The simulator uses :class:`~shrinkgrad.methods.oracle.ProblemOracle`; a distributed rank
    implements the same two methods over its local data (mapping global ids to its rows).
    """

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(m, d): row j is ∇f_{ids[j]}(x) for x of shape (d,), or ∇f_{ids[j]}(x[j]) for (m, d)."""
        ...

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        """(m, d) minibatch estimators: row j averages ``batch_sizes[j]`` samples (keys[j])."""
        ...


# --------------------------------------------------------------------------------------------
# Configuration of a bound method
# --------------------------------------------------------------------------------------------
#: what a theory rule records when every client draws the same coordinates (Config.n_draws)
SHARED_DRAW = "(one shared draw: n = 1)"


def shares_draw(C: Compressor) -> bool:
    """Whether every client of a round draws the same coordinates with ``C``: a shared-seed
    compressor (``rand_k[shared_seed=true]``, also under ``scaled``)."""
    return bool(getattr(C, "shared_seed", False))


def independent_draws(C: Compressor, n: int) -> int:
    """The n of the ω/n variance terms of the unbiased-compressor theory (DCGD and the rules
    built on it, DIANA): the independent compressor draws per round among n clients — n, or 1
    with a shared draw (:func:`shares_draw`): then E‖(1/n) Σ_i C(x_i) − x̄‖² = ω‖x̄‖² ≤
    (ω/n) Σ_i ‖x_i‖², the n = 1 instance of the bounds, not (ω/n²) Σ_i ‖x_i‖²."""
    return 1 if shares_draw(C) else n


@dataclasses.dataclass(frozen=True, eq=False)
class Config:
    """Everything fixed for a run: sizes, compressor and its constant, step size, seed, dtypes.

    Built by :meth:`Method.bind`. ``alpha`` is the contraction constant the method works with
    (for an unscaled unbiased compressor with ω < 1 used by a contractive method, α = 1 − ω;
    NaN when the compressor has none, e.g. ``power_sgd`` without ``alpha=``: numeric step
    sizes only), ``omega`` the variance constant (unbiased compressors only, else ``None``).
    """

    constants: Constants
    compressor: Compressor
    stepsize: float
    stepsize_rule: str
    seed: int
    dtype: torch.dtype
    device: torch.device
    wire_dtype: torch.dtype
    alpha: float
    omega: float | None
    #: reduction weight of every client (global, shape (n,)): 1/n, or w_i for EF21-W
    weights: torch.Tensor
    #: the runtime owns the state (the DDP hook keeps multi-megabyte tensors per parameter and
    #: hands every round the same ones): client and server parts may then update their state
    #: tensors in place instead of returning new ones. False (the simulator, the runner): the
    #: parts are pure functions of their inputs.
    inplace: bool = False
    #: the runtime's reduction takes :class:`~.rules.SparseMessage` batches of shape (m, d)
    #: (:func:`weighted_sum`: the simulator and the runner): a client step that only hands its
    #: compressed vectors to its Message and to :mod:`.rules` (EF21's, ``ef21_update(...,
    #: sparse=True)``) may then receive the messages of a compressor whose sparse form takes
    #: batches (``Compressor.sparse_batches``) in that form
    #: (``Compressor.shifted_sparse``) instead of a dense (m, d) tensor
    sparse_batches: bool = False
    _streams: dict[tuple[str, bytes], KeyStream] = dataclasses.field(
        default_factory=dict, repr=False
    )
    #: per-round constants a run asks for again every round (the Traffic of a fixed-size
    #: message, the weights of the group of clients), computed once: a simulated round of
    #: 1000 clients costs ~1 ms, and each small torch op ~5 µs. Never mutated by their users.
    _memo: dict[Any, Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def n(self) -> int:
        return self.constants.n

    @property
    def d(self) -> int:
        return self.constants.d

    @property
    def shared_draw(self) -> bool:
        """Whether every client draws the same coordinates in a round: a shared-seed compressor
        (``rand_k[shared_seed=true]``, also under ``scaled``). Its ``"compressor"`` keys are
        then one key per round for all clients, as the DDP hook's are, so the messages are
        summable (an all-reduce of k values) and (1/n) Σ_i C(x_i) = C((1/n) Σ_i x_i)."""
        return shares_draw(self.compressor)

    @property
    def n_draws(self) -> int:
        """:func:`independent_draws` of this run's compressor and clients."""
        return independent_draws(self.compressor, self.n)

    def keys(self, stream: str, ids: torch.Tensor, round: int) -> Keys:
        """Keys of the clients ``ids`` in ``stream`` at ``round`` (KeyStreams are cached).

        The ``"compressor"`` keys of a shared draw (:attr:`shared_draw`) are those of one
        stream, ``"compressor/shared"``, the same for every client."""
        # int64: the cache key is the ids' bytes, which for int32 ids [1, 0] are int64's [1]
        ids_np = ids.detach().cpu().numpy().astype(np.int64, copy=False)
        if stream == "compressor" and self.shared_draw:
            ids_np, stream = np.zeros_like(ids_np), "compressor/shared"
        tag = (stream, ids_np.tobytes())
        ks = self._streams.get(tag)
        if ks is None:
            if len(self._streams) > 64:
                self._streams.clear()
            ks = KeyStream(self.seed, ids_np, stream=stream, device=self.device)
            self._streams[tag] = ks
        return ks.at(round)

    def dense(self, values: torch.Tensor) -> torch.Tensor:
        """The values (m, d) of an uncompressed message as the receiver gets them, for a method
        that keeps what it sends in its client state (EF21's ``init="full"``): here the values
        themselves; a runtime whose wire rounds them (the parameter server's
        :class:`~shrinkgrad.methods.asynchronous.WireConfig`) returns them rounded, so the
        client's state follows what the server received."""
        return values

    def compress(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, *, sent_only: bool = False
    ) -> torch.Tensor:
        """C applied row-wise to ``x`` (m, d) with the clients' compressor keys at ``round``.

        ``sent_only=True`` says that the caller only sends the result (it becomes the
        :class:`Message`) and keeps nothing of it in its state (DCGD): a runtime that sends the
        encoded message itself (the DDP hook) may then skip decoding its own message and return
        ``x``. Here the result is always C(x).
        """
        C = self.compressor
        if C.stateful:
            raise TypeError(
                f"{C.name} keeps state between rounds: a method using it must carry that state "
                "(Config.compress_with_state, as ef21 and ef do)"
            )
        keys = None if C.deterministic else self.keys("compressor", ids, round)
        try:
            return C(x, keys)
        except ValueError:
            self._raise_if_diverged(x, round)
            raise

    def compress_difference(
        self, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, round: int
    ) -> torch.Tensor | None:
        """:meth:`compress` of a − b where a runtime can compute it without forming a − b (the
        DDP hook: Top-k selected from the difference chunk by chunk, bit for bit the same), or
        None: then the caller forms a − b and calls :meth:`compress`. Here: None."""
        return None

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s shape, dtype and device to write an intermediate result into.

        Its content is the caller's until the client step returns; a runtime that owns its
        buffers (the DDP hook) returns the same preallocated memory on every call, so a client
        step uses one scratch at a time and keeps none of it in its state. Here: a new tensor.
        """
        return torch.empty_like(like)

    def mirror(self, x: torch.Tensor) -> Mirror | None:
        """The runtime's :class:`~.rules.Mirror` of the server state tensor ``x``: a request to
        write the bfloat16 of x's entries that an in-place sparse addition changes into a
        tensor of the runtime's (the DDP hook's bfloat16 output, when x is the direction D of
        a bfloat16 model). A server part whose direction is x passes it to
        :func:`~.rules.add_message`, which honours it where it can (the fused kernel) and
        records that in ``Mirror.written``; the method's arithmetic is the same either way.
        None (this default): nothing to mirror."""
        return None

    def _raise_if_diverged(self, x: torch.Tensor, round: int) -> None:
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError(
                f"round {round}: a client's vector to compress has non-finite entries (the "
                "method diverged; try a smaller step size)"
            ) from None

    # -- stateful compressors (PowerSGD's previous Q): the state lives in the client state -------
    def compressor_state(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The initial compressor state of the clients ``ids`` for vectors shaped like ``x``
        (m, d), keyed by (seed, client) only: PowerSGD's first Q (m, n, r), or an empty (m, 0)
        tensor for stateless compressors (so that every field of a client state is a tensor
        with the clients on its first axis: groups can be indexed, concatenated, saved)."""
        C = self.compressor
        if not C.stateful:
            return torch.empty(x.shape[0], 0, dtype=self.dtype, device=x.device)
        keys = self.keys("compressor", ids, 0).fold("state")
        return C.init_state(x, keys)  # type: ignore[attr-defined, no-any-return]

    def compress_with_state(
        self, x: torch.Tensor, ids: torch.Tensor, round: int, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`compress` for methods that carry compressor state: ``(C(x), new state)``;
        a stateless compressor returns ``(compress(x), state)`` (the state unchanged)."""
        C = self.compressor
        if not C.stateful:
            return self.compress(x, ids, round), state
        if state is None or state.numel() == 0:
            state = self.compressor_state(x, ids)
        keys = self.keys("compressor", ids, round)
        try:
            return C.step(x, keys, state)  # type: ignore[attr-defined, no-any-return]
        except ValueError:
            self._raise_if_diverged(x, round)
            raise

    def compressing(
        self, ids: torch.Tensor, round: int, state: torch.Tensor | None
    ) -> StatefulCompress:
        """``compress(p)`` for the update rules (:mod:`.rules`) that carries a stateful
        compressor's state: after the call, ``.state`` is the clients' new state."""
        return StatefulCompress(self, ids, round, state)

    def message(self, values: torch.Tensor, ids: torch.Tensor, traffic: Traffic) -> Message:
        """A :class:`Message` of the clients ``ids`` with their reduction weights."""
        return Message(values, self.group_weights(ids), traffic)

    def group_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """``weights[ids]``, kept for the ids tensor a client state carries from round to round
        (the same object every round: one index less per round)."""
        last = self._memo.get("weights")
        if last is not None and last[0] is ids:
            w: torch.Tensor = last[1]
            return w
        w = self.weights[ids]
        self._memo["weights"] = (ids, w)
        return w

    # -- bit counting -------------------------------------------------------------------------
    @property
    def dense_bits(self) -> float:
        """Bits of one uncompressed d-vector in the wire dtype."""
        return float(self.d * torch.finfo(self.wire_dtype).bits)

    def full(self, m: int, bits: float) -> torch.Tensor:
        return torch.full((m,), bits, dtype=torch.float64, device=self.device)

    def dense_traffic(self, m: int, *, down: bool = True) -> Traffic:
        """Each of ``m`` clients sends one uncompressed vector (and received the iterate)."""
        return DenseTraffic(
            self.full(m, self.dense_bits),
            self.full(m, float(paper_width(self.wire_dtype) * self.d)),
            self.full(m, self.dense_bits if down else 0.0),
        )

    def compressed_traffic(
        self, c: torch.Tensor, active: torch.Tensor | None = None, *, down: bool = True
    ) -> Traffic:
        """Each client of the group sends its row of the compressed tensor ``c`` (m, d), dense
        or a :class:`~.rules.SparseMessage` batch.

        ``active`` (bool, (m,)) marks the clients that actually sent (others count 0 bits).
        Random-size messages are counted by the compressor's ``message_bits`` on the message
        cast to the wire dtype; fixed-size ones by ``bits(d, wire_dtype)``.
        """
        m = c.shape[0]
        C = self.compressor
        if (
            getattr(C, "variable_size", False)
            or type(C).message_bits is not Compressor.message_bits
        ):
            if isinstance(c, SparseMessage):
                c = c.dense()
            up = C.message_bits(c.to(self.wire_dtype)).to(torch.float64).to(self.device)
        elif active is None:  # a fixed-size message: the same counts every round
            key = ("compressed", m, down)
            hit = self._memo.get(key)
            if hit is None:
                hit = self._memo[key] = self._fixed_traffic(m, down)
            out: Traffic = hit
            return out
        else:
            up = self.full(m, float(C.bits(self.d, self.wire_dtype)))
        paper = self.full(m, float(self.paper_bits(C)))
        down_t = self.full(m, self.dense_bits if down else 0.0)
        if active is not None:
            mask = active.to(torch.float64)
            up, paper, down_t = up * mask, paper * mask, down_t * mask
        return Traffic(up, paper, down_t)

    def _fixed_traffic(self, m: int, down: bool) -> Traffic:
        C = self.compressor
        return Traffic(
            self.full(m, float(C.bits(self.d, self.wire_dtype))),
            self.full(m, float(self.paper_bits(C))),
            self.full(m, self.dense_bits if down else 0.0),
        )

    def paper_bits(self, C: Compressor) -> float:
        """``C.paper_bits`` for the wire dtype: the dtype is passed for 16-bit wires only (for
        float32/float64 wires the papers count 32 bits either way, and compressors written
        before paper_bits took a dtype keep working)."""
        if self.wire_dtype in HALF_DTYPES:
            return float(C.paper_bits(self.d, self.wire_dtype))
        return float(C.paper_bits(self.d))

    def no_traffic(self, m: int) -> Traffic:
        z = self.full(m, 0.0)
        return Traffic(z, z, z)


class StatefulCompress:
    """A ``compress(p)`` callable over :meth:`Config.compress_with_state`: it applies C to
    the clients ``ids`` at ``round`` and keeps the compressor's new state in :attr:`state`."""

    def __init__(
        self, cfg: Config, ids: torch.Tensor, round: int, state: torch.Tensor | None
    ) -> None:
        self.cfg, self.ids, self.round, self.state = cfg, ids, round, state

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        c, self.state = self.cfg.compress_with_state(p, self.ids, self.round, self.state)
        return c

    def shifted(
        self, x: torch.Tensor, h: torch.Tensor, *, sparse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(C(x − h), h + C(x − h))`` by the compressor's shifted form (one fused pass where
        it has one: :meth:`~shrinkgrad.compressors.Compressor.shifted`), or None for a stateful
        compressor or a runtime whose Config applies C its own way (the DDP hook's wire): the
        caller then applies C itself. Non-finite x − h raises :class:`NonFiniteError`, as
        :meth:`Config.compress` does.

        ``sparse=True`` (the caller takes a :class:`~.rules.SparseMessage`): where the
        runtime's reduction takes one (``Config.sparse_batches``) and the compressor's sparse
        form takes batches (``Compressor.sparse_batches``), C(x − h) comes as a SparseMessage
        of x's shape (:meth:`~shrinkgrad.compressors.Compressor.shifted_sparse`)."""
        cfg = self.cfg
        C = cfg.compressor
        if C.stateful or type(cfg).compress is not Config.compress:
            return None
        keys = None if C.deterministic else cfg.keys("compressor", self.ids, self.round)
        try:
            if sparse and cfg.sparse_batches and C.sparse_batches:
                flat, vals, g = C.shifted_sparse(x, h, keys)
                # typed as the dense form, as the hook's SparseMessages are (rules.Compress)
                sm: Any = SparseMessage(flat, vals, tuple(x.shape))
                return sm, g
            return C.shifted(x, h, keys)
        except ValueError:
            cfg._raise_if_diverged(x - h, self.round)
            raise

    def difference(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
        """C(a − b) without forming a − b where the runtime can (:meth:`Config.compress_difference`,
        stateless compressors only); None: call it on a − b."""
        if self.cfg.compressor.stateful:
            return None
        return self.cfg.compress_difference(a, b, self.ids, self.round)


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------
class Method(abc.ABC, Generic[ServerT, ClientT]):
    """Base class of every method; subclasses implement the parts listed in the module docstring.

    A method object holds only its own hyper-parameters (delay model, participation
    probability, initialisation, ...). :meth:`bind` adds the problem's constants, the compressor,
    the step size and the seed, and returns a :class:`BoundMethod` with ``init`` and ``step``.
    """

    __registry__: ClassVar[Registry[Method[Any, Any]]]

    #: canonical name, e.g. ``"ef21_pp[p=0.5]"``; set by the registry when built from a name
    spec: str = ""
    #: which compressors the method accepts (compatibility as data, design.md principle 8)
    requires: ClassVar[Requirement] = "contractive"
    #: True when the client step hands what ``cfg.compress`` returns only to the rules of
    #: :mod:`.rules` and to its :class:`Message`, and the server parts only add the aggregate to
    #: their state (``rules.add_message``) or return it as the direction: a runtime may then
    #: hand it :class:`~.rules.SparseMessage` values instead of dense tensors (the DDP hook's
    #: sparse path; checked by tests/distributed/test_hooks_methods.py)
    sparse_messages: bool = False
    #: True when the client state carries a stateful compressor's state (ef21, ef): only then
    #: can the method use one (power_sgd)
    carries_compressor_state: ClassVar[bool] = False

    @property
    def samples_minibatches(self) -> bool:
        """True when the method draws its own minibatch gradients (``ef21_sgd[b=...]``): a
        runtime option that turns exact gradients into minibatch ones (the parameter server's
        ``batch_size``) must not be combined with it."""
        return False

    @property
    def compresses_gradient_first(self) -> bool:
        """True when the client step's first use of the oracle's gradient is to hand that very
        tensor to ``cfg.compress`` or, as the first operand, to ``cfg.compress_difference``
        (DCGD's C(∇f_i), EF21's C(∇f_i − g_i)), before anything else reads it. A runtime may
        then hand out a gradient whose values it provides only at that call: the DDP hook lets
        the compressor read a bfloat16 gradient itself there, without a float32 copy, and
        fills the copy only when the call cannot (``compress_difference`` answers None). A
        declared property, checked by tests/distributed/test_hooks_methods.py with a gradient
        that is NaN until that call."""
        return False

    @property
    def accumulates_aggregates(self) -> bool:
        """True when the server state integrates the aggregates: the direction of a round
        depends on earlier rounds' aggregates, not only on this one's (EF21's g ← g + Σ w_i c_i,
        DIANA's shift h ← h + α·aggregate), so the server's state equals a function of the
        clients' states (EF21: g = Σ_i w_i g_i) only as long as every aggregate is the exact
        sum of the messages the clients added to their own states. A runtime whose collective
        rounds the sum (the DDP hook's 16-bit all-reduce) then lets the two drift apart by one
        rounding per round: the hook sums such methods' 16-bit messages in float32 instead
        (``CompressionState(summation="auto")``). A declared property, checked by
        tests/distributed/test_hooks_methods.py: the direction from two different server
        states for one aggregate differs exactly when it is True."""
        return False

    @property
    def name(self) -> str:
        """The canonical name: the registry spec, or one built from the parameters."""
        return self.spec or self.default_spec()

    def default_spec(self) -> str:
        """The name of an object built directly (not from a name); subclasses add parameters."""
        return type(self).__name__.lower()

    def __repr__(self) -> str:
        return f"<method {self.name}>"

    # -- binding -----------------------------------------------------------------------------
    def bind(
        self,
        problem: ProblemLike,
        compressor: Compressor | str | None = None,
        stepsize: float | str | StepSize = "theory",
        seed: int = 0,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        wire_dtype: torch.dtype = torch.float32,
    ) -> BoundMethod[ServerT, ClientT]:
        """Fix the problem constants, compressor, step size and seed of a run.

        ``stepsize`` is a positive number, ``"theory"`` (the rule of methods.md §4 for this
        method, resolved from the problem's and compressor's constants), ``"theory*m"``
        (m times the theory step), ``"theory(other)*m"`` (m times another method's theory step)
        or ``"c/L"`` (also ``L_AM``, ``L_QM``, ``L_max``): the grammar of
        :mod:`shrinkgrad.methods.stepsize`. ``compressor`` defaults to ``identity``.
        """
        method = self.for_problem(problem, stepsize)
        consts = problem if isinstance(problem, Constants) else Constants.of(problem)
        method.check_problem(consts)
        if compressor is None:
            compressor = "identity"
        comp = make_compressor(compressor)
        alpha, omega = method._check_compressor(comp, consts.d)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        dt = dtype if dtype is not None else getattr(problem, "dtype", torch.float64)
        if dt not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dt}")
        if wire_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"wire_dtype must be a floating dtype, got {wire_dtype}")
        dev = (
            torch.device(device)
            if device is not None
            else getattr(problem, "device", torch.device("cpu"))
        )
        weights = method.client_weights(consts).to(dtype=dt, device=dev)
        cfg = Config(
            constants=consts,
            compressor=comp,
            stepsize=math.nan,
            stepsize_rule="",
            seed=int(seed),
            dtype=dt,
            device=torch.device(dev),
            wire_dtype=wire_dtype,
            alpha=alpha,
            omega=omega,
            weights=weights,
        )
        spec = parse_stepsize(stepsize)
        if spec.of is not None:  # "theory(other)*m": another method's rule on this problem
            try:
                other = make_method(spec.of).bind(
                    problem, comp, "theory", seed, dtype=dt, device=dev, wire_dtype=wire_dtype
                )
            except ValueError as e:  # its refusal, said as the reason this step is not defined
                raise type(e)(
                    f"{method.name}: stepsize={str(spec)!r} is {spec.of}'s theory step for "
                    f"{comp.name} on this problem, which {spec.of} does not have: {e}"
                ) from None
            gamma = other.cfg.stepsize * spec.multiplier
            times = f"*{spec.multiplier:g}" if spec.multiplier != 1.0 else ""
            rule = f"{other.cfg.stepsize_rule}{times} of {other.method.name}"
        elif spec.over is not None:  # "c/L"
            gamma, rule = spec.value / spec.constant(consts), str(spec)
        elif spec.theory:
            if not math.isfinite(alpha):
                raise method._unknown_alpha(comp, consts.d)
            if not consts.known:
                method._refuse_theory_first(cfg)  # no rule at all: say that, not "estimate L"
                raise UnknownConstantError(f"{method.name}: {UNKNOWN_L}")
            gamma, rule = method.theory_stepsize(cfg)
            gamma *= spec.multiplier
            rule = rule + (f"*{spec.multiplier:g}" if spec.multiplier != 1.0 else "")
            if consts.estimated:
                rule += "(estimated L)"
        else:
            gamma, rule = spec.value, "constant"
        if not math.isfinite(gamma) or gamma <= 0:
            raise ValueError(f"{method.name}: the step size must be finite and > 0, got {gamma}")
        cfg = dataclasses.replace(cfg, stepsize=float(gamma), stepsize_rule=rule)
        return BoundMethod(method, cfg)

    def _refuse_theory_first(self, cfg: Config) -> None:
        """With L unknown: re-raise the method's own refusal when it has no theory step at all
        (EF, IAG in random order, ...), which no estimate of L would change; return when its
        rule exists and only needs the constants (it then stops at them)."""
        try:
            self.theory_stepsize(cfg)
        except UnknownConstantError:
            return
        except ValueError:
            raise
        except Exception:  # a rule that fails on the missing constants some other way
            return

    def _unknown_alpha(self, C: Compressor, d: int) -> ConstantUnknownError:
        """The compressor's own message for its missing constant."""
        try:
            C.alpha(d)
        except ConstantUnknownError as e:
            return ConstantUnknownError(f"{self.name}: {e}")
        return ConstantUnknownError(f"{self.name}: {C.name} has no known constant")

    def for_problem(
        self, problem: ProblemLike, stepsize: float | str | StepSize
    ) -> Method[ServerT, ClientT]:
        """The method :meth:`bind` binds to ``problem`` with ``stepsize``: ``self`` (default), or a
        copy holding what its theory step size reads from the problem (EF21-SGD's σ²)."""
        return self

    def _check_compressor(
        self, C: Compressor, d: int, *, as_name: str | None = None
    ) -> tuple[float, float | None]:
        """Return (α, ω) the method works with, or raise a ValueError saying what to use.

        A compressor without a known constant (``constant_known`` False) gives α = NaN: numeric
        step sizes work, ``"theory"`` refuses (:meth:`bind`). ``as_name``: the name a refusal
        gives the method (a wrapper that delegates the check, e.g. client momentum, passes its
        own: the method the user asked for)."""
        name = as_name or self.name
        if C.stateful and not self.carries_compressor_state:
            raise ValueError(
                f"{C.name} keeps state between rounds (PowerSGD's previous Q), which {name} "
                "does not carry; use it with ef21 or ef"
            )
        if self.requires == "none":
            if C.kind != "unbiased" or C.omega(d) != 0.0:
                raise ValueError(
                    f"{name} sends uncompressed gradients and takes no compressor (got "
                    f"{C.name}); use dcgd for unbiased compressors or ef21 for contractive ones"
                )
            return 1.0, 0.0
        if self.requires == "unbiased":
            if C.kind != "unbiased":
                raise ValueError(
                    f"{name} needs an unbiased compressor (E[Q(x)] = x, [K18] Def. 1); "
                    f"{C.name} is contractive (biased), which would bias every step. Use an "
                    "unbiased one such as rand_k[k=...], qsgd[s=...] or identity, or run "
                    f"ef21 with {C.name} (or ef, except on a parameter server)"
                )
            omega = float(C.omega(d))
            return 1.0 / (1.0 + omega), omega
        # contractive methods
        if C.kind == "contractive":
            return (float(C.alpha(d)) if C.constant_known else math.nan), None
        omega = float(C.omega(d))
        if omega < 1.0:
            # E‖Q(x) − x‖² ≤ ω‖x‖² = (1 − (1 − ω))‖x‖²: unscaled Q is contractive with α = 1 − ω
            return 1.0 - omega, omega
        raise ValueError(
            f"{name} needs a contractive compressor (E‖C(x) − x‖² ≤ (1 − α)‖x‖², [EF21] "
            f"Def. 1); {C.name} is unbiased with ω = {omega:g} ≥ 1 for d = {d}, so it can "
            f"enlarge errors and is not contractive. Use scaled({C.name}) (the contractive "
            f"C/(1+ω), α = 1/(1+ω) = {1.0 / (1.0 + omega):.4g}) or a contractive compressor "
            "such as top_k[k=1]"
        )

    def check_problem(self, consts: Constants) -> None:
        """Raise a ValueError when the method's parameters do not fit the problem."""

    # -- runtimes (design.md principle 13) ------------------------------------------------------
    def unsupported(self, runtime: Runtime) -> str | None:
        """None when this method runs in ``runtime``; otherwise why not, in one line.

        Every method runs in the simulator and the multi-process runner (both drive
        ``init``/``step`` over groups of clients). A DDP hook (one client per rank, the gradient
        from backward, one tensor at a time) and the asynchronous parameter server (one arriving
        message per update, computed at a stale model) need a method to say that its rules fit:
        subclasses that do override this.
        """
        if runtime in ("simulator", "runner"):
            return None
        if runtime == "hook":
            return f"{self.name} has no per-tensor rule for a DDP communication hook"
        if runtime == "ps":
            return f"{self.name} does not run on an asynchronous parameter server"
        raise ValueError(f"unknown runtime {runtime!r}; the runtimes are {', '.join(RUNTIMES)}")

    def check_runtime(self, runtime: Runtime) -> None:
        """Raise a ValueError when this method cannot run in ``runtime``, naming those that can."""
        reason = self.unsupported(runtime)
        if reason is not None:
            raise ValueError(
                f"{reason}; the methods that run there: {', '.join(methods_for(runtime))}"
            )

    @property
    def identity_is_gd(self) -> bool:
        """True when, with the identity compressor, this method produces gradient descent's
        iterates at the same step size (design.md principle 10). A declared property: the method
        contract suite (tests/methods/test_method_contract.py) checks it wherever it is True.
        """
        return False

    # -- runtimes that own the iterate (the DDP hook) ------------------------------------------
    # A DDP hook does not hold x: the optimizer moves the model. Methods whose server moves x as
    # x ← x − γ·D (interface 2 of the hook contract) run there in a frame that moves with the
    # model: the server state's x is the zero displacement at the point where the clients
    # compute, and the hook hands D to DDP. These two helpers compute D from the method's own
    # parts; subclasses may override :meth:`server_direction` to avoid arithmetic on x (the
    # DDP hook's hot path), and the hook contract suite checks the override against the default.
    def server_direction(
        self, cfg: Config, server: ServerT, aggregate: torch.Tensor | None, r: int
    ) -> tuple[ServerT, torch.Tensor]:
        """``server_post`` of round ``r``, then ``server_pre`` of round ``r + 1`` (moving frame).

        Returns the server state of round ``r + 1`` before its clients act, with ``x`` left at
        ``server.x``, and the direction D with x_pre(r+1) = x_pre(r) − γ·D.
        """
        post = self.server_post(cfg, server, aggregate, r)
        pre = self.server_pre(cfg, post, r + 1)
        return _recentre(server.x, pre, cfg.stepsize)

    def direction_changes(self, cfg: Config, aggregate: Any) -> torch.Tensor | None:
        """The flat positions (int64; repeats allowed) outside which the direction D that
        :meth:`server_direction` returns for ``aggregate`` equals, bit for bit, the direction
        of the round before (the previous ``server_direction`` or ``init_direction``), when
        the method can name them at the aggregate's size; None (this default): D may change
        anywhere. A runtime that keeps D in another dtype (the DDP hook's bfloat16/float16
        output of a float32 method) then converts only these entries instead of all of D.
        Checked for every method that answers by tests/distributed/test_hooks_methods.py."""
        return None

    def init_direction(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> tuple[ServerT, torch.Tensor]:
        """``init_server`` then ``server_pre`` of round 1, in the moving frame: the server state
        of round 1 before its clients act (``x`` left at ``x0``) and D with x_pre(1) = x0 − γ·D."""
        server = self.init_server(cfg, x0, aggregate)
        return _recentre(x0, self.server_pre(cfg, server, 1), cfg.stepsize)

    def client_weights(self, consts: Constants) -> torch.Tensor:
        """Reduction weight of every client: 1/n (the average), overridden by EF21-W (w_i)."""
        return torch.full((consts.n,), 1.0 / consts.n, dtype=torch.float64)

    # -- asynchronous execution ([K18]'s parameter server; methods/asynchronous.py) -------------
    # An asynchronous update applies ONE client's message, computed at a stale model x^v: the
    # client runs this method's own ``client_step`` (ids = [i], the round = its message counter),
    # sends the vector it compressed, and the server maps it to the reduction values below, then
    # applies the method's own ``server_post`` / ``server_pre``. Methods that fit declare
    # ``unsupported("ps") is None`` and override what differs from these defaults (which fit a
    # method without server-side memory, such as DCGD). A method's client step may read only
    # ``server.x`` of the server state (a worker receives the model x, nothing else).

    #: the server keeps one vector per client (IAG's table ĝ_i, EF21's g_i): every update then
    #: uses every client's last message, so its [K18] delay is the age of the oldest one
    async_memory: ClassVar[bool] = False
    #: one client acts per round (IAG): the method has no synchronous every-client round
    incremental: ClassVar[bool] = False

    def async_form(self) -> Method[ServerT, ClientT]:
        """The method whose client step the arriving client runs (IAG: the arrival order)."""
        return self

    def async_delay(self, staleness: int) -> int:
        """The [K18] delay of an update when no applied message is more than ``staleness``
        updates stale: the staleness, or 2·staleness with server memory (an entry is replaced at
        the latest staleness + 1 updates after its client got a model, and was itself at most
        staleness stale; docs/parameter_server.md)."""
        return 2 * staleness if self.async_memory else staleness

    def async_receive(
        self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor, sent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(reduction values (m, d), new memory) of the vectors ``sent`` (m, d) of clients ``ids``.

        The server's aggregate is ``weighted_sum(values, cfg.weights[ids])``, the reduction of
        the synchronous method. Default: the sent vectors themselves (DCGD: w_i·Q_i).
        """
        return sent, memory

    def async_forget(
        self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(reduction values, new memory) that remove lost clients' contributions from the
        server's state, applied with the next update; None when nothing is left to remove.

        Default: a memory entry m_i is the client's share of the server's aggregate
        (Σ_i w_i m_i: IAG's s, EF21's g), so −m_i removes it and m_i ← 0; without memory the
        server keeps nothing of a client."""
        if memory is None:
            return None, memory
        return -memory[ids], memory.index_fill(0, ids, 0.0)

    def async_clients(self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor) -> ClientT:
        """The client state of ``ids`` implied by the server's memory: what a restarted worker
        continues from when a parameter-server run resumes from a snapshot."""
        raise NotImplementedError(f"{self.name} cannot restore its clients from the server")

    def async_theory(self, cfg: Config, delay: int | None) -> tuple[float, str]:
        """The theory step of an asynchronous run whose updates are at most ``delay`` stale
        (None: unbounded). Default: no staleness is the method's own rule; none otherwise."""
        if delay == 0:
            return self.theory_stepsize(cfg)
        raise ValueError(
            f"{self.name} has no theory step size with stale messages (its analysis covers "
            "synchronous rounds only); pass a number"
        )

    def async_admissible(
        self, cfg: Config, stepsize: float, delay: int
    ) -> tuple[float, bool] | None:
        """(the largest step the theory admits at ``delay``, whether ``stepsize`` is admitted),
        or None when no theory covers that delay. Default: the method's own rule at delay 0."""
        if delay != 0:
            return None
        try:
            bound = self.theory_stepsize(cfg)[0]
        except ValueError:
            return None
        return bound, stepsize <= bound

    # -- the parts ---------------------------------------------------------------------------
    def theory_formula(self) -> str:
        """The theory step-size rule in words (``shrinkgrad list methods``, docs)."""
        return "none: pass a number"

    @abc.abstractmethod
    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        """The theory step size of methods.md §4 and the name of the rule used."""

    @abc.abstractmethod
    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[ClientT, Message]:
        """Client part of the initialisation (round 0) for the clients ``ids``."""

    @abc.abstractmethod
    def init_server(self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None) -> ServerT:
        """Server state at round 0 from x⁰ and the reduced initial messages."""

    def server_pre(self, cfg: Config, server: ServerT, r: int) -> ServerT:
        """Server part before the clients act in round ``r`` (default: nothing)."""
        return server

    @abc.abstractmethod
    def client_step(
        self, cfg: Config, server: ServerT, clients: ClientT, oracle: GradientOracle, r: int
    ) -> tuple[ClientT, Message]:
        """Client part of round ``r`` for the group ``clients`` (a leading axis, any subset)."""

    @abc.abstractmethod
    def server_post(
        self, cfg: Config, server: ServerT, aggregate: torch.Tensor | None, r: int
    ) -> ServerT:
        """Server part after the reduction of round ``r``."""


@dataclasses.dataclass(frozen=True, eq=False)
class BoundMethod(Generic[ServerT, ClientT]):
    """A method with its run configuration: the ``init`` / ``step`` pair.

    Example (the simulator does exactly this with ``ids = arange(n)``)::

        bound = make_method("ef21").bind(problem, "top_k[k=1]", "theory", seed=0)
        state, traffic = bound.init(x0, oracle)
        for _ in range(100):
            state, traffic = bound.step(state, oracle)
    """

    method: Method[ServerT, ClientT]
    cfg: Config

    @property
    def stepsize(self) -> float:
        return self.cfg.stepsize

    def init(
        self,
        x0: torch.Tensor,
        oracle: GradientOracle,
        ids: torch.Tensor | None = None,
        reduce: Reduce = weighted_sum,
    ) -> tuple[State[ServerT, ClientT], Traffic]:
        """Round 0 for the clients ``ids`` (default: all n), reducing with ``reduce``."""
        cfg = self.cfg
        x0 = torch.as_tensor(x0, dtype=cfg.dtype, device=cfg.device)
        if x0.shape != (cfg.d,):
            raise ValueError(f"x0 must have shape ({cfg.d},), got {tuple(x0.shape)}")
        ids_t = _check_ids(ids, cfg)
        clients, msg = self.method.init_clients(cfg, x0, oracle, ids_t)
        server = self.method.init_server(cfg, x0, _reduce(msg, reduce))
        return State(0, server, clients), msg.traffic

    def step(
        self,
        state: State[ServerT, ClientT],
        oracle: GradientOracle,
        reduce: Reduce = weighted_sum,
    ) -> tuple[State[ServerT, ClientT], Traffic]:
        """One round: server part, client part on ``state.clients``, reduction, server part."""
        r = state.round + 1
        m = self.method
        server = m.server_pre(self.cfg, state.server, r)
        clients, msg = m.client_step(self.cfg, server, state.clients, oracle, r)
        server = m.server_post(self.cfg, server, _reduce(msg, reduce), r)
        return State(r, server, clients), msg.traffic


def _recentre(x: torch.Tensor, moved: Any, stepsize: float) -> tuple[Any, torch.Tensor]:
    """(``moved`` with its x put back to ``x``, D = (x − moved.x)/γ): see
    :meth:`Method.server_direction`. Server states are NamedTuples with a field ``x``."""
    direction = (x - moved.x) / stepsize
    return moved._replace(x=x), direction


def _reduce(msg: Message, reduce: Reduce) -> torch.Tensor | None:
    if msg.values is None:
        return None
    assert msg.weights is not None
    return reduce(msg.values, msg.weights)


def _check_ids(ids: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    if ids is None:
        return torch.arange(cfg.n, device=cfg.device)
    t = torch.as_tensor(ids, device=cfg.device)
    if t.ndim != 1 or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"client ids must be a 1-d integer tensor, got {t.dtype} {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.n):
        raise ValueError(f"client ids must lie in [0, n={cfg.n})")
    if torch.unique(t).numel() != t.numel():
        raise ValueError("client ids must be distinct")
    return t.to(torch.int64)


METHODS: Registry[Method[Any, Any]] = Registry("method", base=Method)
Method.__registry__ = METHODS


def make_method(spec: str | Method[Any, Any], **params: Any) -> Method[Any, Any]:
    """Build a method from its name, e.g. ``make_method("ef21_pp[p=0.5]")`` or
    ``make_method("ef21_pp", p=0.5)``."""
    return METHODS.make(spec, **params)


def methods_for(runtime: Runtime) -> list[str]:
    """The registered method names whose default configuration runs in ``runtime``."""
    out = []
    for name in METHODS.names():
        try:
            method = METHODS.make(name)
        except (TypeError, ValueError):  # a method that needs parameters to be built
            continue
        if method.unsupported(runtime) is None:
            out.append(name)
    return out
