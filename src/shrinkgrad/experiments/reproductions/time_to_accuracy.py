"""``time-to-accuracy``: which method reaches ε first depends on the network (issue 16).

Set-up (``configs/time-to-accuracy.toml``): dense GD, Top-k + EF21, rand-k + DCGD and QSGD + DCGD
on one LIBSVM problem (a1a logistic regression, L known: theory steps) and one model problem (an
MLP on a1a, L unknown: every method at a grid of numeric steps), every run modelled on a star
network at three uplink bandwidths spanning two orders of magnitude (``run.network``; the
``time_model_s`` column, docs/network.md §7). Everything below is measured per problem.

* **Tuning.** An arm (method + compressor) with several step sizes is tuned: its step is the one
  with the lowest median final training loss over the seeds (ties: the smaller step), as
  ``deep-ef`` does; an arm with one step (the theory step) is its own tuned run. Only tuned runs
  enter the claims.
* **ε** of a problem is the largest final value of its metric (``[claims] metric``: ‖∇f‖² by
  default, the training loss f for the MLP) over its tuned runs, so that every tuned run reaches
  it. The time to ε of an arm on a network is the first modelled time at which the metric is
  ≤ ε (log-interpolated between logged rounds; median over seeds), and likewise its rounds R
  and its uplink bits per client and round u (the initialisation included).

Claims, written before the run:

1. **The fastest method changes with bandwidth**, on every problem: the arm with the smallest
   time to ε at the lowest bandwidth is not the one at the highest.
2. **First principles predict the winner and the crossover.** On a star with per-round compute c,
   latency α and uplink B↑ (the downlink not the bottleneck), an arm that needs R rounds to ε
   and sends u bits per client per round takes (R + 1)(c + 2α + u/B↑) (the initialisation is a
   round). With R and u read from the runs' round counter and bits (never their clock), on every
   problem (a) the predicted winner is the simulated winner on every network, and (b) the
   crossover bandwidth at which dense GD (the arm with the identity compressor) and the
   low-bandwidth winner b tie, B* = ((R_b+1)u_b − (R_g+1)u_g) / ((c + 2α)((R_g+1) − (R_b+1))),
   orders the two as the simulated times do on every network: b faster below B*, GD faster
   above (no positive B*: one of them faster at every bandwidth, as predicted).
3. **The tuning is honest**: every tuned step of a grid of ≥ 3 steps lies inside its grid.

With given compute, no latency and identical clients, the simulated clock is (R + 1)(c + u/B↑) by
construction, so claim 2 checks that the model's bookkeeping (bytes, rounds, the slowest client)
adds up to the first-principles count and that the crossover falls where the curves cross; that
the model's times are those of real links is the calibration of ``benchmarks/ddp.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from ..claims import Claim, final_value, fmt, median, reach, runs_of
from . import REPRODUCTIONS, Reproduction

#: ``metric``: problem label → the results column ε is set on (default ``grad_norm_sq``)
DEFAULTS: dict[str, Any] = {"metric": {}}
#: the column of a problem absent from ``metric``
DEFAULT_METRIC = "grad_norm_sq"

Run = dict[str, Any]


def _arm(row: pd.Series | Mapping[str, Any]) -> str:
    return f"{row['method']} + {row['compressor']}"


def _links(spec: str, n: int) -> tuple[float, float, float]:
    """(uplink bit/s, latency s, compute s) of client 0 of ``spec`` for n clients."""
    from ...network import make_network

    net = make_network(spec)
    links = net.links(n)
    return float(links.up[0]), float(links.latency[0]), float(net.compute_times(n)[0])


def metric_of(problem: str, params: Mapping[str, Any]) -> str:
    """The column ε is set on for ``problem`` (``[claims] metric``)."""
    metrics = params.get("metric") or {}
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"[claims] metric must be a table of problem label → column, got {metrics!r}"
        )
    return str(metrics.get(problem, DEFAULT_METRIC))


def _runs(table: pd.DataFrame) -> list[Run]:
    out = []
    for keys, run in runs_of(table):
        first = run.iloc[0]
        out.append(
            {
                "problem": str(keys.get("problem_label", "")),
                "network": str(first["network"]),
                "arm": _arm(first),
                "step": float(first["stepsize"]),
                "n": int(first["n_clients"]),
                "run": run,
            }
        )
    return out


def tune(runs: list[Run]) -> dict[str, tuple[float, list[float]]]:
    """arm → (its tuned step, its grid): the lowest median final training loss over the seeds
    (and networks: the iterates do not depend on the network), ties to the smaller step."""
    out: dict[str, tuple[float, list[float]]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        grid = sorted({r["step"] for r in mine})
        score = {
            s: median(final_value(r["run"], "loss") for r in mine if r["step"] == s) for s in grid
        }
        out[arm] = (min(grid, key=lambda s: (score[s], s)), grid)
    return out


def measure(table: pd.DataFrame, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Per problem: its metric, ε, the tuned steps and grids, and per network and arm the medians
    over seeds of the simulated time to ε (``time``), the rounds to ε (``rounds``) and the uplink
    bits per client per round to ε (``bits``, the initialisation included)."""
    params = DEFAULTS if params is None else params
    everything = _runs(table)
    out: dict[str, Any] = {}
    for problem in dict.fromkeys(r["problem"] for r in everything):
        metric = metric_of(problem, params)
        runs = [r for r in everything if r["problem"] == problem]
        tuned = tune(runs)
        best = [r for r in runs if r["step"] == tuned[r["arm"]][0]]
        # runs that diverged or made no progress (final value inf) set no tolerance: one of
        # them made ε infinite, so every other run "reached" it at round 0
        finals = [final_value(r["run"], metric) for r in best]
        results = [v for v in finals if math.isfinite(v)]
        eps = max(results) if results else math.nan
        seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r in best:
            run = r["run"]
            rounds = reach(run, eps, x="round", y=metric)
            bits = reach(run, eps, x="bits_up", y=metric)
            per_round = bits / (rounds + 1) if math.isfinite(rounds) else math.inf
            time = reach(run, eps, x="time_model_s", y=metric)
            seen.setdefault((r["network"], r["arm"]), []).append((time, rounds, per_round))
        arms: dict[str, dict[str, dict[str, float]]] = {}
        for (net, arm), values in seen.items():
            cols = list(zip(*values, strict=True))
            arms.setdefault(net, {})[arm] = {
                k: median(v) for k, v in zip(("time", "rounds", "bits"), cols, strict=True)
            }
        out[problem] = {
            "metric": metric,
            "eps": eps,
            "n": runs[0]["n"],
            "tuned": tuned,
            "arms": arms,
        }
    return out


def predicted_time(v: Mapping[str, float], up: float, lat: float, c: float) -> float:
    """(R + 1)(c + 2α + u/B↑): the first-principles time to ε of an arm (module docstring)."""
    return (v["rounds"] + 1) * (c + 2 * lat + v["bits"] / up)


def crossover(va: Mapping[str, float], vb: Mapping[str, float], c: float) -> float:
    """B* at which arms a and b tie: (R_a+1)(c + u_a/B) = (R_b+1)(c + u_b/B) (NaN if none)."""
    ra, rb = va["rounds"] + 1, vb["rounds"] + 1
    den = c * (ra - rb)
    num = rb * vb["bits"] - ra * va["bits"]
    if not (den and math.isfinite(num) and math.isfinite(den)) or num / den <= 0:
        return math.nan
    return num / den


def _mbit(b: float) -> str:
    return f"{fmt(b / 1e6)} Mbit/s"


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    if "network" not in table.columns or "time_model_s" not in table.columns:
        return [Claim("the fastest method changes with bandwidth", "no network runs", "—", None)]
    m = measure(table, params)
    changes: list[str] = []
    changed: list[bool] = []
    pred_parts: list[str] = []
    pred_ok: list[bool] = []
    grid_parts: list[str] = []
    grid_ok: list[bool] = []
    values: dict[str, Any] = {}
    for problem, p in m.items():
        n = p["n"]
        nets = sorted(p["arms"], key=lambda s: _links(s, n)[0])
        bw = {net: _links(net, n)[0] for net in nets}
        times = {net: p["arms"][net] for net in nets}
        winner = {net: min(times[net], key=lambda a: times[net][a]["time"]) for net in nets}
        low, high = nets[0], nets[-1]
        changed.append(winner[low] != winner[high])
        text = ", ".join(
            f"{_mbit(bw[net])}: {winner[net]} ({fmt(times[net][winner[net]]['time'])} s)"
            for net in nets
        )
        changes.append(f"{problem} (ε = {fmt(p['eps'])} on {p['metric']}): {text}")
        # first principles: (R + 1)(c + 2α + u/B↑) from the rounds and bits
        predicted = {}
        for net in nets:
            up, lat, c = _links(net, n)
            pred = {arm: predicted_time(v, up, lat, c) for arm, v in times[net].items()}
            predicted[net] = min(pred, key=lambda a: pred[a])
        agree = all(predicted[net] == winner[net] for net in nets)
        b = winner[low]
        dense = next((a for a in times[high] if a.endswith("+ identity")), None)
        up, lat, c = _links(high, n)
        cross = math.nan
        if dense is not None and dense != b:
            cross = crossover(times[high][dense], times[high][b], c + 2 * lat)
            # the order B* predicts on each network is that of the two first-principles times
            # (they tie at B*; b, with fewer bits, is faster on the side of small B)
            b_first = {
                net: predicted_time(times[net][b], *_links(net, n))
                < predicted_time(times[net][dense], *_links(net, n))
                for net in nets
            }
            order_ok = all(
                (times[net][b]["time"] < times[net][dense]["time"]) == b_first[net] for net in nets
            )
            pred_ok.append(agree and order_ok)
            where = (
                f"B* = {_mbit(cross)} for {dense} vs {b}"
                if math.isfinite(cross)
                else f"no crossover of {dense} and {b} ({b if b_first[low] else dense} faster)"
            ) + f" ({'=' if order_ok else '≠'} simulated order on every network)"
        else:
            pred_ok.append(agree)
            where = f"{b} is the dense arm: no crossover to measure"
        pred_parts.append(
            f"{problem}: predicted winners {', '.join(predicted[net] for net in nets)} "
            f"({'=' if agree else '≠'} simulated); {where}"
        )
        values[problem] = {
            "eps": p["eps"],
            "metric": p["metric"],
            "bandwidth": bw,
            "winner": winner,
            "predicted": predicted,
            "crossover_bit_s": cross if math.isfinite(cross) else -1.0,
            "rounds": {arm: v["rounds"] for arm, v in times[high].items()},
            "bits_per_round": {arm: v["bits"] for arm, v in times[high].items()},
            "tuned": {arm: step for arm, (step, _) in p["tuned"].items()},
        }
        for arm, (step, grid) in p["tuned"].items():
            if len(grid) >= 3:
                inner = grid[0] < step < grid[-1]
                grid_ok.append(inner)
                grid_parts.append(
                    f"{problem} {arm}: {step:g} ∈ [{grid[0]:g}, {grid[-1]:g}]"
                    + ("" if inner else " (at an end)")
                )
    out = [
        Claim(
            "the fastest method to ε changes with the bandwidth",
            "; ".join(changes),
            "on every problem: winner at the lowest bandwidth ≠ winner at the highest",
            all(changed),
            values,
        ),
        Claim(
            "rounds-to-ε × (compute + bits/bandwidth) predicts the winner and the crossover",
            "; ".join(pred_parts),
            "on every problem: the predicted winner is the simulated one on every network, and "
            "B* orders GD and the low-bandwidth winner as the simulated times do",
            all(pred_ok),
            {p: {"crossover_bit_s": v["crossover_bit_s"]} for p, v in values.items()},
        ),
    ]
    if grid_parts:
        out.append(
            Claim(
                "every tuned step lies inside its grid (the grids bracket the best step)",
                "; ".join(grid_parts),
                "no tuned step at an end of its grid",
                all(grid_ok),
                {p: v["tuned"] for p, v in values.items()},
            )
        )
    else:
        out.append(
            Claim(
                "every tuned step lies inside its grid (the grids bracket the best step)",
                "grids of fewer than 3 steps (a short profile)",
                "—",
                None,
            )
        )
    return out


def figures(table: pd.DataFrame, params: Mapping[str, Any], directory: Path) -> list[Path]:
    """Per problem, its tuned runs: the metric against the modelled time, one panel per network,
    log x (``time_to_accuracy-<problem>.png``/``.pdf``)."""
    from ...plotting import plot_results

    if "network" not in table.columns or "time_model_s" not in table.columns:
        return []
    m = measure(table, params)
    paths: list[Path] = []
    for problem, p in m.items():
        sub = table[table["problem_label"] == problem]
        keep = pd.Series(False, index=sub.index)
        for arm, (step, _) in p["tuned"].items():
            keep |= (sub["method"] + " + " + sub["compressor"] == arm) & (sub["stepsize"] == step)
        _, written = plot_results(
            sub[keep],
            "time_model",
            p["metric"],
            directory / f"time_to_accuracy-{problem}",
            facet="network",
            logx=True,
            title=f"time to ε on a star network: {problem} (ε = {fmt(p['eps'])}, tuned runs)",
        )
        paths += written
    return paths


REPRODUCTIONS.register(
    Reproduction(
        name="time-to-accuracy",
        title="Time to ε on a star network at three bandwidths",
        paper="issue 16 (network model)",
        config="time-to-accuracy.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(),
        figures=figures,
    )
)
