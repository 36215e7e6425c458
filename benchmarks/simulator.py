"""Speed of the vectorised simulator: EF21 + top_k[k=1] on a9a, against a per-client Python loop.

Run: ``python benchmarks/simulator.py [--clients 20 100 1000] [--rounds 300] [--loop-rounds 20]``.

For each number of clients n, on the nonconvex logistic regression of [EF21] §5 (a9a, λ = 0.1,
contiguous split, float64, theory step size) it measures, in the same run:

* ``simulate``: rounds per second of :func:`shrinkgrad.simulate` from its ``time_s`` column
  (wall time of the steps, metric evaluation excluded; ``log_every`` = rounds so that metrics are
  evaluated twice), and the wall time including the metrics when logging every round;
* the breakdown of one round: the problem's batched gradient oracle ``client_grads``, the
  compressor on the (n, d) batch, and the rest (method arithmetic + simulator bookkeeping);
* ``loop``: a straightforward per-client implementation of the same mathematics — every client's
  gradient from its own rows (dense torch tensors), Top-1 by ``argmax``, g_i and g updated client
  by client — checked to produce the simulator's iterates, and its time per round.

It prints the ratios the issue asks for: cost per round at n = 1000 over n = 20 (target ≤ 3) and
the loop over the simulator at n = 1000 (target ≥ 30). Timings on a shared machine are noisy: each
figure is the best of ``--repeat`` interleaved measurements (every quantity is measured once per
repetition, so all see the same load), and only the ratios carry over between machines. Columns:
``ms/round`` from ``time_s``; ``+metrics`` wall time per round when logging every round; ``step``
a bare ``BoundMethod.step``; ``grads`` the problem's ``client_grads``; ``top_k`` the compressor
on the (n, d) batch; ``rest`` = step − grads − top_k (method arithmetic and bookkeeping; a
difference of noisy minima); ``loop`` the per-client loop; ``|Δx|`` the largest difference of the
loop's iterate from the simulator's after 3 rounds; ``plain`` a step whose Top-k is a bare
``torch.topk`` (no deterministic tie rule), i.e. what the round costs when the selection costs
no more than ``torch.topk``, and the loop's time over it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from shrinkgrad import make_compressor
from shrinkgrad.compressors.basic import TopK
from shrinkgrad.methods import ProblemOracle, make_method
from shrinkgrad.problems import LinearModelProblem, load, logistic_regression
from shrinkgrad.rng import Keys
from shrinkgrad.sim import simulate

LAM = 0.1


class PlainTopK(TopK):
    """Top-k by ``torch.topk`` alone (ties unspecified): the reference cost of the selection."""

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        idx = torch.topk(x.abs(), self.k, dim=-1, sorted=False).indices
        res = torch.zeros_like(x) if out is None else out.zero_()
        return res.scatter_(-1, idx, x.gather(-1, idx))


def best_of(fn: Callable[[], float], repeat: int) -> float:
    """The smallest of ``repeat`` measurements (each ``fn()`` returns seconds per round)."""
    return min(fn() for _ in range(repeat))


class LoopEF21:
    """EF21 + Top-1 on the nonconvex logistic regression, one client at a time."""

    def __init__(self, problem: LinearModelProblem, gamma: float, x0: torch.Tensor) -> None:
        data = load("a9a")
        X = data.X.tocsr()
        off = problem.offsets  # the contiguous split keeps the file order
        self.A = [torch.from_numpy(X[off[i] : off[i + 1]].toarray()) for i in range(problem.n)]
        self.y = [
            torch.from_numpy(np.array(data.y[off[i] : off[i + 1]], dtype=np.float64))
            for i in range(problem.n)
        ]
        self.n, self.gamma = problem.n, gamma
        self.x = x0.clone()
        self.g_i = [self.grad_i(i, self.x) for i in range(self.n)]
        self.g = sum(self.g_i) / self.n  # type: ignore[assignment]

    def grad_i(self, i: int, x: torch.Tensor) -> torch.Tensor:
        A, y = self.A[i], self.y[i]
        s = torch.sigmoid(-y * (A @ x))
        return A.T @ (-y * s) / A.shape[0] + 2 * LAM * x / (1 + x * x) ** 2

    def step(self) -> None:
        self.x = self.x - self.gamma * self.g
        for i in range(self.n):
            v = self.grad_i(i, self.x) - self.g_i[i]
            j = int(torch.argmax(v.abs()))
            c = torch.zeros_like(v)
            c[j] = v[j]
            self.g_i[i] = self.g_i[i] + c
            self.g = self.g + c / self.n


def per_round(fn: Callable[[], object], rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - t0) / rounds


def measure(n: int, rounds: int, loop_rounds: int, repeat: int) -> dict[str, float]:
    problem = logistic_regression("a9a", n_clients=n, lam=LAM)
    method = make_method("ef21")
    bound = method.bind(problem, "top_k[k=1]", "theory")
    oracle = ProblemOracle(problem)
    C = make_compressor("top_k[k=1]")

    simulate(problem, method, C, "theory", rounds=5)  # warm-up (numba compilation)
    state, _ = bound.init(problem.x0(), oracle)
    G = problem.client_grads(state.x)
    loop = LoopEF21(problem, bound.stepsize, problem.x0())
    plain = method.bind(problem, PlainTopK(1), bound.stepsize)
    plain_state, _ = plain.init(problem.x0(), oracle)

    def bare_plain() -> float:
        nonlocal plain_state

        def one() -> None:
            nonlocal plain_state
            plain_state, _ = plain.step(plain_state, oracle)

        return per_round(one, rounds)

    def sim() -> float:
        res = simulate(problem, method, C, "theory", rounds=rounds, log_every=rounds)
        return float(res.table["time_s"].iloc[-1] - res.table["time_s"].iloc[0]) / rounds

    def sim_logged() -> float:
        t0 = time.perf_counter()
        simulate(problem, method, C, "theory", rounds=rounds, log_every=1)
        return (time.perf_counter() - t0) / rounds

    def bare() -> float:
        nonlocal state

        def one() -> None:
            nonlocal state
            state, _ = bound.step(state, oracle)

        return per_round(one, rounds)

    probes: dict[str, Callable[[], float]] = {
        "sim_s": sim,
        "sim_logged_s": sim_logged,
        "step_s": bare,
        "plain_step_s": bare_plain,
        "grads_s": lambda: per_round(lambda: problem.client_grads(state.x), rounds),
        "compress_s": lambda: per_round(lambda: C(G), rounds),
        "loop_s": lambda: per_round(loop.step, loop_rounds),
    }
    # interleaved repetitions: every probe sees the same machine load; keep the best of each
    out: dict[str, float] = {name: float("inf") for name in probes}
    for _ in range(repeat):
        for name, probe in probes.items():
            out[name] = min(out[name], probe())
    out["n"] = n

    # the loop computes the simulator's iterates (same mathematics)
    check_loop = LoopEF21(problem, bound.stepsize, problem.x0())
    check, _ = bound.init(problem.x0(), oracle)
    for _ in range(3):
        check_loop.step()
        check, _ = bound.step(check, oracle)
    out["loop_max_diff"] = float((check_loop.x - check.x).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[20, 100, 1000])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--loop-rounds", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rows = [measure(n, args.rounds, args.loop_rounds, args.repeat) for n in args.clients]
    hdr = (
        f"{'n':>6} {'rounds/s':>9} {'ms/round':>9} {'+metrics':>9} {'step':>7} {'grads':>7} "
        f"{'top_k':>7} {'rest':>7} {'loop ms':>9} {'loop/sim':>9} {'|Δx| loop':>10} "
        f"{'plain':>7} {'loop/plain':>10}"
    )
    print("EF21 + top_k[k=1], a9a logistic regression (nonconvex, λ=0.1), float64, 1 thread")
    print(hdr)
    for r in rows:
        other = max(0.0, r["step_s"] - r["grads_s"] - r["compress_s"])
        print(
            f"{int(r['n']):>6} {1 / r['sim_s']:>9.1f} {1e3 * r['sim_s']:>9.3f} "
            f"{1e3 * r['sim_logged_s']:>9.3f} {1e3 * r['step_s']:>7.3f} {1e3 * r['grads_s']:>7.3f} "
            f"{1e3 * r['compress_s']:>7.3f} {1e3 * other:>7.3f} {1e3 * r['loop_s']:>9.2f} "
            f"{r['loop_s'] / r['sim_s']:>9.1f} {r['loop_max_diff']:>10.2e} "
            f"{1e3 * r['plain_step_s']:>7.3f} {r['loop_s'] / r['plain_step_s']:>10.1f}"
        )
    by_n = {int(r["n"]): r for r in rows}
    if 20 in by_n and 1000 in by_n:
        scale = by_n[1000]["sim_s"] / by_n[20]["sim_s"]
        speed = by_n[1000]["loop_s"] / by_n[1000]["sim_s"]
        print(f"cost per round, n=1000 over n=20: {scale:.2f}x (target <= 3)")
        print(f"per-client loop over simulate at n=1000: {speed:.1f}x (target >= 30)")


if __name__ == "__main__":
    main()
