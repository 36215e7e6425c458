"""DIANA: compressed gradient *differences* with learned shifts (Mishchenko et al. 2019).

[DIANA] K. Mishchenko, E. Gorbunov, M. Takáč, P. Richtárik, *Distributed learning with compressed
gradient differences*, arXiv 1901.09269 (2019), Algorithm 1 (without momentum or prox);
[HKMSR] S. Horváth, D. Kovalev, K. Mishchenko, S. Stich, P. Richtárik, *Stochastic distributed
learning with gradient quantization and variance reduction*, arXiv 1904.05115 (2019), for the
nonconvex analysis.

Each client keeps a shift h_i that learns ∇f_i, so an unbiased compressor only has to carry the
difference ∇f_i − h_i, which vanishes at a solution: unlike DCGD, DIANA converges to the exact
optimum with a constant step. Round k + 1 (from x^k):

1. client i: Δ_i = ∇f_i(x^k) − h_i; sends Q_i(Δ_i) (unbiased, variance ω); h_i ← h_i + αQ_i(Δ_i);
2. server: ĝ = h + (1/n) Σ_i Q_i(Δ_i); x^{k+1} = x^k − γĝ; h ← h + α (1/n) Σ_i Q_i(Δ_i).

The invariant h = (1/n) Σ_i h_i holds at every round. With the identity compressor ĝ = ∇f(x^k)
for every α: DIANA is gradient descent.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from .base import METHODS, SHARED_DRAW, Config, GradientOracle, Message, Method, Runtime
from .stepsize import theory_function

__all__ = ["DIANA", "DianaClients", "DianaServer"]

DianaInit = Literal["zero", "full"]


class DianaServer(NamedTuple):
    """Server state: x^k and the mean shift h = (1/n) Σ_i h_i."""

    x: torch.Tensor
    h: torch.Tensor


class DianaClients(NamedTuple):
    """Client state: the shifts h_i of the group, (m, d)."""

    ids: torch.Tensor
    h: torch.Tensor


@METHODS.register("diana")
class DIANA(Method[DianaServer, DianaClients]):
    """DIANA ([DIANA] Alg. 1): x^{k+1} = x^k − γ(h + (1/n)Σ Q_i(∇f_i − h_i)), h_i ← h_i + αQ_i(·).

    Parameters
    ----------
    alpha:
        step size α of the shifts; ``None`` (default) takes 1/(1 + ω) of the compressor, the
        largest value the theory allows ([DIANA], [HKMSR]: α ≤ 1/(1 + ω)). A larger α runs with
        a numeric step size, but ``stepsize="theory"`` then refuses.
    init:
        h_i⁰ = 0 (``zero``, [DIANA], nothing sent at round 0) or h_i⁰ = ∇f_i(x⁰) (``full``: one
        uncompressed vector per client at round 0, and H⁰ = 0 in the Lyapunov function).

    Needs an unbiased compressor. Theory step ``stepsize_diana`` (smooth nonconvex f_i, derived
    (D) in :func:`shrinkgrad.theory.stepsize_diana`): 2/(L + √(L² + 4K²)) with
    K = √(ω/n) L_QM/(1 − √(1 − α)); 1/L without compression.
    """

    requires = "unbiased"

    def __init__(self, alpha: float | None = None, init: DianaInit = "zero") -> None:
        if alpha is not None and (
            isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1
        ):
            raise ValueError(
                f"diana: alpha (the shift step size) must be in (0, 1], got {alpha!r}; omit it "
                "for the theory's 1/(1 + ω)"
            )
        if init not in ("zero", "full"):
            raise ValueError(f"diana: init must be zero or full, got {init!r}")
        self.alpha = None if alpha is None else float(alpha)
        self.init = init

    def default_spec(self) -> str:
        params = [] if self.alpha is None else [f"alpha={self.alpha!r}"]
        if self.init != "zero":
            params.append(f"init={self.init}")
        return "diana" + (f"[{','.join(params)}]" if params else "")

    @property
    def identity_is_gd(self) -> bool:
        """ĝ = h + (1/n)Σ(∇f_i − h_i) = ∇f for every α when Q is the identity."""
        return True

    @property
    def accumulates_aggregates(self) -> bool:
        """h ← h + α·(1/n) Σ_i Q_i (the server's shift integrates the aggregates)."""
        return True

    def unsupported(self, runtime: Runtime) -> str | None:
        """DIANA fits a DDP hook (one client per rank: the shift h_i is the tensor's memory, the
        mean shift h is replicated, x moves by −γ(h + aggregate)); it has no theory under the
        staleness of an asynchronous parameter server."""
        if runtime == "hook":
            return None
        if runtime == "ps":
            return "diana has no analysis with stale messages (asynchronous parameter server)"
        return super().unsupported(runtime)

    def shift_stepsize(self, cfg: Config) -> float:
        """α of this run: the parameter, or 1/(1 + ω) of the bound compressor."""
        omega = 0.0 if cfg.omega is None else cfg.omega
        return self.alpha if self.alpha is not None else 1.0 / (1.0 + omega)

    def theory_formula(self) -> str:
        return "2/(L + √(L² + 4K²)), K = √(ω/n) L_QM/(1 − √(1 − α)) (stepsize_diana, D)"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        c = cfg.constants
        L = c.smoothness()[0]
        omega = 0.0 if cfg.omega is None else cfg.omega
        gamma = theory_function("stepsize_diana")(
            L, c.L_QM, omega, cfg.n_draws, self.shift_stepsize(cfg)
        )
        return float(gamma), "stepsize_diana" + (SHARED_DRAW if cfg.shared_draw else "")

    # -- the parts ----------------------------------------------------------------------------
    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[DianaClients, Message]:
        m = ids.numel()
        if self.init == "zero":
            h = torch.zeros(m, cfg.d, dtype=cfg.dtype, device=cfg.device)
            return DianaClients(ids, h), Message(None, None, cfg.no_traffic(m))
        grads = oracle.grads(x0, ids)
        return DianaClients(ids, grads), cfg.message(grads, ids, cfg.dense_traffic(m))

    def init_server(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> DianaServer:
        return DianaServer(x0, torch.zeros_like(x0) if aggregate is None else aggregate)

    def client_step(
        self,
        cfg: Config,
        server: DianaServer,
        clients: DianaClients,
        oracle: GradientOracle,
        r: int,
    ) -> tuple[DianaClients, Message]:
        ids = clients.ids
        q = cfg.compress(oracle.grads(server.x, ids) - clients.h, ids, r)
        h = clients.h + self.shift_stepsize(cfg) * q
        return DianaClients(ids, h), cfg.message(q, ids, cfg.compressed_traffic(q))

    def server_post(
        self, cfg: Config, server: DianaServer, aggregate: torch.Tensor | None, r: int
    ) -> DianaServer:
        assert aggregate is not None
        direction = server.h + aggregate  # ĝ = h + (1/n) Σ Q_i(Δ_i)
        h = server.h + self.shift_stepsize(cfg) * aggregate
        return DianaServer(server.x - cfg.stepsize * direction, h)
