"""`kvchat serve`: the HTTP server over one runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvchat.cli.app import app, stderr
from kvchat.cli.options import (
    runtime_options,
)

if TYPE_CHECKING:
    from kvchat.runtime import RuntimeOptions


@app.command()
@runtime_options()
def serve(
    host: Annotated[
        str, typer.Option("--host", help="Address to bind. Anything but loopback lets every "
                          "machine that can reach this one try the server (plain HTTP: the "
                          "token travels unencrypted).")
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
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="KVCHAT_TOKEN", show_default=False,
                     help="The admin's access token: every request but GET /healthz sends "
                     "'Authorization: Bearer TOKEN'. Without one, a random token is made and "
                     "printed once at start-up."),
    ] = None,
    api_keys: Annotated[
        list[str] | None,
        typer.Option("--api-key", show_default=False,
                     help="An API key, e.g. for OpenAI clients (repeatable). Each key is a "
                     "tenant: its own cached prompts (never a hit for another tenant), its own "
                     "sessions, its own part of /cache/stats and /cache/tree."),
    ] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Turn authentication off: anyone who can connect "
                           "can use the model and read every cached prompt and session.")
    ] = False,
    share_cache: Annotated[
        bool, typer.Option("--share-cache", help="Let all tenants share one cache (the "
                           "admin's). A shared prompt is then computed once for everyone, but "
                           "any tenant can tell whether another sent a prompt, from "
                           "cached_tokens and from time to first token (a hit answers in "
                           "milliseconds, a miss needs a prefill).")
    ] = False,
    cache_salts: Annotated[
        list[str] | None,
        typer.Option("--cache-salt", show_default=False,
                     help="Declare a cache-sharing group NAME (repeatable): requests that send "
                     "\"cache_salt\": NAME share cached prompts, whichever tenant sends them "
                     "(with the timing risk of --share-cache inside the group). Undeclared "
                     "names are refused."),
    ] = None,
    *,
    options: RuntimeOptions,
) -> None:
    """Serve the model over HTTP: /generate, /v1/chat/completions (OpenAI), /cache/stats,
    /cache/tree, /healthz. Stop with Ctrl-C or SIGTERM; the cache snapshot is saved then.

    Requests need the access token (the admin: the whole cache and the sessions dir's
    sessions) or an API key (a tenant: its own salted cache, sessions and views)."""
    import uvicorn

    from kvchat.runtime import Runtime
    from kvchat.server import Server, bind_warning, create_app, log_to_stderr, startup_auth
    from kvchat.sessions import sessions_lock

    access = startup_auth(token, api_keys or [], no_auth, share_cache, cache_salts or [])
    for warning in filter(None, (bind_warning(host, access.auth.enabled), access.warning)):
        stderr().print(f"[bold yellow]Warning:[/bold yellow] [yellow]{escape(warning)}[/yellow]")
    with sessions_lock(options.sessions_dir, "kvchat serve"):
        runtime = Runtime.open(options)
        web = create_app(runtime, batch_size=batch_size, max_tokens=max_tokens,
                         auth=access.auth)
        if access.token_line:  # once, unwrapped, so that it can be copied
            stderr().print(escape(access.token_line), soft_wrap=True, highlight=False)
        log_to_stderr()
        try:
            Server(uvicorn.Config(web, host=host, port=port, lifespan="on")).run()
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the Ctrl-C it shut down on; stopping is what it asked for
        finally:
            # the lifespan saved already, unless a second Ctrl-C forced the exit
            web.state.engine.close()
