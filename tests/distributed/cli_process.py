"""A shrinkgrad command as a real process in its own session, for the Ctrl-C tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def start(args: list[str]) -> subprocess.Popen[str]:
    """``shrinkgrad ARGS`` in a new session (so that ``os.killpg(proc.pid, SIGINT)`` is a
    terminal's Ctrl-C to it alone), its output captured as text."""
    exe = str(Path(sys.executable).with_name("shrinkgrad"))
    return subprocess.Popen(
        [exe, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # SIGINT back to its default (a suite started in the background inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def kill(proc: subprocess.Popen[str]) -> None:
    """Kill the process group if it is still running (a test's ``finally``)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
