"""Running the app: uvicorn with a shutdown that lets requests in flight finish, a background
server for tests and embedding, and the warnings and logging `kvchat serve` starts with."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

# The package's logger: every server module logs to a child of it.
log = logging.getLogger("kvchat.server")

# On shutdown, how long requests in flight may finish before they are interrupted (their K/V
# stays cached); uvicorn cancels whatever is left BACKSTOP_S later.
GRACEFUL_SHUTDOWN_S = 5.0
BACKSTOP_S = 5.0


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach; a host name other than localhost is
    not known to be one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, authenticated: bool = False) -> str | None:
    if is_loopback(host):
        return None
    if authenticated:
        return (
            f"--host {host} is not a loopback address: every machine that can reach this one "
            "can try the server. Requests need the access token or an API key, but plain HTTP "
            "carries them unencrypted: put a TLS proxy in front of it."
        )
    return (
        f"--host {host} is not a loopback address: anyone who can reach this machine can use "
        "the model, read the cache tree (it holds prompt text) and write sessions, since "
        "--no-auth left the server with no authentication."
    )


def log_to_stderr() -> None:
    """Show the server's own messages (startup, snapshot saved) the way uvicorn shows its."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


class Server(uvicorn.Server):
    """uvicorn whose graceful shutdown gives the requests in flight `grace_s` to finish, then
    interrupts them through the engine, so that their replies end normally (finish_reason
    "interrupted") before the lifespan saves the snapshot."""

    def __init__(self, config: uvicorn.Config, grace_s: float = GRACEFUL_SHUTDOWN_S) -> None:
        config.timeout_graceful_shutdown = int(grace_s + BACKSTOP_S)
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app: Any = self.config.app
        timer = asyncio.get_running_loop().call_later(self.grace_s, app.state.engine.interrupt)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


@contextlib.contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
            grace_s: float = GRACEFUL_SHUTDOWN_S) -> Iterator[tuple[str, Server]]:
    """Run app with uvicorn on a background thread (tests, embedding); yields its base URL and
    the server, and shuts it down (lifespan included) on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"), grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
