"""Independent fixtures for the method and simulator tests: heterogeneous least squares, and two
small test compressors (unbiased rand-k, and a non-homogeneous power-of-two rounding).

The problem:

f_i(x) = (1/(2m)) ‖A_i x − y_i‖², f = (1/n) Σ f_i, written here in a few lines so that the method
tests do not depend on the problems package. Client i's rows are scaled by s_i, which spreads the
smoothness constants L_i = λ_max(A_iᵀA_i)/m (exact, from an eigen-decomposition). Minibatch
gradients sample b_i rows with replacement from keyed uniforms.
"""

from __future__ import annotations

import numpy as np
import torch

from shrinkgrad.compressors import Compressor
from shrinkgrad.problems import Problem
from shrinkgrad.rng import Keys


class LeastSquares(Problem):
    name = "lsq_fixture"
    dataset = "synthetic_fixture"
    convex = True  # every f_i is a least-squares loss

    def __init__(
        self,
        n: int = 5,
        d: int = 8,
        m: int = 6,
        seed: int = 0,
        spread: float = 3.0,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        rng = np.random.default_rng(seed)
        scales = np.exp(np.linspace(0.0, np.log(spread), n))
        A = rng.standard_normal((n, m, d)) * scales[:, None, None]
        y = rng.standard_normal((n, m)) + A @ rng.standard_normal(d)
        self.A = torch.tensor(A, dtype=dtype)
        self.y = torch.tensor(y, dtype=dtype)
        self.n, self.d, self.m = n, d, m
        self.dtype = dtype
        H = np.einsum("nmi,nmj->nij", A, A) / m
        self.L_i = torch.tensor([np.linalg.eigvalsh(h)[-1] for h in H], dtype=torch.float64)
        self.L = float(np.linalg.eigvalsh(H.mean(0))[-1])
        self.mu = float(np.linalg.eigvalsh(H.mean(0))[0])
        x_star = np.linalg.solve(H.mean(0), np.einsum("nmi,nm->i", A, y) / (m * n))
        self.x_star = torch.tensor(x_star, dtype=dtype)
        self.f_star = self.loss(self.x_star)

    def loss(self, x: torch.Tensor) -> float:
        r = self.A @ x - self.y
        return float((r**2).sum() / (2 * self.m * self.n))

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        r = self.A @ x - self.y
        return torch.einsum("nmd,nm->nd", self.A, r) / self.m

    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor:
        r = torch.einsum("nmd,nd->nm", self.A, X) - self.y
        return torch.einsum("nmd,nm->nd", self.A, r) / self.m

    def client_stoch_grads(
        self, X: torch.Tensor, batch_sizes: torch.Tensor | int, keys: Keys
    ) -> torch.Tensor:
        b = torch.as_tensor(batch_sizes).expand(self.n)
        bmax = int(b.max())
        u = keys.uniform(bmax, torch.float64)  # (n, bmax)
        rows = (u * self.m).long()  # sample rows with replacement
        valid = (torch.arange(bmax)[None, :] < b[:, None]).to(self.dtype)
        Xn = X.expand(self.n, self.d) if X.ndim == 1 else X
        A_s = torch.gather(self.A, 1, rows[:, :, None].expand(-1, -1, self.d))
        y_s = torch.gather(self.y, 1, rows)
        r = (torch.einsum("nbd,nd->nb", A_s, Xn) - y_s) * valid
        return torch.einsum("nbd,nb->nd", A_s, r) / b[:, None].to(self.dtype)


class UnbiasedRandK(Compressor):
    """Unbiased rand-k (d/k scaling) for the tests, independent of the compressors package."""

    kind = "unbiased"
    positively_homogeneous = True

    def __init__(self, k: int, scaled: bool = False) -> None:
        self.k = k
        self.scaled_down = scaled  # the contractive (k/d)·rand-k
        if scaled:
            self.kind = "contractive"
        self.spec = f"test_rand_k[k={k}]" if not scaled else f"test_scaled_rand_k[k={k}]"

    def omega(self, d: int) -> float:
        if self.scaled_down:
            return super().omega(d)
        return d / self.k - 1.0

    def alpha(self, d: int) -> float:
        return self.k / d

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(self.k * torch.finfo(dtype).bits)

    def paper_bits(self, d: int) -> float:
        return 32.0 * self.k

    def _apply(
        self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert keys is not None
        d = x.shape[-1]
        u = keys.uniform(d, torch.float64)
        idx = torch.argsort(u, dim=-1)[..., : self.k]
        res = torch.zeros_like(x).scatter_(-1, idx, x.gather(-1, idx))
        res = res if self.scaled_down else res * (d / self.k)
        return res if out is None else out.copy_(res)


class PowerOfTwo(Compressor):
    """Deterministic rounding of |x_j| to the nearest power of two: contractive, NOT homogeneous."""

    kind = "contractive"
    deterministic = True
    positively_homogeneous = False
    spec = "test_pow2"

    def alpha(self, d: int) -> float:
        return 8.0 / 9.0  # |C(v) − v| ≤ v/3 (worst case v = 1.5·2^k), so (1 − α) = 1/9

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return 9.0 * d

    def paper_bits(self, d: int) -> float:
        return 32.0 * d

    def _apply(
        self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        a = x.abs()
        lo = torch.exp2(torch.floor(torch.log2(a.clamp_min(1e-300))))
        r = torch.where(a - lo < 2 * lo - a, lo, 2 * lo)
        res = torch.where(a > 0, torch.sign(x) * r, torch.zeros_like(x))
        return res if out is None else out.copy_(res)


def run(
    method: object,
    problem: Problem,
    compressor: object,
    stepsize: float | str,
    rounds: int,
    seed: int = 0,
    x0: torch.Tensor | None = None,
) -> tuple[object, list[object]]:
    """Bind ``method`` and run it, keeping every state (round 0 included)."""
    from shrinkgrad.methods import ProblemOracle, make_method

    bound = make_method(method).bind(problem, compressor, stepsize, seed)  # type: ignore[arg-type]
    oracle = ProblemOracle(problem)
    state, _ = bound.init(problem.x0() if x0 is None else x0, oracle)
    states = [state]
    for _ in range(rounds):
        state, _ = bound.step(state, oracle)
        states.append(state)
    return bound, states


def trajectory(states: list[object]) -> torch.Tensor:
    return torch.stack([s.x for s in states])  # type: ignore[attr-defined]


def rand_k(k: int, scaled: bool = False) -> Compressor:
    """The library's rand_k / scaled(rand_k) when registered, else the test implementation."""
    from shrinkgrad.compressors import COMPRESSORS, make_compressor

    if "rand_k" in COMPRESSORS and (not scaled or "scaled" in COMPRESSORS):
        return make_compressor(f"scaled(rand_k[k={k}])" if scaled else f"rand_k[k={k}]")
    return UnbiasedRandK(k, scaled=scaled)
