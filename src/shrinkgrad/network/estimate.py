"""Predicted wall-clock time to ε: the theory's rounds to ε times the modelled cost of a round.

For a problem, a method with its compressor and step size, and a network:

1. **rounds** T to min_{t<T} E‖∇f(x^t)‖² ≤ ε from the theorem that covers the method
   (:data:`ROUNDS_THEOREMS`, a registry: method name → citation and count):

   * GD, EF21, EF21-W, EF21-PP, EF21-W-PP: T = ⌈2Φ⁰/(γε)⌉, Φ⁰ = f(x⁰) − f^inf + (γ/(2θ(α))) G⁰
     ([EF21] Thm 1, [EFR] Thms 2–3, [BW] Thm 7; :func:`shrinkgrad.theory.rounds_ef21`),
     G⁰ = Σ_i v_i‖g_i⁰ − ∇f_i(x⁰)/(n w_i)‖² measured at the initialisation (0 for
     ``init="full"``) with the weights of the rule's Lyapunov function (v_i = w_i; for
     ``ef21[rule=reloaded]`` v_i = L_AM/(n L_i), [EFR] Thm 3's G_w: :func:`_lyapunov_weights`),
     and its θ (θ(α), or θ_p of [BW] Thm 7 under partial participation:
     :func:`lyapunov_alpha`), at a step not above the method's rule;
   * DCGD with an unbiased ω-compressor ([K18]): the smallest T with
     2(1 + Lγ²ωL_max/n)^T δ⁰/(γT) ≤ ε, δ⁰ = f(x⁰) − 0, for γ ≤ 1/L (Khaled & Richtárik, *Better
     theory for SGD in the nonconvex world*, TMLR 2023, Thm 2 with A = ωL_max/n, B = 1, C = 0;
     :func:`shrinkgrad.theory.rounds_dcgd`);

   any other method is refused in one line naming these (or T is given by the caller);
2. **traffic** of a round: the method's own messages, from a few simulated rounds (what each
   client sends and receives: :class:`shrinkgrad.methods.Traffic`, the compressor's honest
   ``bits``; ⌈bits/8⌉ bytes per message, as the wire sends them: :func:`~.traffic.wire_bytes`),
   so partial participation and random message sizes are in it;
3. **compute** per round: the network spec's ``compute`` (given), or the caller's, or measured —
   the wall time of a simulated round divided by n (one client's share of the vectorised step);
4. **cost** of each simulated round on the network (:meth:`~.topology.Network.round`: the
   slowest active client on a star; the all-reduce or padded all-gather on a ring), averaged.

The prediction is ``init + T × mean round``: a bound-based estimate (the theorem's T is an upper
bound on the rounds needed, often loose by orders of magnitude; ``shrinkgrad plot --x time``
of a real run shows the actual curve).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..registry import parse_spec
from .clock import overflow_message
from .topology import Network, RoundCost, make_network
from .traffic import round_summable, stage_shares, summable, wire_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROUNDS_THEOREMS",
    "Estimate",
    "MeasuredRounds",
    "RoundsTheorem",
    "estimate",
    "measure_rounds",
    "rounds_theorem",
]

#: ``rounds(bound, problem, eps, G0) -> T``: a theorem's rounds to min_{t<T} E‖∇f(x^t)‖² ≤ ε
RoundsFn = Callable[[Any, Any, float, float], int]


@dataclasses.dataclass(frozen=True)
class RoundsTheorem:
    """A theorem that bounds a method's rounds to ε: its citation and its count."""

    source: str
    rounds: RoundsFn


def _gap_to_inf(problem: Any) -> float:
    """f(x⁰) − f^inf, with f^inf the problem's certified lower bound on f."""
    f_low = getattr(problem, "f_star", None)
    if f_low is None:
        f_low = getattr(problem, "f_lower", None)
    if f_low is None:
        raise ValueError(
            f"{problem.name}: no certified lower bound on f (f_star or f_lower), so f(x⁰) − f^inf "
            "is unknown; give the number of rounds (--rounds N, rounds=N)"
        )
    return max(0.0, float(problem.loss(problem.x0())) - float(f_low))


def _ef21_rounds(bound: Any, problem: Any, eps: float, G0: float) -> int:
    """T = ⌈2Φ⁰/(γε)⌉, Φ⁰ = f(x⁰) − f^inf + γG⁰/(2θ) ([EF21] Thm 1 and its relatives), at a
    step not above the method's own rule, with the θ of the rule's Lyapunov function
    (:func:`lyapunov_alpha`: θ(α), or θ_p under partial participation)."""
    from ..theory import rounds_ef21

    gamma_max, rule = bound.method.theory_stepsize(bound.cfg)
    if bound.cfg.stepsize > gamma_max * (1 + 1e-12):
        raise ValueError(
            f"the step size γ = {bound.cfg.stepsize:.4g} exceeds the theory step "
            f"{gamma_max:.4g} ({rule}): the theorem does not bound its rounds; use a step "
            "<= theory, or give the number of rounds (--rounds N, rounds=N)"
        )
    alpha = lyapunov_alpha(bound)
    return rounds_ef21(bound.cfg.stepsize, _gap_to_inf(problem), eps, alpha=alpha, G0=G0)


def lyapunov_alpha(bound: Any) -> float:
    """The α' whose θ(α') = 1 − √(1 − α') is the θ of the Lyapunov function Φ = δ + (γ/(2θ))G
    of the theorem behind the method's step rule.

    Full participation: α' = α, θ(α) ([EF21] Thm 1, [EFR] Thms 2–3). Partial participation
    (EF21-PP, EF21-W-PP: [BW] Thm 7, [EFR] §3.2): the bound is 2δ⁰/(γT) + G⁰/(θ_p T) with the
    θ_p = ρ p_min + θ p_max − ρ − (p_max − p_min) of the free s, ρ the rule uses
    (:func:`shrinkgrad.theory.stepsizes.pp_constants`), the minimisers of B/θ_p: for one
    common p, θ_p = θ(αp) (the rule is EF21's with α' = αp, methods.md §4, D), so α' = αp; for
    per-client p_i, θ_p at the numerical minimiser (:func:`_pp_theta`) and α' = 1 − (1 − θ_p)²,
    whose θ(α') is θ_p.
    """
    alpha = float(bound.cfg.alpha)
    method = bound.method
    if not getattr(method, "partial", False):
        return alpha
    p = [float(v) for v in method.p.reshape(-1).tolist()]
    p_min, p_max = min(p), max(p)
    if p_min == p_max:
        return alpha * p_min
    theta_p = _pp_theta(alpha, p_min, p_max)
    return 1.0 - (1.0 - theta_p) ** 2


def _pp_theta(alpha: float, p_min: float, p_max: float) -> float:
    """θ_p of [BW] Thm 7 at the (s, ρ) that minimise B/θ_p, the step rule of
    :func:`shrinkgrad.theory.stepsizes.stepsize_ef21_pp`
    (:func:`~shrinkgrad.theory.stepsizes.pp_best_parameters`), by
    :func:`~shrinkgrad.theory.stepsizes.pp_constants`."""
    from ..theory.stepsizes import pp_best_parameters, pp_constants

    ratio, s, rho = pp_best_parameters(alpha, p_min, p_max)
    if not math.isfinite(ratio):
        raise ValueError(
            f"no valid θ_p: α·p_max > p_max − p_min fails (α = {alpha:.4g}, p_min = {p_min:.4g}, "
            f"p_max = {p_max:.4g})"
        )
    return pp_constants(alpha, [p_min, p_max], s, rho)[0]


def _dcgd_rounds(bound: Any, problem: Any, eps: float, G0: float) -> int:
    """DCGD with an unbiased ω-compressor: the smallest T with 2(1 + Lγ²ωL_max/n)^T δ⁰/(γT) ≤ ε,
    δ⁰ = f(x⁰) − 0 (every f_i ≥ 0), for γ ≤ 1/L (:func:`shrinkgrad.theory.rounds_dcgd`;
    Khaled & Richtárik, TMLR 2023, Thm 2 with A = ωL_max/n, B = 1, C = 0)."""
    from ..theory import rounds_dcgd

    cfg = bound.cfg
    if cfg.omega is None:
        raise ValueError(
            f"{bound.method.name} with the contractive compressor {cfg.compressor.name} has no "
            "rounds-to-ε rate (DCGD's needs an unbiased compressor); give the number of rounds "
            "(--rounds N, rounds=N), or use ef21"
        )
    L, L_i = cfg.constants.smoothness()
    gamma = float(cfg.stepsize)
    if gamma * float(L) > 1 + 1e-12:
        raise ValueError(
            f"the step size γ = {gamma:.4g} exceeds 1/L = {1 / float(L):.4g}: the DCGD rate "
            "needs γ ≤ 1/L; use a smaller step, or give the number of rounds (--rounds N, rounds=N)"
        )
    gap = max(0.0, float(problem.loss(problem.x0())))  # f_low = 0: the losses are ≥ 0
    return rounds_dcgd(
        gamma,
        gap,
        eps,
        L=float(L),
        L_max=float(L_i.max()),
        omega=float(cfg.omega),
        n=cfg.n_draws,  # 1 for a shared-seed compressor: one draw for every client
    )


#: registered method name → the theorem bounding its rounds to min‖∇f‖² ≤ ε (deterministic
#: gradients; the SGD variants also need the noise floor's σ², not known here)
ROUNDS_THEOREMS: dict[str, RoundsTheorem] = {
    "gd": RoundsTheorem("[EF21] Thm 1 with α = 1 (GD)", _ef21_rounds),
    "ef21": RoundsTheorem("[EF21] Thm 1", _ef21_rounds),
    "ef21_w": RoundsTheorem("[EFR] Thm 2", _ef21_rounds),
    "ef21_pp": RoundsTheorem("[BW] Thm 7 (EF21-PP)", _ef21_rounds),
    "ef21_w_pp": RoundsTheorem("[EFR] §3.2 (EF21-W-PP)", _ef21_rounds),
    "dcgd": RoundsTheorem(
        "Khaled & Richtárik 2023 Thm 2 (DCGD [K18], unbiased ω: A = ωL_max/n)", _dcgd_rounds
    ),
}


def rounds_theorem(method: Any) -> RoundsTheorem:
    """The theorem covering ``method`` (a method or its spec), or a one-line ValueError naming
    the methods that have one."""
    from ..methods import make_method

    name = parse_spec(make_method(method).name).name
    found = ROUNDS_THEOREMS.get(name)
    if found is None:
        raise ValueError(
            f"no rounds-to-ε theorem for {name!r} in shrinkgrad.theory (there is one for "
            f"{', '.join(ROUNDS_THEOREMS)}); give the number of rounds (--rounds N, rounds=N)"
        )
    return found


@dataclasses.dataclass(frozen=True)
class MeasuredRounds:
    """What a few simulated rounds of a method showed: per-client traffic and compute."""

    #: per round: (bytes up per client, bytes down per client), as float lists: ⌈bits/8⌉ of
    #: each client's message (:func:`~.traffic.wire_bytes`)
    traffic: list[tuple[list[float], list[float]]]
    init_traffic: tuple[list[float], list[float]]
    #: measured compute time per client per round (median wall time of a round / n; the
    #: initialisation, whose first call may compile kernels, is charged the same)
    compute_s: float
    #: mean uplink bits per client per round, and of the initialisation
    bits_up: float
    init_bits_up: float
    G0: float
    #: whether the rounds' messages, and the initialisation's, can be all-reduced on a ring
    #: (:func:`~.traffic.round_summable`)
    summable: bool
    init_summable: bool
    #: the shares of a round's messages sent in successive exchanges (:func:`~.traffic.
    #: stage_shares`: PowerSGD's shared basis, P then Q; one exchange otherwise)
    stages: tuple[float, ...] = (1.0,)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A prediction of :func:`estimate` (seconds; see the module docstring)."""

    problem: str
    method: str
    compressor: str
    network: str
    n: int
    d: int
    eps: float
    stepsize: float
    stepsize_rule: str
    rounds: int
    rounds_source: str
    compute_source: str
    init: RoundCost
    per_round: RoundCost
    bits_up_per_round: float
    init_bits_up: float

    @property
    def time_s(self) -> float:
        """init + rounds × the mean round."""
        return self.init.total_s + self.rounds * self.per_round.total_s

    @property
    def bits_up(self) -> float:
        """Uplink bits per client to ε (initialisation included)."""
        return self.init_bits_up + self.rounds * self.bits_up_per_round

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("init", "per_round"):
            cost: RoundCost = getattr(self, key)
            out[key] = {
                "compute_s": cost.compute_s,
                "transfer_s": cost.transfer_s,
                "latency_s": cost.latency_s,
                "total_s": cost.total_s,
                "slowest_client": cost.client,
            }
        out["time_s"] = self.time_s
        out["bits_up"] = self.bits_up
        return out


def measure_rounds(bound: Any, problem: Any, rounds: int = 10) -> MeasuredRounds:
    """Run the initialisation and ``rounds`` rounds of ``bound`` (a bound method) on
    ``problem``, recording each round's per-client traffic and wall time."""
    import torch

    from ..methods.oracle import ProblemOracle
    from ..sim.engine import check_round_memory

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"the number of measured rounds must be an integer >= 1, got {rounds!r}")
    check_round_memory(problem, bound.method)
    oracle = ProblemOracle(problem)
    x0 = problem.x0()
    n = int(problem.n)
    state, tr = bound.init(x0, oracle)

    def per_client(t: Any) -> tuple[list[float], list[float]]:
        # ⌈bits/8⌉ per message: the bytes the wire sends (:func:`~.traffic.wire_bytes`)
        return wire_bytes(t.up).tolist(), wire_bytes(t.down).tolist()

    init_traffic = per_client(tr)
    init_bits = float(tr.up.mean())
    compressed = summable(bound.cfg.compressor)
    init_summable = round_summable(tr, compressed)
    G0 = 0.0
    g = getattr(state.clients, "g", None)
    if isinstance(g, torch.Tensor) and g.shape == (n, problem.d):
        w = bound.cfg.weights.to(torch.float64).reshape(-1, 1)
        target = oracle.grads(state.x, torch.arange(n)).to(torch.float64) / (n * w)
        gap = ((g.to(torch.float64) - target) ** 2).sum(1)
        coef = _lyapunov_weights(bound, n)
        G0 = float(torch.where(gap == 0, 0.0, coef * gap).sum())
    traffic, times, bits, sums = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state, tr = bound.step(state, oracle)
        times.append(time.perf_counter() - t0)
        traffic.append(per_client(tr))
        bits.append(float(tr.up.mean()))
        sums.append(round_summable(tr, compressed))
    times.sort()
    return MeasuredRounds(
        traffic=traffic,
        init_traffic=init_traffic,
        compute_s=times[len(times) // 2] / n,  # the median round
        bits_up=sum(bits) / len(bits),
        init_bits_up=init_bits,
        G0=G0,
        summable=all(sums),
        init_summable=init_summable,
        stages=stage_shares(bound.cfg.compressor, int(problem.d)),
    )


def _lyapunov_weights(bound: Any, n: int) -> torch.Tensor:
    """The weights v_i of G = Σ_i v_i‖g_i − ∇f_i/(n w_i)‖² in the Lyapunov function of the
    method's step rule: the method's weights w_i (1/n: [EF21] Thm 1's G; EF21-W's
    w_i = L_i/Σ_j L_j: [EFR] Thm 2's G_w), or, for ``ef21[rule=reloaded]`` (unweighted, the
    L_AM step), (1/n)(L_AM/L_i): G_w = (1/n) Σ_i (L_AM/L_i)‖g_i − ∇f_i‖² ([EFR] Thm 3;
    methods.md §4), inf for a client with L_i = 0 (whose f_i is constant: its gap is 0 and
    counts 0)."""
    import torch

    method, cfg = bound.method, bound.cfg
    if getattr(method, "rule", None) == "reloaded" and not getattr(method, "weighted", False):
        L_i = cfg.constants.smoothness()[1].to(torch.float64).reshape(-1).cpu()
        L_AM = float(L_i.mean())
        with torch.no_grad():
            return torch.where(L_i > 0, L_AM / (n * L_i), torch.full_like(L_i, math.inf))
    weights: torch.Tensor = cfg.weights.to(torch.float64).reshape(-1).cpu()
    return weights


def theory_rounds(bound: Any, problem: Any, eps: float, G0: float) -> tuple[int, str]:
    """T to min‖∇f‖² ≤ ε of the theorem covering ``bound``'s method, and the theorem's name."""
    theorem = rounds_theorem(bound.method)
    return theorem.rounds(bound, problem, eps, G0), theorem.source


def _mean(costs: Sequence[RoundCost]) -> RoundCost:
    """The average round; its client is the one that was slowest most often."""
    total = RoundCost.total(costs).scaled(1.0 / len(costs))
    clients = [c.client for c in costs if c.client is not None]
    most = max(set(clients), key=clients.count) if clients else None
    return dataclasses.replace(total, client=most)


def estimate(
    problem: Any,
    method: Any = "ef21",
    compressor: Any = "top_k[k=1]",
    network: str | Network = "star[up=10mbit]",
    *,
    eps: float = 1e-3,
    stepsize: float | str = "theory",
    compute: float | str | None = None,
    rounds: int | None = None,
    measure: int = 10,
    seed: int = 0,
    measured: MeasuredRounds | None = None,
) -> Estimate:
    """Predicted time to ε on ``network`` (see the module docstring).

    ``problem``/``method``/``compressor``/``network``: components or their specs; ``compute``:
    seconds per client per round (overrides the measurement; the network's own ``compute`` wins
    over both); ``rounds``: use this T instead of the theorem's; ``measure``: how many rounds
    to simulate for the traffic and compute; ``measured``: reuse an earlier
    :func:`measure_rounds` (several networks, one simulation).
    """
    from ..methods import make_method
    from ..problems import make_problem
    from ..sim.engine import check_round_memory
    from .units import parse_duration

    prob = make_problem(problem)
    meth = make_method(method)
    if rounds is None:
        rounds_theorem(meth)  # refuse a method without a theorem before binding or simulating
        from ..methods.base import Constants, UnknownConstantError

        if not Constants.of(prob).known:
            raise UnknownConstantError(
                f"the rounds-to-ε theorem of {meth.name} needs L and the L_i, which this "
                "problem does not know (a neural network's): give the number of rounds "
                "(rounds=N, --rounds N) to estimate their time, or estimate L first "
                "(shrinkgrad.problems.estimate_smoothness) and pass that problem"
            )
    if measured is None:
        check_round_memory(prob, meth)  # a d too large to simulate: refuse before binding
    bound = meth.bind(prob, compressor, stepsize, seed)
    net = make_network(network)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a number > 0, got {eps!r}")
    m = measured if measured is not None else measure_rounds(bound, prob, measure)
    if rounds is not None:
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
        T, source = rounds, "given"
    else:
        T, source = theory_rounds(bound, prob, float(eps), m.G0)
    if net.compute is not None:
        c, csource = None, f"given by the network ({net.compute})"
    elif compute is not None:
        c, csource = parse_duration(compute, "compute"), "given"
    else:
        c, csource = m.compute_s, "measured (median simulated round / n)"
    stages = m.stages if m.summable else (1.0,)
    costs = [
        net.round(up, down, compute=c, summable=m.summable, stages=stages) for up, down in m.traffic
    ]
    up0, down0 = m.init_traffic
    init = net.round(up0, down0, compute=c, summable=m.init_summable)
    for cost in (init, *costs):
        if not math.isfinite(cost.total_s):
            raise ValueError(overflow_message(cost.total_s, net.describe(int(prob.n))))
    return Estimate(
        problem=getattr(prob, "spec", "") or prob.name,
        method=meth.name,
        compressor=bound.cfg.compressor.name,
        network=net.name,
        n=int(prob.n),
        d=int(prob.d),
        eps=float(eps),
        stepsize=bound.cfg.stepsize,
        stepsize_rule=bound.cfg.stepsize_rule,
        rounds=T,
        rounds_source=source,
        compute_source=csource,
        init=init,
        per_round=_mean(costs),
        bits_up_per_round=m.bits_up,
        init_bits_up=m.init_bits_up,
    )
