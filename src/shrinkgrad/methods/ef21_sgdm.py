"""EF21-SGDM ([FTR23]) and client momentum in front of any method.

[FTR23] Fatkhullin, Tyurin, Richtárik, *Momentum Provably Improves Error Feedback!*, NeurIPS 2023,
Alg. 1 (EF21-SGDM), round t + 1 with η = 1 − β:

1. server: x^{t+1} = x^t − γ g^t;
2. client i: v_i ← (1 − η) v_i + η ∇̂f_i(x^{t+1}) (Polyak momentum as a moving average of the
   client's stochastic gradients); c_i = C(v_i − g_i); g_i ← g_i + c_i; sends c_i;
3. server: g^{t+1} = g^t + (1/n) Σ_i c_i.

Steps 1 and 3 and the EF21 part of step 2 are EF21's own (:mod:`shrinkgrad.methods.ef21`): the
method is :class:`ClientMomentum`, which keeps v_i and hands it to the inner method as the
client's gradient, around plain EF21. Momentum starts from v_i = 0, applied to the initial
gradient as well: v_i⁰ = (1 − β) ∇f_i(x⁰) and g_i⁰ = v_i⁰ (EF21's ``init="full"`` on v) — the
semantics of the DDP hook's ``momentum=β`` since it was written (a momentum-free optimizer at
learning rate lr/(1 − β) then gives SGD(lr, momentum=β) for an exact compressor). With β = 0 the
method is EF21 exactly.

The same wrapper puts client momentum in front of DCGD, EF or EF21-W (the DDP hook's
``momentum=β`` with those methods); those combinations have no theory step size. By name it is
the suffix ``+momentum``: ``dcgd[biased=true]+momentum[beta=0.5]``, ``ef+momentum[beta=0.9,b=8]``
(:meth:`~shrinkgrad.registry.Registry.register_suffix`), the name the wrapper prints.

A client updates v_i only in a round where it computes a gradient: v_i takes ∇̂f_i(x^{t+1}) when
the inner method asks for client i's gradient, and a client the inner method does not ask (a
non-participant of EF21-PP, [BW] Alg. 4: "non-participants compute and send nothing"; a client
that is not IAG's active one) keeps v_i, as it keeps the inner method's state. With minibatches
the estimator is the one the inner method asks for (``ef21_sgd[b=4]+momentum[beta=0.9]`` is
``ef21_sgdm[beta=0.9,b=4]``) or the momentum's own ``b`` with an exact-gradient method, not both.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..compressors import Compressor
from ..rng import Keys
from .base import (
    METHODS,
    Config,
    Constants,
    GradientOracle,
    Init,
    Message,
    Method,
    ProblemLike,
    Runtime,
)
from .ef21 import EF21, check_batch_fits
from .rules import momentum_update
from .stepsize import StepSize, theory_function

__all__ = ["EF21SGDM", "ClientMomentum", "MomentumClients"]


class MomentumClients(NamedTuple):
    """Client state of :class:`ClientMomentum`: the momenta v_i (m, d) and the inner method's
    client state (a NamedTuple with the same ids)."""

    ids: torch.Tensor
    v: torch.Tensor
    inner: Any


class _Given:
    """The oracle the inner method sees in round ``r``: the clients' momenta as their gradients
    at ``x``, the server's iterate of the round.

    A client's momentum moves when the inner method asks for its gradient, and only then:
    v_i ← β v_i + (1 − β) ∇̂f_i(x) ([FTR23] Alg. 1) with ∇̂f_i the oracle's answer to the inner
    method's own request (``grads``: exact, or the momentum's minibatch of size ``b``;
    ``stoch_grads``: the inner method's minibatch, its sizes and keys). A client it does not ask
    (a non-participant of a partial-participation round) computes nothing and keeps v_i; a
    client asked twice in one round gets the v_i of its first request. ``v`` is the momenta
    after the round, for the client state.

    A request at another point (DCGD with delays asks for ∇f_i(x^{t−τ_i}) at stale iterates)
    has no answer here: v_i holds gradients at ``x``, and returning it anyway would silently
    run the inner method without its delays. It is refused, naming the method."""

    #: the inner method must not overwrite v (it is the client state)
    fresh = False

    def __init__(
        self,
        owner: ClientMomentum,
        cfg: Config,
        oracle: GradientOracle,
        v: torch.Tensor,
        ids: torch.Tensor,
        x: torch.Tensor,
        r: int,
    ) -> None:
        self.owner, self.cfg, self.oracle, self.r = owner, cfg, oracle, r
        self.v, self.ids, self.x = v, ids, x
        #: rows of v updated in this round (None: none yet)
        self.done: torch.Tensor | None = None
        #: whether ``v`` is this round's own tensor (a copy, or the state the runtime owns)
        self.owned = cfg.inplace

    def _check_point(self, x: torch.Tensor) -> None:
        if x is self.x:
            return
        same_shape = x.ndim in (1, 2) and x.shape[-1] == self.x.shape[-1]
        if same_shape and torch.equal(x, self.x.expand_as(x)):  # every client's: the iterate
            return
        raise ValueError(
            f"{self.owner.name}: client momentum updates v_i with ∇f_i at the server's iterate and "
            "hands the inner method v_i as its gradient there, but the inner method asks for "
            "gradients at other (stale) points, which the momenta do not hold; wrap a method "
            "whose client step reads ∇f_i at the current iterate (ef21, ef21_w, ef, dcgd, "
            "diana, gd)"
        )

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of v (positions in the group) of the clients ``ids``."""
        index = torch.full(
            (int(self.ids.max()) + 1,), -1, dtype=torch.int64, device=self.ids.device
        )
        index[self.ids] = torch.arange(self.ids.numel(), device=self.ids.device)
        ask = ids.to(self.ids.device)
        rows = index[ask.clamp(0, index.numel() - 1)]
        rows[(ask < 0) | (ask >= index.numel())] = -1
        if bool((rows < 0).any()):
            raise ValueError(
                f"clients {ids[(rows < 0).to(ids.device)].tolist()} are not in this group"
            )
        return rows

    def _momenta(
        self, ids: torch.Tensor, sample: Callable[[torch.Tensor | None], torch.Tensor]
    ) -> torch.Tensor:
        """v_i of the clients ``ids`` after this round's update; ``sample(mask)``: the gradient
        estimators of the clients ``ids[mask]`` (those not updated yet; None: all of ``ids``)."""
        beta = self.owner.beta
        if self.done is None and (ids is self.ids or torch.equal(ids, self.ids)):
            # everybody at once: one fused update of the whole state (in place where the
            # runtime owns it)
            self.v = momentum_update(self.v, sample(None), beta, inplace=self.cfg.inplace)
            self.done = torch.ones(self.ids.numel(), dtype=torch.bool, device=self.v.device)
            return self.v
        rows = self._rows(ids)
        if self.done is None:
            self.done = torch.zeros(self.ids.numel(), dtype=torch.bool, device=self.v.device)
        new = ~self.done[rows]
        if bool(new.any()):
            if not self.owned:  # the old state stays as it was (a pure step)
                self.v, self.owned = self.v.clone(), True
            fresh = rows[new]
            grads = sample(None if bool(new.all()) else new.to(ids.device))
            self.v[fresh] = momentum_update(self.v[fresh], grads, beta)
            self.done[fresh] = True
        return self.v[rows]

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self._check_point(x)
        owner, cfg, oracle, r = self.owner, self.cfg, self.oracle, self.r
        return self._momenta(
            ids, lambda m: owner._gradients(cfg, self.x, ids if m is None else ids[m], oracle, r)
        )

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        """The inner method's minibatch (its sizes and keys) into the momenta: the momentum
        refuses, when it is built, to draw a minibatch of its own as well."""
        self._check_point(x)
        oracle = self.oracle

        def sample(m: torch.Tensor | None) -> torch.Tensor:
            if m is None:
                return oracle.stoch_grads(self.x, ids, batch_sizes, keys)
            return oracle.stoch_grads(self.x, ids[m], batch_sizes[m], keys[m])

        return self._momenta(ids, sample)


class _FirstGradient:
    """The oracle of the inner method's initialisation: v_i⁰ = (1 − β) ∇f_i(x⁰) (momentum from
    v = 0), computed only if the inner initialisation asks for a gradient."""

    fresh = False

    def __init__(self, oracle: GradientOracle, beta: float) -> None:
        self.oracle, self.beta = oracle, beta
        self.v: torch.Tensor | None = None

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.v = (1.0 - self.beta) * self.oracle.grads(x, ids)
        return self.v.clone()  # the inner state must not share memory with v

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        raise TypeError("the initialisation uses exact gradients")


class ClientMomentum(Method[Any, MomentumClients]):
    """Client momentum in front of ``inner``: v_i ← β v_i + (1 − β) ∇̂f_i(x), the inner method
    then runs on v_i as its client gradient (module docstring; [FTR23] Alg. 1 for EF21).

    Parameters
    ----------
    inner:
        a method whose client step reads exact gradients (``oracle.grads``) at the server's
        iterate: ef21, ef21_w, ef, dcgd, diana, gd. One that asks for gradients at other points
        (``delayed_dcgd`` with τ > 0: stale iterates) is refused in its first such round.
    beta:
        the momentum β ∈ [0, 1) (η = 1 − β of [FTR23]).
    batch:
        minibatch size b of the gradient estimators ∇̂f_i (keyed by (seed, "minibatch", i,
        round)); ``None`` uses the oracle's gradients (exact in the simulator, the training
        loop's minibatch gradient in a DDP hook), or the inner method's own minibatches
        (``ef21_sgd[b=4]``). Not both: a method that draws minibatches takes ``batch=None``.
        The initialisation uses exact gradients.

    A client's v_i moves only in the rounds where the inner method asks for its gradient
    (module docstring): partial participation leaves the non-participants' momenta alone.
    By name: ``inner+momentum[beta=...,b=...]`` (the suffix :func:`momentum`).
    """

    def __init__(self, inner: Method[Any, Any], beta: float = 0.9, batch: int | None = None):
        if not isinstance(inner, Method):
            raise TypeError(f"client momentum wraps one method, got {inner!r}")
        if (
            isinstance(beta, bool)
            or not isinstance(beta, (int, float))
            or not (0.0 <= float(beta) < 1.0)
        ):
            raise ValueError(f"the momentum beta must be a number in [0, 1), got {beta!r}")
        if batch is not None and (
            isinstance(batch, bool) or not isinstance(batch, int) or batch < 1
        ):
            raise ValueError(f"minibatch size b must be a positive integer, got {batch!r}")
        if isinstance(inner, ClientMomentum):
            raise ValueError(
                f"{inner.name} has client momentum already (beta={inner.beta!r}); put one "
                f"momentum in front of {inner.inner.name}, e.g. "
                f"{inner.inner.name}+momentum[beta={float(beta)!r}]"
            )
        if batch is not None and inner.samples_minibatches:
            raise ValueError(
                f"{inner.name}+momentum[beta={float(beta)!r},b={batch}]: {inner.name} draws its "
                f"own minibatches and the momentum b={batch} would draw a second one; give the "
                f"minibatch size once (drop b from the momentum: {inner.name}+momentum"
                f"[beta={float(beta)!r}])"
            )
        self.inner: Method[Any, Any] = inner
        self.beta: float = float(beta)
        self.batch: int | None = batch
        #: the inner method's parts handle the messages (the momentum never sees them)
        self.sparse_messages = inner.sparse_messages

    def default_spec(self) -> str:
        extra = "" if self.batch is None else f",b={self.batch}"
        return f"{self.inner.name}+momentum[beta={self.beta!r}{extra}]"

    # -- configuration (the inner method's) ---------------------------------------------------
    def for_problem(
        self, problem: ProblemLike, stepsize: float | str | StepSize
    ) -> Method[Any, MomentumClients]:
        """The momentum's minibatch checked against the problem, and the inner method's own
        checks (``ef21_sgd[b=...]``: b against every m_i); a copy around the inner method's
        bound copy where it makes one."""
        check_batch_fits(self.name, self.batch, problem)
        inner = self.inner.for_problem(problem, stepsize)
        if inner is self.inner:
            return self
        method = copy.copy(self)
        method.inner = inner
        return method

    def _check_compressor(
        self, C: Compressor, d: int, *, as_name: str | None = None
    ) -> tuple[float, float | None]:
        # the inner method's check, its refusals naming the method the user asked for
        return self.inner._check_compressor(C, d, as_name=as_name or self.name)

    def check_problem(self, consts: Constants) -> None:
        self.inner.check_problem(consts)

    def client_weights(self, consts: Constants) -> torch.Tensor:
        return self.inner.client_weights(consts)

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        raise ValueError(f"{self.name} has no theory step size; pass a number")

    @property
    def accumulates_aggregates(self) -> bool:
        """The inner method's (the momentum is the clients')."""
        return self.inner.accumulates_aggregates

    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime == "hook" and self.batch is not None:
            return (
                f"{self.name} samples minibatches through the problem's oracle; in a DDP hook the "
                "gradient is the one backward computed (drop b)"
            )
        if runtime == "hook":
            return self.inner.unsupported(runtime)
        return super().unsupported(runtime)

    @property
    def samples_minibatches(self) -> bool:
        """The momentum's own minibatches or the inner method's."""
        return self.batch is not None or self.inner.samples_minibatches

    # -- the parts ----------------------------------------------------------------------------
    def _gradients(
        self, cfg: Config, x: torch.Tensor, ids: torch.Tensor, oracle: GradientOracle, r: int
    ) -> torch.Tensor:
        if self.batch is None:
            return oracle.grads(x, ids)
        b = torch.full((ids.numel(),), self.batch, dtype=torch.int64, device=ids.device)
        return oracle.stoch_grads(x, ids, b, cfg.keys("minibatch", ids, r))

    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[MomentumClients, Message]:
        first = _FirstGradient(oracle, self.beta)
        inner, msg = self.inner.init_clients(cfg, x0, first, ids)
        v = first.v
        if v is None:  # the inner initialisation read no gradient: the momentum starts at 0
            v = torch.zeros(ids.numel(), cfg.d, dtype=cfg.dtype, device=cfg.device)
        return MomentumClients(ids, v, inner), msg

    def init_server(self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None) -> Any:
        return self.inner.init_server(cfg, x0, aggregate)

    def server_pre(self, cfg: Config, server: Any, r: int) -> Any:
        return self.inner.server_pre(cfg, server, r)

    def client_step(
        self, cfg: Config, server: Any, clients: MomentumClients, oracle: GradientOracle, r: int
    ) -> tuple[MomentumClients, Message]:
        """The inner method's client step on the momenta; v_i moves for the clients whose
        gradient it asks for (:class:`_Given`), the others keep theirs."""
        ids = clients.ids
        given = _Given(self, cfg, oracle, clients.v, ids, server.x, r)
        inner, msg = self.inner.client_step(cfg, server, clients.inner, given, r)
        return MomentumClients(ids, given.v, inner), msg

    def server_post(self, cfg: Config, server: Any, aggregate: torch.Tensor | None, r: int) -> Any:
        return self.inner.server_post(cfg, server, aggregate, r)

    def server_direction(
        self, cfg: Config, server: Any, aggregate: torch.Tensor | None, r: int
    ) -> tuple[Any, torch.Tensor]:
        return self.inner.server_direction(cfg, server, aggregate, r)

    def direction_changes(self, cfg: Config, aggregate: Any) -> torch.Tensor | None:
        return self.inner.direction_changes(cfg, aggregate)

    def init_direction(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor]:
        return self.inner.init_direction(cfg, x0, aggregate)


class EF21SGDM(ClientMomentum):
    """EF21-SGDM ([FTR23] Alg. 1): EF21 on the clients' momenta v_i ← β v_i + (1 − β) ∇̂f_i.

    Needs a contractive compressor. ``b`` (minibatch size) gives the simulator stochastic
    gradients; without it the client gradient is the oracle's (exact in the simulator, the
    training loop's minibatch gradient in a DDP hook). Theory step:
    :func:`shrinkgrad.theory.stepsize_ef21_sgdm` = min{α/(20 L_QM), (1 − β)/(7L)} ((?), see
    there).
    """

    requires = "contractive"

    def __init__(self, beta: float = 0.9, batch: int | None = None, init: Init = "full") -> None:
        super().__init__(EF21(init=init), beta, batch)

    def default_spec(self) -> str:
        params = [f"beta={self.beta!r}"]
        if self.batch is not None:
            params.append(f"b={self.batch}")
        init = getattr(self.inner, "init", "full")
        if init != "full":
            params.append(f"init={init}")
        return f"ef21_sgdm[{','.join(params)}]"

    def theory_formula(self) -> str:
        return "min{α/(20 L_QM), (1 − β)/(7L)} ([FTR23] Thm 3, (?))"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        c = cfg.constants
        L = c.smoothness()[0]
        eta = 1.0 - self.beta
        if not math.isfinite(eta) or eta <= 0:
            raise ValueError(f"{self.name}: the theory step needs beta < 1")
        gamma = theory_function("stepsize_ef21_sgdm")(L, c.L_QM, cfg.alpha, eta)
        return float(gamma), "stepsize_ef21_sgdm"


@METHODS.register_suffix("momentum")
def momentum(inner: Method[Any, Any], beta: float = 0.9, b: int | None = None) -> ClientMomentum:
    """Client momentum v_i ← βv_i + (1−β)∇̂f_i in front of a method ([FTR23] Alg. 1).

    The suffix ``+momentum``: ``ef+momentum[beta=0.9]``, ``dcgd+momentum[beta=0.5,b=8]``."""
    return ClientMomentum(inner, beta=beta, batch=b)


@METHODS.register("ef21_sgdm")
def ef21_sgdm(beta: float = 0.9, b: int | None = None, init: Init = "full") -> EF21SGDM:
    """EF21-SGDM ([FTR23] Alg. 1): EF21 on client momenta v_i ← βv_i + (1−β)∇̂f_i (b: minibatch)."""
    return EF21SGDM(beta=beta, batch=b, init=init)
