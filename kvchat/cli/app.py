"""The `kvchat` Typer app: kvchat's errors as one red paragraph (exit 2), Ctrl-C as exit 130,
never a traceback (an unexpected error too, unless $KVCHAT_TRACEBACK asks for one); the commands
register themselves on `app` from their own modules."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from kvchat import __version__
from kvchat.errors import KvchatError

ERROR_EXIT_CODE = 2
INTERRUPT_EXIT_CODE = 130
CLOSED_PIPE_EXIT_CODE = 141  # 128 + SIGPIPE: what a shell tool whose reader went away returns
TRACEBACK_ENV = "KVCHAT_TRACEBACK"  # set: an unexpected error shows its traceback


def stdout() -> Console:
    # Built per call so the console follows whatever sys.stdout is now (test runners swap it).
    return Console()


def stderr() -> Console:
    return Console(stderr=True)


class _KvchatGroup(TyperGroup):
    """Reports kvchat's own errors as one red paragraph and exit code 2, never a traceback;
    its commands' help shows no type for on/off flags."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _untyped_flags(command, ctx)
        return command

    def get_params(self, ctx: Any) -> Any:
        params = super().get_params(ctx)
        _untyped_flags(self, ctx, params)
        return params

    # Any: typer vendors its own click, whose Context type it does not export.
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KvchatError as error:
            _report_error(error)
            raise typer.Exit(ERROR_EXIT_CODE) from None
        except KeyboardInterrupt:
            _report_interrupt()
            raise typer.Exit(INTERRUPT_EXIT_CODE) from None
        except BrokenPipeError:
            # the reader went away (`kvchat ... | head`): stop quietly, as shell tools do, and
            # leave nothing for Python to fail flushing at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            raise typer.Exit(CLOSED_PIPE_EXIT_CODE) from None
        except Exception as error:
            # Exit, Abort and click's usage errors (they carry an exit code) are click's own
            if isinstance(error, (typer.Exit, typer.Abort)) or hasattr(error, "exit_code") \
                    or os.environ.get(TRACEBACK_ENV):
                raise
            _report_unexpected(error)
            raise typer.Exit(ERROR_EXIT_CODE) from None


def _untyped_flags(command: Any, ctx: Any, params: Any = None) -> None:
    """Typer's help gives every option a type column, `--json <bool>` for a flag that takes no
    value; an empty metavar leaves it blank (click's own help never shows a flag's metavar)."""
    own = [*command.params, command.get_help_option(ctx)] if params is None else params
    for param in own:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _untyped_flags(sub, ctx)


def _report_error(error: KvchatError) -> None:
    stderr().print(f"[bold red]Error:[/bold red] [red]{escape(str(error))}[/red]")


def _report_unexpected(error: Exception) -> None:
    text = str(error).strip()
    detail = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    stderr().print(f"[bold red]Error:[/bold red] [red]kvchat stopped on an unexpected error "
                   f"({escape(detail)}). This is a bug in kvchat, or a model it cannot run; run "
                   f"the command again with {TRACEBACK_ENV}=1 to see where it happened, and "
                   "please report it.[/red]")


def _report_interrupt() -> None:
    stderr().print("[yellow]Interrupted.[/yellow]")


app = typer.Typer(
    name="kvchat",
    cls=_KvchatGroup,
    help="Chat with and batch-run Hugging Face causal language models through a paged KV cache "
    "that is shared across sessions by prefix: a repeated or shared prompt (a system prompt, a "
    "chat template, the history of a conversation) is looked up instead of prefilled again. "
    "Without --model it runs the embedded SmolLM2-135M-Instruct, fully offline.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvchat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Options that apply before any command."""



def main() -> None:
    """Console-script entry point."""
    # Commands report their own errors (see _KvchatGroup); these catch what escapes a command,
    # such as an interrupt while options are parsed.
    try:
        app()
    except KvchatError as error:
        _report_error(error)
        raise SystemExit(ERROR_EXIT_CODE) from None
    except KeyboardInterrupt:
        _report_interrupt()
        raise SystemExit(INTERRUPT_EXIT_CODE) from None


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (timeout, systemd, docker stop, `kvchat stop`) stops the run as Ctrl-C does:
    rows written, cache saved, exit 130; every `finally` runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
