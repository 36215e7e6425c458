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

Only runs that are results are measured: a run that diverged, made no progress or whose last
value of the metric (or training loss, for the tuning) is NaN reaches nothing and sets no ε; an
arm that never reaches ε is slower than every arm that does. A verdict needs a measurement:

* a problem on which no arm reaches ε on a network (every run no result) fails claims 1 and 2;
* a network on which an arm of the problem has no tuned run (a sweep cut short, a failed run),
  a tie for the fastest arm, one bandwidth only, or no dense arm to place B* against leaves that
  part of the claim n/a (never decided by the table's row order); a FAIL elsewhere still fails;
* a tuned step tied in score with an end of its grid is not inside it (the grid does not show
  that the optimum is bracketed), and an arm none of whose steps is a result fails claim 3.

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


def _final(run: pd.DataFrame, y: str) -> float:
    """The run's last ``y`` (:func:`~shrinkgrad.experiments.claims.final_value`), inf when it is
    no result: it diverged, made no progress, or its last value is not finite (a NaN its status
    does not flag is no score to tune on and no value to set ε by)."""
    v = final_value(run, y)
    return v if math.isfinite(v) else math.inf


def scores(runs: list[Run]) -> dict[str, dict[float, float]]:
    """arm → step → the median over its runs (seeds and networks) of the final training loss
    (inf for a run that is no result, :func:`_final`)."""
    out: dict[str, dict[float, float]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {
            s: median(_final(r["run"], "loss") for r in mine if r["step"] == s)
            for s in sorted({r["step"] for r in mine})
        }
    return out


def tune(runs: list[Run]) -> dict[str, tuple[float, list[float]]]:
    """arm → (its tuned step, its grid): the lowest median final training loss over the seeds
    (and networks: the iterates do not depend on the network), ties to the smaller step."""
    return {
        arm: (min(score, key=lambda s: (score[s], s)), list(score))
        for arm, score in scores(runs).items()
    }


def measure(table: pd.DataFrame, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Per problem: its metric, ε, the tuned steps, grids and scores (:func:`scores`), and per
    network and arm the medians over seeds of the simulated time to ε (``time``), the rounds to
    ε (``rounds``) and the uplink bits per client per round to ε (``bits``, the initialisation
    included); ``networks``: every network of the table, ``missing``: per network, the arms of
    the problem without a tuned run there (a sweep cut short, a failed run)."""
    params = DEFAULTS if params is None else params
    everything = _runs(table)
    networks = list(dict.fromkeys(r["network"] for r in everything))
    out: dict[str, Any] = {}
    for problem in dict.fromkeys(r["problem"] for r in everything):
        metric = metric_of(problem, params)
        runs = [r for r in everything if r["problem"] == problem]
        score = scores(runs)
        tuned = tune(runs)
        best = [r for r in runs if r["step"] == tuned[r["arm"]][0]]
        # runs that are no result (final value inf) set no tolerance: one of them made ε
        # infinite, so every other run "reached" it at round 0; nor do they reach it
        finals = [_final(r["run"], metric) for r in best]
        results = [v for v in finals if math.isfinite(v)]
        eps = max(results) if results else math.nan
        seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r, final in zip(best, finals, strict=True):
            run = r["run"]
            if math.isfinite(final):
                rounds = reach(run, eps, x="round", y=metric)
                bits = reach(run, eps, x="bits_up", y=metric)
                per_round = bits / (rounds + 1) if math.isfinite(rounds) else math.inf
                time = reach(run, eps, x="time_model_s", y=metric)
            else:
                time = rounds = per_round = math.inf
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
            "scores": score,
            "arms": arms,
            "networks": networks,
            "missing": {net: [a for a in tuned if a not in arms.get(net, {})] for net in networks},
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


#: the three claims (module docstring)
TITLES = (
    "the fastest method to ε changes with the bandwidth",
    "rounds-to-ε × (compute + bits/bandwidth) predicts the winner and the crossover",
    "every tuned step lies inside its grid (the grids bracket the best step)",
)
#: why a network has no winner: nothing to measure there (n/a) or no arm reached ε (FAIL)
NOT_MEASURED, NONE_REACHED = None, False


def _every(oks: list[bool | None]) -> bool | None:
    """A verdict over parts: False when one fails, else None when one was not measured (or
    there is none), else True."""
    if any(o is False for o in oks):
        return False
    return None if not oks or any(o is None for o in oks) else True


def winner(times: Mapping[str, float]) -> tuple[str | None, bool | None, str]:
    """(the arm with the smallest finite time, or None; the verdict a part that needs it gets
    when there is none; what to show). No arm with a finite time: no arm reached ε
    (:data:`NONE_REACHED`, a failure); a tie for the smallest time: no single winner
    (:data:`NOT_MEASURED`; the table's row order would have chosen one)."""
    finite = {a: t for a, t in times.items() if math.isfinite(t)}
    if not finite:
        return None, NONE_REACHED, "no arm reaches ε"
    best = min(finite.values())
    tied = sorted(a for a, t in finite.items() if t == best)
    if len(tied) > 1:
        return None, NOT_MEASURED, f"tie: {' = '.join(tied)}"
    return tied[0], True, tied[0]


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    """The three claims of the module docstring, per problem and then over the problems
    (:func:`_every`: a problem that fails a claim fails it, one that could not measure it leaves
    it n/a)."""
    if "network" not in table.columns or "time_model_s" not in table.columns:
        return [Claim("the fastest method changes with bandwidth", "no network runs", "—", None)]
    m = measure(table, params)
    if not m:
        return [Claim(title, "no runs", "—", None) for title in TITLES]
    changes: list[str] = []
    changed: list[bool | None] = []
    pred_parts: list[str] = []
    pred_ok: list[bool | None] = []
    grid_parts: list[str] = []
    grid_ok: list[bool] = []
    values: dict[str, Any] = {}
    for problem, p in m.items():
        n = p["n"]
        links = {net: _links(net, n) for net in p["networks"]}
        nets = sorted(p["networks"], key=lambda s: links[s][0])
        bw = {net: links[net][0] for net in nets}
        times: dict[str, dict[str, dict[str, float]]] = {
            net: p["arms"].get(net, {}) for net in nets
        }
        missing: dict[str, list[str]] = p["missing"]
        # the simulated winner per network (None: see `why`), and its verdict when there is none
        win: dict[str, str | None] = {}
        why: dict[str, bool | None] = {}
        shown: dict[str, str] = {}
        for net in nets:
            if missing[net]:
                win[net], why[net] = None, NOT_MEASURED
                shown[net] = f"no tuned run of {', '.join(missing[net])}"
                continue
            win[net], why[net], text = winner({a: v["time"] for a, v in times[net].items()})
            shown[net] = (
                f"{text} ({fmt(times[net][text]['time'])} s)" if win[net] is not None else text
            )
        low, high = nets[0], nets[-1]
        if len(nets) < 2:
            changed.append(NOT_MEASURED)
        elif win[low] is None or win[high] is None:
            changed.append(_every([why[net] for net in (low, high) if win[net] is None]))
        else:
            changed.append(win[low] != win[high])
        text = ", ".join(f"{_mbit(bw[net])}: {shown[net]}" for net in nets)
        if len(nets) < 2:
            text += " (one bandwidth: nothing to compare)"
        changes.append(f"{problem} (ε = {fmt(p['eps'])} on {p['metric']}): {text}")
        # first principles: (R + 1)(c + 2α + u/B↑) from the rounds and bits
        oks: list[bool | None] = []
        predicted: dict[str, str | None] = {}
        for net in nets:
            if win[net] is None:
                predicted[net] = None
                oks.append(why[net])
                continue
            up, lat, c = links[net]
            pred = {arm: predicted_time(v, up, lat, c) for arm, v in times[net].items()}
            predicted[net], _, _ = winner(pred)  # a tie names no winner: n/a
            oks.append(None if predicted[net] is None else predicted[net] == win[net])
        agree = _every(oks)
        mark = {True: "=", False: "≠", None: "?"}
        b = win[low]
        dense = next((a for a in p["tuned"] if a.endswith("+ identity")), None)
        cross = math.nan
        if b is None:
            where = f"no winner at {_mbit(bw[low])}: no crossover to measure"
        elif dense is None:
            oks.append(NOT_MEASURED)
            where = "no dense (identity) arm: no crossover to measure"
        elif dense == b:
            where = f"{b} is the dense arm: no crossover to measure"
        else:
            # the order B* predicts on each network is that of the two first-principles times
            # (they tie at B*; b, with fewer bits, is faster on the side of small B); measured
            # where both arms have tuned runs (elsewhere the network is n/a above)
            both = [net for net in nets if b in times[net] and dense in times[net]]
            b_first = {
                net: predicted_time(times[net][b], *links[net])
                < predicted_time(times[net][dense], *links[net])
                for net in both
            }
            order_ok = all(
                (times[net][b]["time"] < times[net][dense]["time"]) == b_first[net] for net in both
            )
            oks.append(order_ok)
            if both:  # R and u do not depend on the network: read at the highest with both
                up, lat, c = links[both[-1]]
                cross = crossover(times[both[-1]][dense], times[both[-1]][b], c + 2 * lat)
            on = (
                "every network"
                if len(both) == len(nets)
                else f"{len(both)} of {len(nets)} networks (the others lack an arm)"
            )
            where = (
                f"B* = {_mbit(cross)} for {dense} vs {b}"
                if math.isfinite(cross)
                else f"no crossover of {dense} and {b}"
                + (f" ({b if b_first[both[0]] else dense} faster)" if both else "")
            ) + f" ({'=' if order_ok else '≠'} simulated order on {on})"
        pred_ok.append(_every(oks))
        unknown = "; ".join(f"{_mbit(bw[net])}: {shown[net]}" for net in nets if not win[net])
        pred_parts.append(
            f"{problem}: predicted winners {', '.join(predicted[net] or '—' for net in nets)} "
            f"({mark[agree]} simulated{': ' + unknown if unknown else ''}); {where}"
        )
        at_high = times[high]
        values[problem] = {
            "eps": p["eps"],
            "metric": p["metric"],
            "bandwidth": bw,
            "winner": win,
            "predicted": predicted,
            "crossover_bit_s": cross if math.isfinite(cross) else -1.0,
            "rounds": {arm: v["rounds"] for arm, v in at_high.items()},
            "bits_per_round": {arm: v["bits"] for arm, v in at_high.items()},
            "tuned": {arm: step for arm, (step, _) in p["tuned"].items()},
        }
        for arm, (step, grid) in p["tuned"].items():
            if len(grid) >= 3:
                score = p["scores"][arm]
                best = score[step]
                # a tie with an end of the grid does not show the optimum bracketed
                ends = [s for s in (grid[0], grid[-1]) if score[s] == best]
                inner = math.isfinite(best) and not ends
                grid_ok.append(inner)
                note = (
                    " (no step is a result)"
                    if not math.isfinite(best)
                    else " (at an end)"
                    if step in ends
                    else f" (tied with the end {ends[0]:g})"
                    if ends
                    else ""
                )
                grid_parts.append(f"{problem} {arm}: {step:g} ∈ [{grid[0]:g}, {grid[-1]:g}]" + note)
    out = [
        Claim(
            TITLES[0],
            "; ".join(changes),
            "on every problem: winner at the lowest bandwidth ≠ winner at the highest",
            _every(changed),
            values,
        ),
        Claim(
            TITLES[1],
            "; ".join(pred_parts),
            "on every problem: the predicted winner is the simulated one on every network, and "
            "B* orders GD and the low-bandwidth winner as the simulated times do",
            _every(pred_ok),
            {p: {"crossover_bit_s": v["crossover_bit_s"]} for p, v in values.items()},
        ),
    ]
    if grid_parts:
        out.append(
            Claim(
                TITLES[2],
                "; ".join(grid_parts),
                "no tuned step at (or tied in score with) an end of its grid",
                all(grid_ok),
                {p: v["tuned"] for p, v in values.items()},
            )
        )
    else:
        out.append(
            Claim(
                TITLES[2],
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
