"""`kvchat chat`: its options, then the REPL on the target they choose (`kvchat.targets`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from kvchat.cli.app import app, stdout
from kvchat.cli.attach_options import LazyRuntimeOptions, lazy_runtime_options, where_options
from kvchat.cli.options import SAMPLING_PANEL, MaxTokensOption, choices
from kvchat.errors import KvchatError
from kvchat.ui.views import PANEL_MODES

if TYPE_CHECKING:
    from kvchat.targets import Where


@app.command()
@lazy_runtime_options()
@where_options()
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
        float, typer.Option("--temperature", help="0 is greedy decoding.", min=0.0,
                            rich_help_panel=SAMPLING_PANEL)
    ] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.",
                                         rich_help_panel=SAMPLING_PANEL)] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 keeps every token.", min=0,
                                       rich_help_panel=SAMPLING_PANEL)] = 0,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Sampling seed.", show_default=False,
                                 rich_help_panel=SAMPLING_PANEL)
    ] = None,
    panels: Annotated[
        str, typer.Option("--panels", metavar=choices(PANEL_MODES),
                          help="What to show after each reply.")
    ] = "full",
    *,
    options: LazyRuntimeOptions,
    where: Where,
) -> None:
    """Chat in a REPL; after each reply, panels show what the cache served.

    While a kvchat server holds the sessions dir (or with --connect), the chat attaches to it:
    its cache and sessions, shared with everything else it serves. --connect to a peer (another
    OpenAI-compatible engine: llama-server, vLLM, SGLang) keeps the sessions here and shows
    what the peer reports."""
    from kvchat.chat.repl import Chat
    from kvchat.chat.terminal import make_reader
    from kvchat.cli.attach_options import choose_target
    from kvchat.config import SamplingParams
    from kvchat.sessions import validate_name
    from kvchat.text_input import check_text

    name = validate_name(session) if session is not None else None
    if system is not None:
        check_text(system, "The --system text", from_os=True)
    if panels not in PANEL_MODES:
        raise KvchatError(f"--panels must be one of {', '.join(PANEL_MODES)}, got {panels!r}.")
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    console = stdout()
    with choose_target(options, where).chat(name, system, console) as opened:
        Chat(opened.backend, opened.session, params, console, make_reader(opened.history_file),
             panels).run()
