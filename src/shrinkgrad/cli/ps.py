"""``shrinkgrad ps``: run the asynchronous parameter server of [K18] on this machine.

Examples::

    shrinkgrad ps --workers 4 --method iag --compressor "qsgd[s=4]" --tau-max 6 \
        --speeds 1,1,1,5 --delay 0.01 --updates 2000 --out ps-out/
    shrinkgrad ps ps.toml --set ps.tau_max=9 --out ps-out/
    shrinkgrad ps ps.toml --out ps-out/ --resume        # continue after a killed server

One server and W worker processes (forked, gloo on 127.0.0.1). A TOML config uses the format of
the experiment configs (``problem``, ``[run]``) plus a ``[ps]`` table (docs/parameter_server.md);
flags override it. Prints a summary (status, updates per second, the step size and its rule, the
measured staleness and delay, and whether γ satisfies the theory at the measured delay) and,
with ``--out``, writes table.csv, staleness.csv, events.csv, summary.json and staleness.png; the
server snapshots the run into ``--out``'s checkpoint/ as it goes, so ``--resume`` continues it.

Exit status (``results.EXIT_STATUSES``): 0 for ``completed`` and ``time_limit``; 1 for
``diverged`` and ``workers_lost`` (the summary is printed and saved, then one ``error:`` line)
and for a server that died; 2 for a mistake in the command; 130 after Ctrl-C, 143 after SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from typing import TYPE_CHECKING, Any

import click

from . import interrupted_status

if TYPE_CHECKING:
    from ..distributed.ps import PSConfig

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    import tomllib
else:  # pragma: no cover - version dependent
    import tomli as tomllib

__all__ = ["build_config", "ps_cmd"]


def _speeds(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(s) for s in text.replace(" ", "").split(",") if s)
    except ValueError:
        raise ValueError(
            f"--speeds takes comma-separated numbers, one per worker (e.g. 1,1,1,5); got {text!r}"
        ) from None


#: dotted config keys of --set and the PSConfig field they set
_RUN_KEYS = {"run.rounds": "updates", "run.log_every": "log_every", "run.seed": "seed"}


def _set_value(item: str) -> tuple[str, Any]:
    """``ps.tau_max=6`` / ``run.rounds=500`` / ``compressor=qsgd[s=4]`` -> (field, value)."""
    if "=" not in item:
        raise ValueError(f"--set takes KEY=VALUE (e.g. ps.tau_max=6), got {item!r}")
    key, raw = (part.strip() for part in item.split("=", 1))
    key = _RUN_KEYS.get(key, key.removeprefix("ps."))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as qsgd[s=4]
    return key, value


def _rule(s: dict[str, Any]) -> str:
    """The theory's verdict on γ at the measured delay, in words."""
    bound, holds = s["stepsize_bound_measured"], s["rule_holds_at_measured_delay"]
    if holds is None:
        return f"no theory step for {s['method']} at that delay (numeric steps only)"
    verdict = "holds" if holds else "VIOLATED"
    return f"theory at the measured delay: γ ≤ {bound:.6g} ({verdict})"


def _failure(status: str, message: str) -> str:
    """The one ``error:`` line of a run that ended without a result (exit status 1)."""
    if status == "diverged":
        return (
            f"the run diverged ({message}): no result; run again with a smaller --stepsize "
            "(or a bound on the staleness, --tau-max)"
        )
    if status == "workers_lost":
        return f"the run lost its workers ({message}); events.csv says why each was lost"
    return f"the run ended with status {status} ({message})"


def _summary_lines(s: dict[str, Any], out: str | None) -> list[str]:
    lines = [
        f"status: {s['status']} ({s['message']})",
        f"method: {s['method']}  updates: {s['updates']}  wall: {s['wall_s']:.2f} s  "
        f"updates/s: {s['updates_per_s']:.1f}",
        f"stepsize: {s['stepsize']:.6g} ({s['stepsize_rule']}); assumed delay bound: "
        f"{s['tau_bound']}",
        f"measured: staleness max {s['staleness_max']}, [K18] delay max {s['delay_max']}; "
        + _rule(s),
        "mean staleness per worker: "
        + ", ".join(f"{w}: {v:.2f}" for w, v in s["mean_staleness"].items()),
    ]
    first, last = s["grad_norm_sq_first"], s["grad_norm_sq_last"]
    if first is not None and last is not None and math.isfinite(last):
        lines.append(f"grad_norm_sq: {first:.4g} -> {last:.4g}")
    if s["workers_lost"]:
        lines.append(f"workers lost: {s['workers_lost']}")
    lines.extend(s["resumed"])
    if out:
        lines.append(f"results: {out}")
    return lines


def build_config(
    config: str | None, sets: tuple[str, ...], speeds: str | None, flags: dict[str, Any]
) -> PSConfig:
    """The run the command line describes: the config file, then the flags, then ``--set``.

    An invalid value is reported with the option that gave it (``--stepsize 0: the step size
    must be ...``), not as the config file's: see :func:`_blame`.
    """
    from ..distributed.ps import load_ps_config

    overrides: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> the option that set it, as typed
    for key, value in flags.items():
        if value is not None:
            overrides[key] = value
            given[key] = f"--{key.replace('_', '-')} {value}"
    if speeds is not None:
        overrides["speeds"] = _speeds(speeds)
        given["speeds"] = f"--speeds {speeds}"
    for item in sets:
        key, value = _set_value(item)
        overrides[key] = value
        given[key] = f"--set {item}"
    try:
        return load_ps_config(config, overrides=overrides)
    except (TypeError, ValueError) as e:
        blamed = _blame(config, overrides, given, e)
        if blamed is None:
            raise
        raise type(e)(blamed) from None


def _blame(
    config: str | None, overrides: dict[str, Any], given: dict[str, str], error: Exception
) -> str | None:
    """The error's message naming the options that cause it, or None when the config file
    alone does (its message names the file already).

    The options to blame are a smallest set that still gives the same message when every other
    option is left out (options are dropped while the message stays, until none can be): a value
    wrong on its own (``--stepsize 0``) blames its option alone, a combination (``--workers 2
    --tau-max 0``) the options that make it up.
    """
    from ..distributed.ps import load_ps_config

    message = str(error)

    def same_error(keys: list[str]) -> bool:
        try:
            load_ps_config(config, overrides={k: overrides[k] for k in keys})
        except (TypeError, ValueError) as e:
            return str(e) == message
        return False

    keys = list(overrides)
    dropped = True
    while dropped:
        dropped = False
        for key in list(keys):
            rest = [k for k in keys if k != key]
            if same_error(rest):
                keys, dropped = rest, True
    if not keys:
        return None
    prefix = f"{config}: " if config is not None else "<config>: "
    return f"{', '.join(given[k] for k in keys)}: {message.removeprefix(prefix)}"


@click.command("ps")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--problem", help="problem spec, e.g. 'logistic_regression[dataset=a1a]'.")
@click.option("--workers", type=int, help="number of worker processes W (one client each).")
@click.option(
    "--method", help="a method that runs on a parameter server: iag (default), dcgd, ef21, ..."
)
@click.option("--mode", type=click.Choice(["async", "sync"]), help="apply on arrival / rounds.")
@click.option("--compressor", help="compressor spec (default qsgd[s=8]; EF21: scaled(qsgd[s=8])).")
@click.option("--stepsize", help="a number, 'theory' or 'theory*m'.")
@click.option("--tau-max", type=int, help="bound on the staleness (>= W - 1).")
@click.option("--assume-tau", type=int, help="delay the theory step assumes when unbounded.")
@click.option("--updates", type=int, help="server updates to run.")
@click.option("--max-time", type=float, help="wall-clock budget of the update loop (s).")
@click.option("--seed", type=int, help="seed of every keyed draw.")
@click.option("--speeds", help="relative compute time per worker, e.g. 1,1,1,5.")
@click.option("--delay", type=float, help="seconds per gradient at speed 1.")
@click.option("--batch-size", type=int, help="minibatch size (default: full local gradient).")
@click.option("--log-every", type=int, help="snapshot x every N updates.")
@click.option("--wire-dtype", type=click.Choice(["float32", "float64"]))
@click.option("--timeout", type=float, help="seconds before a silent process counts as lost.")
@click.option("--snapshot-every", type=int, help="snapshot the server every N updates (200).")
@click.option("--set", "sets", multiple=True, help="override a config key: ps.tau_max=6.")
@click.option("--out", type=click.Path(file_okay=False), help="directory for the results.")
@click.option("--resume", is_flag=True, help="continue the run in --out from its last snapshot.")
@click.option("--no-plot", is_flag=True, help="skip staleness.png.")
@click.option(
    "--no-progress", is_flag=True, help="no progress lines (shown on a terminal, every 5 s)."
)
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON.")
def ps_cmd(
    config: str | None,
    sets: tuple[str, ...],
    out: str | None,
    no_plot: bool,
    no_progress: bool,
    as_json: bool,
    speeds: str | None,
    resume: bool,
    **flags: Any,
) -> None:
    """Run an asynchronous parameter server: W workers push compressed, stale messages."""
    from ..distributed.ps import PSServerLost, run_ps
    from ..distributed.ps.checkpoint import Checkpoint
    from ..distributed.ps.launch import PROGRESS_EVERY
    from ..distributed.ps.results import exit_status

    cfg = build_config(config, sets, speeds, flags)
    if out:  # the one pre-check of run, train, reproduce and plot: before any process starts
        from ..storage import probe_writable

        probe_writable(out)
    if cfg.speeds is not None and cfg.delay == 0:
        click.echo(
            "warning: speeds without a delay change nothing: a worker spends delay x speed "
            "seconds per message and delay is 0; add e.g. --delay 0.01",
            err=True,
        )
    show = not no_progress and sys.stderr.isatty()
    with contextlib.ExitStack() as stack:
        if out:  # held until the results are saved (another run into out is refused)
            stack.enter_context(Checkpoint(out).hold())
        try:
            result = run_ps(
                cfg, progress_every=PROGRESS_EVERY if show else None, out=out, resume=resume
            )
        except PSServerLost as e:
            hint = f"; continue it with the same command and --resume (--out {out})" if out else ""
            click.echo(f"error: {e}{hint}", err=True)
            raise SystemExit(1) from None
        if out:
            result.save(out, plot=not no_plot)
    summary = result.summary()
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        for line in _summary_lines(summary, out):
            click.echo(line)
    if result.status == "interrupted":
        raise SystemExit(interrupted_status())  # 130 (143 after SIGTERM), after saving
    code = exit_status(result.status)  # diverged, workers_lost: 1 (results.EXIT_STATUSES)
    if code != 0:
        click.echo(f"error: {_failure(result.status, result.message)}", err=True)
        raise SystemExit(code)
