"""EF21 and its variants: EF21-W, EF21-SGD, EF21-W-SGD, EF21-PP, EF21-W-PP.

One implementation (:class:`EF21`) with three orthogonal options, registered under the papers'
names:

========================  =====================================================================
name                      algorithm
========================  =====================================================================
``ef21``                  [EF21] Alg. 1 = [EFR] Alg. 1
``ef21_w``                [EFR] Alg. 2 (weights w_i = L_i / Σ_j L_j)
``ef21_sgd[b=...]``       [BW] Alg. 2: minibatch gradient estimators of size b_i
``ef21_w_sgd[b=...]``     [EFR] §3.1
``ef21_pp[p=...]``        [BW] Alg. 4: client i takes part with probability p_i
``ef21_w_pp[p=...]``      [EFR] §3.2
========================  =====================================================================

Round t + 1 (weighted: w_i = L_i/Σ L_j, s_i = 1/(n w_i); unweighted: w_i = 1/n, s_i = 1):

1. server: x^{t+1} = x^t − γ g^t (broadcast);
2. client i (if it takes part): c_i = C_i^{t+1}(s_i ∇̂f_i(x^{t+1}) − g_i); g_i ← g_i + c_i;
   sends c_i;
3. server: g^{t+1} = g^t + Σ_i w_i c_i (over the clients that took part).

The invariant g = Σ_i w_i g_i holds at every round (EF21: g = (1/n) Σ g_i).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch

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
    UnknownConstantError,
)
from .rules import SparseMessage, add_message, ef21_update
from .stepsize import StepSize, parse_stepsize, theory_function

__all__ = ["EF21", "EF21Clients", "EF21Server"]

Rule = Literal["original", "reloaded", "rare_features"]


class EF21Server(NamedTuple):
    """Server state: x^t and the aggregate g^t = Σ_i w_i g_i^t."""

    x: torch.Tensor
    g: torch.Tensor


class EF21Clients(NamedTuple):
    """Client state: the estimators g_i^t of the group, (m, d), and the state of the
    compressor (PowerSGD's previous Q of every client, (m, n, r); an empty (m, 0) tensor for
    stateless compressors; None only in states built by hand)."""

    ids: torch.Tensor
    g: torch.Tensor
    compressor_state: torch.Tensor | None = None


def _per_client(value: float | Sequence[float] | torch.Tensor, n: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float64).reshape(-1).cpu()
    if t.numel() == 1:
        t = t.expand(n).clone()
    if t.numel() != n:
        raise ValueError(f"{what}: give one value or one per client (n={n}), got {t.numel()}")
    return t


def _fmt(t: torch.Tensor) -> str:
    """A parameter value for a name: the number, or ``per_client`` for a vector."""
    if t.numel() > 1 and not bool((t == t[0]).all()):
        return "per_client"
    v = t.reshape(-1)[0].item()
    return repr(v) if isinstance(v, float) else str(v)


def check_batch_fits(name: str, batch: int | torch.Tensor | None, problem: ProblemLike) -> None:
    """Refuse, when the method is bound, a minibatch size larger than a client's number of
    samples m_i (``problem.client_sizes``; skipped for problems without samples and for bare
    :class:`Constants`): otherwise the run would fail at its first minibatch round, and the
    EF21-SGD theory step would blame a missing variance bound instead."""
    sizes = getattr(problem, "client_sizes", None)
    if batch is None or sizes is None:
        return
    m = torch.as_tensor(sizes).reshape(-1).to(torch.int64).cpu()
    b = torch.as_tensor(batch).reshape(-1).to(torch.int64).cpu()
    if b.numel() == 1:
        b = b.expand(m.numel())
    if b.numel() != m.numel():
        return  # check_problem says so
    bad = torch.nonzero(b > m).reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"{name}: minibatch size b = {int(b[i])} is larger than client {i}'s m_i = "
            f"{int(m[i])} samples (the smallest client holds {int(m.min())}); use b <= "
            f"{int(m.min())} or fewer clients"
        )


def _positive_L_i(name: str, L_i: torch.Tensor) -> torch.Tensor:
    """``L_i`` (flat), or a ValueError naming the first client whose L_i is 0: EF21-W weighs
    client i by w_i = L_i / Σ L_j and has it send ∇f_i/(n w_i) ([EFR] Alg. 2), undefined at
    w_i = 0 (the unweighted methods take such a client, whose f_i is constant)."""
    t = L_i.reshape(-1)
    zero = torch.nonzero(t <= 0).reshape(-1)
    if zero.numel():
        raise ValueError(
            f"{name} weighs client i by w_i = L_i / Σ L_j and has it send ∇f_i/(n w_i) ([EFR] "
            f"Alg. 2), which is undefined for client {int(zero[0])} (L_i = 0: its f_i is "
            f"constant, e.g. all its data rows are zero; {zero.numel()} such client(s)); drop "
            "those clients from the split, or use ef21[rule=reloaded] (the same L_AM step, "
            "unweighted)"
        )
    return t


class EF21(Method[EF21Server, EF21Clients]):
    """EF21 with optional weights (EF21-W), minibatches (-SGD) and partial participation (-PP).

    Parameters
    ----------
    weighted:
        EF21-W ([EFR] Alg. 2): weights w_i = L_i / Σ_j L_j, clients compress ∇f_i/(n w_i) − g_i.
    p:
        participation probability (one for all, or one per client); 1 is full participation.
        Non-participants compute and send nothing and keep g_i ([BW] Alg. 4). Draws are keyed
        by (seed, "participation", i, round).
    batch:
        minibatch size b_i (one for all, or one per client) of the gradient estimators
        (problem's ``client_stoch_grads``, sampling keyed by (seed, "minibatch", i, round));
        ``None`` uses exact gradients.
    init:
        g_i⁰ = ∇f_i(x⁰) (``full``, scaled by s_i for EF21-W), C(∇f_i(x⁰)) (``compressed``) or 0
        (``zero``). Every client takes part in the initialisation; with minibatches it uses
        exact gradients.
    rule:
        theory step size of plain EF21: ``original`` 1/(L + L_QM ξ(α)) ([EF21] Thm 1),
        ``reloaded`` 1/(L + L_AM ξ(α)) ([EFR] Thm 3), or ``rare_features``
        1/(L + L_+ √(c/n) ξ(α)) ([RF]) with c (the most clients sharing a feature) and L_+
        computed from the problem's sparsity pattern (:func:`shrinkgrad.problems.rare_features`;
        a linear-model problem with data). EF21-W always uses the L_AM rule.
    pl:
        use the PL-case rule (needs the problem's μ).
    sigma2:
        bound σ² on the variance of the minibatch estimators, for the EF21-SGD theory rule.
        ``None`` (default) takes it from the problem's ``minibatch_variance_bound(b)``
        (σ² = (1/n) Σ σ_i² for EF21-SGD, σ_w² = (1/n) Σ (L_AM/L_i) σ_i² for EF21-W-SGD); 0 gives
        the deterministic EF21 step, which the authors' code uses.
    """

    requires = "contractive"
    #: the client step hands C(p) to ``rules.ef21_update`` and its Message only, the server adds
    #: the aggregate to g: a runtime may pass SparseMessages (the DDP hook's sparse path)
    sparse_messages = True
    carries_compressor_state = True

    def __init__(
        self,
        *,
        weighted: bool = False,
        p: float | Sequence[float] | torch.Tensor = 1.0,
        batch: int | Sequence[int] | torch.Tensor | None = None,
        init: Init = "full",
        rule: Rule = "original",
        pl: bool = False,
        sigma2: float | None = None,
    ) -> None:
        if init not in ("full", "compressed", "zero"):
            raise ValueError(f"init must be full, compressed or zero, got {init!r}")
        if rule not in ("original", "reloaded", "rare_features"):
            raise ValueError(f"rule must be original, reloaded or rare_features, got {rule!r}")
        p_t = torch.as_tensor(p, dtype=torch.float64).reshape(-1).cpu()
        if p_t.numel() == 0 or not bool(((p_t > 0) & (p_t <= 1)).all()):
            raise ValueError(
                "participation probability p must be in (0, 1] (1 = everybody every round), "
                f"got {p}"
            )
        b_t = None
        if batch is not None:
            b_t = torch.as_tensor(batch).reshape(-1).cpu()
            if b_t.is_floating_point() or b_t.numel() == 0 or bool((b_t < 1).any()):
                raise ValueError(f"minibatch size b must be a positive integer, got {batch}")
            b_t = b_t.to(torch.int64)
        if sigma2 is not None and not (math.isfinite(sigma2) and sigma2 >= 0):
            raise ValueError(f"sigma2 must be a finite number >= 0, got {sigma2}")
        if rule != "original" and (weighted or b_t is not None or bool((p_t < 1).any())):
            raise ValueError(
                f"rule={rule} applies to plain ef21 only (EF21-W always uses the L_AM rule; the "
                "SGD and PP variants have their own rules)"
            )
        if rule == "rare_features" and pl:
            raise ValueError("rule=rare_features has no PL-case form ([RF]); drop pl=true")
        self.weighted = weighted
        self.p = p_t
        self.batch = b_t
        self.init = init
        self.rule = rule
        self.pl = pl
        self.sigma2 = None if sigma2 is None else float(sigma2)
        #: σ² read from the problem at bind time (a bound copy of the method carries it)
        self._sigma2_problem: float | None = None
        #: why the problem gives no σ² (its minibatch_variance_bound's refusal), if it said
        self._sigma2_why = "no minibatch_variance_bound"
        #: (c, L_+) of the rare-features rule, read from the problem's data at bind time
        self._rare: tuple[int, float] | None = None

    @property
    def samples_minibatches(self) -> bool:
        return self.batch is not None

    @property
    def partial(self) -> bool:
        """Some client takes part with probability < 1 (asked every round: kept per p)."""
        memo = self.__dict__.get("_partial_of")
        if memo is None or memo[0] is not self.p:
            memo = (self.p, bool((self.p < 1).any()))
            self.__dict__["_partial_of"] = memo
        return bool(memo[1])

    @property
    def compresses_gradient_first(self) -> bool:
        """Exact gradients, unweighted, everybody every round: the client step's first use of
        ∇f_i is C(∇f_i − g_i) (``rules.ef21_update``'s ``difference``); EF21-W scales ∇f_i
        first, a minibatch or partial round reads it otherwise."""
        return not self.weighted and self.batch is None and not self.partial

    @property
    def accumulates_aggregates(self) -> bool:
        """g^{t+1} = g^t + Σ_i w_i c_i ([EF21] Alg. 1 step 3): g integrates the aggregates."""
        return True

    @property
    def identity_is_gd(self) -> bool:
        """Exact gradients, everybody every round and g_i⁰ = ∇f_i(x⁰) (also C(∇f_i) with C = id)."""
        return self.batch is None and not self.partial and self.init != "zero"

    def default_spec(self) -> str:
        name = "ef21" + ("_w" if self.weighted else "")
        params: list[str] = []
        if self.batch is not None:
            name += "_sgd"
            params.append(f"b={_fmt(self.batch)}")
        if self.partial:
            name += "_pp"
            params.append(f"p={_fmt(self.p)}")
        if self.init != "full":
            params.append(f"init={self.init}")
        if self.rule != "original":
            params.append(f"rule={self.rule}")
        if self.pl:
            params.append("pl=true")
        if self.sigma2 is not None:
            params.append(f"sigma2={self.sigma2!r}")
        return name + (f"[{','.join(params)}]" if params else "")

    # -- configuration -------------------------------------------------------------------------
    def for_problem(
        self, problem: ProblemLike, stepsize: float | str | StepSize
    ) -> Method[EF21Server, EF21Clients]:
        """The theory step of EF21-SGD also reads σ² from the problem (:meth:`_variance_bound`),
        that of ``rule=rare_features`` c and L_+ from its data (:meth:`_rare_constants`)."""
        check_batch_fits(self.name, self.batch, problem)
        needs_sigma2 = self.batch is not None and self.sigma2 is None
        needs_rare = self.rule == "rare_features"
        if not (needs_sigma2 or needs_rare) or not parse_stepsize(stepsize).theory:
            return self
        method = copy.copy(self)
        if needs_sigma2:
            method._sigma2_problem, method._sigma2_why = self._variance_bound(problem)
        if needs_rare:
            method._rare = self._rare_constants(problem)
        return method

    def _rare_constants(self, problem: ProblemLike) -> tuple[int, float]:
        """(c, L_+) of [RF] from the problem's sparsity pattern (:func:`rare_features`)."""
        from ..problems.linear import LinearModelProblem
        from ..problems.rare import rare_features

        if isinstance(problem, Constants):
            raise ValueError(
                f"{self.name}: the rare-features rule reads c and L_+ from the problem's data; "
                "bind the method to the problem itself, not to its Constants"
            )
        if not isinstance(problem, LinearModelProblem):
            raise ValueError(
                f"{self.name} computes c (the most clients sharing a feature) and L_+ from the "
                f"problem's data, and {type(problem).__name__} has no data matrix; use a "
                "linear-model problem (logistic_regression, least_squares), rule=original, or a "
                "numeric stepsize"
            )
        rf = rare_features(problem)
        return rf.c, rf.L_plus

    def _variance_bound(self, problem: ProblemLike) -> tuple[float | None, str]:
        """(σ² (EF21-SGD) or σ_w² (EF21-W-SGD) from ``problem.minibatch_variance_bound(b)``,
        or None with the reason the problem gives none)."""
        bound = getattr(problem, "minibatch_variance_bound", None)
        if bound is None or self.batch is None:
            return None, "no minibatch_variance_bound"
        b = self.batch if self.batch.numel() > 1 else int(self.batch[0])
        try:
            s2 = torch.as_tensor(bound(b), dtype=torch.float64).reshape(-1)
        except ValueError as e:  # e.g. the squared loss has no uniform bound: say so
            return None, str(e)
        if not self.weighted:
            return float(s2.mean()), ""
        L_i = _positive_L_i(self.name, torch.as_tensor(problem.L_i, dtype=torch.float64))
        return float((L_i.mean() / L_i * s2).mean()), ""

    def check_problem(self, consts: Constants) -> None:
        for what, t in (
            ("participation probabilities p", self.p),
            ("minibatch sizes b", self.batch),
        ):
            if t is not None and t.numel() not in (1, consts.n):
                raise ValueError(
                    f"{self.name}: {what}: give one value or one per client (n={consts.n}), "
                    f"got {t.numel()}"
                )

    def client_weights(self, consts: Constants) -> torch.Tensor:
        if not self.weighted:
            return super().client_weights(consts)
        if consts.L_i is None:
            raise UnknownConstantError(
                f"{self.name} weighs the clients by their smoothness constants (w_i = L_i / Σ L_j, "
                "[EFR] Alg. 2), which this problem does not know; estimate them "
                "(shrinkgrad.problems.estimate_smoothness) or use ef21"
            )
        w: torch.Tensor = theory_function("ef21w_weights")(_positive_L_i(self.name, consts.L_i))
        return w.to(torch.float64)

    def theory_formula(self) -> str:
        if self.rule == "rare_features":
            return "1/(L + L_+ √(c/n) ξ(α)) ([RF]; c, L_+ from the data's sparsity pattern)"
        am = self.weighted or self.rule == "reloaded"
        Lm = "L_AM" if am else "L_QM"
        if self.pl:
            return f"min{{1/(L + {Lm}·√(2β/θ)), θ/(2μ)}} (PL)"
        if self.partial:
            return f"1/(L + √(B/θ_p)), B ∝ {Lm}² ([BW] Thm 7{', [EFR] §3.2' if am else ''})"
        if self.batch is not None:
            sgd = f"stepsize_ef21{'w' if am else ''}_sgd"
            return f"1/(L + {Lm} ξ(α_ν)) ({sgd}, σ² from the problem or sigma2)"
        src = "[EFR] Thms 2, 3" if am else "[EF21] Thm 1"
        return f"1/(L + {Lm} ξ(α)) ({src})"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        c = cfg.constants
        L = c.smoothness()[0]
        am = self.weighted or self.rule == "reloaded"  # the L_AM rules of [EFR]
        Lm = c.L_AM if am else c.L_QM
        w = "w" if am else ""
        if self.batch is not None and self.partial:
            raise ValueError(
                f"{self.name}: no theory step size combines minibatches and partial "
                "participation; pass a number"
            )
        if self.rule == "rare_features":
            if self._rare is None:
                raise ValueError(
                    f"{self.name}: the rare-features rule reads c and L_+ from the problem's "
                    "data; bind the method to the problem itself, not to its Constants"
                )
            rare_c, L_plus = self._rare
            gamma = theory_function("stepsize_rare_features")(L, L_plus, rare_c, c.n, cfg.alpha)
            return float(gamma), f"stepsize_rare_features[c={rare_c},L_plus={L_plus:.6g}]"
        if self.pl:
            if self.batch is not None or self.partial:
                raise ValueError(f"{self.name}: the PL rule covers full-gradient EF21/EF21-W only")
            if c.mu is None:
                raise ValueError(
                    f"{self.name} with pl=true needs the PL constant mu of the problem, which is "
                    "not known; drop pl=true or use a problem with mu"
                )
            name = f"stepsize_ef21{w}_pl"
            return float(theory_function(name)(L, Lm, cfg.alpha, c.mu)), name
        if self.partial:
            name = f"stepsize_ef21{w}_pp"
            p = _per_client(self.p, c.n, "p")
            return float(theory_function(name)(L, Lm, cfg.alpha, p)), name
        if self.batch is not None:
            name = f"stepsize_ef21{w}_sgd"
            sigma2 = self.sigma2 if self.sigma2 is not None else self._sigma2_problem
            if sigma2 is None:
                raise ValueError(
                    f"{self.name}: the EF21-SGD theory step needs a bound sigma2 on the minibatch "
                    f"variance, and the problem gives none ({self._sigma2_why}); pass "
                    f"sigma2=... (sigma2=0 gives the deterministic EF21 step) or a number"
                )
            gamma = theory_function(name)(L, Lm, cfg.alpha, sigma2=sigma2)
            return float(gamma), f"{name}[sigma2={sigma2:.4g}]"
        name = "stepsize_ef21_reloaded" if am else "stepsize_ef21"
        return float(theory_function(name)(L, Lm, cfg.alpha)), name

    # -- the parts ----------------------------------------------------------------------------
    def _scale(self, cfg: Config, ids: torch.Tensor) -> torch.Tensor | None:
        """s_i = 1/(n w_i) as a column (EF21-W), or None (EF21: s_i = 1)."""
        if not self.weighted:
            return None
        return (1.0 / (cfg.n * cfg.weights[ids])).unsqueeze(1)

    def _targets(
        self, cfg: Config, x: torch.Tensor, ids: torch.Tensor, oracle: GradientOracle, r: int
    ) -> torch.Tensor:
        """s_i ∇̂f_i(x) for the clients ``ids``: exact or minibatch gradients, scaled for EF21-W
        (in place when the runtime owns the state and the oracle's result is the caller's)."""
        if self.batch is None or r == 0:
            grads = oracle.grads(x, ids)
        else:
            b = self.batch.to(ids.device)
            b = b.expand(ids.numel()) if b.numel() == 1 else b[ids]
            keys = cfg.keys("minibatch", ids, r)
            grads = oracle.stoch_grads(x, ids, b, keys)
        scale = self._scale(cfg, ids)
        if scale is None:
            return grads
        if cfg.inplace and bool(getattr(oracle, "fresh", False)):
            return grads.mul_(scale)
        return grads * scale

    def init_clients(
        self, cfg: Config, x0: torch.Tensor, oracle: GradientOracle, ids: torch.Tensor
    ) -> tuple[EF21Clients, Message]:
        m = ids.numel()
        if self.init == "zero":
            g = torch.zeros(m, cfg.d, dtype=cfg.dtype, device=cfg.device)
            cs = cfg.compressor_state(g, ids)
            return EF21Clients(ids, g, cs), Message(None, None, cfg.no_traffic(m))
        target = self._targets(cfg, x0, ids, oracle, 0)
        cs = cfg.compressor_state(target, ids)
        if self.init == "full":  # g_i: the gradient as the server receives it (cfg.dense)
            g = cfg.dense(target)
            return EF21Clients(ids, g, cs), cfg.message(g, ids, cfg.dense_traffic(m))
        c, cs_new = cfg.compress_with_state(target, ids, 0, cs)
        return EF21Clients(ids, c, cs_new), cfg.message(c, ids, cfg.compressed_traffic(c))

    def init_server(
        self, cfg: Config, x0: torch.Tensor, aggregate: torch.Tensor | None
    ) -> EF21Server:
        g = torch.zeros_like(x0) if aggregate is None else aggregate
        return EF21Server(x0, g)

    def server_pre(self, cfg: Config, server: EF21Server, r: int) -> EF21Server:
        return EF21Server(server.x - cfg.stepsize * server.g, server.g)

    def participants(self, cfg: Config, ids: torch.Tensor, r: int) -> torch.Tensor | None:
        """Bool mask (m,) of the clients taking part in round ``r``; ``None`` when all do."""
        if not self.partial:
            return None
        u = cfg.keys("participation", ids, r).uniform(1, torch.float64)[:, 0]
        return u < self.p.to(u.device)[ids] if self.p.numel() > 1 else u < float(self.p[0])

    def client_step(
        self, cfg: Config, server: EF21Server, clients: EF21Clients, oracle: GradientOracle, r: int
    ) -> tuple[EF21Clients, Message]:
        ids, g, cs = clients.ids, clients.g, clients.compressor_state
        part = self.participants(cfg, ids, r)
        if part is None or bool(part.all()):
            target = self._targets(cfg, server.x, ids, oracle, r)
            # target − g into target itself when no one else holds it (an oracle promising fresh
            # results, or the scaled copy of EF21-W): one (n, d) buffer less per round
            owned = self.weighted or bool(getattr(oracle, "fresh", False))
            comp = cfg.compressing(ids, r, cs)
            c, g_new = ef21_update(
                g,
                target,
                comp,
                inplace=cfg.inplace,
                scratch=target if owned else cfg.scratch(target),
                sparse=True,  # c only goes to the Message (the server adds it to g)
            )
            return EF21Clients(ids, g_new, comp.state), cfg.message(
                c, ids, cfg.compressed_traffic(c)
            )
        c = torch.zeros_like(g)
        if bool(part.any()):
            sel = ids[part]
            target = self._targets(cfg, server.x, sel, oracle, r)
            comp = cfg.compressing(sel, r, None if cs is None else cs[part])
            c[part] = ef21_update(g[part], target, comp)[0]
            if cs is not None and cs.numel():  # participants' state moves on, the others' stays
                assert comp.state is not None
                cs = cs.clone()
                cs[part] = comp.state
        return EF21Clients(ids, g + c, cs), cfg.message(c, ids, cfg.compressed_traffic(c, part))

    def server_post(
        self, cfg: Config, server: EF21Server, aggregate: torch.Tensor | None, r: int
    ) -> EF21Server:
        """[EF21] Alg. 1 step 3: g^{t+1} = g^t + (1/n) Σ_i c_i ([EFR] Alg. 2: Σ_i w_i c_i), the
        aggregate's pairs added in place where the runtime owns g (``Config.inplace``), and
        the runtime's mirror of g (``Config.mirror``: the DDP hook's bfloat16 copy of the
        direction D = g) written in the same pass where it asks for one."""
        assert aggregate is not None
        g = add_message(server.g, aggregate, inplace=cfg.inplace, mirror=cfg.mirror(server.g))
        return EF21Server(server.x, g)

    def server_direction(
        self, cfg: Config, server: EF21Server, aggregate: torch.Tensor | None, r: int
    ) -> tuple[EF21Server, torch.Tensor]:
        """g^r = g^{r−1} + Σ w_i c_i (:meth:`server_post`); the next ``server_pre`` moves x by
        −γ g^r, so the direction is g^r itself (no arithmetic on x)."""
        post = self.server_post(cfg, server, aggregate, r)
        return post, post.g

    def direction_changes(self, cfg: Config, aggregate: Any) -> torch.Tensor | None:
        """D = g^r = g^{r−1} + Σ_i w_i c_i (:meth:`server_post`): with a sparse aggregate only
        its entries change (O(n k) of them for Top-k/rand-k); a dense one may change any."""
        return aggregate.indices if isinstance(aggregate, SparseMessage) else None

    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime == "ps":
            if self.partial:
                return (
                    f"{self.name} draws which clients take part in a round; on a parameter "
                    "server every arrival takes part (use the method without _pp)"
                )
            return None
        if runtime != "hook":
            return super().unsupported(runtime)
        if self.batch is not None:
            return (
                f"{self.name} samples minibatches through the problem's oracle; in a DDP hook the "
                "gradient is the one backward computed (use ef21 or ef21_w: their gradient is "
                "then the training loop's minibatch gradient)"
            )
        if self.partial:
            return (
                f"{self.name}: partial participation is not implemented in the DDP hook (every "
                "rank takes part in every collective)"
            )
        return None

    # -- asynchronous: c_i computed at a stale x; the server mirrors g_i (no theory) ------------
    async_memory = True

    def async_receive(
        self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor, sent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """c_i itself (g ← g + w_i c_i); the server's copy of g_i follows: g_i ← g_i + c_i."""
        assert memory is not None
        return sent, memory.index_add(0, ids, sent)

    def async_clients(
        self, cfg: Config, memory: torch.Tensor | None, ids: torch.Tensor
    ) -> EF21Clients:
        assert memory is not None
        g = memory[ids].clone()
        # a restarted worker's compressor state starts afresh (PowerSGD: its keyed first Q)
        return EF21Clients(ids, g, cfg.compressor_state(g, ids))


# --------------------------------------------------------------------------------------------
# registered names
# --------------------------------------------------------------------------------------------
@METHODS.register("ef21")
def ef21(init: Init = "full", rule: Rule = "original", pl: bool = False) -> EF21:
    """EF21 ([EF21] Alg. 1; [EFR] Alg. 1): g_i ← g_i + C(∇f_i(x^{t+1}) − g_i); contractive C."""
    return EF21(init=init, rule=rule, pl=pl)


@METHODS.register("ef21_w")
def ef21_w(init: Init = "full", pl: bool = False) -> EF21:
    """EF21-W ([EFR] Alg. 2): weights w_i = L_i/Σ L_j, step 1/(L + L_AM ξ(α)); contractive C."""
    return EF21(weighted=True, init=init, pl=pl)


@METHODS.register("ef21_sgd")
def ef21_sgd(b: int = 1, init: Init = "full", sigma2: float | None = None) -> EF21:
    """EF21-SGD ([BW] Alg. 2): EF21 with minibatch gradient estimators of size b."""
    return EF21(batch=b, init=init, sigma2=sigma2)


@METHODS.register("ef21_w_sgd")
def ef21_w_sgd(b: int = 1, init: Init = "full", sigma2: float | None = None) -> EF21:
    """EF21-W-SGD ([EFR] §3.1): EF21-W with minibatch gradient estimators of size b."""
    return EF21(weighted=True, batch=b, init=init, sigma2=sigma2)


@METHODS.register("ef21_pp")
def ef21_pp(p: float = 0.5, init: Init = "full") -> EF21:
    """EF21-PP ([BW] Alg. 4): each client takes part with probability p; others keep g_i."""
    return EF21(p=p, init=init)


@METHODS.register("ef21_w_pp")
def ef21_w_pp(p: float = 0.5, init: Init = "full") -> EF21:
    """EF21-W-PP ([EFR] §3.2): EF21-W where each client takes part with probability p."""
    return EF21(weighted=True, p=p, init=init)
