"""Names, step-size rules, compressor compatibility, bit counting and error messages."""

from __future__ import annotations

import math

import pytest
import torch
from methods_fixtures import LeastSquares, UnbiasedRandK, rand_k, run, trajectory

from shrinkgrad.methods import (
    EF21,
    METHODS,
    Constants,
    DelayedDCGD,
    ProblemOracle,
    make_method,
    parse_stepsize,
)
from shrinkgrad.registry import SpecError


def xi(alpha: float) -> float:
    return (1.0 + math.sqrt(1.0 - alpha)) / alpha - 1.0


# --------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        "gd",
        "dcgd",
        "ef",
        "ef21",
        "ef21[init=zero,rule=reloaded]",
        "ef21_w",
        "ef21_sgd[b=4]",
        "ef21_w_sgd[b=2]",
        "ef21_pp[p=0.5]",
        "ef21_w_pp[p=0.25]",
        "delayed_dcgd[tau=5,model=random]",
        "iag[order=random]",
    ],
)
def test_names_round_trip(spec: str) -> None:
    m = make_method(spec)
    assert m.name == spec
    assert make_method(m.name).name == m.name


def test_all_methods_of_the_issue_are_registered() -> None:
    expected = {"gd", "dcgd", "delayed_dcgd", "iag", "ef", "ef21", "ef21_w", "ef21_sgd"}
    expected |= {"ef21_w_sgd", "ef21_pp", "ef21_w_pp"}
    assert expected <= set(METHODS.names())


def test_objects_built_directly_get_descriptive_names() -> None:
    assert EF21(weighted=True, p=0.3).name == "ef21_w_pp[p=0.3]"
    assert EF21(batch=4).name == "ef21_sgd[b=4]"
    assert DelayedDCGD(tau=2, model="cyclic").name == "delayed_dcgd[tau=2,model=cyclic]"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("ef21_pp[p=1.5]", r"p must be in \(0, 1\]"),
        ("ef21_pp[p=0]", r"p must be in \(0, 1\]"),
        ("ef21_sgd[b=0]", "minibatch size"),
        ("delayed_dcgd[tau=-1]", "tau"),
        ("delayed_dcgd[model=sometimes]", "model"),
        ("iag[order=backwards]", "order"),
        ("ef21[init=random]", "init"),
        ("ef21[rule=best]", "rule"),
        ("ef21_w[p=0.5]", "no parameter 'p'"),
    ],
)
def test_bad_parameters_are_named(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_method(spec)


def test_per_client_vectors_must_match_n(lsq: LeastSquares) -> None:
    with pytest.raises(ValueError, match=r"one per client \(n=5\)"):
        EF21(p=[0.5, 0.5]).bind(lsq, "top_k[k=1]", 0.1)


# --------------------------------------------------------------------------------------------
# step sizes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "theory", "value"),
    [
        (0.1, False, 0.1),
        ("0.25", False, 0.25),
        ("theory", True, 1.0),
        ("theory*4", True, 4.0),
        (" theory * 0.5 ", True, 0.5),
        ("2*theory", True, 2.0),
    ],
)
def test_parse_stepsize(text: str | float, theory: bool, value: float) -> None:
    s = parse_stepsize(text)
    assert s.theory == theory
    assert (s.multiplier if theory else s.value) == value


@pytest.mark.parametrize("text", ["-1", "0", "theory*-2", "theory*x", "fast", "nan", "inf"])
def test_bad_stepsizes_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match=r"step size|multiplier"):
        parse_stepsize(text)
    with pytest.raises(TypeError):
        parse_stepsize(True)  # type: ignore[arg-type]


def test_theory_rules_follow_methods_md(lsq: LeastSquares) -> None:
    L, L_AM = lsq.L, float(lsq.L_i.mean())
    L_QM, L_max = math.sqrt(float((lsq.L_i**2).mean())), float(lsq.L_i.max())
    a = 2 / lsq.d
    cases = {
        ("ef21", "top_k[k=2]"): (1 / (L + L_QM * xi(a)), "stepsize_ef21"),
        ("ef21[rule=reloaded]", "top_k[k=2]"): (1 / (L + L_AM * xi(a)), "stepsize_ef21_reloaded"),
        ("ef21_w", "top_k[k=2]"): (1 / (L + L_AM * xi(a)), "stepsize_ef21_reloaded"),
        ("gd", None): (1 / L, "1/L"),
        ("dcgd", UnbiasedRandK(2)): (
            1 / (L + 2 * (lsq.d / 2 - 1) * L_max / lsq.n),
            "stepsize_dcgd",
        ),
        # EF21 given an unscaled unbiased compressor with ω < 1 works with α = 1 − ω
        ("ef21", UnbiasedRandK(6)): (1 / (L + L_QM * xi(1 - (8 / 6 - 1))), "stepsize_ef21"),
    }
    for (spec, comp), (gamma, rule) in cases.items():
        b = make_method(spec).bind(lsq, comp, "theory")
        assert b.stepsize == pytest.approx(gamma, rel=1e-12), spec
        assert b.cfg.stepsize_rule == rule
        b4 = make_method(spec).bind(lsq, comp, "theory*4")
        assert b4.stepsize == pytest.approx(4 * gamma, rel=1e-12)
        assert b4.cfg.stepsize_rule == rule + "*4"
    # delayed gradients: the smaller of the DCGD rule and 0.99 × the [K18] delayed bound
    tau = 3
    delayed = 0.99 * 2 / (L * (1 + math.sqrt(1 + 8 * tau * (tau + 1))))
    b = make_method(f"delayed_dcgd[tau={tau}]").bind(lsq, "identity", "theory")
    assert b.stepsize == pytest.approx(min(1 / L, delayed), rel=1e-12)
    b = make_method("iag").bind(lsq, "identity", "theory")  # cyclic: τ = n − 1
    tau = lsq.n - 1
    assert b.stepsize == pytest.approx(0.99 * 2 / (L * (1 + math.sqrt(1 + 8 * tau * (tau + 1)))))
    # PP with p = 1 is EF21's rule (the theory module's own identity)
    b = EF21(p=1.0).bind(lsq, "top_k[k=2]", "theory")
    assert b.stepsize == pytest.approx(1 / (L + L_QM * xi(a)), rel=1e-12)
    b = make_method("ef21_pp[p=0.5]").bind(lsq, "top_k[k=2]", "theory")
    assert 0 < b.stepsize < 1 / (L + L_QM * xi(a))
    assert b.cfg.stepsize_rule == "stepsize_ef21_pp"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("ef", "no theory step size"),
        ("iag[order=random]", "unbounded"),
    ],
)
def test_methods_without_a_theory_rule_say_so(lsq: LeastSquares, spec: str, match: str) -> None:
    comp = "top_k[k=1]" if spec == "ef" else "identity"
    with pytest.raises(ValueError, match=match):
        make_method(spec).bind(lsq, comp, "theory")
    make_method(spec).bind(lsq, comp, 0.01)  # a number works


def test_pl_rule_needs_mu() -> None:
    p = LeastSquares()
    b = make_method("ef21[pl=true]").bind(p, "top_k[k=1]", "theory")
    assert b.cfg.stepsize_rule == "stepsize_ef21_pl"
    p.mu = None
    with pytest.raises(ValueError, match="PL constant mu"):
        make_method("ef21[pl=true]").bind(p, "top_k[k=1]", "theory")


# --------------------------------------------------------------------------------------------
# compatibility as data
# --------------------------------------------------------------------------------------------
def test_contractive_methods_reject_unscaled_unbiased_compressors(lsq: LeastSquares) -> None:
    C = rand_k(1)  # ω = d − 1 ≥ 1
    for spec in ("ef21", "ef21_w", "ef21_pp[p=0.5]", "ef"):
        with pytest.raises(ValueError, match=r"contractive.*scaled\(") as e:
            make_method(spec).bind(lsq, C, 0.1)
        assert "ω = 7" in str(e.value)
    make_method("ef21").bind(lsq, rand_k(1, scaled=True), 0.1)  # the scaled version is fine


def test_unbiased_methods_reject_biased_compressors(lsq: LeastSquares) -> None:
    import re

    from shrinkgrad.methods.base import methods_for

    for spec in ("dcgd", "delayed_dcgd[tau=2]", "iag"):
        with pytest.raises(ValueError, match=r"needs an unbiased compressor.*top_k\[k=1\]") as e:
            make_method(spec).bind(lsq, "top_k[k=1]", 0.1)
        # the method it suggests runs wherever dcgd and iag do (the parameter server included)
        suggested = re.search(r"or run (\w+) with", str(e.value))
        assert suggested is not None and suggested[1] in methods_for("ps")
    with pytest.raises(ValueError, match="uncompressed"):
        make_method("gd").bind(lsq, "top_k[k=1]", 0.1)


def test_bind_validates_problem_constants(lsq: LeastSquares) -> None:
    with pytest.raises(ValueError, match="L_i must have one entry per client"):
        make_method("ef21").bind(Constants(5, 8, 1.0, torch.ones(3)), "top_k[k=1]", 0.1)
    with pytest.raises(ValueError, match="seed"):
        make_method("ef21").bind(lsq, "top_k[k=1]", 0.1, seed=-1)
    b = make_method("ef21").bind(lsq, "top_k[k=1]", 0.1)
    with pytest.raises(ValueError, match=r"x0 must have shape \(8,\)"):
        b.init(torch.zeros(3), ProblemOracle(lsq))
    with pytest.raises(ValueError, match="distinct"):
        b.init(lsq.x0(), ProblemOracle(lsq), ids=torch.tensor([0, 0]))


# --------------------------------------------------------------------------------------------
# bits
# --------------------------------------------------------------------------------------------
def test_ef21_bits_count_the_initial_full_send_and_each_message(lsq: LeastSquares) -> None:
    d, k = lsq.d, 2
    b = make_method("ef21").bind(lsq, f"top_k[k={k}]", 0.01)
    oracle = ProblemOracle(lsq)
    state, tr = b.init(lsq.x0(), oracle)
    assert torch.equal(tr.up, torch.full((lsq.n,), 32.0 * d, dtype=torch.float64))
    assert torch.equal(tr.up_paper, tr.up)
    assert torch.equal(tr.down, tr.up)  # x⁰ is broadcast once
    state, tr = b.step(state, oracle)
    assert torch.equal(tr.up, torch.full((lsq.n,), k * (32.0 + math.ceil(math.log2(d)))))
    assert torch.equal(tr.up_paper, torch.full((lsq.n,), 32.0 * k, dtype=torch.float64))
    assert torch.equal(tr.down, torch.full((lsq.n,), 32.0 * d, dtype=torch.float64))
    # init=zero sends nothing; float64 on the wire doubles the dense cost
    b = make_method("ef21[init=zero]").bind(lsq, "top_k[k=1]", 0.01)
    assert float(b.init(lsq.x0(), oracle)[1].up.sum()) == 0.0
    b = make_method("ef21").bind(lsq, "top_k[k=1]", 0.01, wire_dtype=torch.float64)
    assert float(b.init(lsq.x0(), oracle)[1].up[0]) == 64.0 * d


def test_pp_non_participants_send_nothing(lsq: LeastSquares) -> None:
    p = LeastSquares(n=40, d=6)
    b = make_method("ef21_pp[p=0.3]").bind(p, "top_k[k=1]", 0.01, seed=2)
    oracle = ProblemOracle(p)
    state, _ = b.init(p.x0(), oracle)
    per_message = 32.0 + math.ceil(math.log2(p.d))
    for _ in range(5):
        new, tr = b.step(state, oracle)
        sent = tr.up > 0
        assert set(tr.up.unique().tolist()) <= {0.0, per_message}
        assert torch.equal(tr.down > 0, sent)
        # non-participants keep g_i; participants changed it
        same = (new.clients.g == state.clients.g).all(dim=1)
        assert torch.equal(same[~sent], torch.ones(int((~sent).sum()), dtype=torch.bool))
        assert 0 < int(sent.sum()) < p.n
        state = new


def test_iag_only_the_active_client_communicates(lsq: LeastSquares) -> None:
    b = make_method("iag").bind(lsq, "identity", 0.01)
    oracle = ProblemOracle(lsq)
    state, _ = b.init(lsq.x0(), oracle)
    for r in range(1, 8):
        state, tr = b.step(state, oracle)
        active = (r - 1) % lsq.n
        expected = torch.zeros(lsq.n, dtype=torch.float64)
        expected[active] = 32.0 * lsq.d
        assert torch.equal(tr.up, expected)


# --------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", ["ef21_pp[p=0.5]", "delayed_dcgd[tau=2,model=random]", "ef21_sgd[b=2]"]
)
def test_same_seed_same_run_other_seed_other_run(lsq: LeastSquares, spec: str) -> None:
    C = rand_k(3) if "dcgd" in spec else rand_k(3, scaled=True)
    _, a = run(spec, lsq, C, 0.01, 20, seed=5)
    _, b = run(spec, lsq, C, 0.01, 20, seed=5)
    _, c = run(spec, lsq, C, 0.01, 20, seed=6)
    assert torch.equal(trajectory(a), trajectory(b))
    assert not torch.equal(trajectory(a), trajectory(c))


def test_steps_are_pure(lsq: LeastSquares) -> None:
    """A step never modifies its input state (explicit state, optax-style)."""
    for spec, C in [
        ("ef21", "top_k[k=1]"),
        ("iag", "identity"),
        ("delayed_dcgd[tau=2]", "identity"),
    ]:
        b = make_method(spec).bind(lsq, C, 0.01)
        oracle = ProblemOracle(lsq)
        state, _ = b.init(lsq.x0(), oracle)
        state, _ = b.step(state, oracle)
        before = [t.clone() for t in (*state.server, *state.clients)]
        b.step(state, oracle)
        after = list((*state.server, *state.clients))
        assert all(torch.equal(u, v) for u, v in zip(before, after, strict=True))


def test_float32_runs_stay_float32() -> None:
    p = LeastSquares(dtype=torch.float32)
    bound, states = run("ef21", p, "top_k[k=1]", 0.01, 5)
    assert states[-1].x.dtype == torch.float32  # type: ignore[attr-defined]
    assert states[-1].clients.g.dtype == torch.float32  # type: ignore[attr-defined]
    assert bound.cfg.dtype == torch.float32  # type: ignore[attr-defined]


def test_unknown_method_suggests_a_name() -> None:
    with pytest.raises(SpecError, match="did you mean 'ef21'"):
        make_method("ef12")


def test_cli_lists_every_method() -> None:
    from click.testing import CliRunner

    from shrinkgrad.cli import cli

    out = CliRunner().invoke(cli, ["list", "methods"], terminal_width=200)
    assert out.exit_code == 0, out.output
    for name in METHODS.names():
        assert name in out.output
    assert "L_AM ξ(α)" in out.output and "contractive" in out.output
    # the runtimes column, from Method.unsupported
    assert "runtimes" in out.output and "method.unsupported(runtime)" in out.output
    rows = {line.split("│")[1].strip(): line for line in out.output.splitlines() if "│" in line}
    assert "simulator, runner, hook" in rows["diana"]
    assert "simulator, runner" in rows["ef21_plus"] and "hook" not in rows["ef21_plus"]
    # every suffix is listed, applied to a method (its own parameters with their defaults)
    assert METHODS.suffixes() == ["+momentum"]
    assert "beta=0.9" in rows["<method>+momentum"]


def test_package_root_exports() -> None:
    import shrinkgrad

    assert shrinkgrad.make_method("ef21").name == "ef21"
    assert callable(shrinkgrad.simulate) and shrinkgrad.SimResult.__name__ == "SimResult"


# --------------------------------------------------------------------------------------------
# unknown constants (design.md principle 14) and runtimes (principle 13)
# --------------------------------------------------------------------------------------------
def test_unknown_constants_allow_numeric_steps_and_refuse_theory(lsq: LeastSquares) -> None:
    unknown = Constants(lsq.n, lsq.d)  # a network: no L, no L_i
    assert not unknown.known
    for spec in ("gd", "dcgd", "ef", "ef21", "iag", "delayed_dcgd[tau=2]"):
        C = "top_k[k=1]" if spec in ("ef", "ef21") else None
        b = make_method(spec).bind(unknown, C, 0.05)
        assert b.cfg.stepsize == 0.05 and b.cfg.stepsize_rule == "constant"
        # the same trajectory as with the known constants: numeric steps never read them
        oracle = ProblemOracle(lsq)
        state, _ = b.init(lsq.x0(), oracle)
        for _ in range(5):
            state, _ = b.step(state, oracle)
        _, states = run(spec, lsq, C, 0.05, 5)
        assert torch.equal(state.x, trajectory(states)[-1])
        # a method without any theory step says that first (no estimate of L would help)
        why = "has no theory step size" if spec == "ef" else "L is not known for this problem"
        with pytest.raises(ValueError, match=rf"{why}.*pass a number"):
            make_method(spec).bind(unknown, C, "theory*2")
    with pytest.raises(ValueError, match=r"ef21_w weighs the clients.*estimate them"):
        make_method("ef21_w").bind(unknown, "top_k[k=1]", 0.05)


def test_a_theory_step_from_estimated_constants_says_so(lsq: LeastSquares) -> None:
    exact = make_method("ef21").bind(lsq, "top_k[k=1]", "theory")
    est = Constants(lsq.n, lsq.d, lsq.L, lsq.L_i, estimated=True)
    b = make_method("ef21").bind(est, "top_k[k=1]", "theory*2")
    assert b.cfg.stepsize == 2 * exact.cfg.stepsize
    assert b.cfg.stepsize_rule == exact.cfg.stepsize_rule + "*2(estimated L)"


def test_runtimes_every_method_runs_in_the_simulator_and_says_why_not_elsewhere() -> None:
    from shrinkgrad.methods.base import RUNTIMES

    for name in METHODS.names():
        m = make_method(name)
        assert m.unsupported("simulator") is None and m.unsupported("runner") is None
        for rt in RUNTIMES:
            reason = m.unsupported(rt)
            assert reason is None or (reason.strip() and "\n" not in reason)
    with pytest.raises(ValueError, match="unknown runtime"):
        make_method("gd").unsupported("gpu")  # type: ignore[arg-type]
