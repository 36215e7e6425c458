"""Registries and the one ``name[param=value](arg, ...)`` syntax of the API, CLI, configs and plots.

Every component family (compressors, methods, problems, splits, delay models, ...) keeps a
:class:`Registry`. A component is registered with a factory whose *typed signature* is the
parameter specification: keyword parameters become ``[key=value]`` entries, positional parameters
annotated with a component type become ``(arg, ...)`` sub-specs. The same string therefore means
the same thing everywhere::

    qsgd[s=4]                     # QSGD with 4 levels
    top_k[k=1]
    scaled(rand_k[k=5])           # a transform taking one component
    compose(top_k[k=10], qsgd[s=4])
    ef21+momentum[beta=0.9]       # a suffix: client momentum in front of ef21

Grammar (whitespace is ignored between tokens)::

    spec   := term ( "+" NAME [ "[" [ param ("," param)* ] "]" ] )*
    term   := NAME [ "[" [ param ("," param)* ] "]" ] [ "(" [ spec ("," spec)* ] ")" ]
    param  := NAME "=" value
    value  := number | "true" | "false" | "inf" | quoted or bare string | path | quantity
            | spec | "[" [ value ("," value)* ] "]"

A *path* is a bare string holding a ``/`` (or ``\\``): ``dataset=/data/x.svm``,
``dataset=./data/x.svm``, ``address=tcp://host:8786``; a *quantity* is a number with a unit, kept
as a string for the component to read: ``up=10mbit``, ``latency=20ms``; ``[a, b, c]`` is a list
(a tuple in Python). A value with spaces or any of ``, [ ] ( ) =`` is quoted:
``dataset='/my data/x.svm'``.

A *suffix* ``base+name[params]`` is a component registered with :meth:`Registry.register_suffix`
applied to the component ``base`` (its one component argument, written in front of it):
``dcgd[biased=true]+momentum[beta=0.5]`` is the method ``dcgd[biased=true]`` with client
momentum β = 0.5 in front. A suffix is not a name of its own (``Registry.names`` does not list
it): it only exists applied to something.

Keyword arguments are the same parameters: ``registry.make("logistic_regression",
dataset="w1a", n_clients=10)`` equals ``registry.make("logistic_regression[dataset=w1a,
n_clients=10]")`` (keywords take precedence over the spec's own parameters).

The canonical string of a built component (:func:`canonical`) lists the parameters that were given,
in signature order, so it round-trips through :meth:`Registry.make` and is stable for legends.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = [
    "Registry",
    "Spec",
    "SpecError",
    "parse_spec",
]

T = TypeVar("T")


class SpecError(ValueError):
    """A component name or its parameters could not be understood (the message says how to fix)."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed ``name[params](args)`` string, before any registry gives it meaning."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    args: tuple[Spec, ...] = ()
    #: for a suffix ``base+name[params]``: the spec it is applied to (None: a plain ``name``)
    base: Spec | None = None

    def __str__(self) -> str:
        out = self.name
        if self.params:
            out += "[" + ",".join(f"{k}={_format_value(v)}" for k, v in self.params) + "]"
        if self.args:
            out += "(" + ",".join(str(a) for a in self.args) + ")"
        return out if self.base is None else f"{self.base}+{out}"


def _format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isfinite(v) and v == int(v) and abs(v) < 1e15:
            return repr(float(v))
        return repr(v)
    if isinstance(v, str):
        return v if _bare_ok(v) else _quote(v)
    if isinstance(v, Spec):
        return str(v)
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(_format_value(x) for x in v) + "]"
    if isinstance(v, os.PathLike):
        return _format_value(os.fspath(v))
    spec = getattr(v, "spec", None)
    if isinstance(spec, str):
        return spec
    return str(v)


def _bare_ok(v: str) -> bool:
    """Whether ``v`` parses back to the same string when written without quotes."""
    return bool(_BARE.fullmatch(v)) and v.lower() not in ("true", "false", "inf", "+inf")


def _quote(v: str) -> str:
    """``v`` in quotes the tokenizer reads back verbatim (no escapes exist in the grammar)."""
    if "'" not in v:
        return f"'{v}'"
    if '"' not in v:
        return f'"{v}"'
    raise SpecError(f"cannot write {v!r} in a spec: it holds both kinds of quotes")


#: characters of a bare path: anything but whitespace, quotes and the grammar's , [ ] ( ) =
_PATH_CHARS = r"""[^\s,\[\]\(\)='"]"""
#: a number followed by a unit: 10mbit, 20ms, 1.5e3kbit, 100MB/s (read by the component)
_QUANTITY = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[A-Za-z_%µ]+(?:/[A-Za-z]+)?"
_TOKEN = re.compile(
    rf"""\s*(?:
        (?P<str>'[^']*'|"[^"]*")
      | (?P<path>[A-Za-z0-9_.~+:\-]*[/\\]{_PATH_CHARS}*)
      | (?P<qty>{_QUANTITY}(?![A-Za-z0-9_.+\-]))
      | (?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?![A-Za-z_]))
      | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
      | (?P<punct>[\[\]\(\),=+])
    )""",
    re.VERBOSE,
)
_BARE = re.compile(rf"[A-Za-z_][A-Za-z0-9_.\-]*|[A-Za-z0-9_.~+:\-]*[/\\]{_PATH_CHARS}*|{_QUANTITY}")
#: how to write a value the grammar cannot hold bare (the hint of the parse errors)
QUOTING_HINT = (
    "quote a value with spaces or any of , [ ] ( ) = (e.g. dataset='/my data/x.svm'); "
    "paths such as dataset=/data/x.svm need no quotes"
)


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens: list[tuple[str, str, int]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            where = len(text) - len(text[pos:].lstrip())
            raise SpecError(
                f"cannot parse {text!r}: unexpected character {text[where:][:1]!r} at "
                f"position {where}; expected e.g. 'qsgd[s=4]' or 'compose(top_k[k=10],qsgd[s=4])'"
                f"; {QUOTING_HINT}"
            )
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None, kind: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            want = repr(value) if value else (kind or "more input")
            raise SpecError(f"cannot parse {self.text!r}: it ends early, expected {want}")
        if (value is not None and tok[1] != value) or (kind is not None and tok[0] != kind):
            want = repr(value) if value else (kind or "?")
            raise SpecError(
                f"cannot parse {self.text!r}: expected {want} at position {tok[2]}, "
                f"found {tok[1]!r}"
            )
        self.i += 1
        return tok

    def at(self, text: str) -> bool:
        """Whether the next token is ``text``."""
        tok = self.peek()
        return tok is not None and tok[1] == text

    def items(self, close: str, item: Callable[[], T], after: Callable[[list[T]], str]) -> list[T]:
        """Comma-separated ``item()`` s up to the closing bracket (the opening one is taken);
        ``after(items)`` names what a stray token follows (empty: the plain error)."""
        out: list[T] = []
        if not self.at(close):
            out.append(item())
            while self.at(","):
                self.take(",")
                out.append(item())
        self._close(close, after(out))
        return out

    def spec(self) -> Spec:
        """``term ("+" NAME [params])*``: a term, then the suffixes applied to it in turn."""
        out = self.term()
        while self.at("+"):
            self.take("+")
            _, name, pos = self.take(kind="name")
            params = self.params()
            if self.at("("):
                raise SpecError(
                    f"cannot parse {self.text!r}: the suffix +{name} at position {pos} takes no "
                    "component in parentheses (it applies to the spec in front of the +)"
                )
            out = Spec(name, params, (), base=out)
        return out

    def term(self) -> Spec:
        _, name, _ = self.take(kind="name")
        params = self.params()
        args: list[Spec] = []
        if self.at("("):
            self.take("(")
            args = self.items(")", self.spec, lambda _: "")
        return Spec(name, params, tuple(args))

    def params(self) -> tuple[tuple[str, Any], ...]:
        """``[key=value, ...]`` if one follows (none: empty)."""
        if not self.at("["):
            return ()
        seen: set[str] = set()

        def param() -> tuple[str, Any]:
            _, key, _ = self.take(kind="name")
            if key in seen:
                raise SpecError(f"cannot parse {self.text!r}: parameter {key!r} given twice")
            seen.add(key)
            self.take("=")
            return key, self.value()

        self.take("[")
        params = self.items("]", param, lambda ps: f"the value of {ps[-1][0]!r}" if ps else "")
        return tuple(params)

    def _close(self, bracket: str, after: str) -> None:
        """Take the closing ``bracket``; a stray token after a value hints at quoting."""
        tok = self.peek()
        if tok is not None and tok[1] != bracket and after:
            raise SpecError(
                f"cannot parse {self.text!r}: expected ',' or {bracket!r} after {after} at "
                f"position {tok[2]}, found {tok[1]!r}; {QUOTING_HINT}"
            )
        self.take(bracket)

    def value(self) -> Any:
        tok = self.peek()
        if tok is None:
            raise SpecError(f"cannot parse {self.text!r}: a parameter has no value")
        kind, text, _ = tok
        if kind == "punct" and text == "[":
            self.take("[")
            return tuple(self.items("]", self.value, lambda _: "a list item"))
        if kind in ("path", "qty"):
            self.i += 1
            return text
        if kind == "num":
            self.i += 1
            if re.fullmatch(r"[+-]?\d+", text):
                return int(text)
            number = float(text)
            if math.isinf(number):  # only the word inf means an infinite value
                raise SpecError(
                    f"cannot parse {self.text!r}: the number {text} is out of range (it "
                    "overflows to infinity); write inf for an infinite value"
                )
            return number
        if kind == "str":
            self.i += 1
            return text[1:-1]
        if kind == "name":
            low = text.lower()
            nxt = self.tokens[self.i + 1] if self.i + 1 < len(self.tokens) else None
            if nxt is not None and nxt[1] in ("[", "(", "+"):
                return self.spec()
            self.i += 1
            if low in ("true", "false"):
                return low == "true"
            if low in ("inf", "+inf"):
                return math.inf
            return text
        raise SpecError(f"cannot parse {self.text!r}: unexpected {text!r} where a value belongs")


def parse_spec(text: str | Spec) -> Spec:
    """Parse ``name[param=value,...](arg,...)`` into a :class:`Spec` (no registry lookup)."""
    if isinstance(text, Spec):
        return text
    if not isinstance(text, str):
        raise SpecError(
            f"a component name must be a string like 'qsgd[s=4]', got {type(text).__name__}"
        )
    if not text.strip():
        raise SpecError("empty component name; expected e.g. 'top_k[k=1]'")
    p = _Parser(text)
    spec = p.spec()
    if p.peek() is not None:
        tok = p.peek()
        assert tok is not None
        raise SpecError(f"cannot parse {text!r}: unexpected {tok[1]!r} at position {tok[2]}")
    return spec


@dataclasses.dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its factory, its parameters and a one-line summary."""

    name: str
    factory: Callable[..., T]
    summary: str
    keyword: tuple[inspect.Parameter, ...]
    positional: tuple[inspect.Parameter, ...]
    hints: dict[str, Any]


class Registry(Generic[T]):
    """A named family of components built from spec strings.

    ``registry.register("qsgd")(factory)`` records a factory; ``registry.make("qsgd[s=4]")`` builds
    one, checking every parameter name and type against the factory's signature and raising a
    :class:`SpecError` that lists what is allowed otherwise.
    """

    def __init__(self, family: str, *, base: type | None = None) -> None:
        self.family = family
        self.base = base
        self._entries: dict[str, Entry[T]] = {}
        #: suffixes ``base+name[params]``, keyed ``+name``
        self._suffixes: dict[str, Entry[T]] = {}

    # -- registration -----------------------------------------------------------------------
    def register(
        self, name: str, *, summary: str | None = None
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``factory`` (a class or a function) under ``name``."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self._entries[name] = _entry(name, factory, summary)
            return factory

        return deco

    def register_suffix(
        self, name: str, *, summary: str | None = None
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``factory(component, **params)`` as the suffix ``+name``: the
        spec ``base+name[params]`` builds ``factory(make(base), **params)`` (module docstring).
        Its first parameter takes the component; the others are its ``[key=value]`` entries."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            key = f"+{name}"
            if key in self._suffixes:
                raise ValueError(f"{self.family} suffix {key!r} is registered twice")
            entry = _entry(key, factory, summary)
            params = [p for p in inspect.signature(factory).parameters.values() if p.name != "self"]
            first = params[0] if params else None
            if first is None or first.kind not in (
                first.POSITIONAL_ONLY,
                first.POSITIONAL_OR_KEYWORD,
            ):
                raise TypeError(f"the factory of suffix {key!r} must take the component first")
            if any(p.name != first.name for p in entry.positional):
                raise TypeError(f"suffix {key!r} takes one component (the spec in front of it)")
            rest = tuple(p for p in entry.keyword if p.name != first.name)
            self._suffixes[key] = dataclasses.replace(entry, keyword=rest, positional=(first,))
            return factory

        return deco

    # -- lookup -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def suffixes(self) -> list[str]:
        """The registered suffixes, as written after a spec (``+momentum``)."""
        return sorted(self._suffixes)

    def suffix_entry(self, name: str) -> Entry[T]:
        """The suffix ``+name``'s entry (``name`` with or without the ``+``)."""
        key = name if name.startswith("+") else f"+{name}"
        try:
            return self._suffixes[key]
        except KeyError:
            raise SpecError(
                f"unknown {self.family} suffix {key!r}; known: "
                f"{', '.join(self.suffixes()) or '(none)'}" + _did_you_mean(key, self.suffixes())
            ) from None

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise SpecError(
                f"unknown {self.family} {name!r}; known: {', '.join(self.names()) or '(none)'}"
                + _did_you_mean(name, self.names())
            ) from None

    def make(self, spec: str | Spec | T, **overrides: Any) -> T:
        """Build a component from a spec string (or pass an already built one through).

        Keyword arguments are parameters like those inside the brackets, and take precedence
        over them: ``make("qsgd", s=4)`` builds what ``make("qsgd[s=4]")`` builds. Their values
        may be Python objects of the annotated type (a number, a path, a built component).
        """
        if self.base is not None and isinstance(spec, self.base):
            if overrides:
                name = getattr(spec, "spec", "") or type(spec).__name__
                keys = ", ".join(f"{k}=" for k in overrides)
                raise SpecError(
                    f"cannot apply {keys} to an already built {self.family} ({name}): pass its "
                    f"name with the parameters instead, e.g. {name.split('[')[0]!r} with {keys}"
                )
            return typing.cast(T, spec)
        if not isinstance(spec, (str, Spec)):
            raise SpecError(
                f"expected a {self.family} name such as {self._example()!r}, "
                f"got {type(spec).__name__}"
            )
        parsed = parse_spec(spec)
        if parsed.base is not None:
            return self._make_suffix(parsed, overrides)
        entry = self.entry(parsed.name)
        kwargs = self._keywords(entry, {**dict(parsed.params), **overrides})
        args = [self._make_arg(entry, p, a) for p, a in self._match_args(entry, parsed)]
        obj = entry.factory(*args, **kwargs)
        canon = Spec(
            entry.name,
            tuple((p.name, kwargs[p.name]) for p in entry.keyword if p.name in kwargs),
            tuple(parse_spec(getattr(a, "spec", str(a))) for a in args),
        )
        _set_spec(obj, canon)
        return obj

    def _make_suffix(self, parsed: Spec, overrides: dict[str, Any]) -> T:
        """``base+name[params]``: the suffix's factory on ``make(base)``; keyword arguments are
        the suffix's parameters (the outermost one's, as for any spec)."""
        assert parsed.base is not None
        entry = self.suffix_entry(parsed.name)
        kwargs = self._keywords(entry, {**dict(parsed.params), **overrides})
        inner = self.make(parsed.base)
        obj = entry.factory(inner, **kwargs)
        canon = Spec(
            parsed.name,
            tuple((p.name, kwargs[p.name]) for p in entry.keyword if p.name in kwargs),
            (),
            base=parse_spec(getattr(inner, "spec", "") or str(parsed.base)),
        )
        _set_spec(obj, canon)
        return obj

    def _keywords(self, entry: Entry[T], given: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of ``entry``'s factory from the ``[key=value]`` entries,
        checked against its signature and coerced to its annotations."""
        kwargs: dict[str, Any] = {}
        allowed = {p.name for p in entry.keyword}
        for key, raw in given.items():
            if key not in allowed:
                listing = (
                    ", ".join(_describe_param(p, entry.hints) for p in entry.keyword) or "none"
                )
                raise SpecError(
                    f"{self.family} {entry.name!r} has no parameter {key!r}; allowed: {listing}"
                    + _did_you_mean(key, sorted(allowed))
                )
            kwargs[key] = self._coerce(entry, key, raw)
        for p in entry.keyword:
            if p.default is p.empty and p.name not in kwargs:
                raise SpecError(
                    f"{self.family} {entry.name!r} needs parameter {p.name!r}, e.g. "
                    f"'{entry.name}[{p.name}=...]'; parameters: "
                    + ", ".join(_describe_param(q, entry.hints) for q in entry.keyword)
                )
        return kwargs

    # -- helpers ----------------------------------------------------------------------------
    def _example(self) -> str:
        return self.names()[0] if self._entries else "name[param=value]"

    def _match_args(self, entry: Entry[T], parsed: Spec) -> list[tuple[inspect.Parameter, Spec]]:
        pos = entry.positional
        var = [p for p in pos if p.kind == p.VAR_POSITIONAL]
        fixed = [p for p in pos if p.kind != p.VAR_POSITIONAL]
        n = len(parsed.args)
        if (n < len(fixed)) or (n > len(fixed) and not var):
            want = f"{len(fixed)}" + (" or more" if var else "")
            raise SpecError(
                f"{self.family} {entry.name!r} takes {want} component argument(s) in parentheses, "
                f"got {n}: write e.g. '{entry.name}("
                + ", ".join("..." for _ in fixed or var)
                + ")'"
            )
        out = list(zip(fixed, parsed.args, strict=False))
        if var:
            out += [(var[0], a) for a in parsed.args[len(fixed) :]]
        return out

    def _make_arg(self, entry: Entry[T], p: inspect.Parameter, arg: Spec) -> Any:
        # Component arguments are components of the same family unless annotated otherwise.
        return self.make(arg)

    def _coerce(self, entry: Entry[T], key: str, raw: Any) -> Any:
        hint = entry.hints.get(key)
        return coerce_value(raw, hint, f"{self.family} {entry.name!r} parameter {key!r}", self)


def _entry(name: str, factory: Callable[..., T], summary: str | None) -> Entry[T]:
    """The entry of ``factory`` (a class or a function): its typed signature, split into
    component arguments and ``[key=value]`` parameters, and its one-line summary."""
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    sig = inspect.signature(factory)
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # pragma: no cover - unresolvable annotations fall back to none
        hints = {}
    params = [p for p in sig.parameters.values() if p.name != "self"]
    positional = tuple(
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)
        or (
            p.kind == p.POSITIONAL_OR_KEYWORD
            and p.default is p.empty
            and _is_component(hints.get(p.name))
        )
    )
    keyword = tuple(p for p in params if p not in positional and p.kind != p.VAR_KEYWORD)
    doc = summary or (inspect.getdoc(factory) or "").strip().splitlines()[0:1]
    text = doc if isinstance(doc, str) else (doc[0] if doc else "")
    return Entry(name, factory, text, keyword, positional, hints)


def _set_spec(obj: Any, canon: Spec) -> None:
    """Record ``canon`` as ``obj.spec``; objects that refuse attributes keep no canonical name."""
    with contextlib.suppress(AttributeError, TypeError):
        object.__setattr__(obj, "spec", str(canon))


def _unwrap(hint: Any) -> Any:
    """The type inside ``Annotated[T, "description"]`` (any other hint unchanged)."""
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return hint


def _is_component(hint: Any) -> bool:
    hint = _unwrap(hint)
    return hint is not None and isinstance(hint, type) and hasattr(hint, "__registry__")


def _describe_param(p: inspect.Parameter, hints: dict[str, Any]) -> str:
    hint = hints.get(p.name)
    tname = _type_name(hint)
    if p.default is p.empty:
        return f"{p.name} ({tname}, required)"
    return f"{p.name} ({tname}, default {_format_value(p.default)})"


def _type_name(hint: Any) -> str:
    """How a parameter's type reads in errors; ``Annotated[T, "text"]`` reads as the text."""
    if typing.get_origin(hint) is typing.Annotated:
        notes = [m for m in hint.__metadata__ if isinstance(m, str)]
        return notes[0] if notes else _type_name(_unwrap(hint))
    if hint is None:
        return "any"
    if isinstance(hint, type):
        return hint.__name__
    origin = typing.get_origin(hint)
    if origin in (list, tuple, collections.abc.Sequence):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return "list" + (f" of {_type_name(args[0])}" if len(args) == 1 else "")
    if origin is typing.Literal:
        return "one of " + "/".join(str(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    return str(hint)


def coerce_value(raw: Any, hint: Any, what: str, registry: Registry[Any] | None = None) -> Any:
    """Convert a parsed value to the annotated type, or raise a :class:`SpecError` naming what."""
    hint = _unwrap(hint)
    if hint is None or hint is Any:
        return raw
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if raw is None and type(None) in options:
            return None
        errors = []
        # Prefer an exact type match before trying conversions (int before float for "3").
        for opt in sorted(
            options, key=lambda o: 0 if isinstance(o, type) and isinstance(raw, o) else 1
        ):
            if opt is type(None):
                continue
            try:
                return coerce_value(raw, opt, what, registry)
            except SpecError as e:
                errors.append(str(e))
        raise SpecError(f"{what} must be {_type_name(hint)}, got {raw!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if raw in allowed:
            return raw
        raise SpecError(f"{what} must be one of {', '.join(map(repr, allowed))}, got {raw!r}")
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        raise SpecError(f"{what} must be true or false, got {raw!r}")
    if hint is int:
        if (
            isinstance(raw, bool)
            or not isinstance(raw, (int, float))
            or (isinstance(raw, float) and (not math.isfinite(raw) or raw != int(raw)))
        ):
            raise SpecError(f"{what} must be an integer, got {raw!r}")
        return int(raw)
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise SpecError(f"{what} must be a number, got {raw!r}")
        return float(raw)
    if hint is str:
        if isinstance(raw, os.PathLike):
            return os.fspath(raw)
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
        raise SpecError(f"{what} must be a string, got {raw!r}")
    if origin in (tuple, list, collections.abc.Sequence):
        args = typing.get_args(hint)
        if isinstance(raw, (str, bytes)) or not isinstance(raw, (tuple, list)):
            raise SpecError(f"{what} must be a list such as [1,2,3], got {raw!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(raw):
                raise SpecError(f"{what} must be a list of {len(args)} values, got {raw!r}")
            items = [coerce_value(v, a, what, registry) for v, a in zip(raw, args, strict=True)]
        else:
            inner = args[0] if args else None
            items = [coerce_value(v, inner, what, registry) for v in raw]
        return list(items) if origin is list else tuple(items)
    if isinstance(hint, type) and hasattr(hint, "__registry__"):
        reg = hint.__registry__
        if isinstance(raw, (str, Spec)):
            return reg.make(raw)
        if isinstance(raw, hint):
            return raw
        raise SpecError(f"{what} must be a {reg.family} name, got {raw!r}")
    return raw


def _did_you_mean(name: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
