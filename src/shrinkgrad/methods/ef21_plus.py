"""EF21+: per client, the better of EF21's estimator and the plain compressed gradient.

[EF21] P. Richtárik, I. Sokolov, I. Fatkhullin, *EF21: A New, Simpler, Theoretically Better, and
Practically Faster Error Feedback*, NeurIPS 2021, the EF21+ variant; the rule below is the one of
the authors' experiment code (``bdfg_plus_distributed_stable.py``,
``bdfg_plus_pl_distributed_stable.py`` in IgorSokoloff/ef21_experiments_source_code: each worker
builds both estimators and keeps the one nearer to its gradient).

Round t + 1 (from x^t, g^t = (1/n) Σ g_i^t):

1. server: x^{t+1} = x^t − γ g^t (broadcast);
2. client i, with G = ∇f_i(x^{t+1}) and one compressor draw C = C_i^{t+1}:
   b = g_i + C(G − g_i) (EF21's estimator), m = C(G) (the compressed gradient, as in DCGD with a
   biased compressor); g_i ← m if ‖m − G‖ < ‖b − G‖, else b (ties keep EF21's). The client sends
   the compressed vector it used (C(G) or C(G − g_i)) and one bit saying which;
3. server: g^{t+1} = (1/n) Σ_i g_i^{t+1}. When client i switched to m, the server needs its old
   g_i to update the mean: the reduction here carries g_i^{t+1} − g_i^t (as IAG's carries
   new − old), i.e. a deployment's server keeps every g_i (n × d), where EF21's keeps only g.

Theory (:func:`shrinkgrad.theory.stepsize_ef21_plus`): the chosen estimator is never farther
from ∇f_i than EF21's, draw by draw, so EF21's contraction, and its step sizes, carry over (D);
the authors run EF21+ at EF21's step (V).
"""

from __future__ import annotations

from typing import Literal

import torch

from .base import METHODS, Config, GradientOracle, Init, Message, Runtime, Traffic
from .ef21 import EF21, EF21Clients, EF21Server
from .stepsize import theory_function

__all__ = ["EF21Plus"]

PlusRule = Literal["original", "reloaded"]


@METHODS.register("ef21_plus")
class EF21Plus(EF21):
    """EF21+ ([EF21]): each client keeps the nearer to ∇f_i of g_i + C(∇f_i − g_i) and C(∇f_i).

    Parameters
    ----------
    init:
        g_i⁰ = ∇f_i(x⁰) (``full``, default), C(∇f_i(x⁰)) (``compressed``) or 0 (``zero``).
    rule:
        theory step size: ``original`` 1/(L + L_QM ξ(α)) (``stepsize_ef21_plus``, [EF21] Thm 1)
        or ``reloaded`` 1/(L + L_AM ξ(α)) ([EFR] Thm 3); both carry over from EF21 (D).

    Needs a contractive compressor. Bits: the compressed message actually sent plus one flag bit
    (``up``); the papers' convention (``up_paper``) counts the message only. Everything but the
    client step (initialisation, x^{t+1} = x^t − γg^t, g ← g + aggregate) is EF21's.
    """

    #: no: its client step draws ``cfg.compress`` twice (on G − g_i and on G), without the
    #: compressor state EF21 carries (PowerSGD's Q), so a stateful compressor is refused at bind
    carries_compressor_state = False

    def __init__(self, init: Init = "full", rule: PlusRule = "original") -> None:
        if rule not in ("original", "reloaded"):
            raise ValueError(f"ef21_plus: rule must be original or reloaded, got {rule!r}")
        super().__init__(init=init, rule=rule)

    def default_spec(self) -> str:
        params = [] if self.init == "full" else [f"init={self.init}"]
        if self.rule != "original":
            params.append(f"rule={self.rule}")
        return "ef21_plus" + (f"[{','.join(params)}]" if params else "")

    @property
    def compresses_gradient_first(self) -> bool:
        """No: the client step forms ∇f_i − g_i itself (and compares with ∇f_i)."""
        return False

    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime == "hook":
            return (
                "ef21_plus replaces g_i by C(∇f_i) on some rounds, and the mean g then needs the "
                "old g_i of that rank: a compressed all-reduce cannot carry it"
            )
        if runtime == "ps":
            return "ef21_plus has no analysis with stale messages (asynchronous parameter server)"
        if runtime in ("simulator", "runner"):
            return None
        return super().unsupported(runtime)

    def theory_formula(self) -> str:
        if self.rule == "reloaded":
            return "1/(L + L_AM ξ(α)) ([EFR] Thm 3; carries over to EF21+, D)"
        return "1/(L + L_QM ξ(α)) (stepsize_ef21_plus: [EF21] Thm 1 carries over, D)"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        if self.rule == "reloaded":
            return super().theory_stepsize(cfg)  # stepsize_ef21_reloaded
        c = cfg.constants
        gamma = theory_function("stepsize_ef21_plus")(c.smoothness()[0], c.L_QM, cfg.alpha)
        return float(gamma), "stepsize_ef21_plus"

    def client_step(
        self, cfg: Config, server: EF21Server, clients: EF21Clients, oracle: GradientOracle, r: int
    ) -> tuple[EF21Clients, Message]:
        ids, g = clients.ids, clients.g
        grads = oracle.grads(server.x, ids)
        c_ef = cfg.compress(grads - g, ids, r)  # EF21: b = g_i + C(G − g_i)
        c_cg = cfg.compress(grads, ids, r)  # the same draw on G itself: m = C(G)
        b = g + c_ef
        use_m = ((c_cg - grads) ** 2).sum(dim=1) < ((b - grads) ** 2).sum(dim=1)
        pick = use_m.unsqueeze(1)
        g_new = torch.where(pick, c_cg, b)
        sent = torch.where(pick, c_cg, c_ef)
        t = cfg.compressed_traffic(sent)
        flag = Traffic(t.up + 1.0, t.up_paper, t.down)  # one bit: which estimator
        return EF21Clients(ids, g_new), cfg.message(g_new - g, ids, flag)
