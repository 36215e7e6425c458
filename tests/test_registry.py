"""The name[param=value](args) syntax shared by API, CLI, configs and legends."""

from __future__ import annotations

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
