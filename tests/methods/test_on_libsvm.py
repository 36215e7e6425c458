"""Method properties on the library's own problems: nonconvex logistic regression, LIBSVM data."""

from __future__ import annotations

import math

import pytest
import torch
from methods_fixtures import run, trajectory
from test_lyapunov import violations, xi

from shrinkgrad.methods import EF21, ProblemOracle, make_method
from shrinkgrad.problems import LinearModelProblem, logistic_regression

ROUNDS = 60
GAMMA = 1e-7  # below the theory steps of the fixture (L ≈ 6.3e6)


@pytest.fixture(scope="module")
def logreg() -> LinearModelProblem:
    # raw (unscaled) features, samples sorted by norm before chunking: widely spread L_i
    # (L_QM ≈ 3.3 L_AM); 11 clients give unequal client sizes (62 × 10 and 70)
    return logistic_regression("australian", n_clients=11, split="heterogeneous_smoothness")


def test_fixture_is_heterogeneous(logreg: LinearModelProblem) -> None:
    assert logreg.L_QM > 3 * logreg.L_AM


@pytest.mark.parametrize("rule", ["reloaded", "original"])
def test_lyapunov_decrease_on_nonconvex_logistic_regression(
    logreg: LinearModelProblem, rule: str
) -> None:
    """methods.md §4 invariant on a nonconvex problem (f bounded below; f^inf cancels out)."""
    p = logreg
    alpha = 1 / p.d
    theta = 1 - math.sqrt(1 - alpha)
    Lbar = p.L_AM if rule == "reloaded" else p.L_QM
    gamma = 1 / (p.L + Lbar * xi(alpha))
    _, states = run("ef21[init=zero]", p, "top_k[k=1]", gamma, ROUNDS, x0=torch.ones(p.d))
    coef = (p.L_AM / p.L_i).unsqueeze(1) if rule == "reloaded" else torch.ones(p.n, 1)
    phi, gns = [], []
    for s in states:
        G = float((coef * (s.clients.g - p.client_grads(s.x)) ** 2).sum() / p.n)  # type: ignore[attr-defined]
        phi.append(p.loss(s.x) + gamma / (2 * theta) * G)  # type: ignore[attr-defined]
        gns.append(float(p.grad(s.x).norm() ** 2))  # type: ignore[attr-defined]
    assert max(violations(phi, gns, gamma)) <= 1e-12


def test_ef21_w_equals_ef21_for_top_k_on_real_data(logreg: LinearModelProblem) -> None:
    gamma = 1 / (logreg.L + logreg.L_QM * xi(2 / logreg.d))
    _, a = run("ef21", logreg, "top_k[k=2]", gamma, ROUNDS)
    _, b = run("ef21_w", logreg, "top_k[k=2]", gamma, ROUNDS)
    torch.testing.assert_close(trajectory(b), trajectory(a), rtol=1e-10, atol=1e-12)


def test_minibatches_of_the_whole_client_are_exact_gradients(logreg: LinearModelProblem) -> None:
    """EF21-SGD with per-client b_i = m_i (the problem's own sampler) is EF21."""
    sizes = logreg.client_sizes
    assert len(set(sizes.tolist())) > 1  # per-client batch sizes really differ
    o = ProblemOracle(logreg)
    for weighted in (False, True):
        exact = EF21(weighted=weighted).bind(logreg, "top_k[k=2]", GAMMA, seed=1)
        sgd = EF21(weighted=weighted, batch=sizes).bind(logreg, "top_k[k=2]", GAMMA, seed=1)
        sa, _ = exact.init(logreg.x0(), o)
        sb, _ = sgd.init(logreg.x0(), o)
        for _ in range(20):
            sa, _ = exact.step(sa, o)
            sb, _ = sgd.step(sb, o)
        torch.testing.assert_close(sb.x, sa.x, rtol=1e-10, atol=1e-12)
    # smaller batches differ
    half = EF21(batch=(sizes // 2).clamp_min(1)).bind(logreg, "top_k[k=2]", GAMMA, seed=1)
    sc, _ = half.init(logreg.x0(), o)
    for _ in range(20):
        sc, _ = half.step(sc, o)
    assert not torch.allclose(sc.x, sa.x)


def test_per_client_participation_probabilities(logreg: LinearModelProblem) -> None:
    p = [1.0] * 5 + [0.3] * 6
    bound = EF21(p=p).bind(logreg, "top_k[k=1]", GAMMA, seed=3)
    assert bound.method.name == "ef21_pp[p=per_client]"
    o = ProblemOracle(logreg)
    state, _ = bound.init(logreg.x0(), o)
    sent = torch.zeros(logreg.n)
    for _ in range(40):
        state, traffic = bound.step(state, o)
        sent += traffic.up > 0
    assert torch.equal(sent[:5], torch.full((5,), 40.0))  # p_i = 1: every round
    assert bool((sent[5:] < 40).all()) and bool((sent[5:] > 0).all())
    assert 0.15 < float(sent[5:].mean()) / 40 < 0.45  # about p = 0.3


@pytest.mark.parametrize("weighted", [False, True])
def test_sgd_theory_step_reads_the_problems_variance_bound(
    logreg: LinearModelProblem, weighted: bool
) -> None:
    """σ² > 0 with the default Young parameter ν = α/(2(1 − α)) makes α_ν = α/2:
    γ = 1/(L + L̄ ξ(α/2)), L̄ = L_QM (EF21-SGD) or L_AM (EF21-W-SGD)."""
    b, k = 8, 2
    alpha = k / logreg.d
    spec = "ef21_w_sgd" if weighted else "ef21_sgd"
    bound = make_method(f"{spec}[b={b}]").bind(logreg, f"top_k[k={k}]", "theory")
    Lbar = logreg.L_AM if weighted else logreg.L_QM
    assert bound.stepsize == pytest.approx(1 / (logreg.L + Lbar * xi(alpha / 2)), rel=1e-12)
    s2 = logreg.minibatch_variance_bound(b)
    if weighted:
        s2 = logreg.L_AM / logreg.L_i * s2
    assert bound.cfg.stepsize_rule.endswith(f"_sgd[sigma2={float(s2.mean()):.4g}]")
    # sigma2=0 is the deterministic EF21 rule; the method object itself is left untouched
    zero = make_method(f"{spec}[b={b},sigma2=0]").bind(logreg, f"top_k[k={k}]", "theory")
    assert zero.stepsize == pytest.approx(1 / (logreg.L + Lbar * xi(alpha)), rel=1e-12)
    m = make_method(f"{spec}[b={b}]")
    m.bind(logreg, f"top_k[k={k}]", "theory")
    assert m._sigma2_problem is None  # type: ignore[attr-defined]


def test_sgd_theory_step_without_a_variance_bound_says_what_to_do() -> None:
    from methods_fixtures import LeastSquares

    with pytest.raises(ValueError, match=r"needs a bound sigma2.*pass sigma2="):
        make_method("ef21_sgd[b=2]").bind(LeastSquares(), "top_k[k=1]", "theory")
    make_method("ef21_sgd[b=2]").bind(LeastSquares(), "top_k[k=1]", 0.01)  # a number works


def test_a_problem_without_a_variance_bound_says_why() -> None:
    """The squared loss's minibatch variance grows with ‖x‖: EF21-SGD's theory step is refused
    with the problem's own reason (it used to blame a missing minibatch_variance_bound, which
    the problem has), and a given sigma2 runs."""
    from shrinkgrad.problems import least_squares

    p = least_squares("a1a", n_clients=5)
    with pytest.raises(ValueError, match=r"gives none \(the squared loss has no uniform bound"):
        make_method("ef21_sgd[b=4]").bind(p, "top_k[k=3]", "theory")
    assert make_method("ef21_sgd[b=4,sigma2=2]").bind(p, "top_k[k=3]", "theory").stepsize > 0
