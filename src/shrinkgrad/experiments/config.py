"""Experiment configs: a TOML schema, its validation, profiles and overrides.

One file describes a grid of simulations — problems × (method, compressor, step size) × seeds —
with the ``name[param=value]`` syntax of the Python API (:mod:`shrinkgrad.registry`). The complete
annotated schema is in docs/experiments.md; in short::

    name = "my-sweep"                 # optional; used in titles and summaries
    description = "..."               # optional

    [problem]                         # or: problem = "logistic_regression[dataset=a9a]"
    name = "logistic_regression"      #     or: problem = ["spec 1", "spec 2"]
    dataset = "a9a"                   # fixed parameters of the problem factory
    n_clients = 100
    [problem.sweep]                   # each list is an axis (Cartesian product)
    split = ["contiguous", "by_label"]
    [[problem.cases]]                 # explicit variants, merged over the fixed parameters
    dataset = "w1a"

    [run]
    rounds = 1000                     # > 0
    log_every = 10
    seeds = 3                         # seed indices 0, 1, 2 (or a list of indices)
    seed = 0                          # base seed; a run's seed = derive_seed(seed, index)
    tol_rel = 1e-6                    # stop at ‖∇f‖² ≤ tol_rel·‖∇f(x⁰)‖² (or tol = absolute)

    [grid]                            # every method × compressor × step size
    methods = ["ef21", "ef21_w"]
    compressors = ["top_k[k=1]"]
    stepsizes = ["theory", "theory*2"]

    [[pairs]]                         # explicit pairings where a grid is wrong
    method = "ef"
    compressor = "top_k[k=1]"
    stepsize = "theory(ef21)*2"       # the theory step of another method, times 2

    [profiles.quick]                  # a partial config merged over the file by --quick
    run.rounds = 200

Step sizes: the grammar of :func:`shrinkgrad.methods.parse_stepsize` (a number, ``"theory"``,
``"theory*m"``, ``"theory(method)*m"`` — the theory step of another method for the same problem
and compressor, e.g. classic EF at the EF21 step — and ``"c/L"`` with L one of ``L``, ``L_AM``,
``L_QM``, ``L_max``), resolved by ``Method.bind`` like every other runtime's.

Everything is checked before anything runs: unknown keys (with a did-you-mean), wrong types,
unknown component names or parameters (the registries' own messages), and impossible
combinations; the error names the file, the key and the reason (:class:`ConfigError`).
Compatibility of a method with a compressor on a concrete problem is checked by
:func:`shrinkgrad.experiments.grid.check_runs`, which binds every pairing once.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import itertools
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..registry import Spec, SpecError, coerce_value, parse_spec

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    import tomllib
else:  # pragma: no cover - version dependent
    import tomli as tomllib

__all__ = [
    "Arm",
    "ConfigError",
    "ExperimentConfig",
    "ProblemCase",
    "RunSettings",
    "derive_seed",
    "dump_config",
    "load_config",
    "loads_config",
    "parse_config",
    "parse_override",
]


class ConfigError(ValueError):
    """A config file cannot be used; the message names the file, the key and the reason."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        where = f"{source}: " if source else ""
        keytxt = f"{key}: " if key else ""
        super().__init__(f"{where}{keytxt}{reason}")
        self.source = source
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[str, str, str]]:
        """Pickle by the three arguments (an error raised on one rank of ``train`` is sent to
        the others and unpickled there; the default would call ``__init__`` with the message)."""
        return (type(self), (self.source, self.key, self.reason))


# --------------------------------------------------------------------------------------------
# the validated config
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProblemCase:
    """One concrete problem of a config.

    ``spec`` is the full ``name[param=value,...]`` string that
    :func:`shrinkgrad.problems.make_problem` builds; ``label`` names what distinguishes it from the
    config's other problems (``"dataset=w1a,split=by_label"``; the spec itself when there is one
    problem); ``params`` are its parameters as given.
    """

    spec: str
    label: str
    params: tuple[tuple[str, Any], ...] = ()
    #: where in the config file it comes from (``"problem"``, ``"problem.cases[1]"``)
    key: str = "problem"
    #: the ``label`` given to its [[problem.cases]] entry (shared by the entry's sweep variants)
    case: str | None = None


@dataclasses.dataclass(frozen=True)
class Arm:
    """One method × compressor × step-size combination (one curve per problem and seed).

    ``origin`` says where it comes from (``"grid"`` or ``"pairs[2]"``) for error messages.
    """

    method: str
    compressor: str
    stepsize: str
    origin: str = "grid"
    #: labels of the problems it runs on (``None``: every problem of the config)
    problems: tuple[str, ...] | None = None

    def applies_to(self, problem: ProblemCase) -> bool:
        """Whether this arm runs on ``problem`` (named by its label or its case's label)."""
        return self.problems is None or bool({problem.label, problem.case} & set(self.problems))

    @property
    def label(self) -> str:
        """The legend label: canonical specs joined by `` · ``."""
        return f"{self.method} · {self.compressor} · γ={self.stepsize}"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The ``[run]`` table: what every simulation of the config shares."""

    rounds: int = 1000
    log_every: int = 10
    seeds: tuple[int, ...] = (0,)
    seed: int = 0
    tol: float | None = None
    tol_rel: float | None = None
    dtype: str = "float64"
    wire_dtype: str = "float32"
    divergence_factor: float | None = 1e8
    checkpoint_every: int = 500
    #: network specs (``run.network``): every run is simulated on each of them, with the modelled
    #: wall clock ``time_model_s`` (docs/network.md); empty: no network, no such column
    network: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A validated experiment config (see the module docstring and docs/experiments.md).

    ``data`` is the resolved TOML document (profile and overrides applied, defaults filled in):
    :func:`dump_config` writes it back, and loading that file gives the same config.
    """

    name: str
    description: str
    problems: tuple[ProblemCase, ...]
    arms: tuple[Arm, ...]
    run: RunSettings
    skip_incompatible: bool
    claims: Mapping[str, Any]
    source: str
    data: Mapping[str, Any]
    profile: str | None = None

    @property
    def fingerprint(self) -> str:
        """A short hash of everything that determines the runs (not name, description, claims)."""
        return _hash(
            {
                "problems": [p.spec for p in self.problems],
                "arms": [(a.method, a.compressor, a.stepsize, a.problems) for a in self.arms],
                "run": _run_identity(self.run),
            }
        )

    def seed_of(self, index: int) -> int:
        """The simulator seed of seed index ``index`` (:func:`derive_seed`)."""
        return derive_seed(self.run.seed, index)


def derive_seed(base: int, index: int) -> int:
    """The seed of the ``index``-th repetition of an experiment with base seed ``base``.

    A function of the base seed and the seed index only (never of a run's position in the
    grid), so adding a method or a compressor to a config leaves the other runs' seeds — and
    results — unchanged, and all arms of one seed index share their random draws where they
    coincide (common random numbers). Seed index 0 of base seed 0 is seed 0.
    """
    if base == 0 and index == 0:
        return 0
    digest = hashlib.sha256(f"shrinkgrad-seed:{base}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _run_identity(run: RunSettings) -> dict[str, Any]:
    """The ``[run]`` settings that determine the runs (``network`` only when given, so that the
    fingerprints of configs without one are those of earlier versions)."""
    out = dataclasses.asdict(run)
    if not run.network:
        del out["network"]
    return out


def _hash(obj: Any) -> str:
    import json

    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def load_config(
    path: str | os.PathLike[str],
    *,
    profile: str | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """Read and validate a TOML config file.

    ``profile`` merges the file's ``[profiles.<profile>]`` table over it (``"quick"`` for the
    reproductions' ``--quick``); ``overrides`` are dotted assignments applied last, either
    strings ``"run.rounds=50"`` (values in TOML syntax, bare words as strings) or a mapping
    ``{"run.rounds": 50}``. Raises :class:`ConfigError` naming the file and key of any problem.
    """
    p = Path(path)
    source = str(path)
    if not p.exists():
        raise ConfigError(source, "", "no such config file")
    if p.is_dir():
        raise ConfigError(source, "", "is a directory; give a .toml config file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(source, "", f"cannot read it ({e})") from None
    return loads_config(text, source=source, profile=profile, overrides=overrides)


def loads_config(
    text: str,
    *,
    source: str = "<config>",
    profile: str | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """:func:`load_config` for TOML text (``source`` names it in error messages)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, "", f"invalid TOML: {e}") from None
    return parse_config(data, source=source, profile=profile, overrides=overrides)


def parse_config(
    data: Mapping[str, Any],
    *,
    source: str = "<config>",
    profile: str | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """Validate a config given as a parsed TOML document (a nested dict)."""
    doc = copy.deepcopy(dict(data))
    profiles = doc.pop("profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(v, dict) for v in profiles.values()):
        raise ConfigError(source, "profiles", "must be a table of tables, e.g. [profiles.quick]")
    if profile is not None:
        if profile not in profiles:
            known = ", ".join(sorted(profiles)) or "none"
            raise ConfigError(
                source,
                f"profiles.{profile}",
                f"this config has no profile {profile!r} (profiles: {known})"
                + _did_you_mean(profile, list(profiles)),
            )
        _check_keys(profiles[profile], source, f"profiles.{profile}", partial=True)
        doc = _merge(doc, profiles[profile])
    origins: list[tuple[str, str]] = []  # (key, how the user wrote it) of every override
    try:
        if overrides:
            if isinstance(overrides, Mapping):
                items = list(overrides.items())
                origins = [(k, f"override {k}={_show(v)}") for k, v in items]
            else:
                texts = list(overrides)
                items = [parse_override(text) for text in texts]
                origins = [
                    (key, f"--set {text.strip()}")
                    for key, text in zip((k for k, _ in items), texts, strict=True)
                ]
            for key, value in items:
                _set_dotted(doc, key, value, source)
        _check_keys(doc, source, "", partial=False)
        cfg = _build(doc, source, profile)
    except ConfigError as e:
        raise _blame_override(e, origins) from None
    # keep the profiles in the resolved document so --quick still works on it
    resolved = _resolved_document(cfg, doc)
    if profiles:
        resolved["profiles"] = profiles
    return dataclasses.replace(cfg, data=resolved)


def _blame_override(error: ConfigError, origins: Sequence[tuple[str, str]]) -> ConfigError:
    """``error`` about a value an override set, re-addressed to the override that set it
    (``--set run.rounds=abc: must be an integer >= 1``); other errors as they are."""
    for key, origin in reversed(origins):  # the last override of a key is the one in effect
        if error.key == key or error.key.startswith((f"{key}.", f"{key}[")):
            return ConfigError(origin, "" if error.key == key else error.key, error.reason)
    return error


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``"run.rounds=50"`` into ``("run.rounds", 50)``.

    The value is read as TOML (``50``, ``1e-3``, ``true``, ``["a", "b"]``, ``"text"``); a value that
    is not valid TOML is taken as a bare string (``grid.methods=ef21`` is not a list, but
    ``problem.dataset=w1a`` works).
    """
    if "=" not in text:
        raise ConfigError(
            "--set",
            text,
            "write an override as KEY=VALUE, e.g. run.rounds=50 or 'grid.methods=[\"ef21\"]'",
        )
    key, _, raw = text.partition("=")
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError("--set", key, "an override key is a dotted name such as run.rounds")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def dump_config(config: ExperimentConfig) -> str:
    """The resolved config as TOML text (loading it gives the same runs)."""
    import tomli_w

    return tomli_w.dumps(_strip_none(dict(config.data)))


# --------------------------------------------------------------------------------------------
# schema
# --------------------------------------------------------------------------------------------
#: top-level keys and what they are (for messages and did-you-mean)
TOP_KEYS: dict[str, str] = {
    "name": "string",
    "description": "string",
    "problem": "string, list of strings, or table",
    "run": "table",
    "grid": "table",
    "pairs": "array of tables [[pairs]]",
    "claims": "table (parameters of a reproduction's claims)",
    "profiles": "table of partial configs",
}
RUN_KEYS = {f.name for f in dataclasses.fields(RunSettings)}
GRID_KEYS = {"methods", "compressors", "stepsizes", "skip_incompatible", "problems"}
PAIR_KEYS = {
    "method",
    "compressor",
    "stepsize",
    "methods",
    "compressors",
    "stepsizes",
    "problems",
}
PROBLEM_SPECIAL = {"name", "sweep", "cases"}


def _check_keys(doc: Mapping[str, Any], source: str, prefix: str, *, partial: bool) -> None:
    """Unknown keys at the levels the schema fixes (the problem's parameters are checked later)."""

    def unknown(key: str, where: str, allowed: Sequence[str]) -> ConfigError:
        full = f"{where}.{key}" if where else key
        return ConfigError(
            source,
            full,
            f"unknown key; allowed here: {', '.join(sorted(allowed))}"
            + _did_you_mean(key, list(allowed)),
        )

    base = f"{prefix}." if prefix else ""
    for key, value in doc.items():
        if key not in TOP_KEYS:
            raise unknown(key, prefix, list(TOP_KEYS))
        if key == "profiles" and partial:
            raise ConfigError(source, base + key, "a profile cannot define profiles")
        if key == "run" and isinstance(value, dict):
            for k in value:
                if k not in RUN_KEYS:
                    raise unknown(k, base + "run", sorted(RUN_KEYS))
        if key == "grid" and isinstance(value, dict):
            for k in value:
                if k not in GRID_KEYS:
                    raise unknown(k, base + "grid", sorted(GRID_KEYS))
        if key == "pairs" and isinstance(value, list):
            for i, pair in enumerate(value):
                if isinstance(pair, dict):
                    for k in pair:
                        if k not in PAIR_KEYS:
                            raise unknown(k, f"{base}pairs[{i}]", sorted(PAIR_KEYS))


def _build(doc: dict[str, Any], source: str, profile: str | None) -> ExperimentConfig:
    name = doc.get("name", "")
    if not isinstance(name, str):
        raise ConfigError(source, "name", f"must be a string, got {_show(name)}")
    _check_name(name, source)
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(source, "description", f"must be a string, got {_show(description)}")
    if "problem" not in doc:
        raise ConfigError(
            source,
            "problem",
            "missing: say which problem to solve, e.g. "
            'problem = "logistic_regression[dataset=a9a,n_clients=20]" or a [problem] table',
        )
    problems = _problems(doc["problem"], source)
    run = _run(doc.get("run", {}), source)
    grid = doc.get("grid", {})
    if not isinstance(grid, dict):
        raise ConfigError(source, "grid", f"must be a table [grid], got {_show(grid)}")
    skip = grid.get("skip_incompatible", False)
    if not isinstance(skip, bool):
        raise ConfigError(
            source, "grid.skip_incompatible", f"must be true or false, got {_show(skip)}"
        )
    arms = _arms(doc, source, problems)
    claims = doc.get("claims", {})
    if not isinstance(claims, dict):
        raise ConfigError(source, "claims", f"must be a table [claims], got {_show(claims)}")
    return ExperimentConfig(
        name=name,
        description=description,
        problems=problems,
        arms=arms,
        run=run,
        skip_incompatible=skip,
        claims=claims,
        source=source,
        data={},
        profile=profile,
    )


#: longest experiment name: one directory name (255 bytes on common file systems) with room for
#: the ``-distributed`` / ``-quick`` suffixes of the default output directories
NAME_BYTES = 200


def _check_name(name: str, source: str) -> None:
    """The name is the default output directory ``runs/<name>``: one directory name."""
    bad = [c for c in ("/", "\\", "\0") if c in name]
    if bad or name in (".", ".."):
        what = f"contains {bad[0]!r}" if bad else f"is {name!r}"
        raise ConfigError(
            source,
            "name",
            f"{_show(name)} {what}; the name is the default output directory runs/<name>, one "
            "directory name: use letters, digits, spaces and - _ . (or give --out)",
        )
    if len(name.encode("utf-8")) > NAME_BYTES:
        raise ConfigError(
            source,
            "name",
            f"is {len(name.encode('utf-8'))} bytes long; the name is the default output directory "
            f"runs/<name>, and file systems hold at most 255 bytes per name: keep it <= "
            f"{NAME_BYTES} bytes",
        )


# -- problems --------------------------------------------------------------------------------
def _problems(value: Any, source: str) -> tuple[ProblemCase, ...]:
    if isinstance(value, str):
        return (_problem_from_spec(value, source, "problem"),)
    if isinstance(value, list):
        if not value:
            raise ConfigError(source, "problem", "the list of problems is empty")
        cases = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(
                    source, f"problem[{i}]", f"must be a problem spec string, got {_show(item)}"
                )
            cases.append(_problem_from_spec(item, source, f"problem[{i}]"))
        return _unique_problems(_label_cases(cases), source)
    if not isinstance(value, dict):
        raise ConfigError(
            source,
            "problem",
            f"must be a spec string, a list of them or a table, got {_show(value)}",
        )
    name = value.get("name")
    cases_given = value.get("cases")
    names_in_cases = isinstance(cases_given, list) and all(
        isinstance(c, dict) and "name" in c for c in cases_given
    )
    if not isinstance(name, str) and not (name is None and names_in_cases and cases_given):
        raise ConfigError(
            source,
            "problem.name",
            'missing or not a string: the problem family, e.g. name = "logistic_regression" '
            f"(or a name in every [[problem.cases]]; {_registered('problems')})",
        )
    fixed = {k: v for k, v in value.items() if k not in PROBLEM_SPECIAL}
    sweep = value.get("sweep", {})
    if not isinstance(sweep, dict):
        raise ConfigError(source, "problem.sweep", f"must be a table of lists, got {_show(sweep)}")
    for k, v in sweep.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(
                source, f"problem.sweep.{k}", f"must be a non-empty list of values, got {_show(v)}"
            )
        if k in fixed:
            raise ConfigError(
                source, f"problem.sweep.{k}", f"{k!r} is also fixed in [problem]; keep one"
            )
    cases_raw = value.get("cases", [{}])
    if not isinstance(cases_raw, list) or not all(isinstance(c, dict) for c in cases_raw):
        raise ConfigError(source, "problem.cases", "must be an array of tables ([[problem.cases]])")
    if not cases_raw:
        cases_raw = [{}]
    keys = list(sweep)
    out: list[ProblemCase] = []
    for ci, case in enumerate(cases_raw):
        case = dict(case)
        given_label = case.pop("label", None)
        case_name = case.pop("name", name)
        if not isinstance(case_name, str):
            raise ConfigError(
                source, f"problem.cases[{ci}].name", f"must be a string, got {_show(case_name)}"
            )
        if given_label is not None and not isinstance(given_label, str):
            raise ConfigError(
                source, f"problem.cases[{ci}].label", f"must be a string, got {_show(given_label)}"
            )
        for k in case:
            if k in sweep:
                raise ConfigError(
                    source, f"problem.cases[{ci}].{k}", f"{k!r} is also swept in [problem.sweep]"
                )
        for combo in itertools.product(*(sweep[k] for k in keys)):
            params = {**fixed, **case, **dict(zip(keys, combo, strict=True))}
            where = f"problem.cases[{ci}]" if "cases" in value else "problem"
            varying = {**case, **dict(zip(keys, combo, strict=True))}
            made = _problem_from_table(case_name, params, varying, source, where, keys)
            if given_label is not None:
                swept = ",".join(f"{k}={_label_value(v)}" for k, v in zip(keys, combo, strict=True))
                made = dataclasses.replace(
                    made, label=given_label + (f",{swept}" if swept else ""), case=given_label
                )
            out.append(made)
    if len(out) == 1 and not out[0].label:
        out[0] = dataclasses.replace(out[0], label=out[0].spec)
    return _unique_problems(out, source)


def _problem_from_table(
    name: str,
    params: dict[str, Any],
    varying: dict[str, Any],
    source: str,
    where: str,
    swept: Sequence[str] = (),
) -> ProblemCase:
    from ..problems import PROBLEMS

    try:
        entry = PROBLEMS.entry(name)
    except SpecError as e:
        raise ConfigError(source, f"{where}.name", str(e)) from None
    allowed = {p.name: p for p in entry.keyword}
    for k, v in params.items():
        if k not in allowed:
            raise ConfigError(
                source,
                f"{where}.{k}",
                f"problem {name!r} has no parameter {k!r}; parameters: {', '.join(allowed)}"
                + _did_you_mean(k, list(allowed)),
            )
        key = f"problem.sweep.{k}" if k in swept else f"{where}.{k}"
        _check_param(entry.hints.get(k), v, source, key, f"problem {name!r}")
        if k == "dataset" and isinstance(v, str):
            _check_dataset(v, source, key)
    for p in entry.keyword:
        if p.default is p.empty and p.name not in params:
            raise ConfigError(source, where, f"problem {name!r} needs the parameter {p.name!r}")
    order = [p.name for p in entry.keyword if p.name in params]
    spec = str(Spec(name, tuple((k, _spec_value(params[k])) for k in order)))
    label = ",".join(f"{k}={_label_value(varying[k])}" for k in order if k in varying)
    return ProblemCase(spec, label, tuple((k, params[k]) for k in order), where)


def _check_dataset(value: str, source: str, key: str) -> None:
    """A dataset is a bundled name or an existing LIBSVM file (relative to the working dir)."""
    from ..problems.datasets import available

    names = available()
    if value in names or Path(value).expanduser().is_file():
        return
    raise ConfigError(
        source,
        key,
        f"unknown dataset {value!r}: not a bundled name ({', '.join(names)}) and no such file "
        "(paths are relative to the working directory)" + _did_you_mean(value, names),
    )


def _problem_from_spec(text: str, source: str, where: str) -> ProblemCase:
    try:
        parsed = parse_spec(text)
    except SpecError as e:
        raise ConfigError(source, where, str(e)) from None
    case = _problem_from_table(parsed.name, dict(parsed.params), {}, source, where)
    return dataclasses.replace(case, label=case.spec)


def _label_cases(cases: list[ProblemCase]) -> list[ProblemCase]:
    """Label each spec-string problem by the parameters in which it differs from the others."""
    if len(cases) < 2:
        return cases
    keys = sorted({k for c in cases for k, _ in c.params})
    out = []
    for c in cases:
        params = dict(c.params)
        diff = [
            k for k in keys if len({repr(dict(o.params).get(k)) for o in cases}) > 1 and k in params
        ]
        label = ",".join(f"{k}={_label_value(params[k])}" for k in diff)
        name = parse_spec(c.spec).name
        if len({parse_spec(o.spec).name for o in cases}) > 1:
            label = f"{name}[{label}]" if label else name
        out.append(dataclasses.replace(c, label=label or c.spec))
    return out


def _unique_problems(cases: list[ProblemCase], source: str) -> tuple[ProblemCase, ...]:
    seen: dict[str, int] = {}
    labels: dict[str, int] = {}
    for i, c in enumerate(cases):
        if c.spec in seen:
            raise ConfigError(
                source,
                "problem",
                f"the problem {c.spec} appears twice (cases {seen[c.spec]} and {i})",
            )
        if c.label in labels:
            raise ConfigError(
                source,
                c.key,
                f"two problems have the label {c.label!r}; give the cases distinct labels",
            )
        seen[c.spec] = i
        labels[c.label] = i
    return tuple(cases)


def _check_param(hint: Any, value: Any, source: str, key: str, what: str) -> None:
    if isinstance(value, dict):
        raise ConfigError(source, key, f"must be a value, got a table {_show(value)}")
    if isinstance(value, list):
        # a sequence parameter (explicit L_i, explicit split parts) or a mistaken sweep
        return
    try:
        coerce_value(value, hint, f"{what} parameter {key.rsplit('.', 1)[-1]!r}", None)
    except SpecError as e:
        raise ConfigError(source, key, str(e)) from None


def _spec_value(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return parse_spec(v) if re.search(r"[\[\(]", v) else v
        except SpecError:
            return v
    return v


def _label_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# -- run settings ----------------------------------------------------------------------------
def _run(value: Any, source: str) -> RunSettings:
    if not isinstance(value, dict):
        raise ConfigError(source, "run", f"must be a table [run], got {_show(value)}")
    d = RunSettings()
    kw: dict[str, Any] = {}

    def integer(key: str, low: int) -> None:
        if key in value:
            v = value[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(
                    source, f"run.{key}", f"must be an integer >= {low}, got {_show(v)}"
                )
            kw[key] = v

    def number(key: str, *, positive: bool) -> None:
        if key in value:
            v = value[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(source, f"run.{key}", f"must be a finite number, got {_show(v)}")
            if positive and v <= 0:
                raise ConfigError(source, f"run.{key}", f"must be > 0, got {_show(v)}")
            kw[key] = float(v)

    integer("rounds", 1)
    integer("log_every", 1)
    integer("seed", 0)
    integer("checkpoint_every", 1)
    number("tol", positive=False)
    number("tol_rel", positive=True)
    if "tol" in kw and kw["tol"] < 0:
        raise ConfigError(source, "run.tol", f"must be >= 0, got {_show(value['tol'])}")
    if "tol" in kw and "tol_rel" in kw:
        raise ConfigError(source, "run.tol_rel", "give tol (absolute) or tol_rel, not both")
    if "divergence_factor" in value:
        v = value["divergence_factor"]
        if v is False or (isinstance(v, str) and v == "off"):
            kw["divergence_factor"] = None
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 1:
            raise ConfigError(
                source, "run.divergence_factor", f"must be a number > 1 or false, got {_show(v)}"
            )
        else:
            kw["divergence_factor"] = float(v)
    for key in ("dtype", "wire_dtype"):
        if key in value:
            v = value[key]
            allowed = (
                ("float32", "float64")
                if key == "dtype"
                else ("float16", "bfloat16", "float32", "float64")
            )
            if v not in allowed:
                raise ConfigError(
                    source, f"run.{key}", f"must be one of {', '.join(allowed)}, got {_show(v)}"
                )
            kw[key] = v
    if "network" in value:
        kw["network"] = _networks(value["network"], source)
    if "seeds" in value:
        v = value["seeds"]
        if isinstance(v, int) and not isinstance(v, bool):
            if v < 1:
                raise ConfigError(
                    source, "run.seeds", f"must be >= 1 (the number of seeds), got {v}"
                )
            kw["seeds"] = tuple(range(v))
        elif (
            isinstance(v, list)
            and v
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in v)
        ):
            if len(set(v)) != len(v):
                raise ConfigError(source, "run.seeds", f"has repeated seed indices: {v}")
            kw["seeds"] = tuple(v)
        else:
            raise ConfigError(
                source,
                "run.seeds",
                "must be the number of seeds (e.g. 3 for indices 0, 1, 2) or a non-empty list of "
                f"seed indices >= 0, got {_show(v)}",
            )
    return dataclasses.replace(d, **kw)


# -- arms ------------------------------------------------------------------------------------
def _string_list(value: Any, source: str, key: str, *, numbers: bool = False) -> list[str]:
    items = value if isinstance(value, list) else [value]
    out = []
    for i, v in enumerate(items):
        if numbers and isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(repr(float(v)) if isinstance(v, float) else str(v))
        elif isinstance(v, str):
            out.append(v)
        else:
            what = "a string or a number" if numbers else "a string"
            k = f"{key}[{i}]" if isinstance(value, list) else key
            raise ConfigError(source, k, f"must be {what}, got {_show(v)}")
    if not out:
        raise ConfigError(source, key, "is an empty list")
    return out


def _problem_filter(
    entry: Mapping[str, Any], source: str, key: str, problems: Sequence[ProblemCase]
) -> tuple[str, ...] | None:
    if "problems" not in entry:
        return None
    labels = _string_list(entry["problems"], source, f"{key}.problems")
    known = list(dict.fromkeys([p.label for p in problems] + [p.case for p in problems if p.case]))
    for i, lab in enumerate(labels):
        if lab not in known:
            raise ConfigError(
                source,
                f"{key}.problems[{i}]",
                f"no problem is labelled {lab!r}; labels: {', '.join(known)}"
                + _did_you_mean(lab, known),
            )
    return tuple(labels)


def _arms(doc: dict[str, Any], source: str, problems: Sequence[ProblemCase]) -> tuple[Arm, ...]:
    arms: list[Arm] = []
    grid = doc.get("grid", {})
    if "methods" in grid:
        methods = _methods(
            _string_list(grid["methods"], source, "grid.methods"), source, "grid.methods"
        )
        comps = _compressors(
            _string_list(grid.get("compressors", ["identity"]), source, "grid.compressors"),
            source,
            "grid.compressors",
        )
        steps = _stepsizes(
            _string_list(grid.get("stepsizes", ["theory"]), source, "grid.stepsizes", numbers=True),
            source,
            "grid.stepsizes",
        )
        only = _problem_filter(grid, source, "grid", problems)
        for m, c, s in itertools.product(methods, comps, steps):
            arms.append(Arm(m, c, s, "grid", only))
    elif "compressors" in grid or "stepsizes" in grid:
        raise ConfigError(source, "grid.methods", "missing: a [grid] needs a list of methods")
    pairs = doc.get("pairs", [])
    if not isinstance(pairs, list) or not all(isinstance(p, dict) for p in pairs):
        raise ConfigError(source, "pairs", "must be an array of tables: [[pairs]] method = ...")
    for i, pair in enumerate(pairs):
        where = f"pairs[{i}]"
        for single, plural in (
            ("method", "methods"),
            ("compressor", "compressors"),
            ("stepsize", "stepsizes"),
        ):
            if single in pair and plural in pair:
                raise ConfigError(
                    source, f"{where}.{plural}", f"give {single} or {plural}, not both"
                )
        mkey = "methods" if "methods" in pair else "method"
        if mkey not in pair:
            raise ConfigError(
                source, f"{where}.method", 'missing: which method, e.g. method = "ef21"'
            )
        ckey = "compressors" if "compressors" in pair else "compressor"
        skey = "stepsizes" if "stepsizes" in pair else "stepsize"
        methods = _methods(
            _string_list(pair[mkey], source, f"{where}.{mkey}"), source, f"{where}.{mkey}"
        )
        comps = _compressors(
            _string_list(pair.get(ckey, "identity"), source, f"{where}.{ckey}"),
            source,
            f"{where}.{ckey}",
        )
        steps = _stepsizes(
            _string_list(pair.get(skey, "theory"), source, f"{where}.{skey}", numbers=True),
            source,
            f"{where}.{skey}",
        )
        only = _problem_filter(pair, source, where, problems)
        for m, c, s in itertools.product(methods, comps, steps):
            arms.append(Arm(m, c, s, where, only))
    if not arms:
        raise ConfigError(
            source,
            "grid",
            "no runs: give a [grid] with methods = [...] (and compressors, stepsizes) or "
            "[[pairs]] entries",
        )
    seen: dict[tuple[str, str, str], list[Arm]] = {}
    for a in arms:
        key = (a.method, a.compressor, a.stepsize)
        for b in seen.get(key, []):
            if a.problems is None or b.problems is None or set(a.problems) & set(b.problems):
                raise ConfigError(
                    source,
                    a.origin,
                    f"{a.label} is given twice ({b.origin} and {a.origin}) for the same "
                    "problem(s); remove one",
                )
        seen.setdefault(key, []).append(a)
    return tuple(arms)


def _methods(names: list[str], source: str, key: str) -> list[str]:
    from ..methods import make_method

    out = []
    for i, n in enumerate(names):
        try:
            out.append(make_method(n).name)
        except (SpecError, ValueError, TypeError) as e:
            raise ConfigError(source, f"{key}[{i}]" if len(names) > 1 else key, str(e)) from None
    return out


def _compressors(names: list[str], source: str, key: str) -> list[str]:
    from ..compressors import make_compressor

    out = []
    for i, n in enumerate(names):
        try:
            out.append(make_compressor(n).name)
        except (SpecError, ValueError, TypeError) as e:
            raise ConfigError(source, f"{key}[{i}]" if len(names) > 1 else key, str(e)) from None
    return out


def _stepsizes(specs: list[str], source: str, key: str) -> list[str]:
    out = []
    for i, s in enumerate(specs):
        try:
            out.append(_check_stepsize(s))
        except (SpecError, ValueError, TypeError) as e:
            raise ConfigError(source, f"{key}[{i}]" if len(specs) > 1 else key, str(e)) from None
    return out


# --------------------------------------------------------------------------------------------
# step sizes
# --------------------------------------------------------------------------------------------
def _networks(v: Any, source: str) -> tuple[str, ...]:
    """``run.network``: one network spec or a non-empty list of them, each checked now."""
    from ..network import network_of

    specs = [v] if isinstance(v, str) else v
    form = (
        'a network spec such as "star[up=10mbit,down=100mbit,latency=20ms]" or a list of '
        "them (one sweep axis)"
    )
    if not isinstance(specs, list) or not specs or not all(isinstance(x, str) for x in specs):
        raise ConfigError(source, "run.network", f"must be {form}, got {_show(v)}")
    if len(set(specs)) != len(specs):
        raise ConfigError(source, "run.network", f"has repeated networks: {_show(v)}")
    for spec in specs:
        try:
            network_of(spec, "network")
        except ValueError as e:
            raise ConfigError(source, "run.network", str(e)) from None
    return tuple(specs)


def _check_stepsize(text: str) -> str:
    """Validate a step-size spec (:func:`shrinkgrad.methods.parse_stepsize`, the one grammar)
    and return it in canonical form; a plain number is kept as written (it is part of run ids)."""
    from ..methods import parse_stepsize

    s = parse_stepsize(text)
    plain = not s.theory and s.of is None and s.over is None
    return text.strip() if plain else str(s)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _resolved_document(cfg: ExperimentConfig, doc: dict[str, Any]) -> dict[str, Any]:
    """The TOML document of ``cfg`` with defaults filled in (problems as explicit specs)."""
    run = {k: v for k, v in dataclasses.asdict(cfg.run).items()}
    run["seeds"] = list(cfg.run.seeds)
    if cfg.run.network:
        run["network"] = list(cfg.run.network)
    else:
        del run["network"]
    if run["divergence_factor"] is None:
        run["divergence_factor"] = False
    out: dict[str, Any] = {}
    if cfg.name:
        out["name"] = cfg.name
    if cfg.description:
        out["description"] = cfg.description
    out["problem"] = doc["problem"]
    out["run"] = run
    if "grid" in doc:
        out["grid"] = doc["grid"]
    if "pairs" in doc:
        out["pairs"] = doc["pairs"]
    if cfg.claims:
        out["claims"] = dict(cfg.claims)
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _set_dotted(doc: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    node = doc
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            if p == "problem" and isinstance(nxt, str) and i == 0:
                raise ConfigError(
                    source,
                    key,
                    "cannot override a parameter of a problem given as a spec string; write the "
                    "problem as a [problem] table, or override the whole string with problem=...",
                )
            raise ConfigError(source, key, f"{'.'.join(parts[: i + 1])} is not a table")
        node = nxt
    node[parts[-1]] = value


def _strip_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_strip_none(v) for v in obj]
    return obj


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _registered(family: str) -> str:
    from ..problems import PROBLEMS

    return "registered: " + ", ".join(PROBLEMS.names()) if family == "problems" else ""
