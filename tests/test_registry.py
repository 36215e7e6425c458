"""The name[param=value](args) syntax shared by API, CLI, configs and legends, and the
completeness of the component registries (every module imported, every component registered)."""

from __future__ import annotations

from typing import Any

import pytest

from shrinkgrad.registry import Registry, Spec, SpecError, parse_spec


class Thing:
    __registry__: Registry[Thing]

    def __init__(self, **kw: object) -> None:
        self.kw = kw


THINGS: Registry[Thing] = Registry("thing", base=Thing)
Thing.__registry__ = THINGS


@THINGS.register("plain")
class Plain(Thing):
    """A thing with typed parameters."""

    def __init__(self, k: int, p: float = 0.5, flag: bool = False, mode: str = "a") -> None:
        super().__init__(k=k, p=p, flag=flag, mode=mode)


@THINGS.register("wrap")
class Wrap(Thing):
    """A transform taking one component."""

    def __init__(self, inner: Thing, scale: float = 1.0) -> None:
        super().__init__(inner=inner, scale=scale)


@THINGS.register("chain")
class Chain(Thing):
    """A transform taking any number of components."""

    def __init__(self, *parts: Thing) -> None:
        super().__init__(parts=parts)


def test_parse_nested_and_values() -> None:
    s = parse_spec(
        " chain( plain[k=3, p=1e-2, flag=true, mode='x y'], wrap[scale=2](plain[k=1]) ) "
    )
    assert s.name == "chain"
    assert s.args[0] == Spec("plain", (("k", 3), ("p", 0.01), ("flag", True), ("mode", "x y")))
    assert s.args[1].params == (("scale", 2),)
    assert s.args[1].args[0] == Spec("plain", (("k", 1),))


@pytest.mark.parametrize(
    "text",
    ["plain[k=3]", "wrap(plain[k=2,p=0.25])", "chain(plain[k=1],wrap[scale=3.0](plain[k=2]))"],
)
def test_canonical_round_trip(text: str) -> None:
    obj = THINGS.make(text)
    again = THINGS.make(obj.spec)  # type: ignore[attr-defined]
    assert again.spec == obj.spec  # type: ignore[attr-defined]
    assert THINGS.make(str(parse_spec(text))).spec == obj.spec  # type: ignore[attr-defined]


def test_types_are_coerced_and_checked() -> None:
    t = THINGS.make("plain[k=4,p=1]")
    assert t.kw["k"] == 4 and isinstance(t.kw["p"], float)
    with pytest.raises(SpecError, match=r"'k' must be an integer, got 1\.5"):
        THINGS.make("plain[k=1.5]")
    with pytest.raises(SpecError, match="true or false"):
        THINGS.make("plain[k=1,flag=3]")


def test_errors_name_the_problem() -> None:
    with pytest.raises(SpecError, match=r"unknown thing 'plian'.*did you mean 'plain'"):
        THINGS.make("plian[k=1]")
    with pytest.raises(SpecError, match=r"no parameter 'q'.*allowed: k \(int, required\)"):
        THINGS.make("plain[k=1,q=2]")
    with pytest.raises(SpecError, match="needs parameter 'k'"):
        THINGS.make("plain")
    with pytest.raises(SpecError, match="takes 1 component argument"):
        THINGS.make("wrap")
    with pytest.raises(SpecError, match="given twice"):
        parse_spec("plain[k=1,k=2]")
    with pytest.raises(SpecError, match="ends early"):
        parse_spec("plain[k=1")
    with pytest.raises(SpecError, match="unexpected"):
        parse_spec("plain[k=1]]")
    with pytest.raises(SpecError, match="empty"):
        parse_spec("  ")


def test_spec_errors_are_value_errors() -> None:
    # The CLI turns ValueError into a one-line message; SpecError must be one.
    assert issubclass(SpecError, ValueError)


def test_built_objects_pass_through() -> None:
    t = THINGS.make("plain[k=1]")
    assert THINGS.make(t) is t


# --------------------------------------------------------------------------------------------
# completeness: every module of the component packages is imported, every component registered
# --------------------------------------------------------------------------------------------
#: in the order imports flow (design.md): a package never imports the modules of a later one
COMPONENT_PACKAGES = (
    "shrinkgrad.compressors",
    "shrinkgrad.problems",
    "shrinkgrad.methods",
    "shrinkgrad.network",
)

#: public concrete component classes that are deliberately not in a registry, and why
NOT_REGISTERED = {
    "shrinkgrad.problems.splits.ExplicitSplit": "built from per-client index arrays through the "
    "Python API (split=[...]); no name can express it",
    "shrinkgrad.compressors.lowrank.LowRank": "the shared base (matrix view, rank check, bits, "
    "factor wire format) of rank_k and power_sgd, which are named",
}


def _modules(package: str) -> list[str]:
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    return sorted(info.name for info in pkgutil.walk_packages(pkg.__path__, package + "."))


def test_every_module_is_imported_by_its_package() -> None:
    """A module that its package does not import is invisible: whatever it registers vanishes
    from the registry (and from the contract suites) while everything else stays green.

    One fresh interpreter imports the packages in the order imports flow (compressors, problems,
    methods) and records, after each, the modules loaded: a package's snapshot is taken before
    any package above it could import its modules for it.
    """
    import json
    import subprocess
    import sys

    code = (
        "import importlib, json, sys\n"
        "seen = {}\n"
        f"for package in {list(COMPONENT_PACKAGES)!r}:\n"
        "    importlib.import_module(package)\n"
        "    seen[package] = [m for m in sys.modules if m.startswith(package + '.')]\n"
        "print(json.dumps(seen))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=240
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    problems = []
    for package in COMPONENT_PACKAGES:
        for module in _modules(package):
            if module not in loaded[package]:
                init = package.replace(".", "/") + "/__init__.py"
                problems.append(
                    f"{module} is not imported when {package} is: add "
                    f"'from . import {module.rsplit('.', 1)[1]}' to src/{init} (what it "
                    "registers would otherwise vanish)"
                )
    assert not problems, "\n".join(problems)


def _registries() -> list[Registry[Any]]:
    import importlib

    found: dict[int, Registry[Any]] = {}
    for package in COMPONENT_PACKAGES:
        for module in [package, *_modules(package)]:
            for value in vars(importlib.import_module(module)).values():
                if isinstance(value, Registry):
                    found[id(value)] = value
    return list(found.values())


def _registered_classes(registry: Registry[Any]) -> set[type]:
    """The classes a registry builds: class factories, and the return types of function ones,
    for its names and its suffixes (``base+momentum[...]``)."""
    import typing

    out: set[type] = set()
    entries = [registry.entry(n) for n in registry.names()]
    entries += [registry.suffix_entry(s) for s in registry.suffixes()]
    for entry in entries:
        name, factory = entry.name, entry.factory
        if isinstance(factory, type):
            out.add(factory)
            continue
        ret = typing.get_type_hints(factory).get("return")
        assert isinstance(ret, type), (
            f"{registry.family} {name!r}: its factory {factory.__qualname__} must annotate the "
            "class it returns (the completeness check reads it)"
        )
        out.add(ret)
    return out


def test_every_component_class_is_registered() -> None:
    """A public, concrete subclass of a registry's base class must be reachable by name."""
    import importlib
    import inspect

    registries = _registries()
    families = {r.family for r in registries}
    assert {"compressor", "method", "problem", "split"} <= families
    registered = set().union(*(_registered_classes(r) for r in registries))
    missing = []
    for package in COMPONENT_PACKAGES:
        for module_name in _modules(package):
            module = importlib.import_module(module_name)
            for attr, cls in vars(module).items():
                if not isinstance(cls, type) or cls.__module__ != module_name:
                    continue
                for reg in registries:
                    base = reg.base
                    if base is None or cls is base or not issubclass(cls, base):
                        continue
                    qualified = f"{module_name}.{attr}"
                    if (
                        attr.startswith("_")
                        or inspect.isabstract(cls)
                        or cls in registered
                        or qualified in NOT_REGISTERED
                    ):
                        continue
                    missing.append(
                        f"{qualified} is a {reg.family} ({base.__name__} subclass) but no "
                        f"{reg.family} name builds it: register it (@{reg.family.upper()}S."
                        "register(...)), make it private or abstract, or list it in "
                        "NOT_REGISTERED with the reason"
                    )
    assert not missing, "\n".join(missing)
    for qualified in NOT_REGISTERED:  # the exceptions still exist (no stale entries)
        module_name, attr = qualified.rsplit(".", 1)
        assert hasattr(importlib.import_module(module_name), attr), qualified
