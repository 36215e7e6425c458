"""What ``main`` sets up around a command: SIGTERM as an interruption (while the command runs,
and only then), and warnings as one ``warning:`` line each."""

from __future__ import annotations

import os
import signal
import warnings

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


def test_a_warning_is_one_line_shown_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python shows a warning as two lines (the source file and line, then the code); the CLI
    shows ``warning: <text>``, once per text, even when two places warn the same."""
    monkeypatch.delenv("SHRINKGRAD_DEBUG", raising=False)

    def command(argv: list[str] | None) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("the step is outside its theorem", UserWarning, stacklevel=1)
            warnings.warn("the step is outside its theorem", UserWarning, stacklevel=1)
            warnings.warn("another", RuntimeWarning, stacklevel=1)

    before = warnings.showwarning
    monkeypatch.setattr(cli, "_main", command)
    main(["list"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: the step is outside its theorem", "warning: another"]
    assert warnings.showwarning is before
