"""`kvchat serve --detach`, `kvchat token` and `kvchat stop`: a resident server in the
background, found, asked for its token and stopped through the sessions dir's lock file (its
pid, address and access token)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kvchat.cli.app import app, stderr, stdout
from kvchat.cli.options import SessionsDirOption
from kvchat.errors import KvchatError

LOG_NAME = "serve.log"
# Set for the background server: its output is the log file, which never gets the token.
DETACHED_ENV = "KVCHAT_SERVE_DETACHED"
# Loading a large model can take minutes; stopping saves the snapshot (seconds per GiB).
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0


def start_detached(sessions_dir: Path) -> None:
    """Run this same `kvchat serve` command line without --detach in a child process of its
    own session, its output in <sessions-dir>/serve.log (0600); return once it answers."""
    from kvchat.session_lock import lock_holder
    from kvchat.sessions import open_private, private_dir

    holder = lock_holder(sessions_dir)
    if holder is not None:
        raise KvchatError(f"The sessions dir {sessions_dir} is in use by {holder.describe()}"
                          + (f" at {holder.url}" if holder.url else "") + ".")
    log_path = private_dir(sessions_dir) / LOG_NAME
    fd = open_private(log_path, os.O_WRONLY | os.O_APPEND)
    args = [a for a in sys.argv[1:] if a != "--detach"]
    try:
        child = subprocess.Popen([sys.executable, "-m", "kvchat", *args], stdin=subprocess.DEVNULL,
                                 stdout=fd, stderr=fd, start_new_session=True,
                                 env={**os.environ, DETACHED_ENV: "1"})
    finally:
        os.close(fd)
    url = _wait_until_up(child, sessions_dir, log_path)
    where = escape(str(sessions_dir))
    stdout().print(f"kvchat serve is running at {url} (pid {child.pid}); output in "
                   f"{escape(str(log_path))}. `kvchat chat`, `batch` and `inspect` with "
                   f"--sessions-dir {where} attach to it; stop it with `kvchat stop`. "
                   f"Its access token, for other clients: `kvchat token --sessions-dir {where}` "
                   f"prints it (it is kept in {escape(str(sessions_dir / '.lock'))}, 0600).",
                   soft_wrap=True)


def _wait_until_up(child: subprocess.Popen[bytes], sessions_dir: Path, log_path: Path) -> str:
    from kvchat.client import Client, ServerGone
    from kvchat.session_lock import lock_holder

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise KvchatError(f"kvchat serve exited with code {child.returncode} before it "
                              f"answered. The end of {log_path}: " + " | ".join(tail))
        holder = lock_holder(sessions_dir)
        if holder is not None and holder.pid == child.pid and holder.url:
            try:
                with Client(holder.url, holder.token) as client:
                    client.health()
                return holder.url
            except ServerGone:
                pass  # listening, the app not yet started
        time.sleep(0.2)
    raise KvchatError(f"kvchat serve (pid {child.pid}) did not answer within "
                      f"{START_TIMEOUT_S:.0f} s; see {log_path}. It is still running: "
                      "`kvchat stop` stops it.")


@app.command()
def token(sessions_dir: SessionsDirOption = Path("sessions")) -> None:
    """Print the access token of the kvchat server holding --sessions-dir, for curl, OpenAI
    clients or --token elsewhere. It is read from the dir's lock file (<sessions-dir>/.lock,
    0600, one JSON object), so only the dir's owner can read it."""
    from kvchat.session_lock import lock_holder

    holder = lock_holder(sessions_dir)
    if holder is None or holder.url is None:
        stderr().print(f"No kvchat server holds {escape(str(sessions_dir))}: start one with "
                       "`kvchat serve --detach`.")
        raise typer.Exit(1)
    if holder.token is None:
        stderr().print(f"The server at {holder.url} runs without authentication (--no-auth): "
                       "requests need no token.")
        return
    typer.echo(holder.token)


@app.command()
def stop(
    sessions_dir: SessionsDirOption = Path("sessions"),
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for it to save and exit.", min=1)
    ] = STOP_TIMEOUT_S,
) -> None:
    """Stop the kvchat server holding --sessions-dir (SIGTERM: replies in flight finish or
    stop, the cache snapshot is saved), and wait until it has exited."""
    from kvchat.session_lock import lock_holder

    holder = lock_holder(sessions_dir)
    if holder is None:
        stderr().print(f"No kvchat server holds {escape(str(sessions_dir))}.")
        raise typer.Exit(1)
    if holder.url is None or holder.pid <= 0:
        raise KvchatError(f"The sessions dir {sessions_dir} is held by {holder.describe()}, "
                          "not by a server: quit that kvchat itself.")
    try:
        os.kill(holder.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it exited since we read the lock
    deadline = time.monotonic() + timeout
    while lock_holder(sessions_dir) is not None:
        if time.monotonic() > deadline:
            raise KvchatError(f"kvchat serve (pid {holder.pid}) is still saving after "
                              f"{timeout:.0f} s; it has not been killed. Wait, or raise "
                              "--timeout.")
        time.sleep(0.1)
    stdout().print(f"Stopped kvchat serve (pid {holder.pid}) at {holder.url}; the cache "
                   "snapshot is saved.")
