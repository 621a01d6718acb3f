"""The `kvchat` command line: parse options, call the library, render the result.

Each command is one function below. The options that say which model to load and how to size
its cache are one family, added to every command that opens a runtime by `@runtime_options()`,
which hands the command one `RuntimeOptions`; each option is declared once, as an alias below.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from kvchat import __version__
from kvchat.config import H2O_COST_NOTE, POLICY_ENV_VAR
from kvchat.errors import KvchatError
from kvchat.models import ModelReport, describe_model

if TYPE_CHECKING:
    from kvchat.config import SamplingParams
    from kvchat.runtime import RuntimeOptions

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
PolicyOption = Annotated[
    str | None,
    typer.Option(
        "--policy",
        help=f"Eviction policy: lru, sink-lru (never evicts a sequence's first block) or h2o "
        f"(evicts the blocks that received the least attention). Default: ${POLICY_ENV_VAR}, "
        f"else lru. Cost of h2o: {H2O_COST_NOTE}",
        show_default=False,
    ),
]
BlockSizeOption = Annotated[
    int, typer.Option("--block-size", help="Tokens per cache block.", min=1, max=4096)
]
CacheMbOption = Annotated[
    float,
    typer.Option("--cache-mb", help="K/V pool budget in MiB, all layers together; allocated once."),
]
PrefillChunkOption = Annotated[
    int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill forward pass.", min=1)
]
SessionsDirOption = Annotated[
    Path,
    typer.Option(
        "--sessions-dir",
        help="Folder for session transcripts, input history and the cache snapshot.",
        file_okay=False,
    ),
]
MaxTokensOption = Annotated[
    int, typer.Option("--max-tokens", help="Most tokens to generate per reply.", min=1)
]

Command = Callable[..., None]


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


_MODEL_FAMILY = (
    _option("model", ModelOption, None),
    _option("dtype", DtypeOption, None),
    _option("device", DeviceOption, "auto"),
)
_CACHE_FAMILY = (
    _option("policy", PolicyOption, None),
    _option("block_size", BlockSizeOption, 16),
    _option("cache_mb", CacheMbOption, 1024.0),
    _option("prefill_chunk", PrefillChunkOption, 512),
)
_SESSIONS_FAMILY = (_option("sessions_dir", SessionsDirOption, Path("sessions")),)


def runtime_options(*, persist: bool = True) -> Callable[[Command], Command]:
    """Add --model, --dtype, --device, --policy, --block-size, --cache-mb, --prefill-chunk and,
    when the command loads and saves the cache snapshot (`persist`), --sessions-dir to a
    command, which receives them as one keyword argument `options: RuntimeOptions`."""
    family = _MODEL_FAMILY + _CACHE_FAMILY + (_SESSIONS_FAMILY if persist else ())
    return _option_family("options", family, functools.partial(_runtime_options, persist=persist))


def _runtime_options(
    *,
    model: str | None,
    dtype: str | None,
    device: str,
    policy: str | None,
    block_size: int,
    cache_mb: float,
    prefill_chunk: int,
    sessions_dir: Path = Path("sessions"),
    persist: bool,
) -> RuntimeOptions:
    """The one place these options become a RuntimeOptions. A bad value (an unknown policy, a
    zero budget) raises a KvchatError naming the option, before anything is loaded."""
    from kvchat.config import CacheConfig
    from kvchat.runtime import RuntimeOptions

    cache = CacheConfig(block_size=block_size, cache_mb=cache_mb, policy=policy)
    return RuntimeOptions(model=model, dtype=dtype, device=device, cache=cache,
                          prefill_chunk=prefill_chunk, sessions_dir=sessions_dir,
                          persist=persist)


def _option_family(
    target: str, family: tuple[inspect.Parameter, ...], build: Callable[..., Any]
) -> Callable[[Command], Command]:
    """A decorator adding `family`'s options to a command's signature, where Typer reads them;
    the command is called with one argument `target`, built from their values by `build`."""
    names = [p.name for p in family]

    def decorate(command: Command) -> Command:
        own = [p for p in inspect.signature(command).parameters.values() if p.name != target]

        @functools.wraps(command)
        def with_family(**values: Any) -> None:
            built = build(**{name: values.pop(name) for name in names})
            command(**values, **{target: built})

        signature = inspect.Signature([*(_evaluated(p, command) for p in own), *family])
        with_family.__signature__ = signature  # type: ignore[attr-defined]
        # Typer resolves annotations from here too: the target's type must not appear in them.
        with_family.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return with_family

    return decorate


def _evaluated(parameter: inspect.Parameter, command: Command) -> inspect.Parameter:
    """`parameter` with its annotation evaluated, as Typer needs it: this module's `from
    __future__ import annotations` leaves annotations as strings."""
    if not isinstance(parameter.annotation, str):
        return parameter
    namespace = getattr(command, "__globals__", {})
    return parameter.replace(annotation=eval(parameter.annotation, namespace))  # noqa: S307


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


# ---- chat ----------------------------------------------------------------------------------


@app.command()
@runtime_options()
def chat(
    session: Annotated[
        str | None,
        typer.Option("--session", "-s", help="Session to resume or create (default: a new one).",
                     show_default=False),
    ] = None,
    system: Annotated[
        str | None,
        typer.Option("--system", help="System prompt for this session.", show_default=False),
    ] = None,
    max_tokens: MaxTokensOption = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0 is greedy decoding.", min=0.0)
    ] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 keeps every token.", min=0)] = 0,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Sampling seed.", show_default=False)
    ] = None,
    panels: Annotated[
        str, typer.Option("--panels", help="What to show after each reply: off, compact, full.")
    ] = "full",
    *,
    options: RuntimeOptions,
) -> None:
    """Chat in a REPL; after each reply, panels show what the cache served."""
    from kvchat.config import SamplingParams
    from kvchat.sessions import SessionStore, sessions_lock, validate_name
    from kvchat.ui.views import PANEL_MODES

    name = validate_name(session) if session is not None else None
    if panels not in PANEL_MODES:
        raise KvchatError(f"--panels must be one of {', '.join(PANEL_MODES)}, got {panels!r}.")
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    # The lock comes first: a second chat on the same folder fails before loading a model.
    with sessions_lock(options.sessions_dir, "kvchat chat"):
        store = SessionStore(options.sessions_dir)
        name = name or _new_session_name(store.names())
        _run_chat(options, name, system, params, panels)


def _new_session_name(existing: list[str]) -> str:
    from kvchat.ui.repl import next_session_name

    return next_session_name(existing)


def _run_chat(
    options: RuntimeOptions,
    name: str,
    system: str | None,
    params: SamplingParams,
    panels: str,
) -> None:
    from kvchat.runtime import Runtime
    from kvchat.ui.repl import Chat
    from kvchat.ui.terminal import make_reader

    runtime = Runtime.open(options)
    session = runtime.store.load(name)
    if system is not None:
        session.system = system
    reader = make_reader(runtime.store.history_file())
    Chat(runtime, session, params, _stdout(), reader, panels).run()


# ---- inspect -------------------------------------------------------------------------------


@app.command("inspect")
def inspect_snapshot(
    sessions_dir: SessionsDirOption = Path("sessions"),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (schema in the README) instead of text.")
    ] = False,
    depth: Annotated[
        int | None,
        typer.Option("--depth", help="Tree levels to show (text default: 6; JSON: all).",
                     min=1, show_default=False),
    ] = None,
    session: Annotated[
        str | None,
        typer.Option("--session", "-s", help="Only the branches this session's turns went "
                     "through.", show_default=False),
    ] = None,
) -> None:
    """Show the saved cache (radix tree, exact index, stats) without loading the model."""
    from kvchat.sessions import INDEX, cache_dir, read_snapshot_meta, validate_name
    from kvchat.ui import cache_view as cv
    from kvchat.ui.views import SnapshotFacts, inspect_view

    if session is not None:
        validate_name(session)
    index = cache_dir(sessions_dir) / INDEX
    try:
        info = read_snapshot_meta(sessions_dir)
        if info is None:
            _stderr().print(
                f"No cache snapshot in {escape(str(index.parent))}: `kvchat chat` or `kvchat "
                "batch` writes one there."
            )
            raise typer.Exit(1)
        meta = info.meta
        nodes = cv.nodes_from_meta(meta)
        exact = cv.exact_from_meta(meta)
        stats = cv.stats_from_meta(meta, nodes)
    except (OSError, ValueError) as exc:
        raise KvchatError(
            f"The cache snapshot {index} cannot be read ({exc}). The next `kvchat chat` sets "
            "it aside and starts with an empty cache."
        ) from None
    decode = _snapshot_decoder(meta.get("tokenizer_file"))
    fingerprint = meta.get("fingerprint", {})
    if as_json:
        where = {"path": str(index), "saved_at": meta.get("saved_at"),
                 "model_label": meta.get("model_label"),
                 "tokenizer_file": meta.get("tokenizer_file")}
        doc = cv.inspect_document(fingerprint, where, stats, nodes, exact, decode, depth, session)
        # one line: token lists make an indented dump thousands of lines long
        typer.echo(json.dumps(doc, ensure_ascii=False))
        return
    nodes, exact = cv.for_session(nodes, exact, session)
    facts = SnapshotFacts(
        path=str(index),
        model=str(meta.get("model_label") or fingerprint.get("model", "?")),
        dtype=str(fingerprint.get("dtype", "?")),
        saved_at=meta.get("saved_at"),
    )
    _stdout().print(inspect_view(facts, stats, nodes, exact, decode, depth or 6, 8, session))


def _snapshot_decoder(tokenizer_file: str | None) -> Any:
    """Decode edge previews with the tokenizer file alone (no transformers, no torch); None
    when it is not recorded or no longer there (previews then show token ids)."""
    if not tokenizer_file or not Path(tokenizer_file).is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception:  # a damaged tokenizer file only costs the previews
        return None

    def decode(ids: Any) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


# ---- verify --------------------------------------------------------------------------------

# Varied on purpose: short and long, prose, code, lists, arithmetic, several languages.
VERIFY_PROMPTS = (
    "What is the capital of France?",
    "Write a detailed, step-by-step guide for a beginner who wants to start running: cover "
    "shoes, warming up, how far and how often to run in the first month, how to avoid injury, "
    "and what to eat before and after a run.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "List five fruits that are rich in vitamin C.",
    "What is 17 multiplied by 23? Show your working.",
    "Traduis en français : « The weather is lovely today, let's go for a walk. »",
    "¿Cuáles son los tres colores primarios?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Explain what a hash table is to a ten-year-old.",
    "Write a haiku about a paged key-value cache.",
)


def _read_prompt_file(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """(label, messages) per line of a request file in `kvchat batch`'s format; verify runs each
    line on its own (a "session" does not chain lines here)."""
    from kvchat.batch import LineError, parse_line
    from kvchat.ui.cache_view import preview

    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise KvchatError(f"Cannot read {path}: {exc.strerror or exc}.") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = parse_line(line, number)
        except LineError as exc:
            raise KvchatError(f"{path} line {number}: {exc}.") from None
        system = [{"role": "system", "content": item.system}] if item.system else []
        label = item.id if item.id != f"line-{number}" else preview(item.messages[-1]["content"],
                                                                     18)
        out.append((label, system + item.messages))
    if not out:
        raise KvchatError(f"{path} holds no prompts.")
    return out


@app.command()
@runtime_options(persist=False)
def verify(
    prompt: Annotated[
        str | None,
        typer.Argument(help="One prompt (sent as a user turn). Default: ten built-in prompts.",
                       show_default=False),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help='JSONL file in the format of `kvchat batch` (one '
                     '{"prompt": ...} or {"messages": [...]} per line).', dir_okay=False,
                     show_default=False),
    ] = None,
    max_tokens: MaxTokensOption = 32,
    *,
    options: RuntimeOptions,
) -> None:
    """Check that cached generation equals cold generation: per prompt, the first divergent
    token and the largest logit difference. Exit code 1 if any greedy output differs."""
    from kvchat.ui.cache_view import preview
    from kvchat.ui.views import verify_summary, verify_table

    if prompt is not None and file is not None:
        raise KvchatError("Give a prompt or --file, not both.")
    if file is not None:
        prompts = _read_prompt_file(file)
    else:
        texts = [prompt] if prompt is not None else list(VERIFY_PROMPTS)
        prompts = [(preview(t, 18), [{"role": "user", "content": t}]) for t in texts]

    from kvchat.engine.verify import verify_prompt
    from kvchat.runtime import Runtime

    engine = Runtime.open(options).engine
    rows = []
    console = _stdout()
    started = time.perf_counter()
    with console.status("verifying…") as status:
        for i, (label, messages) in enumerate(prompts, 1):
            status.update(f"verifying prompt {i}/{len(prompts)}: {escape(label)}")
            rows += verify_prompt(engine, engine.codec.encode_chat(messages), label, max_tokens)
    console.print(verify_table(rows))
    console.print(verify_summary(rows))
    elapsed = time.perf_counter() - started
    console.print(f"[dim]{len(prompts)} prompt(s) in {elapsed:.1f} s[/dim]")
    if not all(r.tokens_equal for r in rows):
        raise typer.Exit(1)


# ---- serve ---------------------------------------------------------------------------------


@app.command()
@runtime_options()
def serve(
    host: Annotated[
        str, typer.Option("--host", help="Address to bind. Anything but loopback lets every "
                          "machine that can reach this one use the server (no authentication).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.", min=0, max=65535)] = 8000,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Most requests decoded together in one step.",
                          min=1)
    ] = 8,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Reply length for requests that do not set "
                          "max_tokens.", min=1)
    ] = 256,
    *,
    options: RuntimeOptions,
) -> None:
    """Serve the model over HTTP: /generate, /v1/chat/completions (OpenAI), /cache/stats,
    /cache/tree, /healthz. Stop with Ctrl-C or SIGTERM; the cache snapshot is saved then."""
    import uvicorn

    from kvchat.runtime import Runtime
    from kvchat.server import Server, bind_warning, create_app, log_to_stderr
    from kvchat.sessions import sessions_lock

    warning = bind_warning(host)
    if warning:
        _stderr().print(f"[bold yellow]Warning:[/bold yellow] [yellow]{escape(warning)}[/yellow]")
    with sessions_lock(options.sessions_dir, "kvchat serve"):
        runtime = Runtime.open(options)
        web = create_app(runtime, batch_size=batch_size, max_tokens=max_tokens)
        log_to_stderr()
        try:
            Server(uvicorn.Config(web, host=host, port=port, lifespan="on")).run()
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the Ctrl-C it shut down on; stopping is what it asked for
        finally:
            # the lifespan saved already, unless a second Ctrl-C forced the exit
            web.state.engine.close()


# ---- batch ---------------------------------------------------------------------------------


@app.command()
@runtime_options()
def batch(
    file: Annotated[
        Path, typer.Argument(help="JSONL requests: prompt / messages / OpenAI batch lines.",
                             exists=True, dir_okay=False, readable=True)
    ],
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Where results go (JSONL, input order); '-' or "
                     "nothing: stdout, with progress and summary on stderr.", show_default=False),
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Sequences decoded together.", min=1)
    ] = 8,
    max_tokens: MaxTokensOption = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Default for lines without one; 0 is greedy.",
                            min=0.0)
    ] = 0.0,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Default sampling seed.", show_default=False)
    ] = None,
    fail_fast: Annotated[
        bool, typer.Option("--fail-fast", help="Stop at the first line that fails.")
    ] = False,
    *,
    options: RuntimeOptions,
) -> None:
    """Run a file of requests through the shared cache with batched decoding.

    Lines sharing a "session" chain into one conversation. Bad lines are reported with their
    line numbers and skipped; the exit code is 1 if any line failed. Ctrl-C writes what
    finished and saves the cache.
    """
    import sys

    from kvchat.batch import (
        BatchRun,
        output_line,
        parse_error_line,
        read_batch,
        write_jsonl,
    )
    from kvchat.config import SamplingParams
    from kvchat.runtime import Runtime
    from kvchat.sessions import sessions_lock
    from kvchat.ui.batch_view import batch_progress, progress_rate, summary_table

    items, errors = read_batch(file)
    err = _stderr()
    if not items and not errors:
        raise KvchatError(f"{file} holds no requests: it is empty.")
    for line, message in errors:
        err.print(f"[red]line {line}:[/red] {escape(message)} [dim](skipped)[/dim]")
    if errors and fail_fast:
        raise typer.Exit(1)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed)
    to_stdout = output is None or output == "-"
    ui = err if to_stdout else _stdout()
    interrupted = False
    with sessions_lock(options.sessions_dir, "kvchat batch"):
        runtime = Runtime.open(options)
        if runtime.notice:
            ui.print(f"[yellow]{escape(runtime.notice)}[/yellow]")
        started = time.perf_counter()
        with batch_progress(ui) as progress:
            task = progress.add_task("batch", total=len(items), rate="")

            def update(res: Any) -> None:
                if res.error is not None:
                    progress.console.print(f"[red]line {res.item.line}:[/red] "
                                           f"{escape(res.error)}")
                progress.update(task, completed=run.progress.done,
                                rate=progress_rate(run.progress))

            run = BatchRun(runtime.backend, items, params, batch_size, fail_fast, update)
            try:
                run.run()
            except KeyboardInterrupt:
                run.stop()
                interrupted = True
        results = run.ordered()
        rows = {r.item.line: output_line(r) for r in results}
        rows.update({line: parse_error_line(line, message) for line, message in errors})
        ordered = [rows[k] for k in sorted(rows)]
        if to_stdout:
            write_jsonl(ordered, sys.stdout)
        else:
            assert output is not None
            with open(output, "w", encoding="utf-8") as fh:
                write_jsonl(ordered, fh)
        runtime.save()
        stats = runtime.cache.stats() if runtime.cache is not None else None
        ui.print(summary_table(run.progress, results, len(errors), stats,
                               time.perf_counter() - started))
    if interrupted:
        ui.print(f"[yellow]Interrupted: wrote {len(results)} finished result(s); the cache "
                 "was saved.[/yellow]")
        raise typer.Exit(INTERRUPT_EXIT_CODE)
    if errors or run.progress.failed:
        raise typer.Exit(1)


# ---- bench ---------------------------------------------------------------------------------


def _add_bench() -> None:
    from kvchat.bench.commands import bench_app

    app.add_typer(bench_app, name="bench")


def reflow(text: str) -> str:
    """Each paragraph of a docstring on one line, for Rich to wrap to the terminal's width;
    blank lines stay paragraph breaks. (Typer's rich mode keeps a docstring's hard breaks.)"""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _reflow_help(commands: typer.Typer) -> None:
    for info in commands.registered_commands:
        info.help = reflow(info.help or inspect.getdoc(info.callback) or "")
    for group in commands.registered_groups:
        if group.typer_instance is not None:
            _reflow_help(group.typer_instance)


_add_bench()
_reflow_help(app)


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
