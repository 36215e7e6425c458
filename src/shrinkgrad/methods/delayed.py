"""Stale gradients ([K18]): delayed DCGD with delay models, the compressed IAG, the delay rule.

Delayed DCGD keeps a ring buffer of the last τ + 1 iterates in the (replicated) server state;
client i's message in round t + 1 is Q_i(∇f_i(x^{t − τ_i^t})) with 0 ≤ τ_i^t ≤ τ drawn by a delay
model. The compressed IAG updates one client's entry of a table of compressed gradients per round.
Real staleness (an asynchronous parameter server, or the replay of one) is not a delay model but
an execution: :mod:`shrinkgrad.methods.asynchronous`; the delay rule here gives its step size.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from .base import METHODS, Config, GradientOracle, Init, Message, Method, Runtime
from .gd import DCGD_RULE, DelayRule, Group, dcgd_theory
from .stepsize import theory_function

__all__ = [
    "IAG",
    "DelayModel",
    "DelayedDCGD",
    "HistState",
    "IAGClients",
    "IAGServer",
    "async_delayed_theory",
    "delayed_admissible",
    "delayed_theory",
]

DelayModel = Literal["fixed", "random", "speeds", "cyclic"]

#: strict theory bounds (γ must be *below* them, e.g. ``stepsize_delayed``) are used at this factor
STRICT_FACTOR = 0.99


def _randint(cfg: Config, stream: str, ids: torch.Tensor, r: int, high: int) -> torch.Tensor:
    """Keyed integers on {0, …, high − 1}, one per client: ⌊w · high / 2³²⌋ with w ~ U[0, 2³²)."""
    w = cfg.keys(stream, ids, r).bits32(1)[:, 0]
    return (w * high) >> 32


def delayed_theory(cfg: Config, tau: int) -> tuple[float, str]:
    """min{DCGD rule, 0.99 × 2/[L(1 + √(1 + 8τ(τ+1)))]} ([K18]; (?) how ω and delays combine).

    τ = 0 is DCGD and gets the DCGD rule. methods.md marks the delayed rule (?): which algorithm
    it covers and how ω enters are not confirmed; taking the smaller of the two rules is our
    choice, stated in docs/methods.md.
    """
    g_dcgd, rule = dcgd_theory(cfg)
    if tau == 0:
        return g_dcgd, rule
    L = cfg.constants.smoothness()[0]
    g_delay = STRICT_FACTOR * float(theory_function("stepsize_delayed")(L, tau))
    # the DCGD rule's notes carry over: one shared draw (n = 1), f_i not (known to be) convex
    notes = rule.removeprefix(DCGD_RULE)
    return (
        min(g_dcgd, g_delay),
        f"min({DCGD_RULE},{STRICT_FACTOR}*stepsize_delayed[tau={tau}]){notes}",
    )


def async_delayed_theory(name: str, cfg: Config, delay: int | None) -> tuple[float, str]:
    """:func:`delayed_theory` for an asynchronous run of ``name``: its updates are at most
    ``delay`` stale; None (nothing bounds the delay) is the error that says what to give."""
    if delay is None:
        raise ValueError(
            f"stepsize='theory' for asynchronous {name} needs a delay bound: set tau_max "
            "(enforced by the server), or assume_tau (e.g. the maximal delay measured by a pilot "
            "run, see benchmarks/ps.py), or give a number"
        )
    return delayed_theory(cfg, delay)


def delayed_admissible(cfg: Config, stepsize: float, tau: int) -> tuple[float, bool]:
    """The region :func:`delayed_theory` draws its step from, at delay τ: (its supremum, whether
    γ = ``stepsize`` lies in it).

    The region is γ ≤ 1/(L + 2ωL_max/n) (the DCGD rule, a non-strict bound: ``stepsize_dcgd``)
    and, for τ > 0, γ < 2/[L(1 + √(1 + 8τ(τ+1)))] (the strict [K18] delay rule, (?)). At τ = 0
    only the DCGD rule applies, so the DCGD step itself is admitted (the delay rule at τ = 0,
    γ < 1/L, would reject gradient descent's own 1/L).
    """
    g_dcgd = dcgd_theory(cfg)[0]
    if tau == 0:
        return g_dcgd, stepsize <= g_dcgd
    L = cfg.constants.smoothness()[0]
    g_delay = float(theory_function("stepsize_delayed")(L, tau))
    return min(g_dcgd, g_delay), stepsize <= g_dcgd and stepsize < g_delay


class HistState(NamedTuple):
    """Server state of delayed DCGD: x^t and the ring buffer of the last τ + 1 iterates.

    ``history[s]`` holds the latest x^{t'} with t' ≡ s (mod τ + 1), t' ≤ t; slots not yet written
    hold x⁰, so a delay reaching before round 0 reads x⁰.
    """

    x: torch.Tensor
    history: torch.Tensor


@METHODS.register("delayed_dcgd")
class DelayedDCGD(Method[HistState, Group]):
    """DCGD with stale gradients ([K18], asynchronous compressed GD; methods.md §3).

    Round t + 1: client i sends Q_i(∇f_i(x^{t − τ_i^t})), the server steps
    x^{t+1} = x^t − γ (1/n) Σ_i Q_i(∇f_i(x^{t − τ_i^t})). Delay models (0 ≤ τ_i^t ≤ τ):

    * ``fixed``: τ_i^t = τ for every client;
    * ``random``: τ_i^t uniform on {0, …, τ}, keyed by (seed, "delay", i, t + 1);
    * ``speeds``: per-client speeds: τ_i uniform on {0, …, τ} drawn once per client (keyed,
      round 0), fixed over the run (slow clients are always more stale);
    * ``cyclic``: τ_i^t = (t + i) mod (τ + 1): client i refreshes its copy of x every τ + 1
      rounds and computes on it until the next refresh.

    Delays are clipped at round 0 (x^{−k} = x⁰). τ = 0 is DCGD exactly.
    """

    requires = "unbiased"

    def __init__(self, tau: int = 1, model: DelayModel = "fixed") -> None:
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise ValueError(
                f"delayed_dcgd: tau (the maximal delay) must be an integer >= 0, got {tau!r}"
            )
        if model not in ("fixed", "random", "speeds", "cyclic"):
            raise ValueError(
                f"delayed_dcgd: model must be fixed, random, speeds or cyclic, got {model!r}"
            )
        self.tau = tau
        self.model = model

    def default_spec(self) -> str:
        return f"delayed_dcgd[tau={self.tau},model={self.model}]"

    @property
    def identity_is_gd(self) -> bool:
        """τ = 0 is DCGD exactly, hence GD with the identity."""
        return self.tau == 0

    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime == "ps":
            return (
                f"{self.name} draws its delays from a delay model, while a parameter server's "
                "staleness is real: run dcgd there"
            )
        return super().unsupported(runtime)

    def theory_formula(self) -> str:
        return "min{1/(L + 2ω L_max/n), 0.99·2/[L(1 + √(1 + 8τ(τ+1)))]} ([K18], (?))"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        return delayed_theory(cfg, self.tau)

    def delays(self, cfg: Config, ids: torch.Tensor, r: int) -> torch.Tensor:
        """τ_i^{r−1} for the clients ``ids`` (int64, (m,)) in the step producing round ``r``."""
        k = self.tau + 1
        if self.tau == 0:
            return torch.zeros_like(ids)
        if self.model == "fixed":
            return torch.full_like(ids, self.tau)
        if self.model == "random":
            return _randint(cfg, "delay", ids, r, k)
        if self.model == "speeds":
            return _randint(cfg, "delay", ids, 0, k)
        return (ids + (r - 1)) % k  # cyclic

    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[Group, Message]:
        return Group(ids), Message(None, None, cfg.no_traffic(ids.numel()))

    def init_server(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> HistState:
        return HistState(x0, x0.unsqueeze(0).repeat(self.tau + 1, 1))

    def client_step(
        self, cfg: Config, server: HistState, clients: Group, oracle: GradientOracle, r: int
    ) -> tuple[Group, Message]:
        ids = clients.ids
        t = r - 1
        delays = self.delays(cfg, ids, r)
        if not bool(delays.any()):
            grads = oracle.grads(server.x, ids)  # no staleness: one point for everybody
        else:
            slots = (t - delays) % (self.tau + 1)
            grads = oracle.grads(server.history[slots], ids)
        q = cfg.compress(grads, ids, r)
        return clients, cfg.message(q, ids, cfg.compressed_traffic(q))

    def server_post(
        self, cfg: Config, server: HistState, aggregate: torch.Tensor | None, r: int
    ) -> HistState:
        assert aggregate is not None
        x = server.x - cfg.stepsize * aggregate
        slot = torch.tensor([r % (self.tau + 1)], device=x.device)
        return HistState(x, server.history.index_copy(0, slot, x.unsqueeze(0)))


class IAGServer(NamedTuple):
    """Server state of the compressed IAG: x^t and s = S/n = (1/n) Σ_i ĝ_i."""

    x: torch.Tensor
    s: torch.Tensor


class IAGClients(NamedTuple):
    """The table of last compressed gradients, one row per client of the group.

    ``table[j]`` is the server's copy ĝ_i of client ``ids[j]``'s last message. The rows travel
    with the client group so that the client part stays a function of its own clients; in a
    parameter-server deployment the server keeps them.
    """

    ids: torch.Tensor
    table: torch.Tensor


Order = Literal["cyclic", "random", "arrival"]


@METHODS.register("iag")
class IAG(DelayRule[IAGServer, IAGClients]):
    """Compressed incremental aggregated gradient ([K18]; methods.md §3).

    The server keeps ĝ_i for every client and S = Σ_i ĝ_i. Round t + 1: one client i_t
    (``order=cyclic``: i_t = t mod n; ``order=random``: uniform, keyed by (seed, "order", t + 1))
    sends ĝ_{i_t} ← Q(∇f_{i_t}(x^t)); S ← S − old + new; x^{t+1} = x^t − γ S/n.
    Initial table (``init``): ``compressed`` Q(∇f_i(x⁰)) (default), ``full`` ∇f_i(x⁰), ``zero``.
    With the identity compressor this is the classic IAG. Entries are at most n − 1 rounds stale
    under the cyclic order.

    ``order=arrival`` is the order of an asynchronous execution (:mod:`.asynchronous`: the
    parameter server, or the replay of its log): the client asked is the active one, and its
    message is computed at the stale model it was sent. There the server keeps the table
    (:meth:`async_receive`: the reduction value of Q_i is Q_i − ĝ_i, then ĝ_i ← Q_i).
    """

    requires = "unbiased"
    async_memory = True
    incremental = True

    def __init__(self, order: Order = "cyclic", init: Init = "compressed") -> None:
        if order not in ("cyclic", "random", "arrival"):
            raise ValueError(f"iag: order must be cyclic, random or arrival, got {order!r}")
        if init not in ("full", "compressed", "zero"):
            raise ValueError(f"iag: init must be full, compressed or zero, got {init!r}")
        self.order = order
        self.init = init

    def default_spec(self) -> str:
        return f"iag[order={self.order},init={self.init}]"

    def theory_formula(self) -> str:
        return (
            "delayed DCGD rule with τ = n − 1: min{DCGD rule, 0.99·delayed rule} (cyclic order "
            "only; [K18], (?))"
        )

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        if self.order == "random":
            raise ValueError(
                "iag[order=random] has no theory step size: its delays are unbounded (the "
                "[K18] rule needs a maximal delay τ); use order=cyclic (τ = n − 1) or a number"
            )
        if self.order == "arrival":
            raise ValueError(
                "iag[order=arrival]: the delays are those of the asynchronous run; its theory "
                "step comes from the staleness bound (tau_max) of the run"
            )
        return delayed_theory(cfg, cfg.n - 1)

    def active_client(self, cfg: Config, r: int) -> int:
        """i_t for the step producing round ``r`` (t = r − 1); cyclic and random orders."""
        if self.order == "cyclic":
            return (r - 1) % cfg.n
        zero = torch.zeros(1, dtype=torch.int64)
        return int(_randint(cfg, "order", zero, r, cfg.n)[0])

    def _active(self, cfg: Config, ids: torch.Tensor, r: int) -> torch.Tensor:
        if self.order != "arrival":
            return ids == self.active_client(cfg, r)
        if ids.numel() != 1:
            raise ValueError(
                "iag[order=arrival] updates the one arriving client per round: it runs in an "
                "asynchronous execution (shrinkgrad ps, or asynchronous[trace=RUN_DIR](iag)); in "
                "rounds use order=cyclic or random"
            )
        return torch.ones_like(ids, dtype=torch.bool)

    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[IAGClients, Message]:
        m = ids.numel()
        if self.init == "zero":
            table = torch.zeros(m, cfg.d, dtype=cfg.dtype, device=cfg.device)
            return IAGClients(ids, table), Message(None, None, cfg.no_traffic(m))
        grads = oracle.grads(x0, ids)
        if self.init == "full":
            return IAGClients(ids, grads), cfg.message(grads, ids, cfg.dense_traffic(m))
        q = cfg.compress(grads, ids, 0)
        return IAGClients(ids, q), cfg.message(q, ids, cfg.compressed_traffic(q))

    def init_server(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> IAGServer:
        return IAGServer(x0, torch.zeros_like(x0) if aggregate is None else aggregate)

    def client_step(
        self, cfg: Config, server: IAGServer, clients: IAGClients, oracle: GradientOracle, r: int
    ) -> tuple[IAGClients, Message]:
        ids = clients.ids
        active = self._active(cfg, ids, r)
        values = torch.zeros_like(clients.table)
        if not bool(active.any()):  # the active client is in another group
            return clients, cfg.message(values, ids, cfg.no_traffic(ids.numel()))
        sel = ids[active]
        q = cfg.compress(oracle.grads(server.x, sel), sel, r)
        table = clients.table.clone()
        values[active] = q - table[active]
        table[active] = q
        full_q = torch.zeros_like(table)
        full_q[active] = q
        return IAGClients(ids, table), cfg.message(
            values, ids, cfg.compressed_traffic(full_q, active)
        )

    def server_post(
        self, cfg: Config, server: IAGServer, aggregate: torch.Tensor | None, r: int
    ) -> IAGServer:
        assert aggregate is not None
        s = server.s + aggregate
        return IAGServer(server.x - cfg.stepsize * s, s)

    # -- asynchronous: the server keeps the table ([K18]'s parameter server) --------------------
    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime == "ps":
            return None  # every order: the server takes the arrival order (async_form)
        return super().unsupported(runtime)

    def async_form(self) -> IAG:
        return self if self.order == "arrival" else IAG(order="arrival", init=self.init)

    def async_receive(
        self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor, sent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Q_i − ĝ_i (the change of the table's sum), then ĝ_i ← Q_i."""
        assert memory is not None
        return sent - memory[ids], memory.index_copy(0, ids, sent)

    def async_clients(
        self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor
    ) -> IAGClients:
        assert memory is not None
        return IAGClients(ids, memory[ids].clone())
