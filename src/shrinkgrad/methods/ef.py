"""Classic error feedback ([S14]; the baseline of [EF21])."""

from __future__ import annotations

from typing import NamedTuple, cast

import torch

from .base import METHODS, Config, GradientOracle, Message, Method, Runtime
from .gd import XState
from .rules import divide_message, ef_update

__all__ = ["EF", "EFClients"]


class EFClients(NamedTuple):
    """Client state of EF: the error (memory) e_i of every client of the group, (m, d), and
    the state of the compressor (PowerSGD's previous Q, (m, n, r); an empty (m, 0) tensor for
    stateless compressors; None only in states built by hand)."""

    ids: torch.Tensor
    e: torch.Tensor
    compressor_state: torch.Tensor | None = None


@METHODS.register("ef")
class EF(Method[XState, EFClients]):
    """Classic error feedback ([S14] 1-bit SGD; baseline in [EF21] §1; methods.md §3).

    Client state e_i⁰ = 0. Round t + 1: p_i = e_i + γ∇f_i(x^t); v_i = C(p_i); e_i ← p_i − v_i;
    client i sends v_i. Server: x^{t+1} = x^t − (1/n) Σ_i v_i. The step size enters on the
    clients. Needs a contractive compressor. methods.md §4 gives no theory step size for EF:
    pass a number. In a DDP hook (γ = 1, the optimizer's learning rate applied afterwards) e_i is
    the learning-rate-free residual of GRACE: for a constant learning rate and a positively
    homogeneous C that is [S14] with e/γ in place of e.
    """

    requires = "contractive"
    #: C(p) only goes through ``rules.ef_update`` and the Message; the server returns the
    #: aggregate as the direction: a runtime may pass SparseMessages (the DDP hook)
    sparse_messages = True
    carries_compressor_state = True

    @property
    def identity_is_gd(self) -> bool:
        """C = identity keeps e_i = 0, so x^{t+1} = x^t − (1/n) Σ γ∇f_i(x^t)."""
        return True

    def theory_formula(self) -> str:
        return "none in methods.md §4: pass a number"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        raise ValueError(
            "ef (classic error feedback) has no theory step size in methods.md §4; pass a number "
            "(e.g. the EF21 theory step of the same problem, which [EF21] uses for its baseline)"
        )

    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[EFClients, Message]:
        e = torch.zeros(ids.numel(), cfg.d, dtype=cfg.dtype, device=cfg.device)
        cs = cfg.compressor_state(e, ids)
        return EFClients(ids, e, cs), Message(None, None, cfg.no_traffic(ids.numel()))

    def init_server(self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None) -> XState:
        return XState(x0)

    def client_step(
        self, cfg: Config, server: XState, clients: EFClients, oracle: GradientOracle, r: int
    ) -> tuple[EFClients, Message]:
        ids = clients.ids
        grads = oracle.grads(server.x, ids)
        comp = cfg.compressing(ids, r, clients.compressor_state)
        if cfg.inplace:  # e ← e + γ∇f_i in place (no γ∇f_i tensor)
            v, e = ef_update(clients.e, grads, comp, inplace=True, step=cfg.stepsize)
        else:
            v, e = ef_update(clients.e, cfg.stepsize * grads, comp)
        return EFClients(ids, e, comp.state), cfg.message(v, ids, cfg.compressed_traffic(v))

    def server_post(
        self, cfg: Config, server: XState, aggregate: torch.Tensor | None, r: int
    ) -> XState:
        assert aggregate is not None
        return XState(server.x - aggregate)

    def server_direction(
        self, cfg: Config, server: XState, aggregate: torch.Tensor | None, r: int
    ) -> tuple[XState, torch.Tensor]:
        """x ← x − (1/n) Σ v_i = x − γ·(aggregate/γ): the direction is aggregate/γ."""
        assert aggregate is not None
        if cfg.stepsize == 1.0:
            return server, aggregate
        return server, cast(torch.Tensor, divide_message(aggregate, cfg.stepsize))

    def unsupported(self, runtime: Runtime) -> str | None:
        return None if runtime == "hook" else super().unsupported(runtime)
