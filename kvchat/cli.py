"""The `kvchat` command line: parse options, call the library, render the result.

Each command is one function below. Options every model-loading command shares are the
`ModelOption`, `DtypeOption` and `DeviceOption` aliases, so commands spell them identically.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from kvchat import __version__
from kvchat.errors import KvchatError
from kvchat.models import ModelReport, describe_model

ERROR_EXIT_CODE = 2
INTERRUPT_EXIT_CODE = 130

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Hugging Face Hub id, local model folder or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct).",
        show_default=False,
    ),
]
DtypeOption = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on CPU).",
        show_default=False,
    ),
]
DeviceOption = Annotated[
    str,
    typer.Option("--device", help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N."),
]


def _stdout() -> Console:
    # Built per call so the console follows whatever sys.stdout is now (test runners swap it).
    return Console()


def _stderr() -> Console:
    return Console(stderr=True)


class _KvchatGroup(TyperGroup):
    """Reports kvchat's own errors as one red paragraph and exit code 2, never a traceback."""

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


def _report_error(error: KvchatError) -> None:
    _stderr().print(f"[bold red]Error:[/bold red] [red]{escape(str(error))}[/red]")


def _report_interrupt() -> None:
    _stderr().print("[yellow]Interrupted.[/yellow]")


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


@app.command()
def models(
    model: ModelOption = None,
    dtype: DtypeOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Show which model would load, from where, and what its KV cache costs per token."""
    report = describe_model(model, dtype=dtype, device=device)
    _stdout().print(model_table(report))


def model_table(report: ModelReport) -> Table:
    """The `kvchat models` table: a pure function of the report."""
    facts = report.facts
    table = Table(title=report.source.description, box=box.SIMPLE_HEAD, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("Source", report.source.kind)
    if report.source.is_gguf:
        table.add_row("GGUF file", f"{report.source.location} ({_size(report.gguf_bytes)})")
        table.add_row("Converted folder", f"{report.folder} ({_size(report.folder_bytes)})")
    elif report.folder is not None:
        table.add_row("Folder", f"{report.folder} ({_size(report.folder_bytes)})")
    else:
        table.add_row("Hub id", report.source.location)
    table.add_row("Architecture", f"{facts.architecture} ({facts.model_type})")
    n = facts.n_params
    table.add_row("Parameters", "unknown" if n is None else f"{n:,} ({_count(n)})")
    table.add_row("Layers", str(facts.n_layers))
    table.add_row("Attention heads", str(facts.n_heads))
    table.add_row("KV heads", str(facts.n_kv_heads))
    table.add_row("Head dim", str(facts.head_dim))
    context = "unknown" if facts.max_context is None else f"{facts.max_context:,} tokens"
    table.add_row("Max context", context)
    table.add_row("Vocab size", f"{facts.vocab_size:,}")
    table.add_row("Dtype", f"{report.dtype} on {report.device}")
    per_token = facts.kv_bytes_per_token(report.dtype)
    table.add_row("KV bytes per token", f"{per_token:,}")
    # 1k tokens of B bytes each take B KB.
    table.add_row("KV per 1k tokens", f"{per_token:,} KB ({per_token * 1000 / 2**20:,.1f} MiB)")
    return table


def _size(n_bytes: int | None) -> str:
    if n_bytes is None:
        return "size unknown"
    if n_bytes < 1024:
        return f"{n_bytes} B"
    size, unit = float(n_bytes) / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:,.1f} {unit}"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


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
