"""``shrinkgrad estimate``: predicted wall-clock time to ε on a described network.

Example::

    shrinkgrad estimate --problem "logistic_regression[dataset=w1a,n_clients=10]" \\
        --method ef21 --compressor "top_k[k=1]" \\
        --network "star[up=10mbit,down=100mbit,latency=20ms]" --network "ring[bandwidth=1gbit]"

prints the theory's rounds to min‖∇f‖² ≤ ε (``shrinkgrad.network.estimate.ROUNDS_THEOREMS``:
gd, ef21, ef21_w, ef21_pp, ef21_w_pp by [EF21] Thm 1 and its relatives; dcgd with an unbiased
compressor by Khaled & Richtárik 2023 Thm 2; any other method needs ``--rounds N``), the traffic
of a round, and for each network the cost of a round (compute, transfer, latency; the slowest client
on a star) and the predicted time to ε. ``--network`` is repeatable: the method is simulated
once. ``--json`` prints the same as a JSON list. The model: docs/network.md.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ..network.estimate import Estimate

__all__ = ["estimate_cmd"]


@click.command("estimate")
@click.option(
    "--problem",
    "problem",
    required=True,
    help="problem spec, e.g. 'logistic_regression[dataset=w1a,n_clients=10]'",
)
@click.option("--method", default="ef21", show_default=True, help="method spec")
@click.option("--compressor", default="top_k[k=1]", show_default=True, help="compressor spec")
@click.option(
    "--network",
    "networks",
    multiple=True,
    required=True,
    help="network spec, e.g. 'star[up=10mbit,down=100mbit,latency=20ms]' (repeatable)",
)
@click.option(
    "--eps", type=float, default=1e-3, show_default=True, help="target min ‖∇f(x^t)‖² ≤ ε"
)
@click.option("--stepsize", default="theory", show_default=True, help="a number or theory[*m]")
@click.option(
    "--compute",
    default=None,
    help="compute time per client per round, e.g. 50ms [default: the network's compute=, "
    "else measured]",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=0),
    default=None,
    help="use this many rounds (needed for methods without a rounds-to-ε theorem)",
)
@click.option(
    "--measure",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="rounds simulated to measure traffic and compute",
)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print a JSON list instead of tables")
def estimate_cmd(
    problem: str,
    method: str,
    compressor: str,
    networks: tuple[str, ...],
    eps: float,
    stepsize: str,
    compute: str | None,
    rounds: int | None,
    measure: int,
    seed: int,
    as_json: bool,
) -> None:
    """Predicted time to ε of a method on one or more networks (theory rounds × round cost)."""
    from ..network import make_network
    from ..network.units import parse_duration

    nets = [make_network(n) for n in networks]  # spec mistakes first, before any heavy import
    if compute is not None:
        parse_duration(compute, "--compute")
    from ..methods import make_method
    from ..network.estimate import estimate, measure_rounds, rounds_theorem
    from ..problems import make_problem
    from ..sim.engine import check_round_memory

    if rounds is None:
        rounds_theorem(method)  # a method no theorem covers: refuse before building anything

    prob = make_problem(problem)
    for net in nets:  # per-client lists of the wrong length, before any simulation
        net.links(prob.n)
        net.compute_times(prob.n)
    meth = make_method(method)
    check_round_memory(prob, meth)  # n × d arrays that cannot fit: one line, before binding
    bound = meth.bind(prob, compressor, stepsize, seed)
    measured = measure_rounds(bound, prob, measure)
    results = [
        estimate(
            prob,
            method,
            compressor,
            net,
            eps=eps,
            stepsize=stepsize,
            compute=compute,
            rounds=rounds,
            seed=seed,
            measured=measured,
        )
        for net in nets
    ]
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in results], indent=2, default=str))
        return
    _print(results, [n.describe(prob.n) for n in nets])


def _print(results: list[Estimate], described: list[str]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..network.units import format_duration

    first = results[0]
    console = Console(width=max(120, Console().width))
    head = Table(show_header=False, title=escape(f"time to min ‖∇f(xᵗ)‖² ≤ ε = {first.eps:g}"))
    head.add_column("")
    head.add_column("")
    for k, v in (
        ("problem", f"{first.problem} (n = {first.n}, d = {first.d})"),
        ("method", f"{first.method} · {first.compressor}"),
        ("step size", f"γ = {first.stepsize:.4g} ({first.stepsize_rule})"),
        ("rounds to ε", f"{first.rounds} ({first.rounds_source})"),
        ("uplink per client", f"{first.bits_up_per_round:.6g} bits per round"),
        ("compute", first.compute_source),
    ):
        head.add_row(escape(k), escape(v))
    console.print(head)
    t = Table(title="cost of a round (the slowest client's, on a star) and time to ε")
    for col in ("network", "compute", "transfer", "latency", "round", "slowest", "time to ε"):
        t.add_column(col, overflow="fold")
    for r, text in zip(results, described, strict=True):
        c = r.per_round
        t.add_row(
            escape(text),
            format_duration(c.compute_s),
            format_duration(c.transfer_s),
            format_duration(c.latency_s),
            format_duration(c.total_s),
            "—" if c.client is None else f"client {c.client}",
            format_duration(r.time_s),
        )
    console.print(t)
    rounds = (
        "the rounds are the ones given (--rounds)"
        if first.rounds_source == "given"
        else "the rounds are the theorem's bound (an upper bound, often loose)"
    )
    console.print(f"time to ε = initialisation + rounds × mean round; {rounds}")
