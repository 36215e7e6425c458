"""The ``shrinkgrad`` command line.

Subcommands live in one module each under :mod:`shrinkgrad.cli` and are imported lazily, so
``shrinkgrad --help`` is fast and a command only pays for what it uses. To add one, write
``cli/<name>.py`` with a click command and add a line to :data:`COMMANDS`.

User mistakes (bad names, bad parameters, missing files) are reported as one ``error:`` line
without a traceback; ``--debug`` (or ``SHRINKGRAD_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

import click

from ..storage import StorageError

__all__ = ["COMMANDS", "Terminated", "exit_interrupted", "interrupted_status", "main"]

#: command name -> ("module:attribute", one-line help shown by ``shrinkgrad --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("shrinkgrad.cli.listing:list_cmd", "List registered components and their maths."),
    "theory": ("shrinkgrad.cli.theory:theory_cmd", "A problem's constants and step sizes."),
    "train": ("shrinkgrad.cli.train:train_cmd", "Run a config's runs on torch.distributed ranks."),
    "run": ("shrinkgrad.cli.run:run_cmd", "Run a grid of simulations from a TOML config."),
    "plot": ("shrinkgrad.cli.plot:plot_cmd", "Plot a results directory (PNG and PDF)."),
    "reproduce": ("shrinkgrad.cli.reproduce:reproduce_cmd", "Reproduce a paper's claims."),
    "ps": ("shrinkgrad.cli.ps:ps_cmd", "Asynchronous parameter server with stale gradients."),
    "estimate": (
        "shrinkgrad.cli.estimate:estimate_cmd",
        "Predicted time to ε on a network (theory rounds × round cost).",
    ),
}


#: key of ``ctx.meta`` holding the subcommand being run, as ``(name, command)``
_SUBCOMMAND = "shrinkgrad.subcommand"


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        target, _ = COMMANDS[cmd_name]
        module, attr = target.split(":")
        cmd = getattr(importlib.import_module(module), attr)
        assert isinstance(cmd, click.Command)
        return cmd

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        if name is not None and cmd is not None:
            ctx.meta[_SUBCOMMAND] = (name, cmd)  # for the usage errors click leaves without one
        return name, cmd, rest

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.UsageError as e:
            # click raises some parse errors of a subcommand's options (a missing value:
            # "Option '--eps' requires an argument") without a context; name the subcommand so
            # that the error points to its help, not the group's
            sub = ctx.meta.get(_SUBCOMMAND)
            if e.ctx is None and sub is not None:
                e.ctx = click.Context(sub[1], info_name=sub[0], parent=ctx)
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_, help_) in sorted(COMMANDS.items())]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shrinkgrad")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """shrinkgrad: communication-compressed distributed optimization.

    Compressors, EF21 / EF21-W and quantized / delayed gradient methods with theory-exact step
    sizes and honest bit counts: simulate, reproduce the papers, train with torch.distributed.
    """
    if debug:
        os.environ["SHRINKGRAD_DEBUG"] = "1"


#: exceptions that mean "the user asked for something impossible"; shown without a traceback
USER_ERRORS: tuple[type[BaseException], ...] = (
    StorageError,  # an --out that cannot be written (read-only, full, in use): says which and why
    ValueError,
    TypeError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


#: click >= 8.2 raises this (a UsageError whose message is the help) for a group given no
#: arguments; older versions print the help and exit 0 themselves
_NO_ARGS_IS_HELP: tuple[type[click.exceptions.UsageError], ...] = tuple(
    c for c in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if c is not None
)


class Terminated(KeyboardInterrupt):
    """SIGTERM to a command (``kill``, ``timeout``, a job scheduler's stop), raised where the
    command is as a KeyboardInterrupt: every command then saves what a Ctrl-C saves (finished
    runs, checkpoints, its worker processes stopped) and exits with 143 instead of 130. Before,
    SIGTERM ended the command at once and left ``train``'s ranks running on, unlocked."""


#: whether this process has received SIGTERM (the exit status of an interrupted command)
_TERMINATED = [False]


def _on_sigterm(signum: int, frame: Any) -> None:
    _TERMINATED[0] = True
    raise Terminated


def _default_sigterm_in_child() -> None:
    """A process forked by a command (a rank, a parameter-server process) keeps SIGTERM's
    default action: its parent stops it with SIGTERM."""
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_child)


def interrupted_status() -> int:
    """The exit status of an interrupted command: 143 after SIGTERM, 130 after Ctrl-C."""
    return 143 if _TERMINATED[0] else 130


def exit_interrupted(word: str) -> NoReturn:
    """Print ``word`` and exit with status 130 after Ctrl-C (143 after SIGTERM); a further
    Ctrl-C while exiting is ignored (it would otherwise end the process by SIGINT, not with the
    status). Commands that catch the interruption themselves call it with their own message
    (``train``)."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing to protect
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo(word, err=True)
    sys.exit(interrupted_status())


def main(argv: list[str] | None = None) -> Any:
    """Entry point of the ``shrinkgrad`` console script. SIGTERM is an interruption, as Ctrl-C
    is (:class:`Terminated`), while the command runs."""
    with _one_line_warnings():
        if threading.current_thread() is not threading.main_thread():
            return _main(argv)  # only the main thread sets handlers: SIGTERM stays as it is
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return _main(argv)
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Show a warning as one ``warning: ...`` line on stderr, each text once, instead of
    Python's two lines with the source file and line (``--debug`` keeps Python's form)."""
    if os.environ.get("SHRINKGRAD_DEBUG"):
        yield
        return
    shown: set[str] = set()

    def show(message: Warning | str, *_: Any, **__: Any) -> None:
        text = str(message)
        if text not in shown:
            shown.add(text)
            click.echo(f"warning: {text}", err=True)

    previous = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def _main(argv: list[str] | None) -> Any:
    try:
        return cli.main(args=argv, prog_name="shrinkgrad", standalone_mode=False)
    except click.exceptions.Abort:
        exit_interrupted("aborted")
    except KeyboardInterrupt:
        exit_interrupted("interrupted")
    except _NO_ARGS_IS_HELP as e:  # bare ``shrinkgrad``: the help alone, as click shows it
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.UsageError as e:  # one line, like every other user mistake
        where = e.ctx.command_path if e.ctx is not None else "shrinkgrad"
        click.echo(f"error: {e.format_message()} (see '{where} --help')", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except USER_ERRORS as e:
        if os.environ.get("SHRINKGRAD_DEBUG"):
            raise
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
