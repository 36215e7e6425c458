"""Time to ε: the theorem's rounds × the modelled round, and ``shrinkgrad estimate``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shrinkgrad.cli import main
from shrinkgrad.methods import make_method
from shrinkgrad.network.estimate import estimate, measure_rounds
from shrinkgrad.problems import make_problem

PROBLEM = "logistic_regression[dataset=australian_scale,n_clients=5]"  # d = 14


@pytest.fixture(scope="module")
def problem():  # type: ignore[no-untyped-def]
    return make_problem(PROBLEM)


def test_theory_rounds_are_the_ef21_bound(problem) -> None:  # type: ignore[no-untyped-def]
    e = estimate(problem, "ef21", "top_k[k=1]", "star[up=inf,compute=1ms]", eps=1e-3, measure=2)
    bound = make_method("ef21").bind(problem, "top_k[k=1]", "theory")
    gap = float(problem.loss(problem.x0())) - float(problem.f_lower)
    # init="full": G⁰ = 0, so T = ⌈2(f(x⁰) − f_inf)/(γε)⌉ ([EF21] Thm 1)
    assert e.rounds == math.ceil(2 * gap / (bound.stepsize * 1e-3))
    assert e.rounds_source == "[EF21] Thm 1" and e.stepsize == bound.stepsize
    # an infinitely fast network: every round costs the compute time, the init round too
    assert e.per_round.total_s == 1e-3 and e.init.total_s == 1e-3
    assert e.time_s == pytest.approx((e.rounds + 1) * 1e-3, rel=1e-12)


def test_dcgd_rounds_are_the_unbiased_rate(problem) -> None:  # type: ignore[no-untyped-def]
    from shrinkgrad.theory import rounds_dcgd

    L, L_max, n = float(problem.L), float(problem.L_i.max()), problem.n
    omega = problem.d / 2 - 1  # rand-k: ω = d/k − 1
    gap = float(problem.loss(problem.x0()))  # f(x⁰) − 0: every f_i ≥ 0
    eps = 0.05
    # at the theory step 1/(L + 2ωL_max/n) the bound's floor ≈ 2e·δ⁰·Lγ·ωL_max/n is above ε:
    theory = 1 / (L + 2 * omega * L_max / n)
    assert 2 * math.e * gap * L * theory * omega * L_max / n > eps
    with pytest.raises(ValueError, match=r"^no number of rounds guarantees .*use a step size <="):
        estimate(problem, "dcgd", "rand_k[k=2]", "star[up=1mbit]", eps=eps, measure=1)
    # a step below ε/(2e·δ⁰·L·ωL_max/n) gets there
    gamma = 0.5 * eps / (2 * math.e * gap * L * omega * L_max / n)
    net = "star[up=inf,compute=1ms]"
    e = estimate(problem, "dcgd", "rand_k[k=2]", net, eps=eps, stepsize=gamma, measure=2)
    a = L * gamma**2 * omega * L_max / n
    # the smallest T with 2(1 + a)^T δ⁰/(γT) ≤ ε, by a plain scan
    T = 1
    while 2 * (1 + a) ** T * gap / (gamma * T) > eps:
        T += 1
    assert e.rounds == T == rounds_dcgd(gamma, gap, eps, L=L, L_max=L_max, omega=omega, n=n)
    no_growth = math.ceil(2 * gap / (gamma * eps))
    assert no_growth < T  # the growth factor (1 + a)^T counts
    assert e.rounds_source.startswith("Khaled & Richtárik 2023 Thm 2")
    # a shared seed is one draw for every client: A = ωL_max/1, not ωL_max/n (more rounds)
    shared = estimate(
        problem, "dcgd", "rand_k[k=2,shared_seed=true]", net, eps=eps, stepsize=gamma / n,
        measure=2,
    )  # fmt: skip
    want = rounds_dcgd(gamma / n, gap, eps, L=L, L_max=L_max, omega=omega, n=1)
    assert shared.rounds == want != rounds_dcgd(gamma / n, gap, eps, L=L, L_max=L_max,
                                                omega=omega, n=n)  # fmt: skip
    # DCGD's initialisation sends nothing (no client state), so it costs nothing
    assert e.init.total_s == 0 and e.time_s == pytest.approx(e.rounds * 1e-3, rel=1e-12)
    # above 1/L the lemma does not hold: refused, pointing to --rounds
    with pytest.raises(ValueError, match=r"exceeds 1/L = .*needs γ ≤ 1/L.*--rounds N"):
        estimate(problem, "dcgd", "rand_k[k=2]", "star[up=1mbit]", stepsize=1.5 / L, measure=1)
    with pytest.raises(ValueError, match=r"contractive compressor top_k.*no rounds-to-ε rate"):
        estimate(problem, "dcgd[biased=true]", "top_k[k=2]", "star[up=1mbit]", stepsize=0.01)


def test_zero_compute_time_is_bytes_over_bandwidth_plus_latency(problem) -> None:  # type: ignore[no-untyped-def]
    net = "star[up=1mbit,down=10mbit,latency=10ms,compute=0s]"
    e = estimate(problem, "ef21", "top_k[k=1]", net, rounds=1000, measure=3)
    up_bits = 1 * (math.ceil(math.log2(14)) + 32)  # k indices + k float32 values
    down_bits = 32 * 14  # the dense x back to each client
    per = 8 * math.ceil(up_bits / 8) / 1e6 + down_bits / 1e7 + 2 * 0.01  # whole bytes
    assert e.per_round.compute_s == 0 and e.per_round.total_s == pytest.approx(per, rel=1e-12)
    init = 32 * 14 / 1e6 + down_bits / 1e7 + 2 * 0.01  # g_i⁰ = ∇f_i(x⁰) sent dense
    assert e.init.total_s == pytest.approx(init, rel=1e-12)
    assert e.time_s == pytest.approx(init + 1000 * per, rel=1e-12)
    assert e.bits_up == pytest.approx(32 * 14 + 1000 * up_bits, rel=1e-12)


def test_partial_participation_costs_the_slowest_sampled_client(problem) -> None:  # type: ignore[no-untyped-def]
    # client 4 is slow, but only when sampled: the mean round lies strictly between
    net = "star[up=inf,latency=0,compute=[1ms,1ms,1ms,1ms,100ms]]"
    bound = make_method("ef21_pp[p=0.5]").bind(problem, "top_k[k=1]", "theory", 3)
    m = measure_rounds(bound, problem, 40)
    sampled = [up[4] > 0 for up, _ in m.traffic]
    e = estimate(problem, "ef21_pp[p=0.5]", "top_k[k=1]", net, seed=3, measured=m, rounds=1)
    anyone = [any(u > 0 for u in up) for up, _ in m.traffic]
    want = sum(0.1 if s else (1e-3 if a else 0.0) for s, a in zip(sampled, anyone, strict=True))
    assert 0 < sum(sampled) < len(sampled)
    assert e.per_round.total_s == pytest.approx(want / len(sampled), rel=1e-12)


def test_mistakes(problem) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(
        ValueError,
        match=r"^no rounds-to-ε theorem for 'ef' in shrinkgrad.theory \(there is one for gd, "
        r"ef21, ef21_w, ef21_pp, ef21_w_pp, dcgd\); give the number of rounds \(--rounds N",
    ):
        estimate(problem, "ef", "top_k[k=2]", "star[up=1mbit]", measure=1)
    # with the rounds given, any method is estimated
    net = "star[up=inf,compute=1ms]"
    e = estimate(problem, "ef", "top_k[k=2]", net, rounds=7, stepsize=0.1, measure=1)
    assert e.rounds == 7 and e.rounds_source == "given"
    with pytest.raises(ValueError, match=r"exceeds the theory step .*--rounds N"):
        estimate(problem, "ef21", "top_k[k=1]", "star[up=1mbit]", stepsize="theory*2", measure=1)
    with pytest.raises(ValueError, match=r"^eps must be a number > 0"):
        estimate(problem, "ef21", "top_k[k=1]", "star[up=1mbit]", eps=0.0, measure=1)
    with pytest.raises(ValueError, match=r"star parameter 'up': a list of 2 values for 5"):
        estimate(problem, "ef21", "top_k[k=1]", "star[up=[1mbit,2mbit]]", measure=1)
    # a network's L is unknown: its rounds-to-ε theorem cannot run, whatever the step; the
    # message names --rounds, which can (it used to say "pass a number" to a numeric step)
    net_problem = make_problem("mlp[dataset=digits,n_clients=2,hidden=4]")
    for step in (0.5, "theory"):
        with pytest.raises(ValueError, match=r"theorem of ef21 needs L .*--rounds N"):
            estimate(net_problem, "ef21", "top_k[k=5]", "star[up=1mbit]", stepsize=step)
    e = estimate(net_problem, "ef21", "top_k[k=5]", "star[up=1mbit]", stepsize=0.5, rounds=3)
    assert e.rounds == 3


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_cli_prints_the_breakdown_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    nets = ["star[up=10mbit,down=100mbit,latency=20ms]", "ring[bandwidth=1gbit,latency=50us]"]
    args = ["estimate", "--problem", PROBLEM, "--measure", "2", "--compute", "5ms"]
    for n in nets:
        args += ["--network", n]
    assert run_cli(args) == 0
    text = capsys.readouterr().out
    for word in ("rounds to ε", "[EF21] Thm 1", "compute", "transfer", "latency", "time to ε"):
        assert word in text
    assert "star[up=10mbit" in text and "ring[bandwidth=1gbit" in text
    assert "the theorem's bound" in text
    assert run_cli([*args, "--rounds", "7"]) == 0  # given rounds are not called a bound
    text = capsys.readouterr().out
    assert "7 (given)" in text and "the ones given (--rounds)" in text
    assert "theorem's bound" not in text
    assert run_cli([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["network"] for r in rows] == nets
    for r in rows:
        assert r["per_round"]["compute_s"] == 0.005
        total = r["init"]["total_s"] + r["rounds"] * r["per_round"]["total_s"]
        assert r["time_s"] == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--network", "star[up=-1mbit]"], "error: star parameter 'up' must be > 0"),
        (["--network", "star[up=10mbat]"], "error: star parameter 'up': cannot read '10mbat'"),
        (["--network", "strr[up=1mbit]"], "error: unknown network 'strr'"),
        (["--network", "star[up=1mbit]", "--compute", "soon"], "error: --compute: cannot read"),
        (
            ["--network", "star[up=1mbit]", "--method", "diana"],
            "error: no rounds-to-ε theorem for 'diana' in shrinkgrad.theory (there is one for gd, "
            "ef21, ef21_w, ef21_pp, ef21_w_pp, dcgd); give the number of rounds (--rounds N",
        ),
        (
            ["--network", "star[up=[1mbit,2mbit]]"],
            "error: star parameter 'up': a list of 2 values for 5 clients; give one value per "
            "client (5 values) or a single value",
        ),
    ],
)
def test_cli_mistakes_are_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["estimate", "--problem", PROBLEM, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


def test_cli_mistake_without_traceback_in_a_fresh_process() -> None:
    exe = str(Path(sys.executable).with_name("shrinkgrad"))
    res = subprocess.run(
        [exe, "estimate", "--problem", PROBLEM, "--network", "star[up=-1mbit]"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (
        "error: star parameter 'up' must be > 0, got '-1mbit'; give a bandwidth such as 10mbit, "
        "1gbit, 100kbit/s, 50Mbps, 12.5MB/s (bytes), inf, or a number of bit/s"
    )
