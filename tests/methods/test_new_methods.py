"""EF21+ and DIANA (issue 13): per-client loops, what each is for, bits and theory steps."""

from __future__ import annotations

import pytest
import torch
from methods_fixtures import LeastSquares, rand_k, run, trajectory
from methods_reference import diana_loop, ef21_plus_loop

from shrinkgrad import theory as T
from shrinkgrad.methods import DIANA, EF21Plus, ProblemOracle, make_method

ROUNDS = 30


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.fixture
def p5() -> LeastSquares:
    return LeastSquares(n=5, d=9, m=7, seed=3, spread=6.0)


# --------------------------------------------------------------------------------------------
# DIANA
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "alpha", "init"), [("diana", None, "zero"),
                         ("diana[alpha=0.1,init=full]", 0.1, "full")])  # fmt: skip
def test_diana_equals_a_per_client_loop(p5: LeastSquares, spec: str, alpha, init: str) -> None:  # type: ignore[no-untyped-def]
    C = rand_k(3)
    bound, states = run(spec, p5, C, 0.02, ROUNDS, seed=5)
    a = alpha if alpha is not None else 1.0 / (1.0 + C.omega(p5.d))
    ref = diana_loop(p5, bound.cfg.compressor, 0.02, a, 5, ROUNDS, p5.x0(), init=init)  # type: ignore[attr-defined]
    close(trajectory(states), torch.stack(ref))
    for s in states:  # the server's mean shift is the mean of the clients' shifts
        close(s.server.h, s.clients.h.mean(0))  # type: ignore[attr-defined]


def test_diana_reaches_the_optimum_where_dcgd_stalls() -> None:
    """[DIANA]'s point: the shifts learn ∇f_i(x*) ≠ 0, so the compressed differences vanish."""
    p = LeastSquares(n=5, d=8, m=6, spread=2.0)
    assert float(p.client_grads(p.x_star).norm(dim=1).min()) > 0.1  # heterogeneous clients
    dist = {}
    for spec in ("diana", "dcgd"):
        _, states = run(spec, p, rand_k(4), 0.1, 500)
        dist[spec] = float((states[-1].x - p.x_star).norm())
    assert dist["diana"] < 1e-9 < 1e-2 < dist["dcgd"]


def test_diana_bits_and_theory_step(lsq: LeastSquares) -> None:
    C = rand_k(2)
    omega = C.omega(lsq.d)
    bound = make_method("diana").bind(lsq, C, "theory")
    want = T.stepsize_diana(lsq.L, lsq.L_QM, omega, lsq.n)
    assert bound.cfg.stepsize == want and bound.cfg.stepsize_rule == "stepsize_diana"
    assert want == T.stepsize_diana(lsq.L, lsq.L_QM, omega, lsq.n, 1 / (1 + omega))
    oracle = ProblemOracle(lsq)
    state, t0 = bound.init(lsq.x0(), oracle)
    assert float(t0.up.sum()) == 0.0  # h_i⁰ = 0: nothing sent
    _, t1 = bound.step(state, oracle)
    assert torch.equal(t1.up, torch.full((lsq.n,), float(C.bits(lsq.d))))
    full = make_method("diana[init=full]").bind(lsq, C, "theory")
    assert torch.equal(full.init(lsq.x0(), oracle)[1].up, torch.full((lsq.n,), 32.0 * lsq.d))
    # α above 1/(1 + ω): runs with a number, the theory refuses and says why
    too_big = make_method("diana[alpha=0.9]")
    assert too_big.bind(lsq, C, 0.01).cfg.stepsize == 0.01
    with pytest.raises(ValueError, match=r"alpha ≤ 1/\(1 \+ ω\)"):
        too_big.bind(lsq, C, "theory")
    with pytest.raises(ValueError, match="needs an unbiased compressor"):
        make_method("diana").bind(lsq, "top_k[k=1]", 0.01)
    with pytest.raises(ValueError, match=r"alpha .* must be in \(0, 1\]"):
        DIANA(alpha=1.5)


def test_diana_runtimes() -> None:
    m = make_method("diana")
    assert m.unsupported("simulator") is None and m.unsupported("runner") is None
    assert m.unsupported("hook") is None  # per tensor: h_i is the memory, x ← x − γ(h + agg)
    assert "stale" in str(m.unsupported("ps"))


# --------------------------------------------------------------------------------------------
# EF21+
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("comp", ["top_k[k=2]", "scaled_rand_k"])
def test_ef21_plus_equals_a_per_client_loop(p5: LeastSquares, comp: str) -> None:
    C = rand_k(3, scaled=True) if comp == "scaled_rand_k" else comp
    bound, states = run("ef21_plus", p5, C, 0.05, ROUNDS, seed=2)
    ref, switched = ef21_plus_loop(p5, bound.cfg.compressor, 0.05, 2, ROUNDS, p5.x0())  # type: ignore[attr-defined]
    close(trajectory(states), torch.stack(ref))
    assert 0 < switched < p5.n * ROUNDS  # both estimators are chosen along the way


def test_ef21_plus_is_never_farther_from_the_gradients_than_ef21(p5: LeastSquares) -> None:
    """From the same state, EF21+'s g_i is at least as close to ∇f_i as EF21's, every client."""
    C = "top_k[k=1]"
    plus = make_method("ef21_plus").bind(p5, C, 0.05, seed=1)
    ef21 = make_method("ef21").bind(p5, C, 0.05, seed=1)
    oracle = ProblemOracle(p5)
    state, _ = plus.init(p5.x0(), oracle)
    for _ in range(15):
        nxt, _ = plus.step(state, oracle)
        alt, _ = ef21.step(state, oracle)
        close(nxt.x, alt.x)  # the same x^{t+1} = x^t − γ g^t
        G = p5.client_grads(nxt.x)
        err_plus = (nxt.clients.g - G).norm(dim=1)
        err_ef21 = (alt.clients.g - G).norm(dim=1)
        assert bool((err_plus <= err_ef21 * (1 + 1e-12)).all())
        state = nxt


def test_ef21_plus_bits_theory_and_runtimes(lsq: LeastSquares) -> None:
    C = "top_k[k=2]"
    bound = make_method("ef21_plus").bind(lsq, C, "theory")
    alpha = 2 / lsq.d
    assert bound.cfg.stepsize == T.stepsize_ef21_plus(lsq.L, lsq.L_QM, alpha)
    assert T.stepsize_ef21_plus(lsq.L, lsq.L_QM, alpha) == T.stepsize_ef21(lsq.L, lsq.L_QM, alpha)
    assert bound.cfg.stepsize_rule == "stepsize_ef21_plus"
    reloaded = make_method("ef21_plus[rule=reloaded]").bind(lsq, C, "theory")
    assert reloaded.cfg.stepsize == T.stepsize_ef21_reloaded(lsq.L, lsq.L_AM, alpha)
    oracle = ProblemOracle(lsq)
    state, _ = bound.init(lsq.x0(), oracle)
    _, traffic = bound.step(state, oracle)
    msg = make_method("ef21").bind(lsq, C, "theory").cfg.compressor.bits(lsq.d)
    assert torch.equal(traffic.up, torch.full((lsq.n,), float(msg) + 1.0))  # + the flag bit
    assert torch.equal(traffic.up_paper, torch.full((lsq.n,), 32.0 * 2))
    m = EF21Plus()
    assert m.unsupported("runner") is None and "all-reduce" in str(m.unsupported("hook"))
    with pytest.raises(ValueError, match="needs a contractive compressor"):
        make_method("ef21_plus").bind(lsq, rand_k(1), 0.01)
