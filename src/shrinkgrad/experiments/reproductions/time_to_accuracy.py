"""``time-to-accuracy``: which method reaches ε first depends on the network (issue 16).

Set-up (``configs/time-to-accuracy.toml``): dense GD, Top-k + EF21, rand-k + DCGD and QSGD + DCGD
on one LIBSVM problem, every run modelled on a star network at three uplink bandwidths spanning
two orders of magnitude (``run.network``; the ``time_model_s`` column, docs/network.md §7).

Claims, written before the first run:

1. **The fastest method changes with bandwidth.** ε = the largest final ‖∇f‖² of any arm (so that
   every arm reaches it); the time to ε of an arm on a network is the first modelled time with
   ‖∇f‖² ≤ ε (median over seeds). The arm with the smallest time to ε at the lowest bandwidth is
   not the one at the highest.
2. **First principles predict the winner.** On a star with per-round compute c, latency α and
   uplink B↑ (downlink not the bottleneck), a method that needs R rounds to ε and sends u bits per
   client per round takes R·(c + 2α + u/B↑) (the init round included in R + 1). With R and u
   measured on the run's rounds and bits (not its time), the predicted winner equals the
   simulated winner on every network; the bandwidth B* at which the dense method and the
   low-bandwidth winner tie, R_a(c + u_a/B*) = R_b(c + u_b/B*), is reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from ..claims import Claim, final_value, fmt, median, reach, runs_of
from . import REPRODUCTIONS, PlotSpec, Reproduction

DEFAULTS: dict[str, Any] = {}


def _arm(row: pd.Series) -> str:
    return f"{row['method']} + {row['compressor']}"


def _links(spec: str, n: int) -> tuple[float, float, float]:
    """(uplink bit/s, latency s, compute s) of client 0 of ``spec`` for n clients."""
    from ...network import make_network

    net = make_network(spec)
    links = net.links(n)
    return float(links.up[0]), float(links.latency[0]), float(net.compute_times(n)[0])


def measure(table: pd.DataFrame) -> dict[str, Any]:
    """ε, and per network and arm the medians over seeds of the simulated time to ε
    (``time``), the rounds to ε (``rounds``) and the uplink bits per client per round to ε
    (``bits``, the initialisation included)."""
    runs = [(str(run["network"].iloc[0]), _arm(run.iloc[0]), run) for _, run in runs_of(table)]
    eps = max(final_value(run) for _, _, run in runs)
    seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for net, arm, run in runs:
        r = reach(run, eps, x="round")
        per_round = reach(run, eps, x="bits_up") / (r + 1) if math.isfinite(r) else math.inf
        seen.setdefault((net, arm), []).append((reach(run, eps, x="time_model_s"), r, per_round))
    arms: dict[str, dict[str, dict[str, float]]] = {}
    for (net, arm), values in seen.items():
        cols = list(zip(*values, strict=True))
        arms.setdefault(net, {})[arm] = {
            k: median(v) for k, v in zip(("time", "rounds", "bits"), cols, strict=True)
        }
    return {"eps": eps, "n": int(table["n_clients"].iloc[0]), "arms": arms}


def claims(table: pd.DataFrame, params: Mapping[str, Any]) -> list[Claim]:
    if "network" not in table.columns or "time_model_s" not in table.columns:
        return [Claim("the fastest method changes with bandwidth", "no network runs", "—", None)]
    m = measure(table)
    nets = sorted(m["arms"], key=lambda s: _links(s, m["n"])[0])
    winner = {net: min(m["arms"][net], key=lambda a: m["arms"][net][a]["time"]) for net in nets}
    low, high = nets[0], nets[-1]
    bw = {net: _links(net, m["n"])[0] for net in nets}
    text = ", ".join(
        f"{bw[net] / 1e6:g} Mbit/s: {winner[net]} ({fmt(m['arms'][net][winner[net]]['time'])} s)"
        for net in nets
    )
    out = [
        Claim(
            "the fastest method to ε changes with the bandwidth",
            f"ε = {fmt(m['eps'])}; fastest at {text}",
            "winner at the lowest bandwidth ≠ winner at the highest",
            winner[low] != winner[high],
            {"eps": m["eps"], "bandwidth": bw},
        )
    ]
    predicted = {}
    for net in nets:
        up, lat, c = _links(net, m["n"])
        pred = {
            arm: (v["rounds"] + 1) * (c + 2 * lat + v["bits"] / up)
            for arm, v in m["arms"][net].items()
        }
        predicted[net] = min(pred, key=lambda a: pred[a])
    a, b = winner[high], winner[low]
    va, vb = m["arms"][high][a], m["arms"][high][b]
    c = _links(high, m["n"])[2]
    den = c * ((va["rounds"] + 1) - (vb["rounds"] + 1))
    num = (vb["rounds"] + 1) * vb["bits"] - (va["rounds"] + 1) * va["bits"]
    cross = num / den if den and math.isfinite(num) else math.nan
    agree = all(predicted[net] == winner[net] for net in nets)
    out.append(
        Claim(
            "rounds-to-ε × (compute + bits/bandwidth) predicts the winner",
            f"predicted winners: {', '.join(predicted[n] for n in nets)}; "
            f"crossover {a} vs {b} at B* = {fmt(cross / 1e6)} Mbit/s",
            "the predicted winner is the simulated one on every network",
            agree,
            {"crossover_bit_s": cross if math.isfinite(cross) else -1.0},
        )
    )
    return out


REPRODUCTIONS.register(
    Reproduction(
        name="time-to-accuracy",
        title="Time to ε on a star network at three bandwidths",
        paper="issue 16 (network model)",
        config="time-to-accuracy.toml",
        claims=claims,
        defaults=DEFAULTS,
        plots=(PlotSpec("time_model", "grad_norm_sq", facet="network", logx=True),),
    )
)
