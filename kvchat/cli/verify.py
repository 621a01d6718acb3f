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
    fidelity: Annotated[
        bool,
        typer.Option("--fidelity", help="Also load the model at float32 and report, per prompt, "
                     "whether kvchat's text equals that model's own transformers `generate` "
                     "(how close the precision comes; reported, never failed)."),
    ] = False,
    *,
    options: LazyRuntimeOptions,
) -> None:
    """Check that cached generation equals cold generation (a radix hit, an exact repeat drafted
    from its reply, and a cold run batched beside other sequences, each against the lone cold
    run), and that the cold run equals transformers' own `generate` on the same model: per
    prompt, the first divergent token and the largest logit difference. Where the forward is
    batch-invariant (CPU, the default) every comparison is bitwise; exit code 1 on any
    difference. Elsewhere a tie within the precision's rounding is reported, not failed."""
    from kvchat.inspect.previews import preview
    from kvchat.text_input import check_text
    from kvchat.ui.verify_view import fidelity_summary, verify_summary, verify_table

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
    from kvchat.engine.verify import Fidelity, check_prompt
    from kvchat.engine.verify import fidelity as fidelity_of
    reference = None
    if fidelity:
        from kvchat.models.loading import load_model

        with console.status("loading the float32 reference…"):
            reference = load_model(options.values.get("model"), "float32", "cpu").model
    rows = []
    close: list[Fidelity] = []
    if not engine.codec.has_template:
        from kvchat.models.chat_template import NO_TEMPLATE

        model = str(options.values.get("model") or "The model")
        console.print(f"[yellow]{escape(model)} {escape(NO_TEMPLATE)}[/yellow]",
                      soft_wrap=True)
    started = time.perf_counter()
    with console.status("verifying…") as status:
        for i, (label, messages) in enumerate(prompts, 1):
            status.update(f"verifying prompt {i}/{len(prompts)}: {escape(label)}")
            ids = engine.codec.encode_chat(messages)
            check = check_prompt(engine, ids, label, max_tokens)
            rows += check.rows
            if reference is not None:
                close.append(fidelity_of(engine, reference, ids, check.cold, label, max_tokens))
    console.print(verify_table(rows))
    console.print(verify_summary(rows))
    if reference is not None:
        console.print(fidelity_summary(close, engine.runner.precision_label))
    elapsed = time.perf_counter() - started
    console.print(f"[dim]{len(prompts)} prompt(s) in {elapsed:.1f} s[/dim]")
    if not all(r.ok for r in rows):
        raise typer.Exit(1)
