"""``shrinkgrad reproduce NAME [--quick] [--out DIR]``: reproduce a paper's claims in one command.

Runs the reproduction's bundled config (``shrinkgrad list reproductions``), draws its figures,
prints the claim table — the paper's claim, the measured number, pass/fail — and writes it to
DIR/summary.json. ``--quick`` runs the small version (≤ 2 minutes on 2 cores); ``all`` runs every
reproduction (into DIR/<name>). Re-running the same command resumes an interrupted run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .options import format_option, jobs_option, out_option, profile_option, set_option

if TYPE_CHECKING:
    from ..experiments.reproductions import ReproductionResult

__all__ = ["print_claims", "reproduce_cmd"]


@click.command("reproduce")
@click.argument("name")
@click.option("--quick", is_flag=True, help="the small version (≤ 2 minutes on 2 cores)")
@out_option("runs/NAME or runs/NAME-quick")
@jobs_option()
@profile_option("another profile of the bundled config (e.g. tiny)")
@set_option(example="run.seeds=5")
@format_option()
@click.option("--no-progress", is_flag=True, help="no progress bar or per-run lines")
@click.option("--strict", is_flag=True, help="exit with status 1 when a claim fails")
def reproduce_cmd(
    name: str,
    quick: bool,
    out: Path | None,
    jobs: int | None,
    profile: str | None,
    overrides: tuple[str, ...],
    fmt: str | None,
    no_progress: bool,
    strict: bool,
) -> None:
    """Reproduce NAME (see 'shrinkgrad list reproductions'; 'all' runs every one)."""
    from ..experiments.reproductions import REPRODUCTIONS, reproduce

    if quick and profile:
        raise click.UsageError("give --quick or --profile, not both")
    names = REPRODUCTIONS.names() if name == "all" else [REPRODUCTIONS.get(name).name]
    failed = False
    for n in names:
        target = out / n if (out is not None and len(names) > 1) else out
        result = reproduce(
            n,
            target,
            quick=quick,
            profile=profile,
            overrides=list(overrides),
            jobs=jobs,
            fmt=fmt,  # type: ignore[arg-type]
            progress=not no_progress,
            command=["shrinkgrad", *sys.argv[1:]],
        )
        print_claims(result)
        if result.outcome.interrupted:
            click.echo(
                "interrupted: the claims were not measured; run the same command again to resume",
                err=True,
            )
            sys.exit(130)
        failed |= not result.passed or not result.outcome.complete
    if strict and failed:
        sys.exit(1)


def print_claims(result: ReproductionResult) -> None:
    """The claim table of ``result`` and where its files are."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rep = result.reproduction
    console = Console(width=max(120, Console().width))
    table = Table(
        title=escape(f"{rep.name}: {rep.title} ({rep.paper})"),
        show_lines=False,
    )
    for col in ("claim", "measured", "criterion", "result"):
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "FAIL": "bold red", "n/a": "yellow"}
    for c in result.claims:
        table.add_row(
            escape(c.claim),
            escape(c.measured),
            escape(c.criterion),
            f"[{style[c.verdict]}]{c.verdict}[/]",
        )
    console.print(table)
    ok = sum(c.passed is True for c in result.claims)
    bad = sum(c.passed is False for c in result.claims)
    na = len(result.claims) - ok - bad
    tail = f", {na} without a verdict" if na else ""
    console.print(
        escape(
            f"{ok} of {len(result.claims)} claims hold, {bad} fail{tail} "
            f"({result.elapsed_s:.0f} s) → {result.summary_path}"
        )
    )
    if not result.claims and not result.outcome.interrupted:
        console.print("[bold red]no run finished[/]: nothing to measure (see the failures above)")
    elif not result.outcome.complete and not result.outcome.interrupted:
        console.print("[bold red]some runs failed[/]: the claims use the finished runs only")
    for p in result.figures:
        if p.suffix == ".png":
            console.print(escape(f"figure: {p}"))
