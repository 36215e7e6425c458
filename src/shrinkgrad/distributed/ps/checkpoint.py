"""Snapshots of a parameter-server run, so that a killed server can be resumed.

With an output directory, the server keeps two files in ``DIR/checkpoint/``:

* ``snapshot.pt``: its whole state (the method's server state and memory, the update count,
  every worker's last applied counter, the bit counters, the logged iterates, the staleness
  rows and events so far), rewritten every ``snapshot_every`` updates or ``snapshot_seconds``
  seconds and at the end, with the run's end status (``status``, ``message``; a ``diverged``
  run's snapshot makes ``--resume`` refuse it). Written atomically: a temporary file, flushed
  and fsync-ed, renamed over the old one, and the directory fsync-ed, so a kill at any moment
  leaves the previous snapshot or the new one, never a torn file.
* ``updates.log``: one line per applied message (update, worker, counter, version), appended as
  it happens (one ``write`` each, no fsync: it survives a killed process, which is what it is
  for). On resume it says how far the killed server got, i.e. how many updates were lost, and is
  cut back to the snapshot.

While a run writes into ``DIR``, its launcher holds the
:class:`~shrinkgrad.storage.DirectoryLock` of ``DIR`` (the one ``run`` and ``train`` hold on
their ``--out``; :meth:`Checkpoint.hold`), which the server and workers it forks inherit: a
second run into the same directory — a new one or a ``--resume`` of a server still alive — is
refused instead of writing the same snapshot. The kernel drops the lock when the processes end,
so a killed run leaves nothing that blocks its resume.

The workers' client states are not saved: the method restores them from the server's memory
(``Method.async_clients``), so the restarted workers continue exactly from the snapshot.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...storage import DirectoryLock

__all__ = ["FINGERPRINT_FREE", "SNAPSHOT_KIND", "Checkpoint", "check_fingerprint", "fingerprint"]

SNAPSHOT_KIND = "shrinkgrad-ps-snapshot"
SNAPSHOT_VERSION = 1
#: settings a resumed run may change (everything else must equal the snapshot's)
FINGERPRINT_FREE = frozenset(
    {
        "updates",
        "max_time",
        "timeout",
        "speeds",
        "delay",
        "kill_workers",
        "kill_server_after",
        "snapshot_every",
        "snapshot_seconds",
    }
)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: the output directories this process holds (:meth:`Checkpoint.hold` is re-entrant)
_HELD: set[str] = set()


class Checkpoint:
    """The snapshot and the update log of the run in ``out`` (see the module docstring)."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = str(out)
        self.dir = Path(out) / "checkpoint"
        self.snapshot_path = self.dir / "snapshot.pt"
        self.log_path = self.dir / "updates.log"
        self._log: Any = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the output directory's :class:`~shrinkgrad.storage.DirectoryLock` while a run
        writes into it (:class:`~shrinkgrad.storage.DirectoryBusy`, naming the holder, when
        another process holds it). Re-entrant in one process (the CLI holds it across
        ``run_ps`` and the saving of the results); the processes forked inside share it."""
        key = str(Path(self.out).resolve())
        if key in _HELD:
            yield
            return
        with DirectoryLock(self.out):
            _HELD.add(key)
            try:
                yield
            finally:
                _HELD.discard(key)

    # -- writing (the server) ---------------------------------------------------------------------
    def open_log(self, *, fresh: bool) -> None:
        """Start the update log (``fresh``: empty; else appending after a resume's cut), one
        write per line (line-buffered)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        mode = "w" if fresh else "a"
        self._log = open(self.log_path, mode, buffering=1, encoding="ascii")  # noqa: SIM115

    def log(self, update: int, worker: int, counter: int, version: int) -> None:
        if self._log is not None:
            self._log.write(f"{update},{worker},{counter},{version}\n")

    def save(self, payload: dict[str, Any]) -> None:
        """Write the snapshot atomically (temporary file, fsync, rename, fsync the directory)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())
        tmp = self.snapshot_path.with_name(self.snapshot_path.name + ".tmp")
        with open(tmp, "wb") as fh:
            torch.save(dict(payload, kind=SNAPSHOT_KIND, format_version=SNAPSHOT_VERSION), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.snapshot_path)
        _fsync_dir(self.dir)

    def mark(self, status: str, message: str) -> None:
        """Record in the snapshot the run's end status found after the run (the metrics'
        divergence rule, :func:`~.results.build_result`), so that a resume sees it."""
        if self.exists():
            self.save(dict(self.load(), status=status, message=message))

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- reading (the launcher, before a resume) --------------------------------------------------
    def exists(self) -> bool:
        return self.snapshot_path.is_file()

    def load(self) -> dict[str, Any]:
        """The snapshot, or a ValueError naming the file when it is missing or not one."""
        path = self.snapshot_path
        if not path.is_file():
            raise ValueError(
                f"--resume: no parameter-server snapshot in {str(self.dir)!r}; start the run "
                "without --resume"
            )
        try:
            data = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ValueError(
                f"--resume: cannot read the snapshot {str(path)!r} ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(data, dict) or data.get("kind") != SNAPSHOT_KIND:
            raise ValueError(
                f"--resume: {str(path)!r} is not a shrinkgrad parameter-server snapshot"
            )
        if data.get("format_version") != SNAPSHOT_VERSION:
            raise ValueError(
                f"--resume: {str(path)!r} has snapshot format {data.get('format_version')}, this "
                f"version reads format {SNAPSHOT_VERSION}"
            )
        return data

    def reached(self) -> int | None:
        """The last update the update log records (how far the previous server got)."""
        if not self.log_path.is_file():
            return None
        last = None
        with open(self.log_path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                head = line.split(",", 1)[0]
                if line.endswith("\n") and head.isdigit():  # a torn last line is ignored
                    last = int(head)
        return last

    def cut(self, update: int) -> None:
        """Keep the update log's lines up to ``update`` (the snapshot's), atomically."""
        if not self.log_path.is_file():
            return
        with open(self.log_path, encoding="ascii", errors="replace") as fh:
            keep = [
                line
                for line in fh
                if line.endswith("\n")
                and line.split(",", 1)[0].isdigit()
                and int(line.split(",", 1)[0]) <= update
            ]
        tmp = self.log_path.with_name(self.log_path.name + ".tmp")
        with open(tmp, "w", encoding="ascii") as fh:
            fh.writelines(keep)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.log_path)


def fingerprint(config_dict: dict[str, Any], data: str | None = None) -> dict[str, Any]:
    """What a resumed run shares with its snapshot: the config but :data:`FINGERPRINT_FREE`,
    and ``data``, the problem's data digest (``problem.data``: the same spec on a LIBSVM file
    whose contents changed, or a ``problem=`` object on other data, is another problem)."""
    out = {k: v for k, v in config_dict.items() if k not in FINGERPRINT_FREE}
    if data is not None:
        out["problem.data"] = data
    return out


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """A ValueError naming the first setting that differs from the snapshot's."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ValueError(
                f"--resume: the run in {where!r} was made with {key}={saved.get(key)!r}, this one "
                f"has {key}={current.get(key)!r}; resume with the same setting (only "
                f"{', '.join(sorted(FINGERPRINT_FREE))} may change) or use another --out"
            )
