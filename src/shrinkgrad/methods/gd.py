"""Gradient descent and distributed compressed gradient descent (DCGD, [K18]).

Both are stateless on the clients: client i sends ∇f_i(x^t) (GD) or Q_i(∇f_i(x^t)) (DCGD) and the
server steps x^{t+1} = x^t − γ (1/n) Σ_i (message_i).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ..compressors import Compressor
from .base import (
    METHODS,
    SHARED_DRAW,
    ClientT,
    Config,
    GradientOracle,
    Message,
    Method,
    Runtime,
    ServerT,
)
from .stepsize import theory_function

__all__ = ["DCGD", "GD", "DelayRule", "Group", "XState", "dcgd_theory"]


class XState(NamedTuple):
    """Server state of the stateless methods: the iterate x (d,)."""

    x: torch.Tensor


class Group(NamedTuple):
    """Client state of the stateless methods: only the global ids (m,) of the group."""

    ids: torch.Tensor


#: what the rule of a DCGD-based theory step records on a problem whose f_i are not convex
NOT_CONVEX = "(f_i not convex: outside its theorem)"
#: ... and on one that does not say (``convex`` None: a neural network, bare Constants)
NOT_KNOWN_CONVEX = "(f_i not known to be convex: outside its theorem unless they are)"
#: the DCGD rule's name in ``stepsize_rule`` (its notes follow it)
DCGD_RULE = "stepsize_dcgd"


def dcgd_theory(cfg: Config) -> tuple[float, str]:
    """γ = 1/(L + 2ω L_max/n) (:func:`shrinkgrad.theory.stepsize_dcgd`; 1/L for ω = 0), with n
    the independent draws per round (:attr:`Config.n_draws`: 1 for a shared-seed compressor,
    whose aggregate (1/n) Σ_i C(∇f_i) = C(∇f) is the one-client DCGD; the rule then records
    :data:`SHARED_DRAW`).

    The rule is proved for convex f_i (methods.md §4). On a problem that says its f_i are not
    convex (``problem.convex`` False: the nonconvex regularizer) the step is still this value,
    its rule records :data:`NOT_CONVEX` and a UserWarning says so (``shrinkgrad theory`` leaves
    the row out there); on one that does not say (``convex`` None: a neural network, whose L is
    an estimate, or bare :class:`~shrinkgrad.methods.Constants`) it records
    :data:`NOT_KNOWN_CONVEX`, with a warning too."""
    c = cfg.constants
    L, L_i = c.smoothness()
    omega = 0.0 if cfg.omega is None else cfg.omega
    gamma = theory_function("stepsize_dcgd")(L, float(L_i.max()), omega, cfg.n_draws)
    rule = DCGD_RULE + (SHARED_DRAW if cfg.shared_draw else "")
    if c.convex is True:
        return float(gamma), rule
    if c.convex is False:
        why, fix, note = "are not (its regularizer is nonconvex)", "or reg=l2, ", NOT_CONVEX
    else:
        why = "are not known to be (a neural network's are not, in general)"
        fix, note = "or Constants(convex=True) when they are, ", NOT_KNOWN_CONVEX
    warnings.warn(
        f"the DCGD theory step 1/(L + 2ωL_max/n) is proved for convex f_i, and this problem's "
        f"{why}: the run uses it outside its theorem (a number, {fix}keeps within it)",
        UserWarning,
        stacklevel=2,
    )
    return float(gamma), rule + note


class DelayRule(Method[ServerT, ClientT]):
    """Methods whose asynchronous step size is [K18]'s delay rule (DCGD, the IAG): ``"theory"``
    is :func:`~shrinkgrad.methods.delayed.delayed_theory` at the run's delay bound, and the
    check at a measured delay is :func:`~shrinkgrad.methods.delayed.delayed_admissible`."""

    def async_theory(self, cfg: Config, delay: int | None) -> tuple[float, str]:
        from .delayed import async_delayed_theory

        return async_delayed_theory(self.name, cfg, delay)

    def async_admissible(
        self, cfg: Config, stepsize: float, delay: int
    ) -> tuple[float, bool] | None:
        from .delayed import delayed_admissible

        return delayed_admissible(cfg, stepsize, delay)


class _GradientStep(Method[XState, Group]):
    """What GD and DCGD share: no client state, one step x^{t+1} = x^t − γ (1/n) Σ_i message_i.

    Theory step: :func:`dcgd_theory` (ω = 0, i.e. 1/L, for GD). The subclasses say what a client
    sends (:meth:`client_step`).
    """

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        return dcgd_theory(cfg)

    @property
    def identity_is_gd(self) -> bool:
        return True

    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[Group, Message]:
        return Group(ids), Message(None, None, cfg.no_traffic(ids.numel()))

    def init_server(self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None) -> XState:
        return XState(x0)

    def server_post(
        self, cfg: Config, server: XState, aggregate: torch.Tensor | None, r: int
    ) -> XState:
        assert aggregate is not None
        return XState(server.x - cfg.stepsize * aggregate)

    def server_direction(
        self, cfg: Config, server: XState, aggregate: torch.Tensor | None, r: int
    ) -> tuple[XState, torch.Tensor]:
        """x ← x − γ·aggregate (:meth:`server_post`; no ``server_pre``): the direction is the
        aggregate itself."""
        assert aggregate is not None
        return server, aggregate

    def unsupported(self, runtime: Runtime) -> str | None:
        return None if runtime == "hook" else super().unsupported(runtime)


@METHODS.register("gd")
class GD(_GradientStep):
    """Gradient descent: x^{t+1} = x^t − γ ∇f(x^t), each client sending ∇f_i(x^t) in full.

    The uncompressed parent of every method (the identity compressor reduces DCGD, EF, EF21 and
    EF21-W to it). Theory step: 1/L (descent lemma; the value of ``stepsize_dcgd`` at ω = 0),
    recorded as the rule ``"1/L"``, gd's own, not DCGD's.
    """

    requires = "none"

    def theory_formula(self) -> str:
        return "1/L (descent lemma)"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        # stepsize_dcgd at ω = 0 is exactly 1/L; the descent lemma needs no convexity, so GD
        # does not take DCGD's convexity warning (dcgd_theory) with it
        c = cfg.constants
        L, L_i = c.smoothness()
        return float(theory_function("stepsize_dcgd")(L, float(L_i.max()), 0.0, c.n)), "1/L"

    def client_step(
        self, cfg: Config, server: XState, clients: Group, oracle: GradientOracle, r: int
    ) -> tuple[Group, Message]:
        grads = oracle.grads(server.x, clients.ids)
        return clients, cfg.message(grads, clients.ids, cfg.dense_traffic(clients.ids.numel()))


@METHODS.register("dcgd")
class DCGD(DelayRule[XState, Group], _GradientStep):
    """Distributed compressed gradient descent ([K18], distributed quantized GD; methods.md §3).

    Client i sends Q_i^t(∇f_i(x^t)) with an unbiased compressor (a fresh keyed draw per client
    and round); the server steps x^{t+1} = x^t − γ (1/n) Σ_i Q_i^t(∇f_i(x^t)). No client state.
    Converges to a neighbourhood of size ∝ γω(1/n)Σ‖∇f_i(x*)‖² unless all ∇f_i(x*) = 0.
    Theory step: 1/(L + 2ωL_max/n) (``stepsize_dcgd``, convex f_i, (D)). ``biased=true`` also
    accepts contractive compressors (compressed GD without error feedback, the DDP hook's
    ``error_feedback="none"``): the same arithmetic, no theory step.
    """

    requires = "unbiased"
    #: the client only sends its message, the server returns the aggregate as the direction: a
    #: runtime may pass SparseMessages (the DDP hook)
    sparse_messages = True

    def __init__(self, biased: bool = False) -> None:
        if not isinstance(biased, bool):
            raise TypeError(f"dcgd: biased must be true or false, got {biased!r}")
        #: also accept contractive (biased) compressors: plain compressed GD without error
        #: feedback (e.g. Top-k SGD), the baseline error feedback corrects; no theory step
        self.biased = biased

    def default_spec(self) -> str:
        return "dcgd[biased=true]" if self.biased else "dcgd"

    def _check_compressor(
        self, C: Compressor, d: int, *, as_name: str | None = None
    ) -> tuple[float, float | None]:
        if not self.biased or C.kind == "unbiased":
            return super()._check_compressor(C, d, as_name=as_name)
        return float(C.alpha(d)), None

    def theory_formula(self) -> str:
        if self.biased:
            return "1/(L + 2ω L_max/n) (stepsize_dcgd; unbiased compressors only)"
        return "1/(L + 2ω L_max/n) (stepsize_dcgd)"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        if cfg.omega is None:
            raise ValueError(
                f"{self.name} with the biased compressor {cfg.compressor.name} has no theory step "
                "size (DCGD's rule needs an unbiased one); pass a number, or use ef21"
            )
        return dcgd_theory(cfg)

    @property
    def compresses_gradient_first(self) -> bool:
        """The client step is C(∇f_i): the gradient goes to ``cfg.compress`` and nowhere else."""
        return True

    def client_step(
        self, cfg: Config, server: XState, clients: Group, oracle: GradientOracle, r: int
    ) -> tuple[Group, Message]:
        ids = clients.ids
        q = cfg.compress(oracle.grads(server.x, ids), ids, r, sent_only=True)
        return clients, cfg.message(q, ids, cfg.compressed_traffic(q))

    # -- asynchronous: x ← x − γ w_i Q_i(∇f_i(x^{t−τ})) per arriving message ([K18]) -----------
    def unsupported(self, runtime: Runtime) -> str | None:
        return None if runtime == "ps" else super().unsupported(runtime)

    def async_clients(self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor) -> Group:
        return Group(ids)
