"""Options and config loading shared by the commands that run a TOML config (run, train, reproduce).

Each command lists its own options; the ones they share are written once here, with one help
text, so that ``--set``, ``--profile``, ``--format`` and ``--out`` mean the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from ..experiments.config import ExperimentConfig

__all__ = [
    "format_option",
    "jobs_option",
    "load_run_config",
    "out_option",
    "profile_option",
    "set_option",
]

F = TypeVar("F", bound=Callable[..., Any])


def out_option(default: str) -> Callable[[F], F]:
    """``--out/-o DIR``; ``default`` says what an omitted one means."""
    return click.option(
        "--out",
        "-o",
        type=click.Path(file_okay=False, path_type=Path),
        help=f"output directory [default: {default}]",
    )


def jobs_option() -> Callable[[F], F]:
    """``--jobs/-j N``: worker processes of a sweep."""
    return click.option(
        "--jobs", "-j", type=click.IntRange(min=1), help="worker processes [default: cores]"
    )


def format_option() -> Callable[[F], F]:
    """``--format parquet|csv`` of the result tables (into the parameter ``fmt``)."""
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(["parquet", "csv"]),
        help="table format [default: parquet]",
    )


def profile_option(
    what: str = "merge the config's [profiles.NAME] table (e.g. quick)",
) -> Callable[[F], F]:
    """``--profile NAME``, a profile of the config (``what`` is the help text)."""
    return click.option("--profile", help=what)


def set_option(example: str = "run.rounds=500") -> Callable[[F], F]:
    """``--set KEY=VALUE`` (repeatable, into the parameter ``overrides``)."""
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. {example} (repeatable; TOML values)",
    )


def load_run_config(
    config: Path,
    out: Path | None,
    profile: str | None,
    overrides: tuple[str, ...],
    suffix: str = "",
) -> tuple[ExperimentConfig, Path]:
    """The config with its profile and overrides, and the output directory.

    The default directory is ``runs/<config name><suffix>`` (the file's stem when the config has no
    name); a path that is a file is refused before anything runs.
    """
    from ..experiments.config import load_config

    cfg = load_config(config, profile=profile, overrides=list(overrides))
    out_dir = out if out is not None else Path("runs") / f"{cfg.name or config.stem}{suffix}"
    from ..storage import is_file

    if is_file(out_dir):
        raise NotADirectoryError(f"--out {str(out_dir)!r} is a file; give a directory")
    return cfg, out_dir
