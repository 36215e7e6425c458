"""Where a theory step holds, and what the run records when it is used elsewhere (API audit)."""

from __future__ import annotations

import warnings

import pytest

import shrinkgrad as sg
from shrinkgrad import theory as T
from shrinkgrad.methods.gd import NOT_CONVEX

NONCONVEX = "logistic_regression[dataset=australian_scale,n_clients=5]"  # reg=nonconvex
CONVEX = "logistic_regression[dataset=australian_scale,n_clients=5,reg=l2]"


@pytest.mark.parametrize("method", ["dcgd", "delayed_dcgd[tau=2]", "iag"])
def test_the_dcgd_rule_on_nonconvex_f_i_is_recorded_and_warned(method: str) -> None:
    p = sg.make_problem(NONCONVEX)
    assert p.convex is False
    with pytest.warns(UserWarning, match="proved for convex f_i"):
        r = sg.simulate(p, method, "rand_k[k=1]", stepsize="theory", rounds=1)
    assert r.stepsize_rule.endswith(NOT_CONVEX)
    if method == "dcgd":  # the value is the rule's, unchanged
        omega = sg.make_compressor("rand_k[k=1]").omega(p.d)
        assert r.stepsize == pytest.approx(T.stepsize_dcgd(p.L, p.L_max, omega, p.n), rel=1e-12)


def test_the_dcgd_rule_on_a_network_says_its_f_i_are_not_known_convex() -> None:
    """A neural network's problem leaves ``convex`` None: with estimated constants the DCGD
    rule runs, recorded and warned as outside its theorem unless the f_i are convex."""
    from shrinkgrad.methods.gd import NOT_KNOWN_CONVEX
    from shrinkgrad.problems import estimate_smoothness

    net = sg.make_problem("mlp[dataset=digits,n_clients=3,hidden=4]")
    assert net.convex is None
    p = estimate_smoothness(net, iters=20).apply(net)
    with pytest.warns(UserWarning, match=r"are not known to be .*Constants\(convex=True\)"):
        r = sg.simulate(p, "dcgd", "rand_k[k=5]", stepsize="theory", rounds=1)
    assert r.stepsize_rule == "stepsize_dcgd" + NOT_KNOWN_CONVEX + "(estimated L)"


def test_the_dcgd_rule_on_convex_f_i_is_silent() -> None:
    p = sg.make_problem(CONVEX)
    assert p.convex is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = sg.simulate(p, "dcgd", "rand_k[k=1]", stepsize="theory", rounds=1)
    assert r.stepsize_rule == "stepsize_dcgd"


def test_another_methods_rule_says_which_step_it_could_not_take() -> None:
    p = sg.make_problem(CONVEX)
    with pytest.raises(ValueError, match=r"stepsize='theory\(dcgd\)' is dcgd's theory step"):
        sg.simulate(p, "ef21", "top_k[k=1]", stepsize="theory(dcgd)", rounds=1)


@pytest.mark.parametrize(
    ("method", "comp", "why"),
    [
        ("ef", "top_k[k=5]", r"^ef \(classic error feedback\) has no theory step size"),
        ("iag[order=random]", "rand_k[k=5]", r"^iag\[order=random\] has no theory step size"),
        ("ef21", "top_k[k=5]", r"^ef21: L is not known .*estimate_smoothness"),
    ],
)
def test_theory_without_l_names_a_missing_rule_before_the_missing_constants(
    method: str, comp: str, why: str
) -> None:
    """A method with no theory step at all says so on a network too; estimating L (what the
    unknown-L message suggests) would not help it. One with a rule asks for L."""
    net = sg.make_problem("mlp[dataset=digits,n_clients=3,hidden=4]")
    with pytest.raises(ValueError, match=why):
        sg.simulate(net, method, comp, stepsize="theory", rounds=1)


def test_a_momentum_wrappers_refusal_names_the_method_asked_for() -> None:
    """ef21_sgdm runs EF21 inside client momentum; its compressor check is EF21's, but the
    refusal names ef21_sgdm, the method the user gave."""
    p = sg.make_problem(CONVEX)
    with pytest.raises(ValueError, match=r"^ef21_sgdm\[beta=0.9\] needs a contractive"):
        sg.simulate(p, "ef21_sgdm[beta=0.9]", "rand_k[k=2]", stepsize=0.1, rounds=1)
