"""`kvchat serve`: the HTTP server over one runtime."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvchat.cli.app import app, stderr
from kvchat.cli.attach_options import LazyRuntimeOptions, lazy_runtime_options
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.server.auth import StartupAuth


@app.command()
@lazy_runtime_options()
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
    detach: Annotated[
        bool, typer.Option("--detach", help="Run in the background (output in "
                           "<sessions-dir>/serve.log); returns once the server answers. Stop it "
                           "with `kvchat stop`.")
    ] = False,
    *,
    options: LazyRuntimeOptions,
) -> None:
    """Serve the model over HTTP: /generate, /v1/chat/completions (OpenAI), /cache/stats,
    /cache/tree, /sessions, /metrics (Prometheus), /healthz. Stop with Ctrl-C, SIGTERM or
    `kvchat stop`; the cache snapshot is saved then.

    While it runs, `kvchat chat`, `batch` and `inspect` on the same --sessions-dir attach to
    it (the dir's lock file, 0600, holds its address and access token).

    Requests need the access token (the admin: the whole cache and the sessions dir's
    sessions) or an API key (a tenant: its own salted cache, sessions and views)."""
    from kvchat.targets.local import importing

    with importing(stderr()) as imported:  # the server's modules pull in torch
        from kvchat.server import bind_warning, startup_auth
    access = startup_auth(token, api_keys or [], no_auth, share_cache, cache_salts or [])
    if detach:
        from kvchat.cli.detach import start_detached

        start_detached(options.sessions_dir)
        return
    for warning in filter(None, (bind_warning(host, access.auth.enabled), access.warning)):
        stderr().print(f"[bold yellow]Warning:[/bold yellow] [yellow]{escape(warning)}[/yellow]")
    _serve(options, host, port, batch_size, max_tokens, access, imported())


def _serve(options: LazyRuntimeOptions, host: str, port: int, batch_size: int, max_tokens: int,
           access: StartupAuth, imported: float) -> None:
    import uvicorn

    from kvchat.cli.app import terminate_as_interrupt
    from kvchat.server import Server, create_app, log_to_stderr
    from kvchat.session_lock import sessions_lock
    from kvchat.targets.local import open_runtime
    from kvchat.ui.startup_view import listening_line

    # uvicorn re-raises the signal it stopped on: as KeyboardInterrupt, the lock is left cleanly
    with sessions_lock(options.sessions_dir, "kvchat serve") as lock, terminate_as_interrupt():
        sock = _bind(host, port)
        runtime = open_runtime(options.build, stderr(), imported)
        web = create_app(runtime, batch_size=batch_size, max_tokens=max_tokens,
                         auth=access.auth)
        if not runtime.engine.codec.has_template:
            stderr().print(f"[yellow]{escape(runtime.model_label)} has no chat template: "
                           "/v1/chat/completions answers 400 (start with --chat-template to "
                           "set one); /v1/completions and /generate send plain text.[/yellow]",
                           soft_wrap=True)
        if access.token_line:  # once, unwrapped, so that it can be copied
            stderr().print(escape(_token_line(access.token_line)), soft_wrap=True,
                           highlight=False)
        log_to_stderr()
        bound_host, bound_port = sock.getsockname()[:2]
        server = Server(uvicorn.Config(web, host=host, port=bound_port, lifespan="on"))
        url = f"http://{_url_host(bound_host)}:{bound_port}"
        # attached clients find the server here: it is written before it answers
        lock.publish(url, access.auth.admin_token)
        stderr().print(listening_line(url, host), soft_wrap=True, highlight=False)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the Ctrl-C it shut down on; stopping is what it asked for
        finally:
            # the lifespan saved (and said so) already, unless a second Ctrl-C forced the exit
            web.state.engine.close_and_report()
            sock.close()


def _token_line(line: str) -> str:
    """The generated token's line; a background server's output is its log file, which keeps
    no secret: the token is in the sessions dir's lock file (0600) only."""
    import os

    from kvchat.cli.detach import DETACHED_ENV

    if os.environ.get(DETACHED_ENV):
        return ("Access token: generated; not written to this log (attached kvchat commands "
                "read it from the sessions dir's lock file).")
    return line


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KvchatError(f"Cannot listen on {host}:{port} ({exc.strerror or exc}): another "
                          "program uses that port, or the address is not this machine's. "
                          "Pick another with --port (0: any free port).") from None
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):  # listening everywhere: clients here use loopback
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
