"""Speed of the problem oracles (run on demand: ``python benchmarks/problems.py``).

Prints ratios against baselines measured in the same run:

* ``client_grads`` on a9a (logistic regression, nonconvex regularizer) for n ∈ {20, 100, 1000}
  clients: one pass over the data whatever n, so the cost ratio n=1000 / n=20 should be about 1
  (target ≤ 1.5);
* the same against a per-client Python loop (slice client i's CSR rows, z = A_i x, residuals,
  A_iᵀ r / m_i with scipy): target ≥ 20× at n = 1000;
* ``client_grads_at`` (a point per client), minibatch ``client_stoch_grads`` and the torch
  (``index_add``) backend relative to ``client_grads``;
* the fused ``client_grads_and_losses`` (what the simulator logs from) relative to
  ``client_grads`` (target: the losses cost ≤ 15% of the gradient pass) and against the separate
  ``client_losses`` pass it replaces; ``client_grads`` with ``threads=2`` (wall time: meaningful
  only on a quiet machine);
* construction times (exact L_i included) and the synthetic generator at n = 2000.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from shrinkgrad.problems import load, logistic_regression, synthetic_least_squares
from shrinkgrad.problems.linear import LinearModelProblem
from shrinkgrad.rng import Keys


def timeit(fn: Callable[[], object], repeat: int = 7, number: int = 5) -> float:
    """Best seconds per call over ``repeat`` batches of ``number`` calls (after a warm-up).

    The minimum, not the median: on a shared machine the noise only ever adds time.
    """
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def loop_client_grads(p: LinearModelProblem, x: torch.Tensor) -> torch.Tensor:
    """The baseline: a Python loop over clients, scipy per client (same maths)."""
    A = p.data_matrix()
    y = p._y64
    xn = x.numpy()
    out = np.empty((p.n, p.d))
    for i in range(p.n):
        lo, hi = p.offsets[i], p.offsets[i + 1]
        Ai, yi = A[lo:hi], y[lo:hi]
        r = -yi / (1.0 + np.exp(yi * (Ai @ xn)))
        out[i] = Ai.T @ r / (hi - lo)
    G = torch.from_numpy(out)
    return G + 2 * p.lam * x / (1 + x * x) ** 2


def main() -> None:
    torch.set_num_threads(1)
    load("a9a")
    print("shrinkgrad problems benchmark (a9a: 32561 × 123, CSR, 1 thread)\n")
    x = torch.linspace(-0.5, 0.5, 123, dtype=torch.float64)
    base = None
    rows = []
    extra: list[tuple[int, float, float, float]] = []
    for n in (20, 100, 1000):
        t0 = time.perf_counter()
        p = logistic_regression("a9a", n_clients=n)
        build = time.perf_counter() - t0
        torch.testing.assert_close(
            p.client_grads(x), loop_client_grads(p, x), rtol=1e-10, atol=1e-12
        )
        t_fast = timeit(lambda p=p: p.client_grads(x))
        t_loop = timeit(lambda p=p: loop_client_grads(p, x), repeat=3, number=2)
        X = x.expand(n, 123).contiguous() + 0.01
        t_at = timeit(lambda p=p, X=X: p.client_grads_at(X))
        keys = Keys.derive(0, client=np.arange(n), stream="minibatch")
        b = torch.clamp(p.client_sizes // 10, min=1)
        t_sgd = timeit(lambda p=p, X=X, b=b, keys=keys: p.client_stoch_grads(X, b, keys))
        p.backend = "torch"
        t_torch = timeit(lambda p=p: p.client_grads(x))
        p.backend = "numba"
        t_fused = timeit(lambda p=p: p.client_grads_and_losses(x))
        t_losses = timeit(lambda p=p: p.client_losses(x))
        p.threads = 2
        t_two = timeit(lambda p=p: p.client_grads(x))
        p.threads = 1
        extra.append((n, t_fused / t_fast, t_losses / t_fast, t_fast / t_two))
        base = base or t_fast
        rows.append(
            (
                n,
                build,
                t_fast,
                t_fast / base,
                t_loop / t_fast,
                t_at / t_fast,
                t_sgd / t_fast,
                t_torch / t_fast,
            )
        )
    print(
        f"{'n':>5} {'build s':>8} {'client_grads ms':>16} {'vs n=20':>8} {'loop/fast':>10} "
        f"{'at/grads':>9} {'sgd b=m/10':>11} {'torch/numba':>12}"
    )
    for n, build, t, r20, rl, rat, rsgd, rt in rows:
        print(
            f"{n:>5} {build:>8.2f} {t * 1e3:>16.2f} {r20:>8.2f} {rl:>9.1f}× {rat:>9.2f} "
            f"{rsgd:>11.2f} {rt:>12.2f}"
        )
    print(
        f"\n{'n':>5} {'fused/grads':>12} {'separate losses/grads':>22} {'2 threads speed-up':>19}"
    )
    for n, rf, rl, r2 in extra:
        print(f"{n:>5} {rf:>12.3f} {rl:>22.3f} {r2:>19.2f}")
    r = rows[-1]
    print(
        f"\nratio n=1000 / n=20: {r[3]:.2f} (target ≤ 1.5); per-client loop / one pass at n=1000: "
        f"{r[4]:.1f}× (target ≥ 20×)"
    )
    t0 = time.perf_counter()
    s = synthetic_least_squares(n_clients=2000, L_var=4.4e6)
    gen = time.perf_counter() - t0
    xs = torch.zeros(s.d, dtype=torch.float64)
    t_s = timeit(lambda: s.client_grads(xs))
    print(
        f"synthetic_least_squares n=2000, d=20, m=20: generated with exact constants in "
        f"{gen:.2f} s (L_var = {s.L_var:.4g}, asked 4.4e6); client_grads {t_s * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
