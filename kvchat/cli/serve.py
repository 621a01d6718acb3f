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
        stderr().print(f"[bold yellow]Warning:[/bold yellow] [yellow]{escape(warning)}[/yellow]")
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
