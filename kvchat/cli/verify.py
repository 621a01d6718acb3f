"""`kvchat verify`: cached generation against cold generation, prompt by prompt."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kvchat.cli.app import app, stdout
from kvchat.cli.attach_options import LazyRuntimeOptions, lazy_runtime_options
from kvchat.cli.options import MaxTokensOption
from kvchat.errors import KvchatError

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
    from kvchat.inspect.previews import preview

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
@lazy_runtime_options(persist=False)
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
    options: LazyRuntimeOptions,
) -> None:
    """Check that cached generation equals cold generation, and cold generation equals
    transformers' own `generate` on the same model: per prompt, the first divergent token and
    the largest logit difference. Exit code 1 if any greedy output differs by more than the
    precision's rounding explains (a tie within it is reported, not failed)."""
    from kvchat.inspect.previews import preview
    from kvchat.text_input import check_text
    from kvchat.ui.verify_view import verify_summary, verify_table

    if prompt is not None and file is not None:
        raise KvchatError("Give a prompt or --file, not both.")
    if prompt is not None:
        check_text(prompt, "The prompt", from_os=True)  # before the model loads
    if file is not None:
        prompts = _read_prompt_file(file)
    else:
        texts = [prompt] if prompt is not None else list(VERIFY_PROMPTS)
        prompts = [(preview(t, 18), [{"role": "user", "content": t}]) for t in texts]

    from kvchat.targets.local import open_runtime

    console = stdout()
    engine = open_runtime(options.build, console).engine  # imports torch under its status line
    from kvchat.engine.verify import verify_prompt
    rows = []
    if not engine.codec.has_template:
        from kvchat.models.chat_template import NO_TEMPLATE

        model = str(options.values.get("model") or "The model")
        console.print(f"[yellow]{escape(model)} {escape(NO_TEMPLATE)}[/yellow]",
                      soft_wrap=True)
    started = time.perf_counter()
    with console.status("verifying…") as status:
        for i, (label, messages) in enumerate(prompts, 1):
            status.update(f"verifying prompt {i}/{len(prompts)}: {escape(label)}")
            rows += verify_prompt(engine, engine.codec.encode_chat(messages), label, max_tokens)
    console.print(verify_table(rows))
    console.print(verify_summary(rows))
    elapsed = time.perf_counter() - started
    console.print(f"[dim]{len(prompts)} prompt(s) in {elapsed:.1f} s[/dim]")
    if not all(r.ok for r in rows):
        raise typer.Exit(1)
