"""`kvchat batch`: a request file through the shared cache (see kvchat/batch/).

Nothing finished is lost: rows are written as they finish, Ctrl-C and SIGTERM stop admitting,
give every line its row and save the cache, and `--resume` finishes what a killed run left.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kvchat.batch.order import ORDERS
from kvchat.cli.app import INTERRUPT_EXIT_CODE, app, stderr, stdout, terminate_as_interrupt
from kvchat.cli.attach_options import LazyRuntimeOptions, lazy_runtime_options, where_options
from kvchat.cli.options import SAMPLING_PANEL, WHERE_PANEL, choices
from kvchat.errors import KvchatError

PIPE_EXIT_CODE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away

if TYPE_CHECKING:
    from kvchat.batch import BadLine, BatchItem, ItemResult, LineRun, OutputFile, RowWriter
    from kvchat.cache.stats import CacheStats
    from kvchat.targets import BatchSpec, Target, Where


@dataclass
class _Plan:
    """What to run: the parsed file, the -o file held for this run (None: stdout), and what
    an earlier output already holds."""

    items: list[BatchItem]
    bad: list[BadLine]
    output: OutputFile | None = None
    kept: dict[int, dict[str, Any]] = field(default_factory=dict)
    max_tokens: int = 256  # --max-tokens: for lines that set no max_tokens of their own

    @property
    def to_run(self) -> list[BatchItem]:
        return [i for i in self.items if i.line not in self.kept]

    @property
    def lines(self) -> list[int]:
        return [i.line for i in self.items] + [b.line for b in self.bad]


OrderOption = Annotated[
    str, typer.Option("--order", metavar=choices(ORDERS), rich_help_panel=WHERE_PANEL,
                      help="On a peer: cache-aware (each shared-prefix group's first line alone, "
                      "the rest once the peer has prefilled it) or input (file order).")
]
ConcurrencyOption = Annotated[
    int | None,
    typer.Option("--concurrency", min=1, show_default=False, rich_help_panel=WHERE_PANEL,
                 help="Lines in flight at once on a server (default: llama-server's slots, 4 "
                 "on vLLM or SGLang, twice the batch size on kvchat serve)."),
]
LineMaxTokensOption = Annotated[
    int, typer.Option("--max-tokens", min=1, rich_help_panel=SAMPLING_PANEL,
                      help="Most tokens per reply: a line's own max_tokens wins over this.")
]


@app.command()
@lazy_runtime_options()
@where_options()
def batch(
    file: Annotated[
        Path, typer.Argument(help="JSONL requests: prompt / messages / OpenAI batch lines.",
                             exists=True, dir_okay=False, readable=True)
    ],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Results, one JSON row per line, each written as "
                     "it finishes (in input order at the end). Default or '-': stdout.",
                     show_default=False),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep the finished rows already in --output (their "
                           "input lines must be unchanged) and run only the other lines.")
    ] = False,
    batch_size: Annotated[
        str, typer.Option("--batch-size", help="Rows decoded together: a number, or auto "
                          "(steps measured once per model and machine at the sizes this file "
                          "can use, kept, and bounded by the pool).")
    ] = "auto",
    max_tokens: LineMaxTokensOption = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Default for lines without one; 0 is greedy.",
                            min=0.0, rich_help_panel=SAMPLING_PANEL)
    ] = 0.0,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Default sampling seed.", show_default=False,
                                 rich_help_panel=SAMPLING_PANEL)
    ] = None,
    fail_fast: Annotated[
        bool, typer.Option("--fail-fast", help="Stop at the first line that fails.")
    ] = False,
    pin_system: Annotated[
        bool, typer.Option("--pin-system", help="Pin each distinct system prompt once cached "
                           "(up to --max-pinned of the pool): eviction never takes it.")
    ] = False,
    order: OrderOption = "cache-aware",
    concurrency: ConcurrencyOption = None,
    *,
    options: LazyRuntimeOptions,
    where: Where,
) -> None:
    """Run a file of requests through the shared cache with batched decoding.

    Lines sharing a "session" chain into one conversation. Bad lines are reported with their
    line numbers and skipped; the exit code is 1 if any line failed.

    Every line gets one row with its "line" number, written as soon as it finishes. Ctrl-C or
    SIGTERM writes a row for every line and saves the cache; --resume finishes a killed run.

    While a kvchat server holds the sessions dir (or with --connect), the lines go to it and
    are batched with whatever else it runs. --connect to a peer (another OpenAI-compatible engine)
    (llama-server, vLLM, SGLang) sends them in cache-aware order, --concurrency at a time. A
    line whose reply passes --connect-timeout, --idle-timeout or --request-timeout gets an
    error row saying which, and the rest go on.
    """
    from kvchat.cli.attach_options import choose_target
    from kvchat.config import SamplingParams
    from kvchat.targets import BatchSpec

    spec = BatchSpec(SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                    seed=seed), fail_fast, pin_system,
                     _batch_size_option(batch_size), order, concurrency)
    target = choose_target(options, where)
    to_stdout = output is None or str(output) == "-"
    out_path = None if to_stdout else output
    ui = stderr() if to_stdout else stdout()
    with _held(out_path) as held:  # another run writing the same -o is refused here
        plan = _plan(file, held, resume, ui)
        plan.max_tokens = max_tokens
        if plan.bad and fail_fast:
            raise typer.Exit(1)
        run, interrupted = _run_on(target, plan, spec, out_path, ui)
    _finish_command(run, interrupted, plan, file, out_path, pin_system, ui)


def _run_on(target: Target, plan: _Plan, spec: BatchSpec, out_path: Path | None,
            ui: Console) -> tuple[LineRun, bool]:
    """The plan's lines through the target's runner; a server that goes away mid-run says how
    to finish the other lines."""
    from kvchat.client import ServerGone

    with terminate_as_interrupt(), target.batch(plan.to_run, spec, ui) as runner:
        try:
            return _run(plan, ui, runner.size, runner.start, runner.stats, runner.save)
        except ServerGone as exc:
            again = f"the same command with --resume added (it keeps the finished rows in " \
                    f"{out_path})" if out_path else \
                "the same command with -o FILE (every line runs again, finished ones as hits)"
            raise ServerGone(f"{exc} Every finished line has its row; once the server at "
                             f"{target.label} runs again, finish the others with {again}."
                             ) from None


def _finish_command(run: LineRun, interrupted: bool, plan: _Plan, file: Path,
                    out_path: Path | None, pin_system: bool, ui: Console) -> None:
    """What the run pinned, an interrupted run's paragraph, and the exit code."""
    if pin_system:
        _report_pins(run, ui)
    if interrupted:
        _interrupted(run, plan, file, out_path, ui)
    if plan.bad or run.progress.failed or run.behind():  # a session behind: not a clean run
        raise typer.Exit(1)


def _interrupted(run: LineRun, plan: _Plan, file: Path, out_path: Path | None,
                 ui: Console) -> None:
    done = run.progress.finished + len(plan.kept)
    again = f" To finish the others, run the same command (with its --sessions-dir and other " \
            f"options) with --resume added: it keeps the finished rows in {out_path}." \
        if out_path else ""
    ui.print(f"[yellow]Interrupted: {done} line(s) finished and written; every other line "
             f"has a row saying it did not finish. The cache was saved.{again}[/yellow]",
             soft_wrap=True)
    raise typer.Exit(INTERRUPT_EXIT_CODE)


def _report_pins(run: LineRun, ui: Console) -> None:
    """What --pin-system pinned, and each system prompt it could not."""
    for line in run.pin_errors:
        ui.print(f"[yellow]{escape(line)}[/yellow]", soft_wrap=True)
    n = len(run.pinned)
    ui.print(f"[dim]--pin-system: {n} distinct system prompt(s) pinned[/dim]" if n else
             "[dim]--pin-system: no line had a system prompt to pin[/dim]"
             if not run.pin_errors else "[dim]--pin-system: nothing pinned[/dim]")


@contextlib.contextmanager
def _held(out_path: Path | None) -> Iterator[OutputFile | None]:
    """The -o file, locked for this run (refused while another run writes it) until the run
    ends; None for stdout."""
    from kvchat.batch import OutputFile

    held = OutputFile.hold(out_path) if out_path is not None else None
    try:
        yield held
    finally:
        if held is not None:
            held.close()


def _plan(file: Path, output: OutputFile | None, resume: bool, ui: Console) -> _Plan:
    from kvchat.batch import duplicate_ids, previous_rows, read_batch

    try:
        items, bad = read_batch(file)
    except OSError as exc:
        raise KvchatError(f"Cannot read {file}: {exc.strerror or exc}.") from None
    if not items and not bad:
        raise KvchatError(f"{file} holds no requests: it is empty or holds only blank lines.")
    for line in bad:
        ui.print(f"[red]line {line.line}:[/red] {escape(line.message)} [dim](skipped)[/dim]")
    for request_id, lines in duplicate_ids(items).items():
        ui.print(f"[yellow]id {escape(request_id)!s} is used by lines "
                 f"{', '.join(map(str, lines))}: tell their rows apart by \"line\".[/yellow]")
    plan = _Plan(items, bad, output)
    if resume:
        if output is None:
            raise KvchatError("--resume continues a run that wrote to a file: give that file "
                              "with -o.")
        plan.kept = previous_rows(output.path, items)
        ui.print(f"[dim]resuming: {len(plan.kept)} of {len(items)} line(s) already finished in "
                 f"{escape(str(output.path))}[/dim]")
    return plan


def _batch_size_option(value: str) -> int | None:
    if value.strip().lower() == "auto":
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise KvchatError(f"--batch-size must be a positive number or auto, got {value!r}.")
    return size


def _run(plan: _Plan, ui: Console, batch_size: str | None,
         start: Callable[[Callable[[ItemResult], None]], LineRun],
         stats: Callable[[], CacheStats | None], save: Callable[[], None]
         ) -> tuple[LineRun, bool]:
    """Run the plan (`start(update)` makes the run), writing each row as it finishes; returns
    the run and whether it was interrupted. `save` runs however the run ends."""
    from kvchat.batch import OutputClosed, OutputError, RowWriter, bad_line_row, result_row
    from kvchat.client import ServerGone
    from kvchat.ui.batch_view import (
        batch_progress,
        max_tokens_note,
        progress_rate,
        summary_table,
    )

    writer = RowWriter(plan.lines, plan.output, sys.stdout if plan.output is None else None,
                       keep=plan.kept)
    failure: list[KvchatError] = []
    interrupted = False
    started = time.perf_counter()
    with batch_progress(ui) as progress:
        bad = len(plan.bad)  # counted as failed here as in the summary
        task = progress.add_task("batch", total=len(plan.to_run) + bad, completed=bad,
                                 rate=progress_rate(None, bad))

        def update(res: ItemResult) -> None:
            if res.error is not None and not res.not_started:
                progress.console.print(f"[red]line {res.item.line}:[/red] {escape(res.error)}")
            progress.update(task, completed=run.progress.ended + bad,
                            rate=progress_rate(run.progress, bad))
            try:
                writer.write(res.item.line, result_row(res))
            except OutputError as exc:  # stop between steps; raised once the cache is saved
                failure.append(exc)
                run.stop()

        run = start(update)
        try:
            for line in plan.bad:
                writer.write(line.line, bad_line_row(line))
            run.run()
        except KeyboardInterrupt:
            interrupted = True
        except (OutputError, ServerGone) as exc:
            failure.append(exc)
        finally:
            _finish(run, writer, failure, save)
    if any(isinstance(f, OutputClosed) for f in failure):
        _quiet_exit()  # nobody reads the rows any more: no summary, no error, as Unix tools
    extra = run.summary_rows()
    ui.print(summary_table(run.progress, run.ordered(), len(plan.bad), stats(),
                           time.perf_counter() - started, batch_size,
                           max_tokens_note(plan.max_tokens, [i.max_tokens for i in plan.to_run]),
                           run.behind(), extra, len(plan.to_run) - len(run.results)))
    _report_saves(run, ui)
    if failure:
        raise failure[0]
    return run, interrupted


def _quiet_exit() -> None:
    """Stdout was closed under the run (`| head -1`): the cache is saved already; exit as a
    tool killed by SIGPIPE would, saying nothing, and without a last flush into the pipe."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    raise typer.Exit(PIPE_EXIT_CODE)


def _report_saves(run: LineRun, ui: Console) -> None:
    """Every session save that failed, and which sessions' files are behind the rows."""
    for failed in run.save_errors:
        where = f"line {failed.line}" if failed.line is not None else "at the end of the run"
        ui.print(f"[yellow]{where}: {escape(failed.message)}[/yellow]", soft_wrap=True)
    for name, how in run.behind().items():
        ui.print(f"[yellow]Session {escape(name)} is behind on disk ({escape(how)}): its file "
                 "ends at the last save that worked; every reply is in the output rows."
                 "[/yellow]", soft_wrap=True)


def _finish(run: LineRun, writer: RowWriter, failure: list[KvchatError],
            save: Callable[[], None]) -> None:
    """Every line gets its row, the output is put in input order, sessions behind on disk get
    one more try, the cache is saved."""
    from kvchat.batch import OutputError, result_row

    run.save_behind()
    try:
        for res in run.not_started():
            writer.write(res.item.line, result_row(res))
        writer.close()
    except OutputError as exc:
        failure.append(exc)
    save()

