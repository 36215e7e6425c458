"""Configuration of a parameter-server run: one validated, frozen value (API, TOML and CLI).

:class:`PSConfig` holds everything a run needs. It is checked completely on construction, so a
user mistake surfaces as one ``ValueError``/``TypeError`` naming the parameter, the allowed range
and the fix, before any process starts. :func:`load_ps_config` reads the TOML format shared with
the experiment configs (docs/experiments.md): ``problem`` and ``[run]`` mean what they mean there,
and a ``[ps]`` table holds the parameter-server settings::

    problem = "logistic_regression[dataset=a1a]"   # n_clients defaults to ps.workers

    [run]
    rounds = 2000          # server updates (the PS's "round" is one applied message)
    log_every = 10
    seed = 0

    [ps]
    workers = 4
    method = "iag"         # any method that runs on a parameter server: dcgd, iag, ef21, ...
    mode = "async"         # or "sync" (the server waits for all workers every round)
    compressor = "qsgd[s=4]"
    stepsize = "theory"    # a number, "theory" or "theory*m"
    tau_max = 6            # bounded staleness (>= workers - 1); omit for unbounded
    speeds = [1, 1, 1, 5]  # relative compute time per gradient
    delay = 0.02           # seconds of compute per gradient at speed 1
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ...methods.base import Method, make_method, methods_for
from ...registry import Spec, parse_spec

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    import tomllib
else:  # pragma: no cover - version dependent
    import tomli as tomllib

__all__ = ["PSConfig", "load_ps_config"]

Mode = Literal["async", "sync"]

#: the compressor a method gets when none is named: one that compresses, of the method's kind
DEFAULT_COMPRESSORS = {
    "unbiased": "qsgd[s=8]",
    "contractive": "scaled(qsgd[s=8])",
    "none": "identity",
}
#: settings that moved into the method's own parameters, and where
_MOVED = {"init": 'the method\'s init parameter, e.g. method = "iag[init=zero]"'}


def _int(value: Any, name: str, low: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {low}, got {value!r}{hint}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}{hint}")
    return int(value)


def _number(value: Any, name: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        cond = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {cond}, got {value!r}")
    return v


@dataclasses.dataclass(frozen=True)
class PSConfig:
    """A parameter-server run: W worker processes (one client each) and one server process.

    Parameters (docs/parameter_server.md has the full story)
    ---------------------------------------------------------
    problem:
        a problem spec (``logistic_regression[dataset=a1a]``); ``n_clients`` defaults to
        ``workers`` and must equal it when given (worker i holds client i's data).
    workers:
        W, the number of worker processes (>= 1).
    method:
        a method of the registry that runs on a parameter server (``Method.unsupported("ps")``
        is None; ``shrinkgrad.methods.methods_for("ps")``): ``iag`` (compressed IAG, [K18]: the
        server keeps the latest compressed gradient of every worker and steps with their
        average; the default), ``dcgd`` (asynchronous DCGD: the server steps with each message,
        weighted 1/n, as it arrives), the EF21 family (``ef21``, ``ef21_w``, ``ef21_sgd``, ...:
        c_i = C(∇f_i(x^v) − g_i) computed at a stale x^v; numeric steps only with W > 1, no
        theory covers EF21 with stale messages). Parameters go in the spec
        (``iag[init=zero]``).
    mode:
        ``"async"`` (apply on arrival) or ``"sync"`` (every round the server waits for all
        live workers and applies the method's synchronous round: the baseline; not for the
        incremental iag).
    compressor:
        a compressor spec the method accepts; default (None): ``qsgd[s=8]`` for the methods
        that need an unbiased compressor ([K18] Def. 1), ``scaled(qsgd[s=8])`` for the
        contractive ones (EF21).
    stepsize:
        a number, ``"theory"`` or ``"theory*m"``, resolved by the method's ``bind``
        (:class:`~shrinkgrad.methods.asynchronous.Asynchronous`). Async: the method's
        asynchronous rule at the delay bound τ; for dcgd and iag min{DCGD rule, 0.99 × the
        delay rule 2/[L(1 + √(1 + 8τ(τ+1)))]} with τ = ``tau_max`` for dcgd, ``2·tau_max`` for
        methods whose server keeps a per-worker memory (iag: table entries age up to twice the
        arrival staleness), or ``assume_tau``. Sync: the method's own rule.
    tau_max:
        bound on the staleness of every applied message (server version − version the message
        was computed at); the server holds a message (its worker waits for a fresh model) while
        applying it would make another worker's computation too stale. ``None``: unbounded.
        Must be >= W − 1 (W workers computing at once on the same model arrive at least W − 1
        updates apart).
    assume_tau:
        the [K18] delay τ that ``stepsize="theory"`` assumes when ``tau_max`` is not set (for
        example the maximal delay measured by a pilot run; see benchmarks/ps.py).
    updates:
        server updates to run (async: applied messages; sync: rounds).
    max_time:
        optional wall-clock budget of the update loop in seconds.
    seed:
        seed of every keyed draw: worker i's k-th message is the method's client step of round
        k for client i (compressor key (seed, "compressor", i, k), minibatch key (seed,
        "minibatch", i, k), ...); its initial message is round 0.
    speeds, delay:
        worker i spends at least ``delay × speeds[i]`` seconds per message (it sleeps for the
        rest after computing): the artificial heterogeneity of the experiments. Speeds without
        a delay change nothing (``shrinkgrad ps`` warns).
    batch_size:
        minibatch size of the gradients the workers' method reads (``None``: full local
        gradients): every exact gradient becomes an estimator of ``batch_size`` samples keyed
        (seed, "minibatch", i, k).
    log_every:
        keep the server's x every ``log_every`` updates; the metrics of these snapshots are
        computed after the run (never during it, so they cannot perturb the schedule).
    dtype, wire_dtype:
        the model's dtype (sent in full, so workers compute at exactly the server's x) and the
        dtype the messages' values travel in (``float32`` default; ``float64`` makes the run
        bit-compatible with the simulator and its replay).
    timeout:
        seconds. The server declares a worker lost when it has computed for longer than this;
        a worker exits when the server is silent for longer than ``2·timeout``; process-group
        rendezvous waits at most this long.
    divergence_factor:
        stop (status ``diverged``) when a decoded message's squared norm exceeds this factor
        times the first one's, or when x stops being finite; the table is cut at the first
        snapshot that the simulator's divergence rule calls diverged
        (:class:`~shrinkgrad.sim.options.Divergence` with this ``grad_factor``: ‖∇f‖², the
        loss, the distance to x*). ``None`` disables the factors.
    snapshot_every, snapshot_seconds:
        with an output directory (``run_ps(..., out=DIR)``), the server snapshots its whole
        state there every ``snapshot_every`` updates or ``snapshot_seconds`` seconds, whichever
        comes first (atomically: write, fsync, rename), so that ``resume=True`` continues a run
        whose server was killed; it then loses at most the updates since the last snapshot.
    kill_workers, kill_server_after:
        fault injection for tests and demos: worker i SIGKILLs itself after sending
        ``kill_workers[i]`` messages; the server SIGKILLs itself after that many updates.
    """

    problem: str = "logistic_regression[dataset=a1a]"
    workers: int = 4
    method: str = "iag"
    mode: Mode = "async"
    compressor: str | None = None
    stepsize: float | str = "theory"
    tau_max: int | None = None
    assume_tau: int | None = None
    updates: int = 1000
    max_time: float | None = None
    seed: int = 0
    speeds: tuple[float, ...] | None = None
    delay: float = 0.0
    batch_size: int | None = None
    log_every: int = 10
    dtype: Literal["float64", "float32"] = "float64"
    wire_dtype: Literal["float32", "float64"] = "float32"
    timeout: float = 60.0
    divergence_factor: float | None = 1e8
    snapshot_every: int = 200
    snapshot_seconds: float = 10.0
    kill_workers: Mapping[int, int] = dataclasses.field(default_factory=dict)
    kill_server_after: int | None = None

    def __post_init__(self) -> None:
        """Check every field on its own first, then the combinations: the first real problem
        is the one reported (the step size's delay bound is the method's to check, at bind)."""
        set_ = object.__setattr__
        W = _int(self.workers, "workers (the number of worker processes)", 1)
        method = self.build_method()
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")
        for name in ("problem", "compressor"):
            v = getattr(self, name)
            if v is None and name == "compressor":
                continue  # the method's default (compressor_spec)
            if not isinstance(v, str) or not v.strip():
                raise TypeError(f"{name} must be a spec string such as 'qsgd[s=4]', got {v!r}")
            parse_spec(v)  # a SpecError (ValueError) names the syntax problem
        if isinstance(self.stepsize, bool) or not isinstance(self.stepsize, (int, float, str)):
            raise TypeError(
                f"stepsize must be a number, 'theory' or 'theory*m', got {self.stepsize!r}"
            )
        from ...methods.stepsize import parse_stepsize

        parse_stepsize(self.stepsize)  # the one grammar: a number, "theory" or "theory*m"
        if self.tau_max is not None:
            _int(
                self.tau_max,
                "tau_max",
                max(W - 1, 0),
                f" (with {W} workers computing on the same model, the last of them arrives at "
                f"least {W - 1} updates later; use tau_max >= {W - 1} or leave it unset)",
            )
        if self.assume_tau is not None:
            _int(self.assume_tau, "assume_tau", 0)
        _int(self.updates, "updates (server updates to run)", 1)
        if self.max_time is not None:
            set_(self, "max_time", _number(self.max_time, "max_time (seconds)"))
        _int(self.seed, "seed", 0)
        set_(self, "delay", _number(self.delay, "delay (seconds per gradient)", positive=False))
        if self.speeds is not None:
            if isinstance(self.speeds, (str, bytes)) or not hasattr(self.speeds, "__len__"):
                raise TypeError(
                    f"speeds must be a list of W={W} positive numbers, got {self.speeds!r}"
                )
            speeds = tuple(_number(s, "every entry of speeds") for s in self.speeds)
            if len(speeds) != W:
                raise ValueError(
                    f"speeds needs one entry per worker (workers={W}), got {len(speeds)}: "
                    f"{list(speeds)}"
                )
            set_(self, "speeds", speeds)
        if self.batch_size is not None:
            _int(self.batch_size, "batch_size", 1)
        _int(self.log_every, "log_every", 1)
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be 'float64' or 'float32', got {self.dtype!r}")
        if self.wire_dtype not in ("float32", "float64"):
            raise ValueError(f"wire_dtype must be 'float32' or 'float64', got {self.wire_dtype!r}")
        set_(self, "timeout", _number(self.timeout, "timeout (seconds)"))
        if self.timeout < 1.0:  # the processes' rendezvous alone takes longer
            raise ValueError(
                f"timeout must be at least 1 second (the processes connect within it, and a "
                f"worker silent for longer counts as lost), got {self.timeout:g}"
            )
        if self.divergence_factor is not None:
            f = _number(self.divergence_factor, "divergence_factor")
            if f <= 1:
                raise ValueError(f"divergence_factor must be > 1 or None, got {f}")
            set_(self, "divergence_factor", f)
        _int(self.snapshot_every, "snapshot_every (updates between snapshots)", 1)
        set_(self, "snapshot_seconds", _number(self.snapshot_seconds, "snapshot_seconds"))
        if not isinstance(self.kill_workers, Mapping):
            raise TypeError(
                f"kill_workers must map worker ids to message counts, got {self.kill_workers!r}"
            )
        kills: dict[int, int] = {}
        for k, v in self.kill_workers.items():
            i = int(k) if isinstance(k, str) and k.strip().isdigit() else k
            _int(i, "a kill_workers key (a worker id)", 0)
            if i >= W:
                raise ValueError(f"kill_workers names worker {i}, but the workers are 0..{W - 1}")
            kills[int(i)] = _int(v, f"kill_workers[{i}] (messages before the kill)", 1)
        set_(self, "kill_workers", kills)
        if self.kill_server_after is not None:
            _int(self.kill_server_after, "kill_server_after", 1)
        # -- combinations --
        if self.mode == "sync":
            if method.incremental:
                raise ValueError(
                    f"mode='sync' runs the method's synchronous round on every worker; "
                    f"{method.name} updates one worker per round (incremental): use dcgd or "
                    "ef21 for the synchronous baseline, or mode='async'"
                )
            if self.tau_max is not None:
                raise ValueError("tau_max bounds asynchronous staleness; sync runs have none")
            if self.assume_tau is not None:
                raise ValueError(
                    "assume_tau is the delay assumed by an asynchronous run's theory step; sync "
                    "runs have no delay (drop it, or use mode='async')"
                )
        if self.assume_tau is not None and self.tau_max is not None:
            raise ValueError(
                "give tau_max (an enforced bound: the theory step uses it) or assume_tau "
                "(an assumed delay for an unbounded run), not both"
            )
        self.problem_spec()  # checks n_clients against workers

    @property
    def compressor_spec(self) -> str:
        """The compressor: the one given, or the default for the method's kind."""
        if self.compressor is not None:
            return self.compressor
        return DEFAULT_COMPRESSORS[self.build_method().requires]

    def build_method(self) -> Method[Any, Any]:
        """The method of ``method`` (a registry spec), checked to run on a parameter server."""
        if not isinstance(self.method, str) or not self.method.strip():
            raise TypeError(
                f"method must be a method spec such as 'iag' or 'ef21', got {self.method!r}"
            )
        try:
            method = make_method(self.method)  # a SpecError names unknown methods and parameters
        except ValueError as e:  # ... and the ones that run here are what the user can pick
            if "unknown method" not in str(e):
                raise
            raise type(e)(
                f"{e}; of those, the methods that run on a parameter server: "
                f"{', '.join(methods_for('ps'))}"
            ) from None
        reason = method.unsupported("ps")
        if reason is not None:
            raise ValueError(
                f"method: {reason}; the methods that run on a parameter server: "
                f"{', '.join(methods_for('ps'))}"
            )
        return method

    def __hash__(self) -> int:  # kill_workers is a dict: hash the plain-data form instead
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # -- derived ---------------------------------------------------------------------------------
    def problem_spec(self) -> str:
        """The problem spec with ``n_clients = workers`` (added when absent, checked when given)."""
        spec = parse_spec(self.problem)
        params = dict(spec.params)
        n = params.get("n_clients")
        if n is None:
            params["n_clients"] = self.workers
        elif n != self.workers:
            raise ValueError(
                f"the problem has n_clients={n} but workers={self.workers}: every worker holds one "
                "client's data; make them equal (or drop n_clients from the problem spec)"
            )
        return str(Spec(spec.name, tuple(params.items()), spec.args))

    def worker_delay(self, worker: int) -> float:
        """Seconds worker ``worker`` spends (at least) per gradient: ``delay × speeds[worker]``."""
        speed = 1.0 if self.speeds is None else self.speeds[worker]
        return self.delay * speed

    @property
    def run_method(self) -> str:
        """The ``method`` column of the results: the mode and the method's name, e.g.
        ``async_iag``, ``async_dcgd``, ``sync_dcgd``, ``async_ef21[init=zero]``."""
        return f"{self.mode}_{self.build_method().name}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-friendly): what a result's summary records."""
        out = dataclasses.asdict(self)
        out["speeds"] = None if self.speeds is None else list(self.speeds)
        out["kill_workers"] = {str(k): v for k, v in self.kill_workers.items()}
        return out

    def replace(self, **changes: Any) -> PSConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- construction from plain data -----------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PSConfig:
        """Build from a mapping of field names; unknown keys are errors with a suggestion."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key in _MOVED:
                raise ValueError(f"the parameter-server setting {key!r} is now {_MOVED[key]}")
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"unknown parameter-server setting {key!r}{hint}; known: {', '.join(names)}"
                )
        kwargs = dict(data)
        if kwargs.get("speeds") is not None:
            kwargs["speeds"] = tuple(kwargs["speeds"])
        return cls(**kwargs)


#: keys of the shared ``[run]`` table and the PSConfig field each one sets
_RUN_KEYS = {"rounds": "updates", "log_every": "log_every", "seed": "seed"}


def _problem_from_toml(value: Any, source: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        extra = set(value) & {"sweep", "cases"}
        if extra:
            raise ValueError(
                f"{source}: problem: a parameter-server run takes one problem; "
                f"{', '.join(sorted(extra))} (grids of problems) are for 'shrinkgrad run'"
            )
        params = tuple((k, v) for k, v in value.items() if k != "name")
        return str(Spec(value["name"], params))
    raise TypeError(
        f"{source}: problem must be a spec string or a table with 'name' and the factory's "
        f"parameters, got {value!r}"
    )


def load_ps_config(
    path: str | os.PathLike[str] | None = None,
    *,
    text: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PSConfig:
    """Read a TOML config (see the module docstring) and apply ``overrides`` (field -> value).

    Errors name the file and the key. ``text`` parses a TOML string instead of a file.
    """
    source = str(path) if path is not None else "<config>"
    if text is None:
        if path is None:
            doc: dict[str, Any] = {}
        else:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"config file {source!r} does not exist")
            text = p.read_text(encoding="utf-8")
    if text is not None:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{source}: not valid TOML: {e}") from None
    known = {"problem", "run", "ps", "name", "description"}
    for key in doc:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{source}: unknown top-level key {key!r}{hint}; a parameter-server config has "
                "problem, [run] (rounds, log_every, seed) and [ps]"
            )
    data: dict[str, Any] = {}
    if "problem" in doc:
        data["problem"] = _problem_from_toml(doc["problem"], source)
    run = doc.get("run", {})
    if not isinstance(run, Mapping):
        raise TypeError(f"{source}: [run] must be a table")
    for key, value in run.items():
        if key not in _RUN_KEYS:
            raise ValueError(
                f"{source}: run.{key} is not used by a parameter-server run (it reads "
                f"{', '.join(sorted(_RUN_KEYS))}; rounds = server updates)"
            )
        data[_RUN_KEYS[key]] = value
    ps = doc.get("ps", {})
    if not isinstance(ps, Mapping):
        raise TypeError(f"{source}: [ps] must be a table")
    for key, value in ps.items():
        if key in _RUN_KEYS.values() and key in data:
            raise ValueError(f"{source}: ps.{key} repeats a [run] setting; keep one")
        data[key] = value
    if overrides:
        data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return PSConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{source}: {e}") from None
