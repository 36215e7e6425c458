"""SIGTERM is an interruption while a command runs, and only then."""

from __future__ import annotations

import os
import signal

import pytest

from shrinkgrad import cli
from shrinkgrad.cli import Terminated, interrupted_status, main


def test_main_takes_sigterm_while_it_runs_and_gives_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def command(argv: list[str] | None) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))

    monkeypatch.setattr(cli, "_main", command)
    main(["list"])
    assert seen == [cli._on_sigterm]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_during_a_command_is_an_interruption_with_status_143(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "_TERMINATED", [False])
    assert interrupted_status() == 130

    def command(argv: list[str] | None) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.0)  # a bytecode boundary: the handler runs by now

    monkeypatch.setattr(cli, "_main", command)
    with pytest.raises(Terminated):
        main(["list"])
    assert isinstance(Terminated(), KeyboardInterrupt)  # every Ctrl-C path handles it
    assert interrupted_status() == 143
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as e:
            cli.exit_interrupted("terminated")
    finally:
        signal.signal(signal.SIGINT, sigint)  # exit_interrupted ignores a further Ctrl-C
    assert e.value.code == 143
