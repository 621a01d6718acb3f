"""Where a command runs, chosen once (`choose`): in this process (`Local`), on a kvchat server
(`Server`: the one holding the sessions dir, or at --connect), or on a peer (`Peer`: another
OpenAI-compatible engine at --connect, such as llama-server, vLLM or SGLang). Every target
offers a chat (backend and session) and a batch runner, taking the same typed defaults; the
commands in `kvchat.cli` are their options plus one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvchat.config import Bounds
from kvchat.targets.base import BatchRunner, BatchSpec, OpenedChat, Target
from kvchat.targets.local import Local
from kvchat.targets.peer import Peer, detect_peer
from kvchat.targets.server import Server

if TYPE_CHECKING:
    from rich.console import Console

    from kvchat.client import Attachment
    from kvchat.runtime import RuntimeOptions


class Where(NamedTuple):
    """The options that say where a command runs: --connect, --token, --api-key, --standalone
    and the bounds on every call to a server."""

    connect: str | None = None
    token: str | None = None
    api_key: str | None = None
    standalone: bool = False
    bounds: Bounds | None = None


def find_server(sessions_dir: Path, where: Where, ui: Console,
                ignored: Sequence[str] = ()) -> Attachment | None:
    """The server a command attaches to (at --connect, else the kvchat server holding
    `sessions_dir`; None: this process), its calls under `where.bounds`. `ignored`: the model
    and cache options given, which a server keeps its own of (said once here)."""
    from kvchat.client import attachment

    server = attachment(sessions_dir, where.connect, where.token, where.standalone,
                        where.api_key)
    if server is None:
        return None
    if where.bounds is not None:
        server = server._replace(bounds=where.bounds)
    if ignored:
        ui.print(f"[yellow]{', '.join(ignored)} ignored: the server at {server.url} keeps its "
                 "own model and cache settings (--standalone runs one of this command's own)."
                 "[/yellow]")
    return server


def choose(sessions_dir: Path, where: Where, ui: Console,
           build: Callable[[], RuntimeOptions] | None = None,
           ignored: Sequence[str] = ()) -> Target:
    """The target: a peer or kvchat server at --connect, else the kvchat server holding
    `sessions_dir`, else this process (`build` makes its runtime options)."""
    server = find_server(sessions_dir, where, ui, ignored)
    if server is None:
        return Local(sessions_dir, build)
    peer = detect_peer(server)
    if peer is not None:
        return Peer(*peer, sessions_dir)
    return Server(server, sessions_dir)


__all__ = ["BatchRunner", "BatchSpec", "Local", "OpenedChat", "Peer", "Server", "Target",
           "Where", "choose", "detect_peer",
           "find_server"]
