"""PowerSGD's shared basis (``power_sgd[rank, shared=true]``): one collective step of the rows
equals an independent transcription of Vogels et al. 2019 Alg. 1 with W workers, its mean is
the operator on the mean matrix, the state stays shared, and EF21 / EF run with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shrinkgrad import Keys, make_compressor, make_problem, simulate
from shrinkgrad.compressors import ConstantUnknownError, PowerSGD


def _shared(spec: str = "power_sgd[rank=2,shared=true]") -> PowerSGD:
    c = make_compressor(spec)
    assert isinstance(c, PowerSGD) and c.shared and c.collective_rows
    return c


def _vogels_workers(Ms: list[np.ndarray], Q: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Vogels et al. 2019 Alg. 1 with W workers, in numpy (Gram–Schmidt): P = Σ_w M_w Q
    (all-reduce), P̂ = orthogonalize(P), Q_w = M_wᵀ P̂; worker w's own part P̂ Q_wᵀ, next Q the
    mean of the Q_w (the all-reduce mean)."""
    P = sum(M @ Q for M in Ms)
    for j in range(P.shape[1]):
        for i in range(j):
            P[:, j] -= (P[:, i] @ P[:, j]) * P[:, i]
        P[:, j] /= np.linalg.norm(P[:, j])
    Qs = [M.T @ P for M in Ms]
    return [P @ Qw.T for Qw in Qs], sum(Qs) / len(Qs)


def test_shared_step_is_the_paper_algorithm_with_workers() -> None:
    c = _shared()
    d, W = 30, 3  # a 5 × 6 view
    rng = np.random.default_rng(0)
    state = c.init_state(torch.zeros(W, d, dtype=torch.float64), None)
    assert state.shape == (W, 6, 2) and bool((state == state[:1]).all())  # one shared Q0
    Q = state[0].numpy().copy()
    for _ in range(4):  # the Q carried over rounds stays shared and follows the reference
        x = torch.from_numpy(rng.standard_normal((W, d)))
        y, state = c.step(x, None, state)
        outs, Q = _vogels_workers([x[w].numpy().reshape(5, 6) for w in range(W)], Q)
        for w in range(W):
            np.testing.assert_allclose(y[w].numpy(), outs[w].reshape(-1), atol=1e-12)
            # QR (Householder) and Gram–Schmidt may choose opposite signs of a column of P̂
            # (and so of Q); the outputs P̂ Q_wᵀ do not depend on them
            signs = np.sign((state[w].numpy() * Q).sum(0))
            np.testing.assert_allclose(state[w].numpy(), Q * signs, atol=1e-12)


def test_shared_mean_is_the_operator_on_the_mean_and_rows_interact() -> None:
    c, per_client = _shared(), make_compressor("power_sgd[rank=2]")
    assert isinstance(per_client, PowerSGD)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((4, 42)))  # a 6 × 7 view
    q = c.init_state(x, None)
    y, q_next = c.step(x, None, q)
    want, q_want = per_client.step(x.mean(0), Keys.derive(0), q[0])
    torch.testing.assert_close(y.mean(0), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(q_next[0], q_want, rtol=0, atol=1e-12)
    # client 0's output depends on client 1's matrix: a collective, not a per-client operator
    x2 = x.clone()
    x2[1] = torch.from_numpy(rng.standard_normal(42))
    assert float((c.step(x2, None, q)[0][0] - y[0]).abs().max()) > 1e-6
    # a projection on the shared span: never an expansion, row by row
    for i in range(4):
        err, n2 = float(((y[i] - x[i]) ** 2).sum()), float((x[i] ** 2).sum())
        assert err <= n2 * (1 + 1e-12)


def test_shared_mode_bits_alpha_state_and_refusals() -> None:
    c = _shared("power_sgd[rank=4,shared=true]")
    d = 14  # a 4 × 4 view: r(m + n) = 32 > d, still the factors (the shared P is the message)
    assert not c.dense_message(d) and c.bits(d) == 32 * 4 * 8
    assert c.bits(10**6, torch.bfloat16) == 16 * 4 * 2000 == c.paper_bits(10**6, torch.bfloat16)
    assert c.deterministic and make_compressor(c.spec).spec == "power_sgd[rank=4,shared=true]"
    with pytest.raises(ConstantUnknownError, match="depends on the others"):
        c.alpha(100)
    assert _shared("power_sgd[rank=2,alpha=0.1,shared=true]").alpha(100) == 0.1
    x = torch.randn(3, 100)
    q = c.init_state(x, None)
    q[1] += 1.0
    with pytest.raises(ValueError, match="hold different Q's"):
        c.step(x, None, q)
    with pytest.raises(TypeError, match="shared=true or shared=false"):
        PowerSGD(2, shared="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["ef21", "ef"])
def test_error_feedback_runs_with_the_shared_basis(method: str) -> None:
    problem = make_problem("logistic_regression[dataset=australian_scale,n_clients=6]")
    spec = "power_sgd[rank=2,shared=true]"
    res = simulate(problem, method, spec, stepsize=0.3, rounds=150, seed=1, log_every=50)
    t = res.table
    assert res.status == "completed"
    assert float(t["grad_norm_sq"].iloc[-1]) < float(t["grad_norm_sq"].iloc[0])
    cs = res.state.clients.compressor_state
    assert cs.shape == (6, 4, 2) and bool((cs == cs[:1]).all())  # still one shared Q


def test_partial_participation_is_refused_at_the_step() -> None:
    problem = make_problem("logistic_regression[dataset=australian_scale,n_clients=6]")
    with pytest.raises(ValueError, match="hold different Q's"):
        simulate(problem, "ef21_pp[p=0.5]", "power_sgd[rank=1,shared=true]", stepsize=0.3, rounds=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [7, 16, None])  # 7 × 5 and 16 × 3 views of d = 35 / 48 / 48
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_factor_outputs_into_a_buffer_are_the_same_bits(
    dtype: torch.dtype, rows: int | None, offset: int
) -> None:
    """The hook forms P̂ Q_iᵀ and P̂ Q̄ᵀ straight into its buffers (``out=``, at any offset, so
    at any alignment); the bits are those of the separate product (the stacked ``combine``),
    with Q in the layouts the hook hands over (the transposed view factor_q returns, a slice
    of the received buffer) and for a padded view (7 rows of d = 35 → no padding; the flat
    rule of d = 48: a 7 × 7 view, padded) the copy into the buffer."""
    c = _shared(f"power_sgd[rank=2,shared=true{'' if rows is None else f',rows={rows}'}]")
    d = 35 if rows == 7 else 48
    g = torch.Generator().manual_seed(offset)
    x = torch.randn(1, d, generator=g, dtype=dtype)
    q0 = torch.randn(c.matrix_shape(d)[1], 2, generator=g, dtype=dtype)
    p_hat = c.orthonormal_basis(c.factor_p(x, q0)[0])
    q_i = c.factor_q(x, p_hat)  # (1, n, 2), a transposed view
    wire = torch.randn(offset + q_i.numel(), dtype=dtype)
    wire[offset:].copy_(q_i.reshape(-1))
    q_bar = wire[offset:].view(q_i.shape)  # a slice of a received buffer
    for q in (q_i, q_bar):
        want = c.factor_outputs(p_hat, q, d, dtype)
        buf = torch.full((offset + d,), float("nan"), dtype=dtype)
        got = c.factor_outputs(p_hat, q, d, dtype, out=buf[offset:])
        assert got.shape == (1, d) and torch.equal(got, want)
        assert torch.equal(buf[offset:], want[0]) and bool(buf[:offset].isnan().all())
        if c.matrix_shape(d)[0] * c.matrix_shape(d)[1] == d:  # written in place, not copied
            assert got.data_ptr() == buf[offset:].data_ptr()


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "shape", [(16, 2048), (2048, 16), (2048, 1024), (45, 46), (16, 16), (100, 257)]
)
def test_the_product_kernel_gives_torchs_bits(rank: int, shape: tuple[int, int]) -> None:
    """The float32 kernel of P̂ Qᵀ (``_lowrank_kernels``: one fused multiply-add chain per
    entry, sgemm's order) equals ``torch.mm`` bit for bit, for orthonormal and for arbitrary
    factors, so the decompression (hook and simulator) keeps the bits of the BLAS product; it
    writes into a given buffer, and leaves float64 and thin products to torch. The bits are
    BLAS's order on this machine's torch; where a BLAS sums another way (another CPU or torch
    build: probed on a product the order decides), the kernel must still be the product to
    float32 round-off."""
    from shrinkgrad.compressors import _lowrank_kernels as K

    def same_order_as_blas() -> bool:
        g0 = torch.Generator().manual_seed(0)
        a0, b0 = torch.randn(64, 8, generator=g0), torch.randn(64, 8, generator=g0)
        return torch.equal(K.product_into(a0, b0, torch.empty(64, 64)), torch.mm(a0, b0.t()))

    exact = same_order_as_blas()

    m, n = shape
    g = torch.Generator().manual_seed(m * n + rank)
    thin = torch.randn(K.MIN_SIDE - 1, rank, generator=g)
    assert not K.usable(thin, torch.randn(n, rank)) and not K.usable(torch.randn(m, rank), thin)
    p_hat = torch.linalg.qr(torch.randn(m, rank, generator=g)).Q
    for a in (p_hat, 1e3 * torch.randn(m, rank, generator=g)):
        b = torch.randn(rank, n, generator=g).t()  # a transposed view, as factor_q returns
        assert K.usable(a, b)
        out = torch.full((m, n), float("nan"))
        assert K.product_into(a, b, out) is out
        ref = torch.mm(a, b.t())
        if exact:
            assert torch.equal(out, ref)
        else:  # another BLAS order: the same product up to float32 rounding
            bound = 4 * rank * torch.finfo(torch.float32).eps * (a.abs() @ b.abs().t())
            assert bool(((out - ref).abs() <= bound).all())
    assert not K.usable(p_hat.double(), b.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [16, 40, 3])  # 16 × 40, 40 × 16 (the kernel), 3 × 214 (torch)
@pytest.mark.parametrize("alpha", [1.0, -1.0])
def test_fused_addition_of_the_factors_is_the_separate_one(
    dtype: torch.dtype, rows: int, alpha: float
) -> None:
    """EF21's g + P̂ Q_iᵀ (and EF's e − P̂ Q_iᵀ) as the hook runs them, fused (``add_outputs``:
    one pass, no dense C; through ``rules.add_message`` of a LowRankMessage), give exactly the
    bits of forming the product (``factor_outputs``) and then adding it; a LowRankMessage's
    ``dense`` is the product; other α and a padded view are refused or formed densely."""
    from shrinkgrad.methods.rules import LowRankMessage, add_message

    c = _shared(f"power_sgd[rank=2,shared=true,rows={rows}]")
    d = 640 if rows != 3 else 642
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, d, generator=g, dtype=dtype)
    q0 = torch.randn(c.matrix_shape(d)[1], 2, generator=g, dtype=dtype)
    p_hat = c.orthonormal_basis(c.factor_p(x, q0)[0])
    q_i = c.factor_q(x, p_hat)
    state = 1e2 * torch.randn(d, generator=g, dtype=dtype)
    separate = state + alpha * c.factor_outputs(p_hat, q_i, d, dtype)[0]
    fused = state.clone()
    c.add_outputs(fused, p_hat, q_i, alpha)
    assert torch.equal(fused, separate)

    def add(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, a: float) -> None:
        c.add_outputs(x, left, right, a)

    msg = LowRankMessage(p_hat, q_i, (d,), add)
    assert torch.equal(msg.dense(), c.factor_outputs(p_hat, q_i, d, dtype)[0])
    kept = state.clone()
    out = add_message(kept, msg, inplace=True, alpha=alpha)
    assert out is kept and torch.equal(out, separate)
    assert torch.equal(add_message(state, msg, alpha=alpha), separate)  # functional form
    assert torch.allclose(add_message(state, msg, alpha=0.5), state + 0.5 * msg.dense())
    with pytest.raises(ValueError, match="alpha"):
        c.add_outputs(state.clone(), p_hat, q_i, 0.5)
    with pytest.raises(ValueError, match="contiguous"):
        c.add_outputs(torch.zeros(d + 1, dtype=dtype), p_hat, q_i)
