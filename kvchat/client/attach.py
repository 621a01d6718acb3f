"""Which server a command attaches to: the one named by --connect, else the `kvchat serve`
holding the sessions dir (its lock file records its address and access token)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from kvchat.client.http import Client
from kvchat.config import Bounds
from kvchat.errors import KvchatError
from kvchat.session_lock import lock_holder

TOKEN_ENV_VAR = "KVCHAT_TOKEN"
API_KEY_ENV_VAR = "OPENAI_API_KEY"


class Attachment(NamedTuple):
    """A server to talk to, and how it was found (for the banner and for error messages)."""

    url: str
    token: str | None
    found: str  # "--connect URL" or "the server holding <dir> (pid N)"
    connect: bool = False  # named by --connect: any OpenAI-compatible engine may answer
    pid: int | None = None  # the server's process, as the lock file says (not for --connect)
    bounds: Bounds = Bounds()  # how long every call waits (--connect-timeout and the others)

    def client(self) -> Client:
        return Client(self.url, self.token, self.pid, self.bounds)


def attachment(sessions_dir: Path, connect: str | None, token: str | None,
               standalone: bool, api_key: str | None = None) -> Attachment | None:
    """The server a command should attach to, or None to run in-process (`standalone`, or no
    server holds the sessions dir). With --connect the credential is --api-key, else the
    kvchat token (--token, $KVCHAT_TOKEN), else $OPENAI_API_KEY."""
    if standalone:
        if connect is not None:
            raise KvchatError("--standalone runs in this process and --connect attaches to a "
                              "server: give one of them.")
        return None
    if connect is not None:
        if not connect.startswith(("http://", "https://")):
            raise KvchatError(f"--connect takes a URL such as http://127.0.0.1:8000, got "
                              f"{connect!r}.")
        key = (api_key or token or os.environ.get(TOKEN_ENV_VAR)
               or os.environ.get(API_KEY_ENV_VAR) or None)
        return Attachment(connect, key, f"--connect {connect}", connect=True)
    holder = lock_holder(sessions_dir)
    if holder is None or holder.url is None:
        return None  # free, or held by a chat or batch: the standalone path says which
    return Attachment(holder.url, token or holder.token,
                      f"the server holding {sessions_dir} (pid {holder.pid})", pid=holder.pid)
