"""Fixes of stop 35's network audit (the time model): each expectation is computed here by hand from
the α–β formulas of docs/network.md, the theorems of methods.md §4 and the problem's own data,
independently of the code under test.

1. PowerSGD's shared basis is two all-reduces (P, then Q), on a ring and on a star;
2. EF21-PP's rounds to ε use θ_p of [BW] Thm 7, not the compressor's θ(α);
3. ``ef21[rule=reloaded]`` measures G⁰ as [EFR] Thm 3's G_w;
4. absurd link values are refused, or blamed on the network;
5. the public cost functions check their inputs;
6. an absurd synthetic problem size is a one-line error;
7. unit spellings (MBPS, μs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shrinkgrad.compressors.lowrank import matrix_shape
from shrinkgrad.network import make_network
from shrinkgrad.network.collectives import point_to_point, ring_allgather, ring_allreduce
from shrinkgrad.network.estimate import estimate
from shrinkgrad.network.traffic import Collective, hook_collectives, ps_messages
from shrinkgrad.network.units import parse_bandwidth, parse_duration
from shrinkgrad.problems import make_problem
from shrinkgrad.sim import simulate

N, D, R = 6, 30, 2
PROBLEM = f"synthetic_least_squares[n_clients={N},d={D}]"
SHARED = f"power_sgd[rank={R},alpha=0.1,shared=true]"


def _per_round(network: str, compressor: str) -> np.ndarray:
    r = simulate(PROBLEM, "ef21", compressor, rounds=3, network=network, stepsize=1e-4)
    return np.diff(r.table["time_model_s"].to_numpy())  # rounds 1, 2, 3 (compressed)


# -- 1. PowerSGD's shared basis ------------------------------------------------------------------
def test_shared_power_sgd_on_a_ring_is_two_allreduces() -> None:
    B, alpha = 100e6, 20e-6
    net = "ring[bandwidth=100mbit,latency=20us,compute=0]"
    m, n = matrix_shape(D)
    P, Q = 4.0 * R * m, 4.0 * R * n  # float32 factors, bytes per rank
    p = N
    # two ring all-reduces one after the other: 2(p−1)/p·8(P+Q)/B + 2·2(p−1)α
    by_hand = 2 * (p - 1) / p * 8 * (P + Q) / B + 2 * 2 * (p - 1) * alpha
    hook = make_network(net).step(hook_collectives(SHARED, [D], min_numel=1), p).total_s
    assert hook == pytest.approx(by_hand, rel=1e-12)
    assert _per_round(net, SHARED) == pytest.approx(np.full(3, by_hand), rel=1e-12)
    e = estimate(PROBLEM, "ef21", SHARED, net, rounds=5, measure=2, stepsize=1e-4)
    assert e.per_round.total_s == pytest.approx(by_hand, rel=1e-12)


def test_per_client_power_sgd_on_a_ring_stays_an_allgather() -> None:
    B, alpha = 100e6, 20e-6
    net = "ring[bandwidth=100mbit,latency=20us,compute=0]"
    m, n = matrix_shape(D)
    block = 4.0 * R * (m + n)  # each client's own factors
    by_hand = (N - 1) * 8 * block / B + (N - 1) * alpha
    assert _per_round(net, f"power_sgd[rank={R},alpha=0.1]") == pytest.approx(
        np.full(3, by_hand), rel=1e-12
    )


def test_shared_power_sgd_on_a_star_is_two_round_trips() -> None:
    up, down, alpha = 1e6, 10e6, 5e-3
    net = "star[up=1mbit,down=10mbit,latency=5ms,compute=0]"
    m, n = matrix_shape(D)
    P, Q, x = 4.0 * R * m, 4.0 * R * n, 4.0 * D  # bytes: factors, and the iterate down
    # round trip 1: the iterate down, P up; round trip 2 (after every P): P̂ down, Q up
    first = alpha + 8 * x / down + alpha + 8 * P / up
    second = alpha + 8 * P / down + alpha + 8 * Q / up
    assert _per_round(net, SHARED) == pytest.approx(np.full(3, first + second), rel=1e-12)


# -- 2. EF21-PP: θ_p of [BW] Thm 7 ---------------------------------------------------------------
def _theta_p_numerically(alpha: float, p: float) -> tuple[float, float]:
    """(θ_p, B/θ_p) at the (s, ρ) minimising B/θ_p, [BW] Thm 7 as written in methods.md §4."""
    from scipy.optimize import minimize

    def parts(v: np.ndarray) -> tuple[float, float]:
        s, rho = math.exp(v[0]), math.exp(v[1])
        th, be = 1 - (1 + s) * (1 - alpha), (1 + 1 / s) * (1 - alpha)
        return rho * p + th * p - rho, be * p + (1 + 1 / rho) * (1 - p)

    def obj(v: np.ndarray) -> float:
        tp, b = parts(v)
        return b / tp if tp > 0 else 1e300

    best = min(
        (
            minimize(
                obj,
                [math.log(s0), math.log(r0)],
                method="Nelder-Mead",
                options={"xatol": 1e-12, "fatol": 1e-14, "maxiter": 20000},
            )
            for s0 in (1e-3, 1e-2, 1e-1)
            for r0 in (1e-3, 1e-2, 1e-1)
        ),
        key=lambda r: r.fun,
    )
    tp, b = parts(best.x)
    return tp, b / tp


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_ef21_pp_rounds_use_theta_p(p: float) -> None:
    prob = make_problem(PROBLEM)
    x0 = prob.x0()
    grads = prob.client_grads(x0).to(torch.float64)
    G0 = float((grads**2).sum(1).mean())  # init=zero: g_i⁰ = 0
    gap = float(prob.loss(x0)) - float(prob.f_star)
    alpha = 1.0 / D  # top_k[k=1]
    theta_p, ratio = _theta_p_numerically(alpha, p)
    L, L_i = float(prob.L), np.asarray(prob.L_i, dtype=float)
    gamma = 1 / (L + math.sqrt((L_i**2).mean()) * math.sqrt(ratio))
    eps = 1e-3
    e = estimate(
        prob,
        f"ef21_pp[p={p},init=zero]",
        "top_k[k=1]",
        "star[up=inf]",
        eps=eps,
        measure=2,
        compute=0.0,
    )
    assert e.stepsize == pytest.approx(gamma, rel=1e-6)
    expected = (2 * gap / e.stepsize + G0 / theta_p) / eps  # 2Φ⁰/(γε), Φ⁰ with θ_p
    assert abs(e.rounds - expected) <= 1 + 1e-6 * expected
    old = (2 * gap / e.stepsize + G0 / (1 - math.sqrt(1 - alpha))) / eps  # with θ(α)
    assert e.rounds > old * 1.01  # the G⁰ term is the larger one here


def test_ef21_pp_theta_for_per_client_p_is_that_of_the_step() -> None:
    from shrinkgrad.methods.ef21 import EF21
    from shrinkgrad.network.estimate import lyapunov_alpha

    prob = make_problem(PROBLEM)
    ps = np.array([0.9, 0.8, 0.85, 0.9, 0.95, 0.8])
    bound = EF21(p=ps.tolist()).bind(prob, "top_k[k=5]", "theory")
    a, p_min, p_max = float(bound.cfg.alpha), ps.min(), ps.max()
    theta_p = 1 - math.sqrt(1 - lyapunov_alpha(bound))
    # B/θ_p of the library's step: γ = 1/(L + L_QM √(B/θ_p))
    L, L_QM = float(prob.L), math.sqrt(float((prob.L_i**2).mean()))
    ratio = ((1 / bound.cfg.stepsize - L) / L_QM) ** 2
    # methods.md §4 on a grid of (s, ρ): the pairs whose B/θ_p is (up to the grid) that
    # minimum have θ_p close to the library's
    s_, rho = np.meshgrid(np.geomspace(1e-3, 1e3, 3000), np.geomspace(1e-4, 10, 1500))
    th, be = 1 - (1 + s_) * (1 - a), (1 + 1 / s_) * (1 - a)
    tp = rho * p_min + th * p_max - rho - (p_max - p_min)
    b = be * p_max + (1 + 1 / rho) * (1 - p_min)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(tp > 0, b / tp, np.inf)
    i = np.unravel_index(np.argmin(r), r.shape)
    assert r[i] == pytest.approx(ratio, rel=1e-3)
    assert theta_p == pytest.approx(float(tp[i]), rel=2e-2)
    assert theta_p < 1 - math.sqrt(1 - a)  # smaller than θ(α)


# -- 3. ef21[rule=reloaded]: G_w -----------------------------------------------------------------
def test_reloaded_rule_measures_g_w() -> None:
    prob = make_problem(f"synthetic_least_squares[n_clients={N},d={D},L_var=1e3]")
    x0 = prob.x0()
    grads = prob.client_grads(x0).to(torch.float64)
    L_i = np.asarray(prob.L_i, dtype=float)
    gaps = (grads**2).sum(1).numpy()  # init=zero
    G_w = float(np.mean(L_i.mean() / L_i * gaps))
    G = float(gaps.mean())
    assert abs(G_w / G - 1) > 0.05  # the two differ on this problem
    gap = float(prob.loss(x0)) - float(prob.f_star)
    alpha, eps = 1.0 / D, 1e-3
    theta = 1 - math.sqrt(1 - alpha)
    kw = {"eps": eps, "measure": 2, "compute": 0.0}
    e = estimate(prob, "ef21[rule=reloaded,init=zero]", "top_k[k=1]", "star[up=inf]", **kw)
    gamma = 1 / (float(prob.L) + L_i.mean() * ((1 + math.sqrt(1 - alpha)) / alpha - 1))
    assert e.stepsize == pytest.approx(gamma, rel=1e-9)
    expected = (2 * gap / e.stepsize + G_w / theta) / eps
    assert abs(e.rounds - expected) <= 1 + 1e-9 * expected
    w = estimate(prob, "ef21_w[init=zero]", "top_k[k=1]", "star[up=inf]", **kw)
    assert w.stepsize == pytest.approx(e.stepsize, rel=1e-12)
    assert abs(w.rounds - e.rounds) <= 1


# -- 4. absurd link values -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        "star[up=loguniform[low=1e-300,high=1e300]]",
        "star[up=lognormal[median=10mbit,sigma=1e308]]",
        "ring[bandwidth=1gbit,latency=lognormal[median=1ms,sigma=1e308]]",
    ],
)
def test_draws_that_overflow_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=r"parameter '(up|latency)'") as e:
        make_network(spec).links(3)
    assert "\n" not in str(e.value) and "draws" in str(e.value)


def test_a_bandwidth_that_overflows_is_refused_but_inf_is_a_fast_link() -> None:
    for text in ("1e400", "1e400mbit", "1e305tbit"):
        with pytest.raises(ValueError, match=r"up: .* out of range"):
            parse_bandwidth(text, "up")
    assert parse_bandwidth("inf") == math.inf and parse_bandwidth(math.inf) == math.inf


def test_estimate_refuses_an_overflowing_round() -> None:
    with pytest.raises(ValueError, match=r"^the network model's time of a round is inf s") as e:
        estimate(PROBLEM, "ef21", "top_k[k=1]", "star[up=1e-310]", rounds=10, measure=1)
    assert "\n" not in str(e.value)


# -- 5. the public cost functions check their inputs ---------------------------------------------
@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: Collective("allreduce", -5), "nbytes must be a finite number"),
        (lambda: Collective("allreduce", float("nan")), "nbytes must be a finite number"),
        (lambda: Collective("broadcast", 8), "kind must be one of allreduce, allgather"),
        (
            lambda: make_network("star[up=1mbit]").step([Collective("allreduce", 8)], 0),
            "number of ranks p must be an integer >= 1, got 0",
        ),
        (
            lambda: make_network("ring[bandwidth=1gbit]").step([Collective("allreduce", 8)], -1),
            "number of ranks p must be an integer >= 1, got -1",
        ),
        (
            lambda: make_network("ring[bandwidth=1gbit]").collective(Collective("allreduce", 8), 0),
            "number of ranks p must be an integer >= 1, got 0",
        ),
        (
            lambda: make_network("star[up=1mbit]").collective(Collective("allgather", 8), 0),
            "number of ranks p must be an integer >= 1, got 0",
        ),
        (lambda: ring_allreduce(100, 4, 0.0, 0.0), "bandwidth must be > 0"),
        (lambda: ring_allreduce(100, 4, -1e9, 0.0), "bandwidth must be > 0"),
        (lambda: ring_allgather(100, 4, 1e9, -1.0), "latency must be a finite number"),
        (lambda: point_to_point(100, 1e9, float("nan")), "latency must be a finite number"),
        (
            lambda: hook_collectives("top_k[k=2]", [2000], dtype=torch.int32),
            "dtype must be a floating-point torch dtype",
        ),
        (
            lambda: ps_messages("top_k[k=2]", 100, dtype=torch.int64),
            "dtype must be a floating-point torch dtype",
        ),
        (
            lambda: ps_messages("top_k[k=2]", 100, wire_dtype=torch.int32),
            "wire_dtype must be a floating-point torch dtype",
        ),
    ],
)
def test_bad_inputs_are_one_line_value_errors(call, says: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=says) as e:
        call()
    assert "\n" not in str(e.value)


def test_numpy_integers_are_sizes() -> None:
    assert hook_collectives("top_k[k=2]", [np.int64(2000), np.int32(64)]) == hook_collectives(
        "top_k[k=2]", [2000, 64]
    )
    assert ps_messages("top_k[k=2]", np.int64(100)) == ps_messages("top_k[k=2]", 100)
    c = Collective("allreduce", np.int64(4000))
    net = make_network("ring[bandwidth=1gbit,latency=1ms]")
    assert net.step([c], np.int64(4)).total_s == pytest.approx(
        2 * 3 / 4 * 8 * 4000 / 1e9 + 2 * 3 * 1e-3, rel=1e-12
    )


# -- 6. an absurd synthetic problem ---------------------------------------------------------------
def test_an_absurd_synthetic_problem_is_refused_before_allocating() -> None:
    with pytest.raises(ValueError, match=r"needs .* more than the .* of memory available") as e:
        make_problem("synthetic_least_squares[n_clients=10,d=1000000000,m=2]")
    assert "\n" not in str(e.value) and "d = 1,000,000,000" in str(e.value)


# -- 7. unit spellings -----------------------------------------------------------------------------
def test_unit_spellings() -> None:
    assert parse_bandwidth("10Mbps") == 1e7 and parse_bandwidth("10MBps") == 8e7
    assert parse_bandwidth("10MBIT") == 1e7 and parse_bandwidth("10BYTES") == 80.0
    for ambiguous in ("10MBPS", "10mBPS", "10MbPS"):
        with pytest.raises(ValueError, match=r"ambiguous .*bps.*Bps"):
            parse_bandwidth(ambiguous)
    assert parse_duration("50μs") == parse_duration("50µs") == pytest.approx(50e-6)
