"""``import shrinkgrad`` and ``shrinkgrad --help`` stay light: heavy libraries load on first use."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "pandas", "scipy", "numba", "sklearn", "matplotlib")


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


def test_import_and_help_load_no_heavy_library() -> None:
    assert _loaded_after("import shrinkgrad") == set()
    help_code = (
        "from click.testing import CliRunner\n"
        "from shrinkgrad.cli import cli\n"
        "r = CliRunner().invoke(cli, ['--help'])\n"
        "assert r.exit_code == 0 and 'reproduce' in r.output, r.output"
    )
    assert _loaded_after(help_code) == set()


def test_public_names_resolve_lazily() -> None:
    """Every name in ``shrinkgrad.__all__`` resolves, to the object its submodule defines."""
    import shrinkgrad
    from shrinkgrad import compressors, sim

    for name in shrinkgrad.__all__:
        assert getattr(shrinkgrad, name) is not None, name
    assert shrinkgrad.make_compressor is compressors.make_compressor
    assert shrinkgrad.simulate is sim.simulate
    assert set(shrinkgrad.__all__) <= set(dir(shrinkgrad))
