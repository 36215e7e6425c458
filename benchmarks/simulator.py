"""Speed of the vectorised simulator with metrics logged every round, against a per-client loop.

Run: ``python benchmarks/simulator.py [--clients 1000] [--rounds 500] [--loop-rounds 20]
[--repeat 5] [--threads 1 2]`` and, for federated-scale client counts,
``python benchmarks/simulator.py scale [--clients 1000 10000 100000]``.

**The target of issue 17** (default command). EF21 + top_k[k=1] on a9a, nonconvex logistic
regression (λ = 0.1, [EF21] §5), contiguous split, float64, x⁰ = 0, EF21's theory step, metrics
(‖∇f(xᵗ)‖² and f(xᵗ)) logged at every round:

* ``sim``: wall time per round of :func:`shrinkgrad.simulate` with ``log_every=1`` (the whole
  call over the rounds: set-up, steps, metrics, table);
* ``sim unlogged``: the same with ``log_every=rounds`` (metrics at rounds 0 and R only); the
  added cost of logging every round is ``sim / sim unlogged − 1`` (target ≤ 15%);
* ``loop``: the same mathematics written as the EF21 authors' code is, a straightforward numpy
  loop over clients with one scipy CSR matrix per client: per client, margins A_i x, its loss and
  gradient from them, the Top-1 of ∇f_i − g_i by ``argmax``, g_i and g updated; ‖∇f‖² is the
  squared norm of the clients' mean gradient and f the mean of their losses, every round. It is
  checked to produce the simulator's iterates (``|Δx|`` after the measured rounds) and its
  logged metrics. Target: loop / sim ≥ 30;
* ``pass`` (the floor): one fused gradient-and-loss pass of the problem at one point
  (``client_grads_and_losses``: margins A x over a9a's 451 592 non-zeros, φ' with one ``exp`` per
  sample, the per-client sums Σ_j r_j a_j, the losses), the one pass over the data that every
  EF21 round must make. ``loop / pass`` is the ceiling of the speed-up: a round whose every
  other operation were free could not beat it; ``sim − pass`` is what the rest of the round
  (the method's dense (n, d) operations, the reduction, the metrics, the engine) costs.

Measurements alternate (sim, sim unlogged, loop, sim, ...) for ``--repeat`` repetitions so that
all see the same machine load; the table gives the median and the range (min–max) of each, and
of the per-repetition ratios. ``--threads 1 2`` runs it with the problem's gradient pass on one
and on two numba threads (``logistic_regression(..., threads=2)`` and ``SHRINKGRAD_THREADS=2``
for the compressors' kernels: EF21's shifted Top-1 over blocks of rows; results bit for bit
equal; torch's own operations on one thread in both).

**Which methods log for free** (also printed): the logging overhead per method at n = 1000.
Methods whose clients all evaluate ∇f_i at the new iterate (EF21, EF21-W) or at the current one
in the next step (GD, DCGD, EF: the metric pass is handed to that step) pay only the fused loss
(one division and a polynomial per sample) and a mean over clients; methods that never evaluate
every client's exact gradient at the iterate (EF21-PP, EF21-SGD, delayed DCGD, IAG) need a
separate fused gradient-and-loss pass per logged row.

**Federated scale** (``scale``): n ∈ {10³, 10⁴, 10⁵} clients of the synthetic least-squares
generator (d = 100, m = 10 samples per client) and of a9a / w8a logistic regression with
``contiguous[reuse=true]`` (client i gets samples of its own chunk; when n exceeds the samples,
one sample each, reused). Each configuration runs in a fresh process that reports its set-up
time (problem construction with exact L_i), EF21 + top_k[k=1] time per round (logged every 10
rounds) and peak resident memory; the table prints how both grow with n against the data size.
"""

from __future__ import annotations

import os

# numba's and torch's OpenMP workers sleep instead of spinning between parallel regions: with
# 2 threads on a shared 2-core machine a spinning worker made a logged round 3-4x slower (9.1
# against 2.6 ms); set before numba or torch start their thread pools
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

LAM = 0.1


# --------------------------------------------------------------------------------------------
# the baseline: the authors' style of loop
# --------------------------------------------------------------------------------------------
class LoopEF21:
    """EF21 + Top-1 on the nonconvex logistic regression, one client at a time (numpy/scipy).

    Logs ‖∇f(x)‖² (the clients' mean gradient) and f(x) (the clients' mean loss) every round,
    computing each client's loss and gradient from one set of margins, as the EF21 authors'
    code does.
    """

    def __init__(self, A: sp.csr_matrix, y: np.ndarray, offsets: np.ndarray, gamma: float) -> None:
        self.n = offsets.size - 1
        self.A = [A[offsets[i] : offsets[i + 1]].tocsr() for i in range(self.n)]
        self.AT = [a.T.tocsr() for a in self.A]
        self.y = [y[offsets[i] : offsets[i + 1]] for i in range(self.n)]
        self.gamma = gamma
        self.x = np.zeros(A.shape[1])
        grads, losses = zip(*(self.oracle(i, self.x) for i in range(self.n)), strict=True)
        self.g_i = [g.copy() for g in grads]
        self.g = np.mean(self.g_i, axis=0)
        self.log = [self.metrics(list(grads), list(losses))]

    def oracle(self, i: int, x: np.ndarray) -> tuple[np.ndarray, float]:
        A, AT, y = self.A[i], self.AT[i], self.y[i]
        t = -y * (A @ x)
        loss = float(np.mean(np.logaddexp(0.0, t)))
        r = -y / (1.0 + np.exp(-t))
        reg = 2 * LAM * x / (1 + x * x) ** 2
        return AT @ r / A.shape[0] + reg, loss + LAM * float(np.sum(x * x / (1 + x * x)))

    @staticmethod
    def metrics(grads: list[np.ndarray], losses: list[float]) -> tuple[float, float]:
        g = np.mean(grads, axis=0)
        return float(g @ g), float(np.mean(losses))

    def step(self) -> None:
        self.x = self.x - self.gamma * self.g
        grads, losses = [], []
        for i in range(self.n):
            grad, loss = self.oracle(i, self.x)
            v = grad - self.g_i[i]
            j = int(np.argmax(np.abs(v)))
            self.g_i[i][j] += v[j]
            self.g[j] += v[j] / self.n
            grads.append(grad)
            losses.append(loss)
        self.log.append(self.metrics(grads, losses))


# --------------------------------------------------------------------------------------------
# the target measurement
# --------------------------------------------------------------------------------------------
#: the clock of every measurement: wall time (``--clock wall``, the default) or this process's
#: CPU time (``--clock cpu``: on a machine shared with other jobs it leaves out the time spent
#: waiting for a core, so single-thread ratios stay meaningful; useless for 2 threads)
CLOCK: Callable[[], float] = time.perf_counter


def _timed(fn: Callable[[], object]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def measure(n: int, rounds: int, loop_rounds: int, repeat: int, threads: int) -> dict[str, Any]:
    from shrinkgrad import simulate
    from shrinkgrad.problems import logistic_regression

    # the sparse pass on ``threads`` numba threads; torch's (n, d) operations stay on one
    # thread (they are ~1 MB each: a second OpenMP team spinning next to numba's on a 2-core
    # machine made a logged round several times slower)
    torch.set_num_threads(1)
    # the compressors' kernels (EF21's shifted Top-1 over row blocks) on as many threads
    os.environ["SHRINKGRAD_THREADS"] = str(threads)
    problem = logistic_regression("a9a", n_clients=n, lam=LAM, threads=threads)
    args: tuple[Any, ...] = (problem, "ef21", "top_k[k=1]", "theory")
    warm = simulate(*args, rounds=3, log_every=1)  # numba compilation, caches
    gamma = warm.stepsize
    A, y = problem.data_matrix(), problem._y64  # client order = file order (contiguous split)

    def sim() -> float:
        return _timed(lambda: simulate(*args, rounds=rounds, log_every=1)) / rounds

    def sim_unlogged() -> float:
        return _timed(lambda: simulate(*args, rounds=rounds, log_every=rounds)) / rounds

    loop = LoopEF21(A, y, problem.offsets, gamma)

    def loop_round() -> float:
        return _timed(lambda: [loop.step() for _ in range(loop_rounds)]) / loop_rounds

    x_probe = warm.x

    def sparse_pass() -> float:  # the floor: the one pass over the data a round must make
        return _timed(lambda: [problem.client_grads_and_losses(x_probe) for _ in range(50)]) / 50

    probes = {"sim": sim, "sim_unlogged": sim_unlogged, "loop": loop_round, "pass": sparse_pass}
    samples: dict[str, list[float]] = {k: [] for k in probes}
    for _ in range(repeat):  # A, B, C, A, B, C, ...
        for name, probe in probes.items():
            samples[name].append(probe())

    # the loop computes the simulator's iterates and metrics
    check = LoopEF21(A, y, problem.offsets, gamma)
    xs: list[torch.Tensor] = []
    res = simulate(*args, rounds=loop_rounds, callback=lambda r, s: xs.append(s.x.clone()))
    dx, dm = 0.0, 0.0
    for r in range(loop_rounds):
        check.step()
        dx = max(dx, float(np.max(np.abs(check.x - xs[r].numpy()))))
    table = res.table[["grad_norm_sq", "loss"]].to_numpy()
    dm = float(np.max(np.abs(np.array(check.log) - table) / np.abs(table)))
    return {"n": n, "threads": threads, "samples": samples, "max_dx": dx, "max_rel_dmetric": dm}


def _spread(v: list[float], scale: float = 1.0) -> str:
    return f"{statistics.median(v) * scale:.3f} [{min(v) * scale:.3f}–{max(v) * scale:.3f}]"


def report(out: dict[str, Any]) -> None:
    s = out["samples"]
    speed = [lo / si for lo, si in zip(s["loop"], s["sim"], strict=True)]
    ceiling = [lo / pa for lo, pa in zip(s["loop"], s["pass"], strict=True)]
    rest = [si - pa for si, pa in zip(s["sim"], s["pass"], strict=True)]
    over = [a / b - 1 for a, b in zip(s["sim"], s["sim_unlogged"], strict=True)]
    print(
        f"n={out['n']:<6} threads={out['threads']}  sim {_spread(s['sim'], 1e3)} ms/round   "
        f"unlogged {_spread(s['sim_unlogged'], 1e3)} ms   loop {_spread(s['loop'], 1e3)} ms"
    )
    print(
        f"          loop/sim {_spread(speed)}x (target >= 30)   logging overhead "
        f"{_spread(over, 100)} % (target <= 15)   |Δx| {out['max_dx']:.1e}   "
        f"metrics rel. diff {out['max_rel_dmetric']:.1e}"
    )
    print(
        f"          floor: pass {_spread(s['pass'], 1e3)} ms, loop/pass {_spread(ceiling)}x "
        f"(the ceiling), sim − pass {_spread(rest, 1e3)} ms (the rest of the round)"
    )


def method_overheads(n: int, rounds: int, repeat: int) -> None:
    """The logging overhead of every kind of method (free metrics or a metric pass)."""
    from shrinkgrad import simulate
    from shrinkgrad.problems import logistic_regression

    torch.set_num_threads(1)
    problem = logistic_regression("a9a", n_clients=n, lam=LAM)
    cases = [
        ("ef21", "top_k[k=1]", "theory", "free: ∇f_i at the new iterate"),
        ("ef21_w", "top_k[k=1]", "theory", "free: ∇f_i at the new iterate"),
        ("gd", None, "theory", "free: the metric pass is the next step's"),
        ("dcgd", "rand_k[k=5]", "theory", "free: the metric pass is the next step's"),
        ("ef", "top_k[k=1]", 0.5, "free: the metric pass is the next step's"),
        ("ef21_pp[p=0.5]", "top_k[k=1]", "theory", "metric pass: a subset of clients"),
        ("ef21_sgd[b=8]", "top_k[k=1]", 0.5, "metric pass: minibatch estimators"),
        ("delayed_dcgd[tau=2]", "rand_k[k=5]", "theory", "metric pass: stale points"),
        ("iag", "rand_k[k=5]", "theory", "metric pass: one client per round"),
    ]
    print(f"\nlogging overhead per method (a9a, n={n}, 1 thread; median of {repeat}):")
    for method, comp, step, why in cases:
        run = (problem, method, comp, step)
        simulate(*run, rounds=2)
        logged, plain = [], []
        for _ in range(repeat):
            logged.append(_timed(lambda run=run: simulate(*run, rounds=rounds)))  # type: ignore[misc]
            plain.append(_timed(lambda run=run: simulate(*run, rounds=rounds, log_every=rounds)))  # type: ignore[misc]
        over = [a / b - 1 for a, b in zip(logged, plain, strict=True)]
        print(
            f"  {method:<20} {1e3 * statistics.median(plain) / rounds:7.3f} ms/round, logged "
            f"every round +{_spread(over, 100)} %   {why}"
        )


# --------------------------------------------------------------------------------------------
# federated-scale client counts (each configuration in its own process)
# --------------------------------------------------------------------------------------------
def _scale_child(kind: str, n: int, rounds: int) -> dict[str, Any]:
    import resource

    from shrinkgrad import simulate
    from shrinkgrad.problems import load, logistic_regression, synthetic_least_squares

    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    if kind != "synthetic":
        load(kind)  # reading the file: the same for every n, reported apart
    load_s = time.perf_counter() - t0
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    if kind == "synthetic":
        p: Any = synthetic_least_squares(n_clients=n, d=100, m=10, L_var=1e4)
    else:
        p = logistic_regression(kind, n_clients=n, split="contiguous[reuse=true]", lam=LAM)
    setup, setup_cpu = time.perf_counter() - t0, time.process_time() - c0
    after_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    simulate(p, "ef21", "top_k[k=1]", "theory", rounds=2)  # compilation
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(p, "ef21", "top_k[k=1]", "theory", rounds=rounds, log_every=10)
    per_round = (time.perf_counter() - t0) / rounds
    per_round_cpu = (time.process_time() - c0) / rounds
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    nnz = int(p.data_matrix().nnz) if sp.issparse(p.data_matrix()) else p.n_samples * p.d
    return {
        "kind": kind,
        "n": n,
        "d": p.d,
        "samples": p.n_samples,
        "nnz": nnz,
        "load_s": load_s,
        "setup_s": setup,
        "setup_cpu_s": setup_cpu,
        "round_ms": 1e3 * per_round,
        "round_cpu_ms": 1e3 * per_round_cpu,
        "time_s_ms": 1e3 * float(res.table["time_s"].iloc[-1]) / rounds,
        "rss_start_mb": base / 1024,
        "rss_setup_mb": after_setup / 1024,
        "rss_peak_mb": peak / 1024,
        "status": res.status,
    }


def scale(clients: list[int], kinds: list[str], rounds: int) -> None:
    print(
        "EF21 + top_k[k=1], 1 thread, logged every 10 rounds; each configuration in a fresh "
        "process (peak RSS includes the interpreter and torch, ~0.35 GB); set-up = building the "
        "problem with its exact L_i (the dataset file is read before); wall (cpu) times"
    )
    print(
        f"{'problem':<10} {'n':>7} {'d':>4} {'samples':>8} {'nnz':>9} {'set-up s (cpu)':>15} "
        f"{'ms/round (cpu)':>15} {'peak MB':>8} {'cpu ms/round per 10⁶ (nnz + n·d)':>33}"
    )
    for kind in kinds:
        for n in clients:
            cmd = [sys.executable, __file__, "_child", kind, str(n), str(rounds)]
            # one BLAS thread: a multi-threaded OpenBLAS on a busy 2-core machine made the set-up's
            # Gram products 30× slower (docs/platform-notes.md)
            env = dict(
                os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"
            )
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if proc.returncode != 0:
                print(f"{kind:<10} {n:>7}  failed: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            work = (r["nnz"] + r["n"] * r["d"]) / 1e6
            setup = f"{r['setup_s']:.2f} ({r['setup_cpu_s']:.2f})"
            per = f"{r['round_ms']:.1f} ({r['round_cpu_ms']:.1f})"
            print(
                f"{kind:<10} {n:>7} {r['d']:>4} {r['samples']:>8} {r['nnz']:>9} {setup:>15} "
                f"{per:>15} {r['rss_peak_mb']:>8.0f} {r['round_cpu_ms'] / work:>33.2f}"
            )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind, n, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(_scale_child(kind, n, rounds)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "scale":
        ap = argparse.ArgumentParser(description="federated-scale client counts")
        ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10_000, 100_000])
        ap.add_argument("--problems", nargs="+", default=["synthetic", "a9a", "w8a"])
        ap.add_argument("--rounds", type=int, default=30)
        a = ap.parse_args(sys.argv[2:])
        scale(a.clients, a.problems, a.rounds)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--loop-rounds", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-methods", action="store_true", help="skip the per-method overheads")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        "EF21 + top_k[k=1], a9a logistic regression (nonconvex, λ=0.1), float64, x0 = 0, "
        f"theory step, metrics logged every round; {args.clock} clock; median [min–max] over "
        f"{args.repeat} alternating repetitions"
    )
    for n in args.clients:
        for threads in args.threads:
            report(measure(n, args.rounds, args.loop_rounds, args.repeat, threads))
    if not args.no_methods:
        method_overheads(max(args.clients), args.rounds, max(3, args.repeat // 2))


if __name__ == "__main__":
    main()
