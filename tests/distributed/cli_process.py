"""A shrinkgrad command as a real process in its own session, for the Ctrl-C tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def assert_group_gone(proc: subprocess.Popen[str], wait: float = 10.0) -> None:
    """Assert that no process of the command's session is left once it has exited (a rank or
    worker orphaned by its launcher would be), allowing ``wait`` seconds for them to end."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.killpg(proc.pid, 0)  # succeeds while any process of the group lives
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of the command's group {proc.pid} are still running")
        time.sleep(0.1)
