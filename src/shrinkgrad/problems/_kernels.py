"""Single-pass CPU kernels (numba) for linear-model problems with clients as a tensor axis.

The samples of all clients are stored in client order. For a list of rows ``rows`` (all rows for
full gradients, a minibatch for stochastic ones), with ``client[k]`` the client of ``rows[k]``:

* :func:`rowdot_csr` / :func:`rowdot_dense`: z_k = ⟨a_{rows[k]}, X[client[k]]⟩ — one pass over
  the non-zeros of the chosen rows, whatever the number of clients;
* :func:`scatter_csr` / :func:`scatter_dense`: G[client[k]] += r_k a_{rows[k]} — the per-client
  weighted sums of rows, also one pass.

So the stacked client gradients cost O(nnz + n·d) for any n (benchmarks/problems.py). The
kernels are compiled per dtype (float32 / float64) on first use and cached on disk. Each sum is
accumulated in the order of the stored non-zeros (rows in order, columns in order), so results
do not depend on how the kernels are written.

Losses from the gradient pass (:func:`client_losses`): the logistic loss log(1 + exp(t)),
t = −y·z, needs exp(−t), which the gradient pass computes for φ'(z) anyway; the one-point pass
(:func:`point_pass_csr`) stores it when the caller wants the losses too, and
:func:`client_losses` finishes with one division and a polynomial per sample, in a loop the
compiler vectorises (no call into libm). The separate evaluation uses the same kernel on the same
exp(−t) (:func:`neg_margin_exp`), so the fused and the separate losses agree bit for bit.

:func:`point_pass_csr` / :func:`point_pass_dense` do the whole gradient pass at one point for
every client in one call (margins, φ', the per-client sums and the regularizer's gradient, with
the values of the kernels above bit for bit); their ``_threads`` versions spread the clients over
numba threads (``prange`` over clients: each client's rows are contiguous and its sums keep the
serial order, so the result is the same bit for bit for any number of threads).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from .._numba_twin import twin

__all__ = [
    "block_mean",
    "block_rows",
    "client_losses",
    "dphi_weighted",
    "neg_margin_exp",
    "point_pass_csr",
    "point_pass_csr_threads",
    "point_pass_dense",
    "point_pass_dense_threads",
    "regularizer",
    "rowdot_csr",
    "rowdot_dense",
    "scatter_csr",
    "scatter_dense",
    "select_smallest",
]

_jit: Any = numba.njit(cache=True, nogil=True)
#: the loss polynomial's kernel: vectorised (``error_model="numpy"``) with multiply-adds
#: contracted into FMAs (``fastmath={"contract"}`` only: no reassociation, no finite-math
#: assumptions), 0.07 against 0.10 ms on a9a's 32 561 samples
_jit_vec: Any = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
_jit_par: Any = numba.njit(cache=True, nogil=True, parallel=True)

#: log 2 and √2 − 1 (the split of the log1p argument range, below)
_LN2 = 0.6931471805599453
_SQRT2_M1 = 0.41421356237309503


@numba.njit(cache=True, inline="always")
def _row_dot(indptr, indices, data, ones, j, x):  # type: ignore[no-untyped-def]  # pragma: no cover
    """⟨a_j, x⟩ over row j's stored non-zeros, in their order (``ones``: data not read)."""
    s = 0.0
    if ones:
        for p in range(indptr[j], indptr[j + 1]):
            s += x[np.uint64(indices[p])]
    else:
        for p in range(indptr[j], indptr[j + 1]):
            s += data[p] * x[np.uint64(indices[p])]
    return s


@numba.njit(cache=True, inline="always")
def _row_scatter(indptr, indices, data, ones, j, rk, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """g += r_k a_j over row j's stored non-zeros, in their order (``ones``: data not read)."""
    if ones:
        for p in range(indptr[j], indptr[j + 1]):
            g[np.uint64(indices[p])] += rk
    else:
        for p in range(indptr[j], indptr[j + 1]):
            g[np.uint64(indices[p])] += rk * data[p]


@_jit
def rowdot_csr(indptr, indices, data, rows, client, X, ones, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``ones``: every stored value is 1.0 (binary features, e.g. a9a), so ``data`` is not read
    (1.0·v = v exactly: the same result). Unsigned indices skip numba's negative-index check."""
    for k in range(rows.shape[0]):
        out[k] = _row_dot(indptr, indices, data, ones, rows[k], X[client[k]])


@_jit
def scatter_csr(indptr, indices, data, rows, client, r, ones, G):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``ones`` as in :func:`rowdot_csr` (r_k·1.0 = r_k exactly)."""
    for k in range(rows.shape[0]):
        rk = r[k]
        if rk == 0.0:
            continue
        _row_scatter(indptr, indices, data, ones, rows[k], rk, G[client[k]])


@_jit
def dphi_weighted(logistic, z, y, w, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out_k = φ'(z_k; y_k)·w_k with the arithmetic of the numpy expressions it replaces
    (``-y * expit(-y * z) * w``, expit(t) = 1/(1 + exp(−t)) as scipy computes it, or
    ``2 * (z - y) * w``), in z's dtype: the same bits, without the temporaries."""
    one = z.dtype.type(1.0)
    two = z.dtype.type(2.0)
    if logistic:
        for k in range(z.shape[0]):
            ny = -y[k]
            out[k] = (ny * (one / (one + math.exp(-(ny * z[k]))))) * w[k]
    else:
        for k in range(z.shape[0]):
            out[k] = (two * (z[k] - y[k])) * w[k]


@_jit
def neg_margin_exp(z, y, e_out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """e_k = exp(−t_k), t_k = −y_k z_k: the expression of :func:`dphi_weighted` and of the
    one-point pass, the same bits."""
    for k in range(z.shape[0]):
        ny = -y[k]
        e_out[k] = math.exp(-(ny * z[k]))


@_jit_vec
def _sample_losses(logistic, z, y, e, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out_k = φ(z_k; y_k) in float64 (branch-free, so that the loop vectorises).

    Logistic: φ = log(1 + exp(t)) = max(t, 0) + log1p(v), v = exp(−|t|) ∈ (0, 1], which is e_k
    for t ≥ 0 and 1/e_k for t < 0. log1p(v) = 2 atanh(s), s = v/(2 + v); above v = √2 − 1 the
    argument is halved first, log1p(v) = log 2 + log1p((v − 1)/2), so that |s| ≤ 3 − 2√2 ≈ 0.1716
    and the series 2s Σ_{k ≤ 10} s^{2k}/(2k + 1) is exact to 2.4·10⁻¹⁷ relative (the first
    omitted term). Each branch's s is one quotient of e_k: s = e/(2 + e), (e − 1)/(e + 3),
    1/(2e + 1) or (1 − e)/(3e + 1) (e ± 1 is exact where it is used, Sterbenz). So the loss is
    within a few ulps of ``numpy.logaddexp(0, t)`` for every t (tested), and e = 0 or inf (|t|
    beyond the exponent range) give t and 0 exactly. The polynomial's multiply-adds are
    contracted into FMAs where the CPU has them (one rounding instead of two per step: the
    same bound, last bits that depend on the CPU, as ``exp`` from libm already does); the
    fused and the separate losses use this one kernel, so they still agree bit for bit.
    Squared: φ = (z − y)² in z's dtype, as ``(z - y) ** 2``.
    """
    if not logistic:
        for k in range(z.shape[0]):
            r = z[k] - y[k]
            out[k] = r * r
        return
    for k in range(z.shape[0]):
        ek = float(e[k])
        t = -float(y[k]) * float(z[k])
        pos = t >= 0.0
        big = ek >= _SQRT2_M1 if pos else ek <= 1.0 / _SQRT2_M1
        if pos:
            num = ek - 1.0 if big else ek
            den = ek + 3.0 if big else ek + 2.0
        else:
            num = 1.0 - ek if big else 1.0
            den = 3.0 * ek + 1.0 if big else 2.0 * ek + 1.0
        s = num / den
        s2 = s * s
        q = 1.0 / 21.0
        q = q * s2 + 1.0 / 19.0
        q = q * s2 + 1.0 / 17.0
        q = q * s2 + 1.0 / 15.0
        q = q * s2 + 1.0 / 13.0
        q = q * s2 + 1.0 / 11.0
        q = q * s2 + 1.0 / 9.0
        q = q * s2 + 1.0 / 7.0
        q = q * s2 + 1.0 / 5.0
        q = q * s2 + 1.0 / 3.0
        lp = 2.0 * s + (2.0 * s * s2) * q
        out[k] = (t if pos else 0.0) + (lp + _LN2 if big else lp)


@_jit
def client_losses(logistic, z, y, e, offsets, inv_m, buf, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out_c = (1/m_c) Σ_{k ∈ client c} φ(z_k; y_k) (float64), rows of client c being
    offsets[c]:offsets[c+1]; ``e`` = exp(−t) of the logistic loss (:func:`point_pass_csr`,
    :func:`neg_margin_exp`), ``buf`` a float64 scratch of length N."""
    _sample_losses(logistic, z, y, e, buf)
    for c in range(offsets.shape[0] - 1):
        acc = 0.0
        for k in range(offsets[c], offsets[c + 1]):
            acc += buf[k]
        out[c] = acc * inv_m[c]


@_jit
def regularizer(nonconvex, lam, x, grad, value):  # type: ignore[no-untyped-def]  # pragma: no cover
    """ψ's gradient into ``grad`` and, when ``value`` has one entry, ψ(x) into it, in one pass
    over x (d entries): ψ = λ Σ_j x_j²/(1 + x_j²) ([EF21] §5's nonconvex regularizer) or
    λ/2 ‖x‖² (l2). A term whose x_j² overflows is 1 (its limit), not inf/inf = NaN.

    The gradient has the bits of the torch expressions it replaces, entry by entry in x's
    dtype: ``(2λ)·x / (1 + x·x)²`` (torch squares by one product) and ``λ·x``. The value sums
    x_j²/(1 + x_j²) (or x_j²) in order in float64 and multiplies by λ (λ/2) in x's dtype: the
    numba backend's ψ(x) (``LinearModelProblem._reg_value``), for the fused and the separate
    losses alike; a torch ``sum`` adds in another order, so the two backends agree to
    round-off, not bit for bit.
    """
    dt = x.dtype.type
    one = dt(1.0)
    acc = 0.0
    if nonconvex:
        c = dt(2.0 * lam)
        for q in range(x.shape[0]):
            xq = x[q]
            sq = xq * xq
            t = one + sq
            grad[q] = (c * xq) / (t * t)
            # x_j² overflows (|x_j| > 1.3e154, 1.8e19 in float32): its term is 1, not inf/inf
            acc += 1.0 if sq == np.inf else float(sq / t)
        scale = dt(lam)
    else:
        c = dt(lam)
        for q in range(x.shape[0]):
            xq = x[q]
            grad[q] = c * xq
            acc += float(xq * xq)
        scale = dt(0.5 * lam)
    if value.shape[0] > 0:
        value[0] = scale * dt(acc)


#: clients per block of the one-point pass: each block (one prange iteration) allocates the
#: scratch of its samples once, and computes their losses in one vectorised call
PASS_BLOCK = 64


def _point_pass_csr(  # type: ignore[no-untyped-def]  # pragma: no cover
    indptr, indices, data, ones, offsets, x, y, w, logistic, reg, G, inv_m, loss, block_rows, part
):
    """The gradient pass at one point x for every client (``prange`` over blocks of clients).

    Per client c (rows offsets[c]:offsets[c+1]): z_k = ⟨a_k, x⟩ as :func:`rowdot_csr`,
    r_k = φ'(z_k)·w_k as :func:`dphi_weighted`, G[c] = Σ_k r_k a_k as :func:`scatter_csr` into
    a zeroed row, then G[c] += reg (the regularizer's gradient, as ``G.add_(reg)``) and, when
    ``loss`` has length n, the clients' mean losses as :func:`client_losses`, while their
    margins and exp(−t) are in cache: the values of those kernels bit for bit, for any number
    of threads. z, r and exp(−t) live in a scratch of ``block_rows`` (the most samples of a
    block of :data:`PASS_BLOCK` clients) per block, not in arrays of all N samples, and w
    (1/m_c, the same for all of a client's samples) is read once per client: the pass reads the
    data, x and y and writes G and the losses, nothing else. G need not be zeroed by the
    caller. ``indices`` may be of any integer type (the problem stores the narrowest that holds
    d − 1: uint8 for a9a's 123 features).

    When ``part`` has one row per block it receives the block's column sums Σ_{c ∈ block} G[c]
    (clients in order, each row added while it is in cache), from which :func:`block_mean`
    forms ∇f = (1/n) Σ_c G[c] without a second pass over G (the same bits for any number of
    threads: the blocks are fixed by :data:`PASS_BLOCK`); an empty ``part`` skips it.
    """
    n = offsets.shape[0] - 1
    dt = G.dtype
    sums = part.shape[0] > 0
    for b in numba.prange((n + PASS_BLOCK - 1) // PASS_BLOCK):
        c0, c1 = b * PASS_BLOCK, min(n, (b + 1) * PASS_BLOCK)
        base = offsets[c0]
        z = np.empty(block_rows, dtype=dt)
        r = np.empty(block_rows, dtype=dt)
        e = np.empty(block_rows, dtype=dt)
        for c in range(c0, c1):
            _client_csr(
                indptr, indices, data, ones, offsets[c], offsets[c + 1], base, x, y, w,
                logistic, reg, G[c], z, r, e,
            )  # fmt: skip
            if sums:
                _add_row(part[b], G[c], c == c0)
        if loss.shape[0] > 0:
            _block_losses(logistic, z, y, e, offsets, c0, c1, inv_m, loss)


@_jit
def _add_row(acc, row, first):  # type: ignore[no-untyped-def]  # pragma: no cover
    """acc = row (``first``) or acc += row: a block's running column sum."""
    if first:
        for q in range(row.shape[0]):
            acc[q] = row[q]
    else:
        for q in range(row.shape[0]):
            acc[q] += row[q]


@_jit
def block_mean(part, n, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out = (Σ_b part[b]) / n, the blocks added in order (the one-point pass's column sums,
    :func:`point_pass_csr`): ∇f = (1/n) Σ_i ∇f_i from the pass itself."""
    for q in range(out.shape[0]):
        acc = part[0, q]
        for b in range(1, part.shape[0]):
            acc += part[b, q]
        out[q] = acc / n


@_jit
def _client_csr(indptr, indices, data, ones, lo, hi, base, x, y, w, logistic, reg, g, z, r, e):  # type: ignore[no-untyped-def]  # pragma: no cover
    """One client of :func:`_point_pass_csr`: z, r, e of its rows j at j − base, its row g."""
    for j in range(lo, hi):
        z[j - base] = _row_dot(indptr, indices, data, ones, j, x)
    _client_dphi(logistic, y, w[lo], lo, hi, base, z, r, e)
    for q in range(g.shape[0]):
        g[q] = 0.0
    for j in range(lo, hi):
        rk = r[j - base]
        if rk != 0.0:
            _row_scatter(indptr, indices, data, ones, j, rk, g)
    for q in range(g.shape[0]):
        g[q] = g[q] + reg[q]


@_jit
def _client_dphi(logistic, y, wc, lo, hi, base, z, r, e):  # type: ignore[no-untyped-def]  # pragma: no cover
    """r = φ'(z; y)·w_c for one client's rows lo … hi − 1 (at j − base in z, r, e) and, for the
    logistic loss, e = exp(−t): the arithmetic of :func:`dphi_weighted` and
    :func:`neg_margin_exp` (the same bits), shared by the sparse and dense one-point passes."""
    one = z.dtype.type(1.0)
    two = z.dtype.type(2.0)
    if logistic:
        for j in range(lo, hi):
            ny = -y[j]
            ej = math.exp(-(ny * z[j - base]))
            r[j - base] = (ny * (one / (one + ej))) * wc
            e[j - base] = ej
    else:
        for j in range(lo, hi):
            r[j - base] = (two * (z[j - base] - y[j])) * wc


@_jit
def _block_losses(logistic, z, y, e, offsets, c0, c1, inv_m, loss):  # type: ignore[no-untyped-def]  # pragma: no cover
    """loss[c] = (1/m_c) Σ φ(z_k; y_k) for the clients c0 … c1 − 1, whose rows (from
    offsets[c0]) have their z and e at 0, 1, … — as :func:`client_losses` (same bits): one
    vectorised :func:`_sample_losses` over the block, then each client's sum in row order."""
    base, m = offsets[c0], offsets[c1] - offsets[c0]
    buf = np.empty(m, dtype=np.float64)
    _sample_losses(logistic, z[:m], y[base : base + m], e[:m], buf)
    for c in range(c0, c1):
        acc = 0.0
        for k in range(offsets[c] - base, offsets[c + 1] - base):
            acc += buf[k]
        loss[c] = acc * inv_m[c]


def _point_pass_dense(  # type: ignore[no-untyped-def]  # pragma: no cover
    A, offsets, x, y, w, logistic, reg, G, inv_m, loss, block_rows, part
):
    """:func:`_point_pass_csr` for dense data (:func:`rowdot_dense`, :func:`scatter_dense`),
    the block column sums ``part`` included."""
    n = offsets.shape[0] - 1
    sums = part.shape[0] > 0
    dt = G.dtype
    d = A.shape[1]
    for b in numba.prange((n + PASS_BLOCK - 1) // PASS_BLOCK):
        c0, c1 = b * PASS_BLOCK, min(n, (b + 1) * PASS_BLOCK)
        base = offsets[c0]
        z = np.empty(block_rows, dtype=dt)
        r = np.empty(block_rows, dtype=dt)
        e = np.empty(block_rows, dtype=dt)
        for c in range(c0, c1):
            lo, hi = offsets[c], offsets[c + 1]
            for j in range(lo, hi):
                s = 0.0
                for q in range(d):
                    s += A[j, q] * x[q]
                z[j - base] = s
            _client_dphi(logistic, y, w[lo], lo, hi, base, z, r, e)
            for q in range(d):
                G[c, q] = 0.0
            for j in range(lo, hi):
                rk = r[j - base]
                for q in range(d):
                    G[c, q] += rk * A[j, q]
            for q in range(d):
                G[c, q] = G[c, q] + reg[q]
            if sums:
                _add_row(part[b], G[c], c == c0)
        if loss.shape[0] > 0:
            _block_losses(logistic, z, y, e, offsets, c0, c1, inv_m, loss)


def block_rows(offsets: np.ndarray) -> int:
    """The most samples of a block of :data:`PASS_BLOCK` consecutive clients (the one-point
    pass's scratch size)."""
    ends = offsets[PASS_BLOCK::PASS_BLOCK]
    ends = np.append(ends, offsets[-1]) if ends.size == 0 or ends[-1] != offsets[-1] else ends
    starts = offsets[:-1:PASS_BLOCK][: ends.size]
    return int(np.max(ends - starts))


#: the one-point pass, serial (``prange`` is ``range``) and over numba threads (a twin of the
#: same code with a cache of its own, ``shrinkgrad._numba_twin``)
point_pass_csr = _jit(_point_pass_csr)
point_pass_dense = _jit(_point_pass_dense)
point_pass_csr_threads = _jit_par(twin(_point_pass_csr))
point_pass_dense_threads = _jit_par(twin(_point_pass_dense))


@_jit
def rowdot_dense(A, rows, client, X, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    d = A.shape[1]
    for k in range(rows.shape[0]):
        j = rows[k]
        c = client[k]
        s = 0.0
        for q in range(d):
            s += A[j, q] * X[c, q]
        out[k] = s


@_jit
def scatter_dense(A, rows, client, r, G):  # type: ignore[no-untyped-def]  # pragma: no cover
    d = A.shape[1]
    for k in range(rows.shape[0]):
        j = rows[k]
        c = client[k]
        rk = r[k]
        for q in range(d):
            G[c, q] += rk * A[j, q]


@_jit
def select_smallest(u, offsets, b, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out ← for each client i, the rows of its b_i smallest u (ascending, ties by position)."""
    pos = 0
    for i in range(offsets.shape[0] - 1):
        lo = offsets[i]
        order = np.argsort(u[lo : offsets[i + 1]], kind="mergesort")
        for k in range(b[i]):
            out[pos] = lo + order[k]
            pos += 1
