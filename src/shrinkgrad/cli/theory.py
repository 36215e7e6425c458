"""``shrinkgrad theory``: a problem's smoothness constants and every applicable step-size rule.

Example::

    shrinkgrad theory --dataset australian --clients 100 --split contiguous \
        --compressor "top_k[k=1]"

prints L, statistics of the L_i, L_AM, L_QM, L_var, μ when known, the compressor's α (and ω when
it is unbiased), ξ(α), then each rule of methods.md §4 that applies with its value, source and
mark, and the predicted rounds and bits per client to reach ‖∇f‖² ≤ ε. ``--json`` prints the same
as one JSON object (strict JSON: a value that is not a finite number is ``null``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import click
from click.core import ParameterSource

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
    """Constants, step sizes and predictions of one problem × compressor, as plain data.

    ``compressor``: a built compressor or its spec string (``"top_k[k=1]"``), read by
    :func:`shrinkgrad.compressors.make_compressor` as everywhere else (stop 35's audit).
    ``p`` is the participation probability of the PP rules, in (0, 1] ([BW] Thm 7). When f(x⁰)
    (and, for the ℓ2 logistic loss, f* by L-BFGS) would take more memory than is available (a
    high declared dimension d), those values and the predictions built on them are left out and
    ``notes`` says so; everything else needs O(nnz + n) memory (nothing is quadratic in d).
    """
    from .. import theory as T
    from ..compressors import make_compressor
    from ..problems.linear import LinearModelProblem
    from ..problems.memory import MemoryBudgetError, check_memory
    from ..problems.rare import rare_features

    p = _check_p(p)
    compressor = make_compressor(compressor)  # a spec string, or a built compressor unchanged
    d, n = problem.d, problem.n
    notes: list[str] = []

    def fits(vectors: int, left_out: str, what: str) -> bool:
        """Whether ``vectors`` float64 d-vectors fit; if not, a note says what was left out."""
        try:
            check_memory(8.0 * d * vectors, f"evaluating {what} at d = {d:,}")
        except MemoryBudgetError as e:
            notes.append(
                f"{left_out} left out: {e} (the constants and step sizes need only O(nnz) memory)"
            )
            return False
        return True

    # f(x⁰) for the predictions takes a few float64 d-vectors, f* of the ℓ2 logistic loss (solved
    # by L-BFGS on first access of problem.f_star) more
    has_f0 = fits(_WORKING_VECTORS, "predicted rounds and bits", "f(x⁰)")
    solve = getattr(problem, "reg", "") == "l2" and getattr(problem, "loss_kind", "") == "logistic"
    has_f_star = not solve or fits(_LBFGS_VECTORS, "f*", "f* (by L-BFGS)")
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
        "L_i median": float(L_i.quantile(0.5)),  # not .median(): the lower middle value
        "L_i max": float(L_i.max()),
        "L_AM": problem.L_AM,
        "L_QM": problem.L_QM,
        "L_max": problem.L_max,
        "L_var": problem.L_var,
        "L_QM/L_AM": problem.L_QM / problem.L_AM,
        "mu": problem.mu,
        "f_star": problem.f_star if has_f_star else None,
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

    # every rule in α: for an unbiased C (ω > 0) the α is that of the scaled C/(1 + ω)
    scaled = "for the scaled C/(1+ω)" if unbiased and omega else ""

    def add_alpha(rule: str, value: float, source: str, mark: str, note: str = "") -> None:
        add(rule, value, source, mark, "; ".join(x for x in (note, scaled) if x))

    add_alpha("ef21", T.stepsize_ef21(L, Q, alpha), "[EF21] Thm 1", "V")
    if unbiased and omega is not None and 0 < omega < 1:  # C itself is contractive too
        add(
            "ef21 (C itself)",
            T.stepsize_ef21(L, Q, 1.0 - omega),
            "[EF21] Thm 1",
            "V",
            f"α = 1 − ω = {1.0 - omega:.4g}: what simulate(..., 'ef21', C) uses",
        )
    add_alpha(
        "ef21_reloaded / ef21_w", T.stepsize_ef21_reloaded(L, A, alpha), "[EFR] Thms 2, 3", "—"
    )
    add_alpha("ef21_plus", T.stepsize_ef21_plus(L, Q, alpha), "[EF21] Thm 1 carries over", "D")
    if problem.mu is not None:
        add_alpha("ef21_pl", T.stepsize_ef21_pl(L, Q, alpha, problem.mu), "[EF21] Thm 2", "V")
        add_alpha("ef21w_pl", T.stepsize_ef21w_pl(L, A, alpha, problem.mu), "[EFR] appendix", "?")
    # p ∈ (0, 1] (checked above) always admits a step: B/θ_p = L̃² ξ(αp)² ([BW] Thm 7, common p)
    add_alpha("ef21_pp", T.stepsize_ef21_pp(L, Q, alpha, p), "[BW] Thm 7", "V/?", f"p = {p:g}")
    add_alpha("ef21w_pp", T.stepsize_ef21w_pp(L, A, alpha, p), "[EFR] §3.2", "?", f"p = {p:g}")
    # ν of a noisy gradient (σ² > 0): α/(2(1 − α)), so α_ν = α/2; ν = ∞ at α = 1, where the step
    # is 1/L for every ν (no compression error; theory.stepsizes._nu)
    nu = T.ef21_sgd_nu(alpha, 1.0)
    nu_note = "ν = α/(2(1−α)): α → α/2" if alpha < 1 else "no compression: γ = 1/L"
    sgd = T.stepsize_ef21_sgd(L, Q, alpha, nu=nu)
    add_alpha("ef21_sgd", sgd, "derived; [BW] Thm 4", "D/?", nu_note)
    sgd_w = T.stepsize_ef21w_sgd(L, A, alpha, nu=nu)
    add_alpha("ef21w_sgd", sgd_w, "derived; [EFR] §3.1", "D/?", nu_note)
    if isinstance(problem, LinearModelProblem):
        rf = rare_features(problem)
        add_alpha(
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
        # a shared-seed C draws the same coordinates for every client: the ω/n terms take n = 1
        from ..methods.base import independent_draws, shares_draw

        draws = independent_draws(compressor, n)
        one = "; one shared draw: n = 1" if shares_draw(compressor) else ""
        add(
            "diana",
            T.stepsize_diana(L, Q, omega, draws),
            "derived; [DIANA], [HKMSR]",
            "D",
            f"α = 1/(1+ω) = {1.0 / (1.0 + omega):.4g}{one}",
        )
        if getattr(problem, "convex", None):
            add(
                "dcgd",
                T.stepsize_dcgd(L, problem.L_max, omega, draws),
                "derived",
                "D",
                "convex f_i" + one,
            )

    pred: list[dict[str, Any]] = []
    report = {
        "constants": const,
        "compressor": comp,
        "stepsizes": rules,
        "predictions": pred,
        "notes": notes,
    }
    if not has_f0:
        return report
    x0 = problem.x0()
    f0 = problem.loss(x0)
    f_star = const["f_star"]
    f_low = f_star if f_star is not None else problem.f_lower  # f_lower: 0 before any solve
    gap = f0 - (f_low if f_low is not None else 0.0)
    init_bits = 32.0 * d  # g_i⁰ = ∇f_i(x⁰) sent uncompressed in float32
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
    return report


def _check_p(p: float) -> float:
    """The participation probability of the PP rules, in (0, 1] ([BW] Thm 7), else ValueError."""
    v = float(p)
    if not 0.0 < v <= 1.0:  # also refuses NaN
        raise ValueError(
            f"p (the participation probability of the PP rules) must be in (0, 1], got {p}"
        )
    return v


def _json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN/inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _fmt(v: Any) -> str:
    if v is None:
        return "unknown"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _p_option(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise click.BadParameter(
            f"the participation probability of the PP rules must be in (0, 1], got {value}"
        )
    return value


def _eps_option(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not (math.isfinite(value) and value > 0.0):
        raise click.BadParameter(f"the target ‖∇f‖² must be a finite number > 0, got {value}")
    return value


def _same(key: str, inside: Any, option: Any) -> bool:
    """Whether an option's value equals the one the --problem spec gives for the same key."""
    from ..registry import parse_spec

    if key == "split":
        return str(parse_spec(str(inside))) == str(parse_spec(str(option)))
    if key == "dataset":
        a, b = str(inside), str(option)
        return a == b or (os.path.isfile(a) and os.path.isfile(b) and os.path.samefile(a, b))
    if isinstance(inside, (int, float)) and isinstance(option, (int, float)):
        return float(inside) == float(option)
    return str(inside) == str(option)


_NEEDED = "required for problems on a dataset unless --problem gives it"


@click.command("theory")
@click.option(
    "--problem",
    "problem_name",
    default="logistic_regression",
    show_default=True,
    help="problem name or full spec, e.g. 'least_squares' or "
    "'logistic_regression[dataset=a9a,n_clients=20]'; an option below that disagrees with the "
    "spec is an error",
)
@click.option(
    "--dataset",
    default=None,
    help=f"bundled dataset name or LIBSVM file path ({_NEEDED}: dataset=)",
)
@click.option(
    "--clients", type=int, default=None, help=f"number of clients n ({_NEEDED}: n_clients=)"
)
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
    callback=_p_option,
    help="participation probability of the PP rules, in (0, 1]",
)
@click.option(
    "--tau",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="maximal delay τ ≥ 0 (delayed rule)",
)
@click.option(
    "--eps",
    type=float,
    default=1e-3,
    show_default=True,
    callback=_eps_option,
    help="target ‖∇f‖² > 0 for predicted rounds",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
@click.pass_context
def theory_cmd(
    ctx: click.Context,
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
    """Print L, L_i statistics, L_AM, L_QM, L_var, ξ and every applicable step size.

    A problem on a dataset (logistic_regression, least_squares, mlp, ...) needs --dataset and
    --clients, or dataset= and n_clients= inside --problem.
    """
    from ..compressors import make_compressor
    from ..methods.base import Constants, UnknownConstantError
    from ..problems import PROBLEMS
    from ..registry import parse_spec

    spec = parse_spec(problem_name)
    params = {q.name: q for q in PROBLEMS.entry(spec.name).keyword}
    accepted = set(params)
    # parameters without a usable default (dataset; n_clients = None unless a list split)
    needed = {k for k, q in params.items() if q.default is q.empty or q.default is None}
    given = dict(spec.params)
    explicit_split = ctx.get_parameter_source("split") not in (
        ParameterSource.DEFAULT,
        ParameterSource.DEFAULT_MAP,
    )
    overrides: dict[str, Any] = {}
    for key, option, value in (
        ("dataset", "--dataset", dataset),
        ("n_clients", "--clients", clients),
        ("lam", "--lam", lam),
        ("reg", "--reg", reg),
        ("split", "--split", split if explicit_split else None),
    ):
        if value is None:
            continue
        if key in given:  # said twice: the same value is fine, two different ones are an error
            if not _same(key, given[key], value):
                raise click.UsageError(
                    f"{option} {value} disagrees with {key}={given[key]} inside --problem "
                    f"{problem_name!r}; give {key} once"
                )
            continue
        overrides[key] = value  # an unknown key is reported by the registry
    if "split" in accepted and "split" not in given:
        overrides["split"] = split
    if "dataset" in needed and "dataset" not in given and dataset is None:
        raise click.UsageError("give --dataset (a bundled name such as 'australian', or a file)")
    if "n_clients" in needed and "n_clients" not in given and clients is None:
        raise click.UsageError("give --clients (the number of clients n)")
    problem = PROBLEMS.make(spec, **overrides)
    comp = make_compressor(compressor)
    try:
        Constants.of(problem).smoothness()
    except UnknownConstantError:
        name = getattr(problem, "spec", "") or problem.name
        raise UnknownConstantError(
            f"the smoothness constants L and L_i of {name} are not known (a neural network has "
            "no known global L), and every rule here needs them; the command line cannot "
            "estimate them or take them as options. In Python, local estimates at x⁰ give the "
            "report: theory_report(estimate_smoothness(problem).apply(problem), compressor) "
            "with shrinkgrad.cli.theory.theory_report and shrinkgrad.problems.estimate_smoothness "
            "(local curvature, not a global bound: no guarantee)"
        ) from None
    report = theory_report(problem, comp, p=p, tau=tau, eps=eps)
    if as_json:
        click.echo(json.dumps(_json_safe(report), indent=2, default=str, allow_nan=False))
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
    for note in report.get("notes", []):
        console.print(escape(f"note: {note}"))
    if not report["predictions"]:
        return
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
