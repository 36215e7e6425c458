"""``shrinkgrad plot DIR --x bits --y grad_norm_sq``: convergence figures of a results directory.

Writes ``DIR/plots/<y>_vs_<x>.png`` (200 dpi) and ``.pdf`` (or ``--out STEM``): one panel per
problem (``--facet COLUMN``, ``--facet none`` for one panel), one curve per method ×
compressor × step size (median over seeds, shaded quantile band), one legend, log y for
‖∇f‖² and losses, L_var in each panel's title; diverged runs are marked, never drawn as
converged. ``--where method=ef21`` keeps only matching rows (repeatable).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..plotting.axes import X_AXES, Y_AXES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["filter_rows", "nothing_finished", "plot_cmd"]


def _band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"write the band as LO,HI quantiles, e.g. 0.1,0.9; got {text!r}"
        ) from None
    return lo, hi


def _listing(values: list[str], limit: int = 12) -> str:
    shown = ", ".join(values[:limit])
    return shown + (f", … ({len(values) - limit} more)" if len(values) > limit else "")


def filter_rows(table: pd.DataFrame, conditions: tuple[str, ...]) -> pd.DataFrame:
    """The rows of ``table`` matching every ``COLUMN=VALUE`` (numbers compare as numbers)."""
    import pandas as pd

    for cond in conditions:
        col, sep, value = cond.partition("=")
        col = col.strip()
        if not sep or col not in table.columns:
            what = "write COLUMN=VALUE" if not sep else f"the results have no column {col!r}"
            raise ValueError(
                f"--where {cond!r}: {what}; columns: {', '.join(map(str, table.columns))}"
            )
        column = table[col]
        keep = column.astype(str) == value
        if pd.api.types.is_numeric_dtype(column):
            with contextlib.suppress(ValueError):
                keep |= column == float(value)
        if not keep.any():
            present = sorted({str(v) for v in column.dropna().unique()})
            raise ValueError(
                f"--where {cond!r}: no rows have {col} = {value!r}; its values: "
                + _listing(present)
            )
        table = table[keep]
    return table


def nothing_finished(directory: Path) -> str:
    """The error for a results directory in which no run has finished yet (a sweep interrupted
    before its first run ended): what the runs are doing (``runs.csv``) and how to resume."""
    import pandas as pd

    from ..experiments.display import status_detail

    where = f"{str(directory)!r}"
    states = ""
    with contextlib.suppress(OSError, ValueError, KeyError):
        states = f" ({status_detail(pd.read_csv(directory / 'runs.csv'))})"
    return (
        f"{where}: no run has finished yet{states}, so there is nothing to plot; "
        f"{_resume_advice(directory)}"
    )


def _resume_advice(directory: Path) -> str:
    """How to finish the sweep of ``directory``: its own command (env.json), else ``run`` on
    its config."""
    import json

    command = ""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        command = str(json.loads((directory / "env.json").read_text("utf-8")).get("command", ""))
    if command.startswith(("shrinkgrad run", "shrinkgrad train")):  # (train: its ranks'
        return f"run '{command}' again to resume it"  # checkpoints resume under train only)
    if (directory / "config.toml").is_file():
        config = directory / "config.toml"
        return f"resume the sweep with 'shrinkgrad run {config} --out {directory}'"
    return "finish it with the command that wrote it"


def unfinished_note(directory: Path) -> str | None:
    """A note when some runs of ``directory``'s config have not finished (an interrupted or
    killed sweep): the figure then shows the finished ones only, and whole arms may be
    missing. None when every run finished, or there is no config to count them by."""
    from ..experiments.config import load_config
    from ..experiments.grid import expand
    from ..experiments.results import find_run_table

    try:
        runs = expand(load_config(directory / "config.toml"))
    except Exception:  # no (readable) config: nothing to count the runs by
        return None
    missing = [r for r in runs if find_run_table(directory / "runs" / r.run_id) is None]
    if not missing:
        return None
    done_arms = {r.arm.label for r in runs if r not in missing}
    absent = sorted({r.arm.label for r in missing} - done_arms)
    arms = f"; arms with no finished run, not drawn: {', '.join(absent)}" if absent else ""
    return (
        f"note: {len(missing)} of {len(runs)} runs have not finished, so the figure shows the "
        f"{len(runs) - len(missing)} finished ones{arms}; {_resume_advice(directory)}"
    )


@click.command("plot")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--x", "x", type=click.Choice(list(X_AXES)), default="bits", show_default=True)
@click.option(
    "--y", "y", type=click.Choice(list(Y_AXES)), default="grad_norm_sq", show_default=True
)
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help="output path without extension [default: DIR/plots/<y>_vs_<x>]",
)
@click.option(
    "--facet",
    default="problem_label",
    show_default=True,
    help="one panel per value of this column (none: one panel)",
)
@click.option("--band", default="0.1,0.9", show_default=True, help="quantiles of the band")
@click.option("--logx", is_flag=True, help="log-scale x axis")
@click.option("--logy/--linear-y", default=None, help="y scale [default: log for ‖∇f‖² and losses]")
@click.option("--where", multiple=True, metavar="COLUMN=VALUE", help="keep matching rows only")
@click.option("--title", help="figure title")
@click.option(
    "--formats", default="png,pdf", show_default=True, help="comma-separated file formats"
)
@click.option("--dpi", type=click.IntRange(50, 1200), default=200, show_default=True)
def plot_cmd(
    directory: Path,
    x: str,
    y: str,
    out: Path | None,
    facet: str,
    band: str,
    logx: bool,
    logy: bool | None,
    where: tuple[str, ...],
    title: str | None,
    formats: str,
    dpi: int,
) -> None:
    """Plot the results in DIRECTORY (written by 'shrinkgrad run' or 'reproduce')."""
    from ..experiments.results import load_results
    from ..plotting import plot_results

    d = Path(directory)
    try:
        table = load_results(d)
    except FileNotFoundError:  # no results file yet: a sweep killed before its first save?
        if d.is_dir() and ((d / "runs").is_dir() or (d / "config.toml").is_file()):
            raise ValueError(nothing_finished(d)) from None
        raise
    if table.empty and d.is_dir():
        raise ValueError(nothing_finished(d))
    if d.is_dir():
        note = unfinished_note(d)
        if note is not None:
            click.echo(note, err=True)
    if "status" not in table.columns:  # an old or foreign table: divergence cannot be told
        click.echo(
            "note: the table has no 'status' column, so diverged runs cannot be told apart and "
            "are drawn as ordinary curves (tables of run, train and reproduce have it)",
            err=True,
        )
    table = filter_rows(table, where)
    # a results file's plots go next to it (DIR/results.parquet → DIR/plots/...)
    base = d.parent if d.is_file() else d
    stem = out if out is not None else base / "plots" / f"{y}_vs_{x}"
    try:
        _, paths = plot_results(
            table,
            x,
            y,
            stem,
            facet=None if facet == "none" else facet,
            quantiles=_band(band),
            logx=logx,
            logy=logy,
            title=title,
            formats=[f.strip() for f in formats.split(",") if f.strip()],
            dpi=dpi,
        )
    except OSError as e:
        raise ValueError(f"{e}; choose another --out") from None
    for p in paths:
        click.echo(str(p))
