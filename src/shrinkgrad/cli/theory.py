"""``shrinkgrad theory``: a problem's smoothness constants and every applicable step-size rule.

Example::

    shrinkgrad theory --dataset australian --clients 100 --split contiguous \
        --compressor "top_k[k=1]"

prints L, statistics of the L_i, L_AM, L_QM, L_var, μ when known, the compressor's α (and ω when
it is unbiased), ξ(α), then each rule of methods.md §4 that applies with its value, source and
mark, and the predicted rounds and bits per client to reach ‖∇f‖² ≤ ε. ``--json`` prints the same
as one JSON object.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

__all__ = ["theory_cmd", "theory_report"]

#: float64 d-vectors the predictions take at most: x⁰ and the temporaries of f(x⁰)
_WORKING_VECTORS = 6
#: ... and with the ℓ2 logistic f* solved by L-BFGS (10 correction pairs and temporaries)
_LBFGS_VECTORS = 32


def theory_report(
    problem: Any,
    compressor: Any,
    *,
    p: float = 0.5,
    tau: int = 1,
    eps: float = 1e-3,
) -> dict[str, Any]:
    """Constants, step sizes and predictions of one problem × compressor, as plain data."""
    from .. import theory as T
    from ..problems.linear import LinearModelProblem
    from ..problems.memory import check_memory
    from ..problems.rare import rare_features

    d, n = problem.d, problem.n
    # f(x⁰) for the predictions (and f* for the ℓ2 logistic loss, by L-BFGS) take a few float64
    # d-vectors; everything else here needs O(nnz + n) memory (nothing is quadratic in d)
    solve = getattr(problem, "reg", "") == "l2" and getattr(problem, "loss_kind", "") == "logistic"
    check_memory(
        8.0 * d * (_LBFGS_VECTORS if solve else _WORKING_VECTORS),
        f"evaluating f(x⁰){' and f*' if solve else ''} at d = {d:,}",
        "the constants and step sizes alone need only O(nnz) memory: compute them with the Python "
        "API (shrinkgrad.problems.rare_features, shrinkgrad.theory)",
    )
    from ..methods.base import Constants

    # a problem without known constants (a neural network) refuses in the methods' one message
    _, L_i = Constants.of(problem).smoothness()
    L_i = L_i.double()
    const: dict[str, Any] = {
        "problem": getattr(problem, "spec", "") or problem.name,
        "dataset": problem.dataset,
        "n": n,
        "d": d,
        "L": problem.L,
        "L_i min": float(L_i.min()),
        "L_i median": float(L_i.median()),
        "L_i max": float(L_i.max()),
        "L_AM": problem.L_AM,
        "L_QM": problem.L_QM,
        "L_max": problem.L_max,
        "L_var": problem.L_var,
        "L_QM/L_AM": problem.L_QM / problem.L_AM,
        "mu": problem.mu,
        "f_star": problem.f_star,
    }
    unbiased = compressor.kind == "unbiased"
    alpha = float(compressor.alpha(d))
    omega = float(compressor.omega(d)) if unbiased else None
    comp = {
        "compressor": compressor.name,
        "kind": compressor.kind,
        "alpha": alpha,
        "omega": omega,
        "xi": T.xi(alpha),
        "bits per message": float(compressor.bits(d)),
    }
    L, A, Q = problem.L, problem.L_AM, problem.L_QM
    rules: list[dict[str, Any]] = []

    def add(rule: str, value: float, source: str, mark: str, note: str = "") -> None:
        rules.append(
            {"rule": rule, "stepsize": value, "source": source, "mark": mark, "note": note}
        )

    scaled = " (for the scaled C/(1+ω))" if unbiased else ""
    add("ef21", T.stepsize_ef21(L, Q, alpha), "[EF21] Thm 1", "V", scaled)
    add(
        "ef21_reloaded / ef21_w",
        T.stepsize_ef21_reloaded(L, A, alpha),
        "[EFR] Thms 2, 3",
        "—",
        scaled,
    )
    add("ef21_plus", T.stepsize_ef21_plus(L, Q, alpha), "[EF21] Thm 1 carries over", "D", scaled)
    if problem.mu is not None:
        add("ef21_pl", T.stepsize_ef21_pl(L, Q, alpha, problem.mu), "[EF21] Thm 2", "V")
        add("ef21w_pl", T.stepsize_ef21w_pl(L, A, alpha, problem.mu), "[EFR] appendix", "?")
    try:
        add("ef21_pp", T.stepsize_ef21_pp(L, Q, alpha, p), "[BW] Thm 7", "V/?", f"p = {p:g}")
        add("ef21w_pp", T.stepsize_ef21w_pp(L, A, alpha, p), "[EFR] §3.2", "?", f"p = {p:g}")
    except ValueError as e:  # pragma: no cover - p in (0, 1] always admits a step here
        add("ef21_pp", math.nan, "[BW] Thm 7", "V/?", str(e))
    nu = T.ef21_sgd_nu(alpha, 1.0)
    nu_note = "ν = α/(2(1−α)): α → α/2" if alpha < 1 else "no compression"
    add("ef21_sgd", T.stepsize_ef21_sgd(L, Q, alpha, nu=nu), "derived; [BW] Thm 4", "D/?", nu_note)
    add(
        "ef21w_sgd", T.stepsize_ef21w_sgd(L, A, alpha, nu=nu), "derived; [EFR] §3.1", "D/?", nu_note
    )
    if isinstance(problem, LinearModelProblem):
        rf = rare_features(problem)
        add(
            "rare_features",
            T.stepsize_rare_features(L, rf.L_plus, rf.c, n, alpha),
            "[RF]",
            "V" if rf.exact else "D",
            f"c = {rf.c}, L_+ = {rf.L_plus:.4g}" + ("" if rf.exact else " (bound)"),
        )
    add("delayed (strict <)", T.stepsize_delayed(L, tau), "[K18]", "?", f"τ = {tau}")
    if unbiased and omega is not None:
        add(
            "unbiased_single (strict <)", T.stepsize_unbiased_single(L, omega), "descent lemma", "D"
        )
        add(
            "unbiased_single_optimal",
            T.stepsize_unbiased_single_optimal(L, omega),
            "descent lemma",
            "D",
        )
        add(
            "diana",
            T.stepsize_diana(L, Q, omega, n),
            "derived; [DIANA], [HKMSR]",
            "D",
            f"α = 1/(1+ω) = {1.0 / (1.0 + omega):.4g}",
        )
        convex = getattr(problem, "reg", "") == "l2" or getattr(problem, "lam", 1.0) == 0.0
        if convex:
            add("dcgd", T.stepsize_dcgd(L, problem.L_max, omega, n), "derived", "D", "convex f_i")

    x0 = problem.x0()
    f0 = problem.loss(x0)
    f_low = problem.f_star if problem.f_star is not None else problem.f_lower
    gap = f0 - (f_low if f_low is not None else 0.0)
    init_bits = 32.0 * d  # g_i⁰ = ∇f_i(x⁰) sent uncompressed in float32
    pred = []
    for rule in ("ef21", "ef21_reloaded / ef21_w"):
        gamma = next(r["stepsize"] for r in rules if r["rule"] == rule)
        T_rounds = T.rounds_ef21(gamma, gap, eps, alpha=alpha)
        bits = T.bits_to_accuracy(T_rounds, comp["bits per message"], initial_bits=init_bits)
        pred.append(
            {
                "rule": rule,
                "eps": eps,
                "f(x0) - f_inf bound": gap,
                "rounds": T_rounds,
                "bits per client": bits,
            }
        )
    return {"constants": const, "compressor": comp, "stepsizes": rules, "predictions": pred}


def _fmt(v: Any) -> str:
    if v is None:
        return "unknown"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@click.command("theory")
@click.option(
    "--problem",
    "problem_name",
    default="logistic_regression",
    show_default=True,
    help="problem name or full spec, e.g. 'least_squares' or "
    "'logistic_regression[dataset=a9a,n_clients=20]'",
)
@click.option("--dataset", default=None, help="bundled dataset name or LIBSVM file path")
@click.option("--clients", type=int, default=None, help="number of clients n")
@click.option(
    "--split", default="contiguous", show_default=True, help="split name, e.g. 'shuffled[seed=0]'"
)
@click.option("--lam", type=float, default=None, help="regularization strength λ (problem default)")
@click.option("--reg", type=click.Choice(["nonconvex", "l2"]), default=None, help="regularizer")
@click.option("--compressor", default="top_k[k=1]", show_default=True, help="compressor spec")
@click.option(
    "--p",
    "p",
    type=float,
    default=0.5,
    show_default=True,
    help="participation probability (PP rules)",
)
@click.option(
    "--tau", type=int, default=1, show_default=True, help="maximal delay τ (delayed rule)"
)
@click.option(
    "--eps", type=float, default=1e-3, show_default=True, help="target ‖∇f‖² for predicted rounds"
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
def theory_cmd(
    problem_name: str,
    dataset: str | None,
    clients: int | None,
    split: str,
    lam: float | None,
    reg: str | None,
    compressor: str,
    p: float,
    tau: int,
    eps: float,
    as_json: bool,
) -> None:
    """Print L, L_i statistics, L_AM, L_QM, L_var, ξ and every applicable step size."""
    from ..compressors import make_compressor
    from ..problems import PROBLEMS
    from ..registry import parse_spec

    spec = parse_spec(problem_name)
    params = {q.name: q for q in PROBLEMS.entry(spec.name).keyword}
    accepted = set(params)
    # parameters without a usable default (dataset; n_clients = None unless a list split)
    needed = {k for k, q in params.items() if q.default is q.empty or q.default is None}
    given = dict(spec.params)
    overrides: dict[str, Any] = {}
    for key, value in (
        ("dataset", dataset),
        ("n_clients", clients),
        ("lam", lam),
        ("reg", reg),
    ):
        if value is not None:
            overrides[key] = value  # an unknown key is reported by the registry
    if "split" in accepted and "split" not in given:
        overrides["split"] = split
    if "dataset" in needed and "dataset" not in given and dataset is None:
        raise click.UsageError("give --dataset (a bundled name such as 'australian', or a file)")
    if "n_clients" in needed and "n_clients" not in given and clients is None:
        raise click.UsageError("give --clients (the number of clients n)")
    problem = PROBLEMS.make(spec, **overrides)
    comp = make_compressor(compressor)
    report = theory_report(problem, comp, p=p, tau=tau, eps=eps)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    _print(report)


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=140)
    t = Table(title=escape(f"problem {report['constants']['problem']}"), show_header=False)
    t.add_column("constant")
    t.add_column("value", justify="right")
    for k, v in report["constants"].items():
        t.add_row(escape(k), escape(_fmt(v)))
    for k, v in report["compressor"].items():
        t.add_row(escape(k), escape(_fmt(v)))
    console.print(t)
    s = Table(title="step sizes (methods.md §4; marks V verified, D derived, ? unconfirmed)")
    for col in ("rule", "γ", "source", "mark", "note"):
        s.add_column(col)
    for r in report["stepsizes"]:
        s.add_row(
            escape(r["rule"]),
            _fmt(r["stepsize"]),
            escape(r["source"]),
            r["mark"],
            escape(r["note"]),
        )
    console.print(s)
    q = Table(title="predicted rounds / bits per client to reach min ‖∇f(x^t)‖² ≤ ε ([EF21] Thm 1)")
    for col in ("rule", "ε", "f(x⁰) − f_inf (bound)", "rounds", "bits per client"):
        q.add_column(col)
    for r in report["predictions"]:
        q.add_row(
            escape(r["rule"]),
            _fmt(r["eps"]),
            _fmt(r["f(x0) - f_inf bound"]),
            str(r["rounds"]),
            _fmt(r["bits per client"]),
        )
    console.print(q)
