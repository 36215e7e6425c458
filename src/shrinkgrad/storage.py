"""Files that survive crashes: atomic writes, a writability probe, and a directory lock.

Every results file shrinkgrad writes — result tables, ``summary.json``, ``env.json``, run
summaries, simulator checkpoints, parameter-server snapshots — goes through
:func:`atomic_write`: the bytes go to a temporary file beside the target (a name unique to the
writing process), are flushed and ``fsync``-ed, and the temporary file is renamed over the target
(``os.replace`` is atomic on POSIX and Windows), then the directory is ``fsync``-ed so that the
rename itself is durable. A kill or a power cut at any moment leaves the previous file or the new
one, never a torn one; a failed write (a full disk) removes its temporary file and raises
:class:`StorageError`, a one-line message naming the file and what to do.

:func:`probe_writable` writes (and removes) a small file in a directory before any work starts,
so a read-only or full ``--out`` is reported before the first run, not after it.
:class:`DirectoryLock` keeps two processes from writing one output directory at the same time
(an advisory ``flock`` on ``DIR/.lock``, released by the kernel when its holder dies, even by
SIGKILL).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "DirectoryBusy",
    "DirectoryLock",
    "StorageError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "is_file",
    "probe_writable",
    "remove_stale_temporaries",
]

#: what to do about a failed write, by errno
_HINTS = {
    errno.ENOSPC: "the disk is full: free some space (or choose another --out) and run the "
    "same command again; finished runs are kept",
    errno.EDQUOT: "the disk quota is exceeded: free some space (or choose another --out) and run "
    "the same command again; finished runs are kept",
    errno.EROFS: "the file system is read-only: choose another --out",
    errno.EACCES: "permission denied: choose a directory you can write (--out)",
    errno.EPERM: "permission denied: choose a directory you can write (--out)",
    errno.ENAMETOOLONG: "a file name is too long for this file system: choose a shorter --out or "
    "experiment name",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another --out",
    errno.EEXIST: "a part of the path exists and is not a directory: choose another --out",
}
#: size of the probe file of :func:`probe_writable`
PROBE_BYTES = 1 << 16
#: the suffix of temporary files (``.<name>.<pid>.<random>.tmp``)
_TMP_SUFFIX = ".tmp"


class StorageError(OSError):
    """A file or directory could not be written; the message names it and says what to do."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def of(cls, path: str | os.PathLike[str], error: OSError, doing: str = "write") -> StorageError:
        """The error for ``error`` raised while doing ``doing`` on ``path``."""
        if isinstance(error, StorageError):
            return error
        reason = error.strerror or type(error).__name__
        hint = _HINTS.get(error.errno or -1, "")
        return cls(
            f"cannot {doing} {os.fspath(path)}: {reason}" + (f"; {hint}" if hint else ""),
            error.errno,
        )


class DirectoryBusy(StorageError):
    """Another live process holds the lock of an output directory."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be opened)."""
    if sys.platform == "win32":  # pragma: no cover - platform dependent
        return
    with contextlib.suppress(OSError):
        _fsync_path(path)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], Any]) -> Path:
    """Write a file atomically: ``write(tmp)`` fills a temporary file, which is fsync-ed and
    renamed over ``path``. Returns ``path``.

    ``write`` receives the temporary path (``df.to_parquet(tmp)``, ``torch.save(obj, tmp)``).
    Creates missing parent directories. Any OSError (a full disk, a read-only file system)
    removes the temporary file and raises :class:`StorageError`; ``path`` is then unchanged.
    """
    target = Path(path)
    tmp = _temporary(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        _fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise StorageError.of(target, e) from None
        raise
    _fsync_dir(target.parent)
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write` of ``text`` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def probe_writable(directory: str | os.PathLike[str], size: int = PROBE_BYTES) -> Path:
    """Create ``directory`` (with parents) and check by writing that it takes files.

    Writes ``size`` bytes to a probe file, fsyncs and removes it. Raises :class:`StorageError`
    (read-only, permission denied, disk full, a name too long, a parent that is a file) before
    any work starts. Returns the directory.
    """
    d = Path(directory)
    try:
        if is_file(d):
            raise StorageError(f"--out {os.fspath(d)!r} is a file; give a directory", errno.ENOTDIR)
        d.mkdir(parents=True, exist_ok=True)
    except StorageError:
        raise
    except OSError as e:
        raise StorageError.of(d, e, "create the directory") from None
    probe = d / f".shrinkgrad-probe.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * size)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        raise StorageError.of(d, e, "write to") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return d


def is_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` exists and is not a directory; a path the file system cannot even look
    up (a name too long) is a :class:`StorageError` naming it."""
    p = Path(path)
    try:
        return p.exists() and not p.is_dir()
    except OSError as e:
        raise StorageError.of(p, e, "use") from None


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> int:
    """Remove the temporary files that killed writers left in ``directory`` (not recursive).

    Call it only while holding the directory's :class:`DirectoryLock`. Returns how many.
    """
    count = 0
    with contextlib.suppress(OSError):
        for p in Path(directory).glob(f".*{_TMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                p.unlink()
                count += 1
    return count


class DirectoryLock:
    """An exclusive lock on a directory for the lifetime of a sweep (``with DirectoryLock(d):``).

    A second process asking for the same directory gets :class:`DirectoryBusy` at once, naming the
    holder (pid, host, command, start time). The kernel releases the lock when the holder exits or
    is killed. Advisory (``flock``): it protects shrinkgrad processes from each other on local file
    systems; where ``flock`` is unavailable (Windows) it is a no-op.
    """

    def __init__(self, directory: str | os.PathLike[str], what: str = "") -> None:
        self.directory = Path(directory)
        self.path = self.directory / ".lock"
        self.what = what or " ".join(sys.argv)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError.of(self.path, e, "create the lock file") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryBusy(
                    f"{os.fspath(self.directory)} is in use by another shrinkgrad process{holder}; "
                    "wait for it to finish, or choose another --out",
                    e.errno,
                ) from None
            raise StorageError.of(self.path, e, "lock") from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.what,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return ""
    if not isinstance(info, dict) or "pid" not in info:
        return ""
    command = f": {info['command']}" if info.get("command") else ""
    return (
        f" (pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')}{command})"
    )
