"""`kvchat chat`: the REPL over a runtime opened under the sessions dir's lock."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from kvchat.cli.app import app, stdout
from kvchat.cli.options import (
    MaxTokensOption,
    runtime_options,
)
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.config import SamplingParams
    from kvchat.runtime import RuntimeOptions


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
    Chat(runtime, session, params, stdout(), reader, panels).run()
