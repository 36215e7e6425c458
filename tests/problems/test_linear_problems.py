"""Oracles of the linear-model problems against an independent autograd computation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from shrinkgrad.problems import (
    LinearModelProblem,
    least_squares,
    load,
    logistic_regression,
    make_split,
)
from shrinkgrad.rng import Keys

CASES = [
    ("logistic", "nonconvex", 0.1),
    ("logistic", "l2", 0.05),
    ("squared", "nonconvex", 0.2),
    ("squared", "l2", 0.3),
    ("squared", "nonconvex", 0.0),
]


def _build(loss: str, reg: str, lam: float, storage: str, dtype: str = "float64") -> Any:
    factory = logistic_regression if loss == "logistic" else least_squares
    split = make_split("dirichlet[alpha=1.0,seed=3]")  # unequal client sizes
    return factory("a1a", n_clients=6, split=split, lam=lam, reg=reg, storage=storage, dtype=dtype)


def _reference_fi(loss: str, reg: str, lam: float, parts: list[np.ndarray]) -> list[Any]:
    """f_i written from scratch on dense float64 client blocks (the dataset, not the problem)."""
    ds = load("a1a")
    fs = []
    for p in parts:
        A = torch.from_numpy(ds.X[p].toarray())
        y = torch.from_numpy(np.asarray(ds.y[p]))

        def f(x: torch.Tensor, A: torch.Tensor = A, y: torch.Tensor = y) -> torch.Tensor:
            z = A @ x
            data = (
                torch.log1p(torch.exp(-y * z)).mean()
                if loss == "logistic"
                else ((z - y) ** 2).mean()
            )
            r = (x**2 / (1 + x**2)).sum() if reg == "nonconvex" else 0.5 * (x**2).sum()
            return data + lam * r

        fs.append(f)
    return fs


def _autograd(f: Any, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(x), x)
    return g


@pytest.mark.parametrize(("loss", "reg", "lam"), CASES)
@pytest.mark.parametrize("storage", ["sparse", "dense"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_client_gradients_equal_autograd(
    loss: str, reg: str, lam: float, storage: str, backend: str
) -> None:
    p = _build(loss, reg, lam, storage)
    p.backend = backend
    parts = make_split("dirichlet[alpha=1.0,seed=3]")(load("a1a"), 6)
    fs = _reference_fi(loss, reg, lam, parts)
    gen = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(p.d, dtype=torch.float64, generator=gen)
    X = 0.3 * torch.randn(p.n, p.d, dtype=torch.float64, generator=gen)
    ref = torch.stack([_autograd(f, x) for f in fs])
    ref_at = torch.stack([_autograd(f, X[i]) for i, f in enumerate(fs)])
    G = p.client_grads(x)
    assert G.shape == (p.n, p.d) and G.dtype == torch.float64
    torch.testing.assert_close(G, ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(p.grad(x), ref.mean(0), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(p.client_grads_at(X), ref_at, rtol=1e-12, atol=1e-13)
    losses = torch.stack([f(x) for f in fs]).detach()
    torch.testing.assert_close(p.client_losses(x), losses, rtol=1e-12, atol=0)
    assert p.loss(x) == pytest.approx(float(losses.mean()), rel=1e-12)


def test_float32_matches_float64() -> None:
    p64 = _build("logistic", "nonconvex", 0.1, "sparse")
    p32 = _build("logistic", "nonconvex", 0.1, "sparse", dtype="float32")
    x = torch.linspace(-1, 1, p64.d, dtype=torch.float64)
    G32 = p32.client_grads(x.float())
    assert G32.dtype == torch.float32
    torch.testing.assert_close(G32.double(), p64.client_grads(x), rtol=1e-5, atol=1e-6)
    assert p32.L == p64.L  # constants are computed in float64 from the same data
    torch.testing.assert_close(p32.L_i, p64.L_i, rtol=0, atol=0)


def test_stochastic_with_full_batches_is_exact() -> None:
    p = _build("logistic", "nonconvex", 0.1, "sparse")
    X = torch.randn(p.n, p.d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    keys = Keys.derive(0, client=np.arange(p.n), stream="minibatch")
    S = p.client_stoch_grads(X, p.client_sizes, keys)
    torch.testing.assert_close(S, p.client_grads_at(X), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_minibatches_have_the_requested_sizes_and_depend_only_on_own_key(backend: str) -> None:
    p = _build("squared", "l2", 0.1, "sparse")
    p.backend = backend
    b = torch.clamp(p.client_sizes // 3, min=1)
    keys = Keys.derive(7, round=3, client=np.arange(p.n), stream="minibatch")
    rows, w = p.minibatch_rows(b, keys)
    client = torch.from_numpy(np.repeat(np.arange(p.n), p.client_sizes.numpy()))[rows]
    assert torch.equal(torch.bincount(client, minlength=p.n), b)
    torch.testing.assert_close(w, 1.0 / b[client].double())
    # change client 0's key only: the other clients' minibatches are unchanged
    other = Keys(keys.lo.clone(), keys.hi.clone())
    other.lo[0] = (other.lo[0] + 12345) % 2**32
    x = torch.ones(p.d, dtype=torch.float64)
    S1, S2 = p.client_stoch_grads(x, b, keys), p.client_stoch_grads(x, b, other)
    torch.testing.assert_close(S1[1:], S2[1:], rtol=0, atol=0)
    assert not torch.equal(S1[0], S2[0])


def test_numba_and_torch_minibatches_agree() -> None:
    p = _build("logistic", "l2", 0.1, "dense")
    keys = Keys.derive(1, round=9, client=np.arange(p.n), stream="minibatch")
    X = torch.randn(p.n, p.d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a = p.client_stoch_grads(X, 5, keys)
    p.backend = "torch"
    torch.testing.assert_close(p.client_stoch_grads(X, 5, keys), a, rtol=1e-12, atol=1e-14)


def test_minibatch_estimator_is_unbiased() -> None:
    """Monte-Carlo over 600 keyed rounds: the mean is within 6 standard errors of ∇f_i."""
    p = _build("logistic", "nonconvex", 0.1, "sparse")
    x = torch.full((p.d,), 0.2, dtype=torch.float64)
    K = 600
    draws = torch.stack(
        [
            p.client_stoch_grads(x, 4, Keys.derive(11, round=t, client=np.arange(p.n), stream="mb"))
            for t in range(K)
        ]
    )
    mean, se = draws.mean(0), draws.std(0) / K**0.5
    err = (mean - p.client_grads(x)).abs()
    assert bool((err <= 6 * se + 1e-12).all())
    # and the sampling is genuinely random: the draws are not all equal
    assert float(draws.std(0).max()) > 1e-3


def test_oracle_input_errors() -> None:
    p = _build("logistic", "nonconvex", 0.1, "sparse")
    with pytest.raises(ValueError, match=r"shape \(123,\)"):
        p.client_grads(torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN or inf"):
        p.client_grads(torch.full((p.d,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \(n, d\)"):
        p.client_grads_at(torch.zeros(p.n + 1, p.d, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch tensor"):
        p.client_grads(np.zeros(p.d))  # type: ignore[arg-type]
    keys = Keys.derive(0, client=np.arange(p.n))
    with pytest.raises(ValueError, match=r"batch size .* must be in \[1, m_i"):
        p.client_stoch_grads(torch.zeros(p.d, dtype=torch.float64), 10**6, keys)
    with pytest.raises(TypeError, match="integers"):
        p.client_stoch_grads(torch.zeros(p.d, dtype=torch.float64), 0.5, keys)  # type: ignore[arg-type]


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="lam"):
        logistic_regression("australian", n_clients=2, lam=-1.0)
    with pytest.raises(TypeError, match="dtype must be"):
        logistic_regression("australian", n_clients=2, dtype="float16")
    with pytest.raises(ValueError, match=r"no CUDA device|cpu"):
        if torch.cuda.is_available():  # pragma: no cover - only on GPU machines
            raise ValueError("cpu")
        logistic_regression("australian", n_clients=2, device="cuda")
    with pytest.raises(ValueError, match="every client needs at least one sample"):
        LinearModelProblem(
            np.eye(2), np.ones(2), [np.array([0]), np.array([], dtype=np.int64)], loss="squared"
        )


def test_storage_auto_prefers_dense_for_dense_data() -> None:
    assert logistic_regression("australian", n_clients=5).storage == "dense"  # density 0.8
    assert logistic_regression("a1a", n_clients=5).storage == "sparse"  # density 0.11


def test_info_and_metadata() -> None:
    p = logistic_regression("australian", n_clients=5, split="shuffled[seed=2]")
    info = p.info()
    assert info["problem"] == "logreg_nonconvex" and info["dataset"] == "australian"
    assert info["split"] == "shuffled[seed=2]" and info["n_clients"] == 5 and info["d"] == 14
    assert int(p.client_sizes.sum()) == 690 and p.f_lower == 0.0
    torch.testing.assert_close(p.x0(), torch.zeros(14, dtype=torch.float64))


@pytest.mark.parametrize("factory", [logistic_regression, least_squares])
def test_minibatch_variance_by_enumerating_every_minibatch(factory: Any) -> None:
    import itertools

    parts = [np.arange(0, 5), np.arange(5, 12), np.arange(12, 13)]
    p = factory("australian_scale", split=parts, lam=0.1, reg="l2")
    x = torch.linspace(-0.3, 0.3, p.d, dtype=torch.float64)
    b = torch.tensor([2, 3, 1])
    ds = load("australian_scale")
    full = p.client_grads(x)
    expected = []
    for i, rows in enumerate(parts):
        A = torch.from_numpy(ds.X[rows].toarray())
        y = torch.from_numpy(np.asarray(ds.y[rows]))
        z = A @ x
        dphi = -y * torch.sigmoid(-y * z) if factory is logistic_regression else 2 * (z - y)
        per = dphi[:, None] * A + 0.1 * x  # per-sample gradients of f_i (regularizer included)
        devs = [
            float(((per[list(S)].mean(0) - full[i]) ** 2).sum())
            for S in itertools.combinations(range(len(rows)), int(b[i]))
        ]
        expected.append(np.mean(devs))
    np.testing.assert_allclose(p.minibatch_variance(x, b).numpy(), expected, rtol=1e-10, atol=1e-15)


def test_minibatch_variance_bound_for_logistic() -> None:
    p = logistic_regression("a1a", n_clients=6)
    bound = p.minibatch_variance_bound(3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        x = torch.randn(p.d, dtype=torch.float64, generator=gen) * 3
        assert bool((p.minibatch_variance(x, 3) <= bound * (1 + 1e-12)).all())
    assert (
        float(p.minibatch_variance(torch.zeros(p.d, dtype=torch.float64), p.client_sizes).max())
        == 0.0
    )
    with pytest.raises(ValueError, match="no uniform bound"):
        least_squares("a1a", n_clients=6).minibatch_variance_bound(3)


@pytest.mark.parametrize(("loss", "reg", "lam"), CASES)
@pytest.mark.parametrize("storage", ["sparse", "dense"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_restrict_is_the_clients_own_problem_bit_for_bit(
    loss: str, reg: str, lam: float, storage: str, dtype: str
) -> None:
    p = _build(loss, reg, lam, storage, dtype)
    ids = torch.tensor([4, 1, 3])  # any order: client j of the result is client ids[j]
    sub = p.restrict(ids)
    assert isinstance(sub, LinearModelProblem)
    assert (sub.n, sub.d, sub.dtype, sub.storage) == (3, p.d, p.dtype, p.storage)
    assert torch.equal(sub.client_sizes, p.client_sizes[ids])
    assert torch.equal(sub.L_i, p.L_i[ids])
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(p.d, generator=gen, dtype=torch.float64) * 0.3).to(p.dtype)
    X = (torch.randn(p.n, p.d, generator=gen, dtype=torch.float64) * 0.3).to(p.dtype)
    assert torch.equal(sub.client_grads(x), p.client_grads(x)[ids])
    assert torch.equal(sub.client_grads_at(X[ids]), p.client_grads_at(X)[ids])
    assert torch.equal(sub.client_losses(x), p.client_losses(x)[ids])
    # the keyed minibatch of client ids[j] is drawn from keys[ids[j]] alone: the same rows
    keys = Keys.derive(3, client=np.arange(p.n), stream="minibatch")
    b = torch.clamp(p.client_sizes // 2, min=1)
    assert torch.equal(
        sub.client_stoch_grads(X[ids], b[ids], keys[ids]),
        p.client_stoch_grads(X, b, keys)[ids],
    )
    # one client alone, and every client in order, are restrictions too
    assert torch.equal(p.restrict(torch.tensor([5])).client_grads(x)[0], p.client_grads(x)[5])
    assert torch.equal(p.restrict(torch.arange(p.n)).client_grads(x), p.client_grads(x))


def test_restrict_errors() -> None:
    p = logistic_regression("a1a", n_clients=4)
    with pytest.raises(ValueError, match=r"lie in \[0, n=4\)"):
        p.restrict(torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="distinct"):
        p.restrict(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="at least one"):
        p.restrict(torch.tensor([], dtype=torch.int64))
    with pytest.raises(TypeError, match="integers"):
        p.restrict(torch.tensor([0.0, 1.0]))


# --------------------------------------------------------------------------------------------
# the intercept option (issue 17)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loss", "reg", "lam"), [("logistic", "nonconvex", 0.1), ("squared", "l2", 0.3)]
)
@pytest.mark.parametrize("storage", ["sparse", "dense"])
def test_an_intercept_is_a_column_of_ones_with_exact_constants(
    loss: str, reg: str, lam: float, storage: str
) -> None:
    factory = logistic_regression if loss == "logistic" else least_squares
    split = make_split("dirichlet[alpha=1.0,seed=3]")
    base = factory("a1a", n_clients=6, split=split, lam=lam, reg=reg, storage=storage)
    p = factory("a1a", n_clients=6, split=split, lam=lam, reg=reg, storage=storage, intercept=True)
    assert p.d == base.d + 1 and p.intercept and p.info()["intercept"] is True
    # gradients: the model a_jᵀw + b, x = (w, b), the regularizer on every coordinate
    ds = load("a1a")
    parts = split(ds, 6)
    gen = torch.Generator().manual_seed(1)
    x = 0.3 * torch.randn(p.d, dtype=torch.float64, generator=gen)
    for i, rows in enumerate(parts):
        A = torch.from_numpy(ds.X[rows].toarray())
        y = torch.from_numpy(np.asarray(ds.y[rows]))

        def f(v: torch.Tensor, A: torch.Tensor = A, y: torch.Tensor = y) -> torch.Tensor:
            z = A @ v[:-1] + v[-1]
            data = (
                torch.log1p(torch.exp(-y * z)).mean()
                if loss == "logistic"
                else ((z - y) ** 2).mean()
            )
            r = (v**2 / (1 + v**2)).sum() if reg == "nonconvex" else 0.5 * (v**2).sum()
            return data + lam * r

        torch.testing.assert_close(p.client_grads(x)[i], _autograd(f, x), rtol=1e-12, atol=1e-13)
        # L_i: the largest eigenvalue of f_i's Hessian at x = 0, where it is attained
        H = torch.autograd.functional.hessian(f, torch.zeros(p.d, dtype=torch.float64))
        assert float(p.L_i[i]) == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-10)
    # adding a column never lowers λ_max (interlacing); with one-hot a1a it raises every L_i
    assert bool((p.L_i > base.L_i).all()) and p.L > base.L
    # restrict keeps the intercept, bit for bit
    ids = torch.tensor([4, 1])
    sub = p.restrict(ids)
    assert sub.intercept and sub.d == p.d
    assert torch.equal(sub.client_grads(x), p.client_grads(x)[ids])
    assert torch.equal(sub.L_i, p.L_i[ids])


def test_intercept_and_threads_by_name() -> None:
    from shrinkgrad.problems import make_problem

    p = make_problem("logistic_regression[dataset=a1a,n_clients=3,intercept=true,threads=2]")
    assert p.d == 124 and p.intercept and p.threads == 2  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        logistic_regression("a1a", n_clients=3, threads=0)
    with pytest.raises(ValueError, match="intercept must be True or False"):
        logistic_regression("a1a", n_clients=3, intercept="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(("d", "kind"), [(1, np.uint8), (256, np.uint8), (257, np.uint16)])
def test_column_indices_are_stored_in_the_narrowest_type(d: int, kind: type) -> None:
    """d − 1 must fit: 256 features still fit uint8, 257 need uint16."""
    from shrinkgrad.problems.linear import _index_dtype

    assert _index_dtype(d) is kind
    assert _index_dtype(2**16 + 1) is np.uint32


@pytest.mark.parametrize("loss", ["logistic", "squared"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_narrow_index_pass_equals_the_int64_pass_and_the_separate_losses(
    loss: str, dtype: str
) -> None:
    """The one-point kernel on the stored uint8 indices gives the bits of the same kernel on
    int64 indices, and its fused losses those of client_losses (the separate margins pass)."""
    from shrinkgrad.problems import _kernels as PK

    p = _build(loss, "nonconvex", 0.1, "sparse", dtype=dtype)
    assert p._indices.dtype == np.uint8  # a1a: d = 123
    x = 0.3 * torch.randn(p.d, dtype=p.dtype, generator=torch.Generator().manual_seed(4))
    G, losses = p.client_grads_and_losses(x)
    G64 = np.empty((p.n, p.d), dtype=p._A.dtype)
    PK.point_pass_csr(
        p._indptr, p._indices.astype(np.int64), p._data, p._ones, p.offsets, x.numpy(), p._y,
        p._w, loss == "logistic", p._reg_grad(x).numpy(), G64, p._inv_m,
        np.empty(0, dtype=np.float64), p._block_rows, np.empty((0, p.d), dtype=p._A.dtype),
    )  # fmt: skip
    assert torch.equal(G, torch.from_numpy(G64))
    assert torch.equal(losses, p.client_losses(x))
    assert torch.equal(G, p.client_grads(x))


@pytest.mark.parametrize("storage", ["sparse", "dense"])
def test_the_pass_mean_gradient_is_the_block_sums_in_order_for_any_thread_count(
    storage: str,
) -> None:
    """∇f from the one-point pass's block column sums (no second pass over G) is, bit for bit,
    Σ_blocks (Σ_{c in block} G[c], clients in order) / n computed here row by row; the same for
    1 and 2 threads; the same as the fused triple's mean; and within round-off of G.mean(0)."""
    from shrinkgrad.problems import _kernels as PK

    data = "a1a" if storage == "sparse" else "australian_scale"
    n = 3 * PK.PASS_BLOCK + 5  # four blocks, the last partial
    one = logistic_regression(data, n_clients=n, lam=0.1, split="contiguous[reuse=true]")
    two = logistic_regression(data, n_clients=n, lam=0.1, split="contiguous[reuse=true]", threads=2)
    assert one.storage == storage
    x = 0.2 * torch.randn(one.d, dtype=one.dtype, generator=torch.Generator().manual_seed(9))
    G = one.client_grads(x).numpy()
    ref = np.zeros(one.d)
    for b0 in range(0, n, PK.PASS_BLOCK):
        acc = G[b0].copy()
        for c in range(b0 + 1, min(n, b0 + PK.PASS_BLOCK)):
            acc = acc + G[c]
        ref = acc if b0 == 0 else ref + acc
    ref = ref / n
    g1, g2 = one.grad(x), two.grad(x)
    assert torch.equal(g1, torch.from_numpy(ref)) and torch.equal(g1, g2)
    G3, losses, mean = one.client_grads_losses_and_mean(x)
    assert torch.equal(mean, g1) and torch.equal(G3, torch.from_numpy(G))
    assert torch.equal(losses, one.client_losses(x))
    torch.testing.assert_close(g1, torch.from_numpy(G).mean(dim=0), rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("reg", ["nonconvex", "l2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_regularizer_kernel_has_the_torch_gradient_bits_and_an_in_order_value(
    reg: str, dtype: torch.dtype
) -> None:
    """The numba backend's ψ in one call: its gradient equals the torch expression bit for bit
    (random, tiny, huge and signed-zero entries), its value is the float64 sum in order times λ
    (λ/2) in the dtype, and both backends' f_i agree to round-off."""
    from shrinkgrad.problems import _kernels as PK

    lam = 0.37
    gen = torch.Generator().manual_seed(11)
    big = 1e160 if dtype == torch.float64 else 1e20  # x² overflows, (1 + x²)² too
    edge = [0.0, -0.0, 1e-30, -1e-30, 1e10, -3e17, 1.0, -1.0, big, -big]
    x = torch.cat(
        [
            torch.randn(200, dtype=torch.float64, generator=gen) * 3.0,
            torch.tensor(edge, dtype=torch.float64),
        ]
    ).to(dtype)
    p = _build("logistic", reg, lam, "sparse", dtype=str(dtype).split(".")[1])
    grad = np.empty(x.numel(), dtype=x.numpy().dtype)
    PK.regularizer(reg == "nonconvex", lam, x.numpy(), grad, np.empty(0, dtype=grad.dtype))
    ref = (2.0 * lam) * x / (1.0 + x * x) ** 2 if reg == "nonconvex" else lam * x
    assert torch.equal(torch.from_numpy(grad), ref)  # the same bits, signed zeros included
    assert torch.equal(torch.from_numpy(grad).signbit(), ref.signbit())
    xn = x[:-2].numpy()  # ψ itself is finite: without the overflowing entries
    value = np.empty(1, dtype=xn.dtype)
    PK.regularizer(reg == "nonconvex", lam, xn, np.empty_like(xn), value)
    xs = [float(v) for v in xn]
    acc = 0.0
    for v in xs:
        q = np.asarray(v, dtype=xn.dtype)
        acc += float(q * q / (1 + q * q)) if reg == "nonconvex" else float(q * q)
    scale = np.asarray(lam if reg == "nonconvex" else 0.5 * lam, dtype=xn.dtype)
    assert value[0] == scale * np.asarray(acc, dtype=xn.dtype)
    # the problem's numba losses carry this value; the torch backend's differ by round-off only
    y = 0.3 * x[: p.d]  # margins of a moderate size (the backends' loss kernels differ too)
    f_numba = p.client_losses(y)
    p.backend = "torch"
    f_torch = p.client_losses(y)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(f_numba, f_torch, rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_nonconvex_regularizer_is_finite_where_x_squared_overflows(dtype: torch.dtype) -> None:
    """ψ = λ Σ x_j²/(1 + x_j²) is bounded by λd: an entry whose x_j² overflows (|x_j| > 1.3e154,
    1.8e19 in float32) adds its limit 1 in all three implementations (numba kernel, torch, the
    float64 value), not inf/inf = NaN, so a large but finite iterate has a finite loss."""
    from shrinkgrad.problems import _kernels as PK
    from shrinkgrad.problems.linear import _reg_value_np

    lam = 0.37
    big = 1e160 if dtype == torch.float64 else 1e20
    small = torch.tensor([0.0, 1.0, -3.0, 0.5], dtype=dtype)
    x = torch.cat([small, torch.tensor([big, -big], dtype=dtype)])
    assert torch.isfinite(small * small).all() and torch.isinf(x[4:] * x[4:]).all()
    want = sum(v * v / (1 + v * v) for v in (0.0, 1.0, -3.0, 0.5)) + 2.0  # two limits of 1
    value = np.empty(1, dtype=x.numpy().dtype)
    PK.regularizer(True, lam, x.numpy(), np.empty_like(x.numpy()), value)
    tol = 1e-15 if dtype == torch.float64 else 1e-6
    assert value[0] == pytest.approx(lam * want, rel=tol)
    assert _reg_value_np("nonconvex", x.numpy()) == pytest.approx(want, rel=tol)
    p = _build("logistic", "nonconvex", lam, "sparse", dtype=str(dtype).split(".")[1])
    assert float(p._reg_value(x)) == pytest.approx(lam * want, rel=tol)
    y = torch.zeros(p.d, dtype=dtype)
    y[0] = big
    for backend in ("numba", "torch"):
        p.backend = backend
        assert torch.isfinite(p.client_losses(y)).all(), backend
    assert np.isfinite(p.loss(y))


def test_the_loss_polynomial_is_within_a_few_ulps_of_logaddexp() -> None:
    """The fused pass's logistic loss φ = log(1 + exp(t)) from e = exp(−t) (a vectorised
    series with FMAs, no libm log) against numpy's logaddexp(0, t), relative to the value, for
    t across the exponent range, around the branch points v = exp(−|t|) = √2 − 1, and at
    e = 0 / inf (|t| past the range: φ = t and 0 exactly). Fails on a truncated series, a wrong
    branch constant or an FMA-induced loss of accuracy."""
    from shrinkgrad.problems import _kernels as PK

    gen = np.random.default_rng(5)
    b = -np.log(np.sqrt(2.0) - 1.0)  # |t| where v crosses √2 − 1
    t = np.concatenate(
        [
            gen.uniform(-40, 40, 20000),
            gen.uniform(-1, 1, 5000) * 1e-6 + b,
            gen.uniform(-1, 1, 5000) * 1e-6 - b,
            np.linspace(-700, 700, 5001),
            [0.0, 1e-300, -1e-300, 36.0, -36.0, 745.0, -745.0],
        ]
    )
    y = np.where(gen.random(t.size) < 0.5, 1.0, -1.0)
    z = -t / y  # t = −y z exactly (y = ±1)
    with np.errstate(over="ignore"):
        e = np.exp(-t)
    out = np.empty_like(t)
    PK._sample_losses(True, z, y, e, out)
    ref = np.logaddexp(0.0, t)
    ulps = np.abs(out - ref) / np.spacing(np.abs(ref))
    assert float(ulps.max()) <= 4.0, float(ulps.max())
    huge = np.array([800.0, -800.0])  # e = 0 (t ≫ 0) and inf (t ≪ 0)
    out2 = np.empty(2)
    with np.errstate(over="ignore"):
        PK._sample_losses(True, -huge, np.ones(2), np.exp(-huge), out2)
    assert out2[0] == 800.0 and out2[1] == 0.0
