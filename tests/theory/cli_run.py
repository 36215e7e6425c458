"""Run the ``shrinkgrad`` CLI in-process: (exit status, stdout, stderr)."""

from __future__ import annotations

import pytest

from shrinkgrad.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
