"""``shrinkgrad list FAMILY``: every registered component with its maths.

Families register a printer in :data:`LISTINGS` (name -> function printing a rich table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["LISTINGS", "list_cmd"]


def _compressors(console: Console) -> None:
    from ..compressors import COMPRESSORS
    from ..registry import _format_value

    table = Table(
        title=escape("compressors (build with make_compressor('name[param=value]'))"),
        caption=escape(
            "bits: float32 values (float64 values count 64, bfloat16/float16 values 16; norms of "
            "16-bit inputs stay float32); indices ⌈log₂ d⌉ bits each; paper_bits(d) counts 32 "
            "per float with indices free; dtypes: inputs taken (16-bit ones computed in float32). "
            "Derivations: docs/compressors.md"
        ),
    )
    cols = ("name", "parameters", "kind", "constant", "bits per message", "collective", "dtypes")
    for col in cols:
        table.add_column(col)
    for name in COMPRESSORS.names():
        entry = COMPRESSORS.entry(name)
        cls = entry.factory
        params = ", ".join(
            p.name if p.default is p.empty else f"{p.name}={_format_value(p.default)}"
            for p in entry.keyword
        )
        if entry.positional:
            comps = "(C)" if len(entry.positional) == 1 else "(C1, C2)"
            params = ", ".join(filter(None, [comps, params]))
        cells = [
            name,
            params,
            str(getattr(cls, "kind_text", "") or getattr(cls, "kind", "")),
            str(getattr(cls, "constant_formula", "")),
            str(getattr(cls, "bits_formula", "")),
            str(getattr(cls, "collective_text", "") or getattr(cls, "collective", "")),
            _dtypes(cls),
        ]
        table.add_row(*(escape(c) for c in cells))
    console.print(table)


def _dtypes(cls: Any) -> str:
    """The input dtypes of a compressor class, short: ``f32 f64 bf16 f16``."""
    short = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16"}
    dtypes = cls.dtypes() if hasattr(cls, "dtypes") else ()
    return " ".join(short.get(str(t).removeprefix("torch."), str(t)) for t in dtypes)


def _datasets(console: Console) -> None:
    import math

    from ..problems.datasets import BUNDLED, IMAGE_DATASETS

    table = Table(title=escape("bundled datasets (load with shrinkgrad.datasets.load('name'))"))
    for col in ("name", "samples", "features", "labels", "description"):
        table.add_column(col)
    rows: list[list[str]] = []
    for name, info in BUNDLED.items():
        lo, hi = info.label_values
        labels = f"{lo:g}, {hi:g} → −1, +1"
        rows.append([name, str(info.n_samples), str(info.n_features), labels, info.description])
    for name, img in IMAGE_DATASETS.items():  # multi-class images: the class indices are kept
        channels, *pixels = img.image_shape
        shape = "×".join(str(s) for s in pixels)
        per = "" if channels == 1 else f", {channels} channels"
        features = f"{math.prod(img.image_shape)} ({shape} images{per})"
        labels = f"{img.n_classes} classes (0 … {img.n_classes - 1})"
        rows.append([name, str(img.n_samples), features, labels, img.description])
    for cells in sorted(rows):
        table.add_row(*(escape(c) for c in cells))
    console.print(table)


def _registry_table(console: Console, title: str, registry: Any) -> None:
    table = Table(title=escape(title))
    for col in ("name", "parameters", "summary"):
        table.add_column(col)
    for name in registry.names():
        entry = registry.entry(name)
        params = ", ".join(
            p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in entry.keyword
        )
        table.add_row(escape(name), escape(params), escape(entry.summary))
    console.print(table)


def _problems(console: Console) -> None:
    from ..problems import PROBLEMS

    _registry_table(console, "problems (build with make_problem('name[param=value]'))", PROBLEMS)


def _splits(console: Console) -> None:
    from ..problems import SPLITS

    _registry_table(console, "client splits (split='name[param=value]')", SPLITS)


def _methods(console: Console) -> None:
    from ..methods import METHODS
    from ..methods.base import RUNTIMES

    title = "methods (simulate(problem, 'name[param=value]', compressor, stepsize='theory*m'))"
    caption = (
        "runtimes: simulator (vectorised clients), runner (multi-process, "
        "shrinkgrad.distributed.runner), hook (DDP communication hook), ps (asynchronous "
        "parameter server); why a method does not run somewhere: method.unsupported(runtime)"
    )
    table = Table(title=escape(title), caption=escape(caption))
    for col in ("name", "parameters", "compressor", "theory step size", "runtimes", "summary"):
        table.add_column(col)
    for name in METHODS.names():
        entry = METHODS.entry(name)
        params = ", ".join(
            p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in entry.keyword
        )
        try:
            method = METHODS.make(name)
        except (TypeError, ValueError):  # a required parameter: nothing to say without it
            cells = [name, params, "", "", "(give the parameters)", entry.summary]
        else:
            runtimes = ", ".join(rt for rt in RUNTIMES if method.unsupported(rt) is None)
            cells = [name, params, method.requires, method.theory_formula(), runtimes]
            cells.append(entry.summary)
        table.add_row(*(escape(c) for c in cells))
    for suffix in METHODS.suffixes():  # applied to a method: "ef21+momentum[beta=0.9]"
        entry = METHODS.suffix_entry(suffix)
        params = ", ".join(f"{p.name}={p.default!r}" for p in entry.keyword)
        cells = [f"<method>{suffix}", params, "the method's", "none", "the method's", entry.summary]
        table.add_row(*(escape(c) for c in cells))
    console.print(table)


def _reproductions(console: Console) -> None:
    from ..experiments.reproductions import REPRODUCTIONS, config_path

    table = Table(title=escape("reproductions (run with shrinkgrad reproduce NAME [--quick])"))
    for col in ("name", "paper", "what", "config"):
        table.add_column(col)
    for name in REPRODUCTIONS.names():
        rep = REPRODUCTIONS.get(name)
        cells = [name, rep.paper, rep.title, config_path(rep).name]
        table.add_row(*(escape(c) for c in cells))
    console.print(table)


#: family name -> printer
LISTINGS: dict[str, Callable[[Console], None]] = {
    "compressors": _compressors,
    "datasets": _datasets,
    "methods": _methods,
    "problems": _problems,
    "reproductions": _reproductions,
    "splits": _splits,
}


@click.command("list")
@click.argument("family", type=click.Choice(sorted(LISTINGS)), default="compressors")
def list_cmd(family: str) -> None:
    """List registered components of FAMILY with their maths (default: compressors)."""
    LISTINGS[family](Console(width=160))
