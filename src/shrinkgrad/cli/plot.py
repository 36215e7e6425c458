"""``shrinkgrad plot DIR --x bits --y grad_norm_sq``: convergence figures of a results directory.

Writes ``DIR/plots/<y>_vs_<x>.png`` and ``.pdf`` (or ``--out STEM``): one panel per problem,
one curve per method × compressor × step size (median over seeds, shaded quantile band), log
y, legends with the canonical specs and the step-size rule, L_var in each panel's title.
``--where method=ef21`` keeps only matching rows (repeatable).
"""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["plot_cmd"]

X_CHOICES = ["bits", "bits_paper", "bits_down", "rounds", "time"]
Y_CHOICES = ["grad_norm_sq", "loss"]


def _band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"write the band as LO,HI quantiles, e.g. 0.1,0.9; got {text!r}"
        ) from None
    return lo, hi


@click.command("plot")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--x", "x", type=click.Choice(X_CHOICES), default="bits", show_default=True)
@click.option("--y", "y", type=click.Choice(Y_CHOICES), default="grad_norm_sq", show_default=True)
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help="output path without extension [default: DIR/plots/<y>_vs_<x>]",
)
@click.option("--facet", default="problem_label", show_default=True, help="one panel per value")
@click.option("--band", default="0.1,0.9", show_default=True, help="quantiles of the band")
@click.option("--logx", is_flag=True, help="log-scale x axis")
@click.option("--where", multiple=True, metavar="COLUMN=VALUE", help="keep matching rows only")
@click.option("--title", help="figure title")
@click.option(
    "--formats", default="png,pdf", show_default=True, help="comma-separated file formats"
)
def plot_cmd(
    directory: Path,
    x: str,
    y: str,
    out: Path | None,
    facet: str,
    band: str,
    logx: bool,
    where: tuple[str, ...],
    title: str | None,
    formats: str,
) -> None:
    """Plot the results in DIRECTORY (written by 'shrinkgrad run' or 'reproduce')."""
    from ..experiments.results import load_results
    from ..plotting import plot_results

    table = load_results(directory)
    for cond in where:
        col, sep, value = cond.partition("=")
        if not sep or col not in table.columns:
            known = ", ".join(c for c in table.columns if table[c].dtype == object)
            raise click.BadParameter(
                f"{cond!r}: write COLUMN=VALUE with a column of the results ({known})",
                param_hint="--where",
            )
        table = table[table[col].astype(str) == value]
        if table.empty:
            raise click.BadParameter(f"no rows have {col} = {value!r}", param_hint="--where")
    stem = out if out is not None else Path(directory) / "plots" / f"{y}_vs_{x}"
    _, paths = plot_results(
        table,
        x,
        y,
        stem,
        facet=facet,
        quantiles=_band(band),
        logx=logx,
        title=title,
        formats=[f.strip() for f in formats.split(",") if f.strip()],
    )
    for p in paths:
        click.echo(str(p))
