"""Progress of a sweep: rich bars on a terminal, one line per finished run otherwise.

On a terminal: a bar over runs (finished / total, elapsed, remaining) and one transient bar per
active run over its rounds. A failed run (an exception, a worker process that died) and a run
rescheduled on another worker (dask) are printed the moment it happens, and so is a run that made
no progress (status ``no_progress``: it ended above its starting loss). Elsewhere (a log file,
``nohup``): a line per finished run, so a long sweep's log says what finished and how.
``progress=False`` shows nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

from .execute import NO_PROGRESS
from .grid import RunSpec

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Display",
    "LineDisplay",
    "NullDisplay",
    "RichDisplay",
    "make_display",
    "status_counts",
    "status_detail",
]

RESCHEDULED = "its worker was lost; resumed from its last checkpoint on another worker"


def status_detail(runs: pd.DataFrame) -> str:
    """``1 completed, 1 no progress``: how many runs of ``runs.csv`` have each status (in
    status order, ``_`` written as a space)."""
    counts = runs["status"].value_counts().to_dict() if len(runs) else {}
    return ", ".join(f"{v} {str(k).replace('_', ' ')}" for k, v in sorted(counts.items()))


def status_counts(runs: pd.DataFrame) -> str:
    """``2 runs (1 completed, 1 interrupted)``: the summaries of ``run``, ``train`` and
    ``plot`` count a sweep's runs this way."""
    n, detail = len(runs), status_detail(runs)
    return f"{n} {'run' if n == 1 else 'runs'}" + (f" ({detail})" if detail else "")


class Display(Protocol):
    def start(self) -> None: ...

    def event(self, kind: str, run: RunSpec, payload: dict[str, Any]) -> None: ...

    def stop(self) -> None: ...


class NullDisplay:
    """Shows nothing."""

    def start(self) -> None:
        pass

    def event(self, kind: str, run: RunSpec, payload: dict[str, Any]) -> None:
        pass

    def stop(self) -> None:
        pass


def _outcome(payload: dict[str, Any]) -> str:
    status = payload.get("status", "?")
    no_progress = status == NO_PROGRESS  # never a plain "completed": say so, and why
    text = (
        f"{'NO PROGRESS' if no_progress else status} after {payload.get('rounds', '?')} rounds, "
        f"‖∇f‖²={payload.get('grad_norm_sq', float('nan')):.3g} "
        f"({payload.get('wall_s', 0.0):.1f} s)"
    )
    return f"{text}: {payload.get('message', '')}" if no_progress else text


class LineDisplay:
    """One line on stderr per finished, failed or interrupted run."""

    def __init__(self, total: int, done: int) -> None:
        self.total = total
        self.done = done
        self.t0 = time.monotonic()

    def start(self) -> None:
        if self.done == self.total:
            self._print(f"all {self.total} runs already finished")
        elif self.done:
            self._print(f"{self.done} of {self.total} runs already finished; running the rest")

    def event(self, kind: str, run: RunSpec, payload: dict[str, Any]) -> None:
        if kind == "done":
            self.done += 1
            self._print(f"[{self.done}/{self.total}] {run.label}: {_outcome(payload)}")
        elif kind == "failed":
            self._print(f"[failed] {run.label}: {payload.get('message', '')}")
        elif kind == "interrupted":
            self._print(f"[interrupted] {run.label}: checkpoint saved")
        elif kind == "rescheduled":
            self._print(f"[rescheduled] {run.label}: {RESCHEDULED}")

    def stop(self) -> None:
        pass

    @staticmethod
    def _print(text: str) -> None:
        print(text, file=sys.stderr, flush=True)


class RichDisplay:
    """A bar over runs and one transient bar per active run (rounds)."""

    def __init__(self, total: int, done: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.total = total
        self.overall = self.progress.add_task("runs", total=total, completed=done)
        self.tasks: dict[str, Any] = {}

    def start(self) -> None:
        self.progress.start()

    def event(self, kind: str, run: RunSpec, payload: dict[str, Any]) -> None:
        p = self.progress
        if kind == "start":
            old = self.tasks.pop(run.run_id, None)  # a rescheduled run starts again
            if old is not None:
                p.remove_task(old)
            room = max(20, min(70, self.console.width - 48))  # leave room for bar and counts
            label = run.label if len(run.label) <= room else run.label[: room - 1] + "…"
            self.tasks[run.run_id] = p.add_task("  " + label, total=payload.get("rounds", 1))
        elif kind == "progress" and run.run_id in self.tasks:
            p.update(self.tasks[run.run_id], completed=payload.get("round", 0))
        elif kind in ("done", "failed", "interrupted"):
            task = self.tasks.pop(run.run_id, None)
            if task is not None:
                p.remove_task(task)
            if kind == "done":
                p.advance(self.overall)
                if payload.get("status") == NO_PROGRESS:
                    text = f"[no progress] {run.label}: {payload.get('message', '')}"
                    p.console.print(text, markup=False)
            elif kind == "failed":
                p.console.print(f"[failed] {run.label}: {payload.get('message', '')}", markup=False)
        elif kind == "rescheduled":
            p.console.print(f"[rescheduled] {run.label}: {RESCHEDULED}", markup=False)

    def stop(self) -> None:
        self.progress.stop()


def make_display(progress: bool, total: int, done: int) -> Display:
    """A :class:`RichDisplay` on a terminal, a :class:`LineDisplay` otherwise, or nothing."""
    if not progress:
        return NullDisplay()
    if sys.stderr.isatty():
        return RichDisplay(total, done)
    return LineDisplay(total, done)
