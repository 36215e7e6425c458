"""Plain per-client loops of the methods, written independently of ``shrinkgrad.methods``.

Each function runs one algorithm of methods.md §3 client by client, with the per-client keys of
the library's documented convention (the step producing round r draws at ``round=r`` in the
streams "compressor", "participation", "minibatch"; the initialisation at round 0), and returns
the list of iterates x⁰, x¹, …. Gradients come from the fixture's raw data (A_i, y_i), not from
the problem's batched oracles.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shrinkgrad.compressors import Compressor
from shrinkgrad.rng import Keys


def grad_i(problem: object, i: int, x: torch.Tensor) -> torch.Tensor:
    A, y, m = problem.A[i], problem.y[i], problem.m  # type: ignore[attr-defined]
    return A.T @ (A @ x - y) / m


def stoch_grad_i(problem: object, i: int, x: torch.Tensor, b: int, key: Keys) -> torch.Tensor:
    A, y, m = problem.A[i], problem.y[i], problem.m  # type: ignore[attr-defined]
    rows = (key.uniform(b, torch.float64) * m).long()
    As, ys = A[rows], y[rows]
    return As.T @ (As @ x - ys) / b


def key(seed: int, r: int, i: int, stream: str = "compressor") -> Keys:
    return Keys.derive(seed, round=r, client=i, stream=stream)


def compress(C: Compressor, v: torch.Tensor, seed: int, r: int, i: int) -> torch.Tensor:
    return C(v, None if C.deterministic else key(seed, r, i))


def gd_loop(problem: object, gamma: float, rounds: int, x0: torch.Tensor) -> list[torch.Tensor]:
    xs = [x0]
    x = x0
    for _ in range(rounds):
        x = x - gamma * problem.grad(x)  # type: ignore[attr-defined]
        xs.append(x)
    return xs


def dcgd_loop(
    problem: object, C: Compressor, gamma: float, seed: int, rounds: int, x0: torch.Tensor
) -> list[torch.Tensor]:
    n = problem.n  # type: ignore[attr-defined]
    xs, x = [x0], x0
    for r in range(1, rounds + 1):
        total = torch.zeros_like(x)
        for i in range(n):
            total = total + compress(C, grad_i(problem, i, x), seed, r, i)
        x = x - gamma * total / n
        xs.append(x)
    return xs


def ef_loop(
    problem: object, C: Compressor, gamma: float, seed: int, rounds: int, x0: torch.Tensor
) -> list[torch.Tensor]:
    n = problem.n  # type: ignore[attr-defined]
    e = [torch.zeros_like(x0) for _ in range(n)]
    xs, x = [x0], x0
    for r in range(1, rounds + 1):
        total = torch.zeros_like(x)
        for i in range(n):
            p = e[i] + gamma * grad_i(problem, i, x)
            v = compress(C, p, seed, r, i)
            e[i] = p - v
            total = total + v
        x = x - total / n
        xs.append(x)
    return xs


def ef21_loop(
    problem: object,
    C: Compressor,
    gamma: float,
    seed: int,
    rounds: int,
    x0: torch.Tensor,
    *,
    weighted: bool = False,
    p: float = 1.0,
    batch: int | None = None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """EF21 / EF21-W / -PP / -SGD, init g_i = s_i ∇f_i(x⁰). Returns iterates and every g_i^t."""
    n = problem.n  # type: ignore[attr-defined]
    L_i = problem.L_i  # type: ignore[attr-defined]
    w = [float(L_i[i] / L_i.sum()) if weighted else 1.0 / n for i in range(n)]
    s = [1.0 / (n * w[i]) if weighted else 1.0 for i in range(n)]
    g_i = [s[i] * grad_i(problem, i, x0) for i in range(n)]
    g = sum(w[i] * g_i[i] for i in range(n))
    x = x0
    xs, gs = [x0], [list(g_i)]
    for r in range(1, rounds + 1):
        x = x - gamma * g
        for i in range(n):
            if p < 1.0:
                u = key(seed, r, i, "participation").uniform(1, torch.float64)[0]
                if not u < p:
                    continue
            if batch is None:
                gr = grad_i(problem, i, x)
            else:
                gr = stoch_grad_i(problem, i, x, batch, key(seed, r, i, "minibatch"))
            c = compress(C, s[i] * gr - g_i[i], seed, r, i)
            g_i[i] = g_i[i] + c
            g = g + w[i] * c
        xs.append(x)
        gs.append(list(g_i))
    return xs, gs


def iag_loop(
    problem: object, gamma: float, rounds: int, x0: torch.Tensor, order: list[int]
) -> list[torch.Tensor]:
    """Uncompressed IAG: table of ∇f_i at the last visit, x ← x − γ mean(table)."""
    n = problem.n  # type: ignore[attr-defined]
    table = [grad_i(problem, i, x0) for i in range(n)]
    xs, x = [x0], x0
    for r in range(1, rounds + 1):
        i = order[r - 1]
        table[i] = grad_i(problem, i, x)
        x = x - gamma * sum(table) / n
        xs.append(x)
    return xs


def delayed_loop(
    problem: object, C: Compressor, gamma: float, seed: int, rounds: int, x0: torch.Tensor, tau: int
) -> list[torch.Tensor]:
    """DCGD with the fixed delay τ: client i uses x^{max(t − τ, 0)} in the step from x^t."""
    n = problem.n  # type: ignore[attr-defined]
    xs = [x0]
    for r in range(1, rounds + 1):
        t = r - 1
        stale = xs[max(t - tau, 0)]
        total = torch.zeros_like(x0)
        for i in range(n):
            total = total + compress(C, grad_i(problem, i, stale), seed, r, i)
        xs.append(xs[-1] - gamma * total / n)
    return xs


def diana_loop(
    problem: object,
    C: Compressor,
    gamma: float,
    alpha: float,
    seed: int,
    rounds: int,
    x0: torch.Tensor,
    init: str = "zero",
) -> list[torch.Tensor]:
    """DIANA ([DIANA] Alg. 1): Δ_i = ∇f_i(x) − h_i, ĝ = h + mean Q(Δ_i), h_i += αQ(Δ_i)."""
    n = problem.n  # type: ignore[attr-defined]
    h = [grad_i(problem, i, x0) if init == "full" else torch.zeros_like(x0) for i in range(n)]
    xs, x = [x0], x0
    for r in range(1, rounds + 1):
        mean_h = sum(h) / n
        total = torch.zeros_like(x)
        for i in range(n):
            q = compress(C, grad_i(problem, i, x) - h[i], seed, r, i)
            h[i] = h[i] + alpha * q
            total = total + q
        x = x - gamma * (mean_h + total / n)  # type: ignore[operator]
        xs.append(x)
    return xs


def ef21_plus_loop(
    problem: object, C: Compressor, gamma: float, seed: int, rounds: int, x0: torch.Tensor
) -> tuple[list[torch.Tensor], int]:
    """EF21+ (the authors' ``bdfg_plus_*``): keep the nearer of g_i + C(G − g_i) and C(G).

    Returns the iterates and how many times a client kept the compressed gradient C(G); checks
    on the way that the kept estimator is never farther from ∇f_i than EF21's candidate.
    """
    n = problem.n  # type: ignore[attr-defined]
    g = [grad_i(problem, i, x0) for i in range(n)]
    xs, x, switched = [x0], x0, 0
    for r in range(1, rounds + 1):
        x = x - gamma * sum(g) / n  # type: ignore[operator]
        for i in range(n):
            G = grad_i(problem, i, x)
            b = g[i] + compress(C, G - g[i], seed, r, i)
            m = compress(C, G, seed, r, i)
            if float((m - G).norm()) < float((b - G).norm()):
                g[i], switched = m, switched + 1
            else:
                g[i] = b
            assert float((g[i] - G).norm()) <= float((b - G).norm())
        xs.append(x)
    return xs, switched


# --------------------------------------------------------------------------------------------
# shared by the reference tests: keyed uniforms and a nonconvex logistic problem
# --------------------------------------------------------------------------------------------
#: λ of the nonconvex regularizer in the reference logistic problems
LAM = 0.1


def uniform(seed: int, r: int, i: int, stream: str, count: int = 1) -> torch.Tensor:
    """The keyed float64 uniforms of client ``i`` at round ``r`` in ``stream`` (the library's
    documented convention: ``Keys.derive(seed, round=r, client=i, stream=stream)``)."""
    return Keys.derive(seed, round=r, client=i, stream=stream).uniform(count, torch.float64)


class NonconvexLogistic:
    """Clients' rows ``A[i]`` and labels ``y[i]`` (set by a subclass), the logistic loss with the
    nonconvex regularizer λ Σ x_k²/(1 + x_k²) (methods.md §1); a minibatch is the b samples with
    the smallest keyed uniforms (sample j's key: counter j), drawn without replacement."""

    A: list[torch.Tensor]
    y: list[torch.Tensor]

    @staticmethod
    def _grad(A: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        loss = A.T @ (-y * torch.sigmoid(-y * (A @ x))) / A.shape[0]
        return loss + LAM * 2.0 * x / (1.0 + x * x) ** 2

    def grad(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self._grad(self.A[i], self.y[i], x)

    def minibatch(self, i: int, x: torch.Tensor, r: int, b: int, seed: int) -> torch.Tensor:
        u = uniform(seed, r, i, "minibatch", self.A[i].shape[0])
        rows = torch.argsort(u, stable=True)[:b]
        return self._grad(self.A[i][rows], self.y[i][rows], x)


class A1A(NonconvexLogistic):
    """a1a's raw rows in contiguous chunks (the last client takes the remainder), the logistic
    loss with the nonconvex regularizer λ Σ x_k²/(1 + x_k²) (methods.md §1, l. 34-36)."""

    def __init__(self, n: int) -> None:
        from shrinkgrad.problems import load

        ds = load("a1a")
        X, y = np.asarray(ds.X.toarray()), np.asarray(ds.y, dtype=np.float64)
        N = X.shape[0]
        sizes = [N // n] * (n - 1) + [N - (N // n) * (n - 1)]
        off = np.concatenate([[0], np.cumsum(sizes)])
        self.n, self.d, self.sizes = n, X.shape[1], sizes
        self.A = [torch.tensor(X[off[i] : off[i + 1]]) for i in range(n)]
        self.y = [torch.tensor(y[off[i] : off[i + 1]]) for i in range(n)]
        H = [(a.T @ a).numpy() / (4.0 * a.shape[0]) for a in self.A]
        L_i = [np.linalg.eigvalsh(h)[-1] + 2 * LAM for h in H]
        self.L_i = torch.tensor(L_i, dtype=torch.float64)
        self.L = float(np.linalg.eigvalsh(sum(H) / n)[-1]) + 2 * LAM

    def sigma2_i(self, b: Sequence[int]) -> list[float]:
        """σ_i² = (m − b)/(b(m − 1)) · (1/m) Σ_j ‖a_j‖² (|φ'| ≤ 1, sampling without replacement)."""
        out = []
        for i, a in enumerate(self.A):
            m = a.shape[0]
            out.append((m - b[i]) / (b[i] * (m - 1)) * float((a * a).sum()) / m)
        return out
