"""The results of a sweep on disk: per-run tables, the concatenated results table, JSON files.

Layout of an output directory ``DIR`` (docs/experiments.md):

* ``DIR/results.parquet`` (or ``results.csv``) — every run's table concatenated, one row per run
  × logged round, with the config columns of :data:`RESULT_COLUMNS`;
* ``DIR/runs.csv`` — one row per run: id, problem, arm, seed, status, rounds, final metrics;
* ``DIR/config.toml`` — the resolved config; ``DIR/env.json`` — versions, host, seed, command;
* ``DIR/runs/<run-id>/`` — ``run.json`` (what the run is), ``checkpoint.pt`` while it runs,
  ``table.parquet`` and ``done.json`` once it finished.

Every file is written by :func:`shrinkgrad.storage.atomic_write` (a temporary file, fsync,
rename), so a crash never leaves a torn file; ``results.parquet`` is rebuilt from the per-run
tables, so nothing finished is lost. A file that exists but cannot be read raises
:class:`CorruptFileError`, a ValueError naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from ..sim import COLUMNS
from ..storage import atomic_write, atomic_write_text

__all__ = [
    "CONFIG_COLUMNS",
    "RESULT_COLUMNS",
    "CorruptFileError",
    "Format",
    "concat_tables",
    "default_format",
    "find_run_table",
    "load_results",
    "read_json",
    "read_table",
    "write_json",
    "write_table",
]

Format = Literal["parquet", "csv"]

#: columns the sweep adds beside the simulator's (:data:`shrinkgrad.sim.COLUMNS`)
CONFIG_COLUMNS = (
    "run_id",
    "experiment",
    "problem_spec",
    "problem_label",
    "stepsize_spec",
    "seed_index",
    "status",
    "L",
    "L_AM",
    "L_QM",
    "L_max",
    "L_var",
    "mu",
)
#: every column of a results table, in order
RESULT_COLUMNS = tuple(COLUMNS) + CONFIG_COLUMNS


def default_format() -> Format:
    """``parquet`` when pyarrow is installed, else ``csv``."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        return "csv"
    return "parquet"


def write_table(table: pd.DataFrame, stem: Path, fmt: Format) -> Path:
    """Write ``table`` to ``stem.parquet`` or ``stem.csv`` atomically; return the path."""
    path = stem.with_name(stem.name + ("." + fmt))
    if fmt == "parquet":
        return atomic_write(path, lambda p: table.to_parquet(p, index=False))
    return atomic_write(path, lambda p: table.to_csv(p, index=False))


def read_table(path: Path) -> pd.DataFrame:
    """Read a table written by :func:`write_table`; a file that is not one is a ValueError
    naming it."""
    try:
        if path.suffix == ".parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # pyarrow / pandas parser errors of every kind
        raise CorruptFileError(path, f"{type(e).__name__}: {e}") from None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON atomically."""
    text = json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"
    atomic_write_text(path, text)


def read_json(path: Path) -> Any:
    """Read a JSON file; one that cannot be read is a :class:`CorruptFileError` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise CorruptFileError(path, f"{type(e).__name__}: {e}") from None


class CorruptFileError(ValueError):
    """A results file exists but cannot be read (edited, truncated by hand, another program's)."""

    def __init__(self, path: Path, reason: str, fix: str = "") -> None:
        short = reason if len(reason) <= 160 else reason[:157] + "..."
        super().__init__(f"{path}: cannot read it ({short})" + (f"; {fix}" if fix else ""))
        self.path = path
        self.reason = reason
        self.fix = fix

    def __reduce__(self) -> tuple[Any, tuple[Path, str, str]]:
        """Pickle by the arguments (sent between ``train``'s ranks, like ConfigError)."""
        return (type(self), (self.path, self.reason, self.fix))

    def with_fix(self, fix: str) -> CorruptFileError:
        """The same error with ``fix`` (what to do) appended."""
        return CorruptFileError(self.path, self.reason, fix)


def find_run_table(run_dir: Path) -> Path | None:
    """The finished table of a run directory, or None when the run has not finished."""
    if not (run_dir / "done.json").exists():
        return None
    for ext in ("parquet", "csv"):
        p = run_dir / f"table.{ext}"
        if p.exists():
            return p
    return None


def concat_tables(tables: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate run tables into one results table with the columns of :data:`RESULT_COLUMNS`."""
    frames = [t for t in tables if len(t)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in RESULT_COLUMNS})
    out = pd.concat(frames, ignore_index=True)
    first = [c for c in RESULT_COLUMNS if c in out.columns]
    rest = [c for c in out.columns if c not in RESULT_COLUMNS]
    return out[first + rest]


def _config_order(d: Path) -> Callable[[Path], tuple[int, str]]:
    """Sort key of run directories: the order of the runs in ``d``'s config (the order of a
    results table ``run`` writes, so a rebuilt table draws its curves in the same order and
    styles), then by name for runs the config does not list (or without a config)."""
    order: dict[str, int] = {}
    with contextlib.suppress(Exception):  # no or unreadable config: names only
        from .config import load_config
        from .grid import expand

        order = {r.run_id: i for i, r in enumerate(expand(load_config(d / "config.toml")))}
    return lambda p: (order.get(p.name, len(order)), p.name)


def load_results(out: str | os.PathLike[str]) -> pd.DataFrame:
    """The results table of a sweep directory (``results.parquet``/``.csv``).

    The table is the sweep's current one, as the sweep's next rewrite of ``results.*`` would
    write it: when the directory's config (``config.toml``) has finished runs under ``runs/``
    that the results file lacks (the sweep was killed between two of its periodic rewrites),
    or there is no results file yet, the table is rebuilt from the config's finished runs
    (:func:`~shrinkgrad.experiments.execute.collect_results`: config order, current labels;
    runs of an earlier version of the config are not mixed in). When both ``results.parquet``
    and ``results.csv`` exist (an earlier sweep wrote the other ``--format``), the newer is
    read. Without a readable config, the finished runs under ``runs/`` rebuild a missing table.
    """
    d = Path(out)
    if not d.exists():
        raise FileNotFoundError(f"{str(d)!r}: no such results directory")
    if d.is_file():
        if d.suffix not in (".parquet", ".csv"):
            raise ValueError(f"{str(d)!r}: expected a results directory or a .parquet/.csv table")
        table = read_table(d)
        if "round" not in table.columns:  # runs.csv, say: one row per run, no curve to draw
            raise ValueError(
                f"{str(d)!r} is not a results table (it has no 'round' column: one row per run, "
                "as runs.csv); give the results directory or its results.parquet/.csv"
            )
        return table
    saved: pd.DataFrame | None = None
    files = [p for p in (d / f"results.{ext}" for ext in ("parquet", "csv")) if p.exists()]
    if files:
        # both: the other is an earlier sweep's, written with another --format (parquet on a tie)
        p = max(files, key=lambda f: f.stat().st_mtime_ns)
        try:
            saved = read_table(p)
        except CorruptFileError as e:  # the finished runs' own tables rebuild it
            if not (d / "runs").is_dir():
                raise
            raise e.with_fix(
                f"delete it: the table is then rebuilt from the finished runs in {d / 'runs'}"
            ) from None
    current = _current_table(d, saved)
    if current is not None:
        return current
    if saved is not None:
        return saved
    runs = d / "runs"
    tables = []
    if runs.is_dir():
        for run_dir in sorted(runs.iterdir(), key=_config_order(d)):
            t = find_run_table(run_dir)
            if t is not None:
                tables.append(read_table(t))
    if not tables:
        raise FileNotFoundError(
            f"{str(d)!r} holds no results (no results.parquet, results.csv or finished runs); "
            "run 'shrinkgrad run CONFIG --out DIR' first"
        )
    return concat_tables(tables)


def _current_table(d: Path, saved: pd.DataFrame | None) -> pd.DataFrame | None:
    """The table of the finished runs of ``d``'s config, when ``saved`` (the results file, or
    None) lacks some of them; None when it has them all, or without a readable config or any
    finished run of it. A finished run that cannot be read raises :class:`CorruptFileError`
    when there is no results file to fall back on."""
    if not (d / "runs").is_dir():
        return None
    from .config import load_config
    from .grid import expand

    try:
        config = load_config(d / "config.toml")
        runs = expand(config)
    except (ValueError, OSError):  # no readable config (ConfigError), or its data moved away
        return None  # (DatasetError): nothing to tell the sweep's runs by
    finished = {r.run_id for r in runs if find_run_table(d / "runs" / r.run_id) is not None}
    if not finished:
        return None
    if saved is not None and "run_id" in saved.columns and finished <= set(saved["run_id"]):
        return None
    from .execute import collect_results

    try:
        table, _ = collect_results(d, runs, config.name)
    except CorruptFileError:
        if saved is None:
            raise
        return None
    return table
