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

from . import interrupted_status
from .options import format_option, jobs_option, out_option, profile_option, set_option

if TYPE_CHECKING:
    from ..experiments.reproductions import ReproductionResult

__all__ = ["interrupted_message", "print_claims", "reproduce_cmd"]


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
    # the command line as given (re-running it resumes), whatever program ran this function
    command = ["shrinkgrad", "reproduce", name]
    for flag, value in (
        ("--quick", quick),
        ("--profile", profile),
        ("--out", out),
        ("--jobs", jobs),
        ("--format", fmt),
        ("--no-progress", no_progress),
        ("--strict", strict),
    ):
        if value is True:
            command.append(flag)
        elif value not in (None, False):
            command += [flag, str(value)]
    for o in overrides:
        command += ["--set", o]
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
            command=command,
        )
        if result.outcome.interrupted:
            click.echo(interrupted_message(result, names[names.index(n) + 1 :]), err=True)
            sys.exit(interrupted_status())
        print_claims(result)
        failed |= not result.passed or not result.outcome.complete
    if strict and failed:
        sys.exit(1)


def interrupted_message(result: ReproductionResult, left: list[str] | None = None) -> str:
    """What an interrupted reproduction says instead of an empty claim table: how far it got
    and the command that finishes it (finished runs are kept and resume is exact)."""
    done, total = result.progress
    runs = f"{done} of {total} runs" if total is not None else f"{done} runs"
    rest = f"; not started: {', '.join(left)}" if left else ""
    return (
        f"{result.reproduction.name}: interrupted after {runs} finished{rest}; the claims are "
        f"measured once every run has finished. To finish (finished runs are kept), run: "
        f"{result.resume_command}"
    )


def print_claims(result: ReproductionResult) -> None:
    """The claim table of ``result`` and where its files are; an interrupted reproduction,
    or one where no run finished, says so instead of printing an empty table."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rep = result.reproduction
    console = Console(width=max(120, Console().width))
    if result.outcome.interrupted:
        console.print(escape(interrupted_message(result)))
        return
    if not result.claims:
        console.print(
            escape(f"{rep.name}: ")
            + "[bold red]no run finished[/]: nothing to measure (see the failures above)"
        )
        return
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
    if not result.outcome.complete:
        console.print("[bold red]some runs failed[/]: the claims use the finished runs only")
    for p in result.figures:
        if p.suffix == ".png":
            console.print(escape(f"figure: {p}"))
