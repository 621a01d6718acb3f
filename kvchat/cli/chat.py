"""`kvchat chat`: the REPL over a runtime opened under the sessions dir's lock."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvchat.cli.app import app, stdout
from kvchat.cli.attach_options import (
    ApiKeyOption,
    ConnectOption,
    LazyRuntimeOptions,
    StandaloneOption,
    TokenOption,
    bounds_options,
    lazy_runtime_options,
)
from kvchat.cli.options import MaxTokensOption
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.client import Attachment
    from kvchat.client.openai_http import OpenAIClient
    from kvchat.client.peers import PeerInfo
    from kvchat.config import Bounds, SamplingParams
    from kvchat.runtime import RuntimeOptions


@app.command()
@lazy_runtime_options()
@bounds_options()
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
    connect: ConnectOption = None,
    token: TokenOption = None,
    api_key: ApiKeyOption = None,
    standalone: StandaloneOption = False,
    *,
    options: LazyRuntimeOptions,
    bounds: Bounds,
) -> None:
    """Chat in a REPL; after each reply, panels show what the cache served.

    While a kvchat server holds the sessions dir (or with --connect), the chat attaches to it:
    its cache and sessions, shared with everything else it serves. --connect to another
    OpenAI-compatible engine (llama-server, vLLM, SGLang) keeps the sessions here and shows
    what that engine reports."""
    from kvchat.cli.attach_options import find_server
    from kvchat.config import SamplingParams
    from kvchat.session_lock import sessions_lock
    from kvchat.sessions import SessionStore, validate_name
    from kvchat.text_input import check_text
    from kvchat.ui.views import PANEL_MODES

    name = validate_name(session) if session is not None else None
    if system is not None:
        check_text(system, "The --system text", from_os=True)
    if panels not in PANEL_MODES:
        raise KvchatError(f"--panels must be one of {', '.join(PANEL_MODES)}, got {panels!r}.")
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    server = find_server(options, connect, token, standalone, api_key, bounds)
    if server is not None:
        from kvchat.cli.attach_options import remote_engine

        engine = remote_engine(server)
        if engine is not None:
            _engine_chat(*engine, options, name, system, params, panels)
            return
        _attached_chat(server, options, name, system, params, panels)
        return
    # The lock comes first: a second chat on the same folder fails before loading a model.
    with sessions_lock(options.sessions_dir, "kvchat chat"):
        store = SessionStore(options.sessions_dir)
        name = name or _new_session_name(store.names())
        _run_chat(options.build(), name, system, params, panels)


def _attached_chat(server: Attachment, options: LazyRuntimeOptions, name: str | None,
                   system: str | None, params: SamplingParams, panels: str) -> None:
    from kvchat.chat.repl import Chat
    from kvchat.chat.server import ServerBackend
    from kvchat.chat.terminal import make_reader
    from kvchat.sessions import SessionStore

    with server.client() as client:
        backend = ServerBackend(client, server.found)
        name = name or _new_session_name(backend.sessions.names())
        session = backend.sessions.open(name)
        if system is not None:
            session.system = system
        reader = make_reader(SessionStore(options.sessions_dir).history_file())
        Chat(backend, session, params, stdout(), reader, panels).run()


def _engine_chat(client: OpenAIClient, engine: PeerInfo, options: LazyRuntimeOptions,
                 name: str | None, system: str | None, params: SamplingParams,
                 panels: str) -> None:
    """The REPL on a remote engine; its sessions are this sessions dir's, under its lock."""
    from kvchat.chat.peer import PeerBackend
    from kvchat.chat.repl import Chat
    from kvchat.chat.terminal import make_reader
    from kvchat.client.ledger import Ledger
    from kvchat.session_lock import sessions_lock
    from kvchat.sessions import SessionStore

    with client, sessions_lock(options.sessions_dir, f"kvchat chat --connect {engine.url}"):
        store = SessionStore(options.sessions_dir)
        ledger = Ledger.open(options.sessions_dir, engine.url, engine.kind)
        backend = PeerBackend(client, engine, store, ledger)
        session = store.open(name or _new_session_name(store.names()))
        if system is not None:
            session.system = system
        Chat(backend, session, params, stdout(), make_reader(store.history_file()),
             panels).run()


def _new_session_name(existing: list[str]) -> str:
    from kvchat.chat.repl import next_session_name

    return next_session_name(existing)


def _run_chat(
    options: RuntimeOptions,
    name: str,
    system: str | None,
    params: SamplingParams,
    panels: str,
) -> None:
    from kvchat.chat.repl import Chat
    from kvchat.chat.terminal import make_reader
    from kvchat.runtime import Runtime

    runtime = Runtime.open(options)
    session = runtime.store.open(name)
    if system is not None:
        session.system = system
    reader = make_reader(runtime.store.history_file())
    console = stdout()
    try:
        Chat(runtime, session, params, console, reader, panels).run()
    finally:
        runtime.close()  # the disk tier's queued blocks reach the disk
        for notice in runtime.take_notices():
            console.print(f"[yellow]{escape(notice)}[/yellow]")
