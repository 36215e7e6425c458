"""The package root: ``__version__`` from the distribution's metadata, and subpackages reachable
as attributes (``sg.datasets.load("a9a")``) while ``import shrinkgrad`` stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shrinkgrad

HEAVY = ("torch", "pandas", "scipy", "numba", "sklearn", "matplotlib")


def _python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=240
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_subpackages_are_attributes_without_an_import_and_the_root_stays_lazy() -> None:
    out = _python(
        "import sys\n"
        "import shrinkgrad as sg\n"
        "v = sg.__version__\n"
        f"print('heavy:', ','.join(m for m in {HEAVY!r} if m in sys.modules) or '-')\n"
        "ds = sg.datasets.load('a9a')\n"
        "print('a9a', ds.n_samples, ds.n_features)\n"
        "import types\n"
        "for name in ('problems', 'theory', 'methods', 'distributed', 'compressors', 'sim'):\n"
        "    mod = getattr(sg, name)\n"
        "    assert isinstance(mod, types.ModuleType) and mod.__name__ == 'shrinkgrad.' + name\n"
        "print('xi', sg.theory.xi(0.5), sg.methods.make_method('ef21').name)\n"
        "p = sg.problems.make_problem('logistic_regression[dataset=a1a,n_clients=4]')\n"
        "print('problem', p.n)\n"
    )
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["heavy:"] == "-"  # the version and the root import load nothing heavy
    assert lines["a9a"] == "32561 123"
    assert lines["xi"].startswith("2.414213562373") and lines["xi"].endswith("ef21")
    assert lines["problem"] == "4"


def test_version_comes_from_the_distribution_metadata() -> None:
    from importlib import metadata

    try:
        installed = metadata.version("shrinkgrad")
    except metadata.PackageNotFoundError:  # pragma: no cover - a bare source checkout
        pytest.skip("shrinkgrad is not installed here")
    assert shrinkgrad.__version__ == installed
    assert "__version__" in dir(shrinkgrad) and "datasets" in dir(shrinkgrad)


def test_version_falls_back_to_the_checkouts_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    pyproject = Path(shrinkgrad.__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():  # pragma: no cover - an installed copy without the checkout
        assert shrinkgrad._read_version() == "0+unknown"
        return
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    want = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert shrinkgrad._read_version() == want


def test_unknown_attributes_still_raise() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        shrinkgrad.nope  # type: ignore[attr-defined]  # noqa: B018
