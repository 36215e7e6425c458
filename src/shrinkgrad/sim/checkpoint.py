"""Atomic checkpoints of a simulation: method state, bit counters, table rows and round.

Keyed randomness (:mod:`shrinkgrad.rng`) makes every draw a function of (seed, stream, client,
round), so there is no generator state to save: the explicit method state, the per-client bit
counters, the elapsed time and the rows logged so far determine the rest of the run exactly.

A checkpoint is written by :func:`shrinkgrad.storage.atomic_write` (a temporary file, fsync, a
rename over ``<path>``), so a crash or a kill at any moment leaves either the previous checkpoint
or the new one, never a torn file. Files are read with
``torch.load(weights_only=False)``: load only checkpoints you wrote yourself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..storage import atomic_write

__all__ = ["FORMAT_VERSION", "load_checkpoint", "save_checkpoint"]

FORMAT_VERSION = 1


def save_checkpoint(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (temporary file, fsync, rename)."""
    data = dict(payload, format_version=FORMAT_VERSION)
    atomic_write(path, lambda tmp: torch.save(data, tmp))


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The payload saved at ``path``, or ``None`` when there is no checkpoint yet."""
    target = Path(path)
    if not target.exists():
        return None
    if target.is_dir():
        raise IsADirectoryError(f"checkpoint path {str(target)!r} is a directory; give a file name")
    try:
        data = torch.load(target, map_location="cpu", weights_only=False)
    except Exception as e:  # a file that is not a checkpoint
        raise ValueError(
            f"cannot read the checkpoint {str(target)!r} ({type(e).__name__}: {e}); delete it or "
            "choose another checkpoint path"
        ) from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{str(target)!r} is not a shrinkgrad simulation checkpoint (format "
            f"{FORMAT_VERSION}); delete it or choose another checkpoint path"
        )
    return data
