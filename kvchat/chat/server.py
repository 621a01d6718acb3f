"""`kvchat chat` attached to a server: the REPL's ChatBackend over HTTP.

A turn is a streamed POST /generate on the session, which the server extends and saves; the
client's copy of the session is then refreshed from the server. Before a turn the client
writes the session back, so that /rewind, /retry, /system and /fork (changes made here) are
what the server continues. Ctrl-C hangs up the stream: the server stops the reply at its next
step and records what it computed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvchat.chat.backend import (
    PLAIN_LINE,
    CacheViews,
    PinInfo,
    PinsInfo,
    Reply,
    Sessions,
    TurnDone,
    TurnFailed,
)
from kvchat.client.http import Client, ReplyStream, ServerError
from kvchat.errors import KvchatError
from kvchat.responses import result_from_turn
from kvchat.sessions import Session, Turn, validate_name

if TYPE_CHECKING:
    from kvchat.cache.stats import CacheStats
    from kvchat.config import SamplingParams
    from kvchat.engine.result import GenerationResult
    from kvchat.inspect.documents import NodeView

UNAVAILABLE = {
    "clear-cache": "the cache is the server's, shared with its other clients (restart the "
    "server with an empty sessions dir to start cold)",
}


class RemoteSessions:
    """The caller's sessions on the server."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def names(self) -> list[str]:
        return sorted(str(s["name"]) for s in self.client.sessions())

    def exists(self, name: str) -> bool:
        return self.client.session(validate_name(name)) is not None

    def open(self, name: str, create: bool = True) -> Session:
        doc = self.client.session(validate_name(name))
        if doc is not None:
            return Session.from_json(doc)
        if not create:
            from kvchat.sessions import SessionNotFound

            raise SessionNotFound(f"No session {name!r} on the server.")
        return Session(name)

    def save(self, session: Session) -> None:
        self.client.put_session(session.to_json())

    def refresh(self, session: Session) -> None:
        """Copy the server's record of the session into `session`, in place."""
        doc = self.client.session(session.name)
        if doc is not None:
            fresh = Session.from_json(doc)
            session.system, session.messages = fresh.system, fresh.messages
            session.tokens, session.turns = fresh.tokens, fresh.turns
            session.updated = fresh.updated


class RemoteReply:
    cancel_event: threading.Event | None = None  # Ctrl-C raises; the loop then hangs up

    def __init__(self, stream: ReplyStream, sessions: RemoteSessions, session: Session) -> None:
        self.stream = stream
        self.sessions = sessions
        self.session = session
        self.turns_before = len(session.turns)

    def __iter__(self) -> Iterator[str]:
        return iter(self.stream)

    def close(self) -> None:
        self.stream.close()

    def finish(self) -> TurnDone | TurnFailed:
        self.stream.close()
        result, error = self.stream.result, self.stream.error
        self.sessions.refresh(self.session)  # the server waits for the turn's record
        if len(self.session.turns) <= self.turns_before:
            return TurnFailed(error or "The reply stopped before it started.")
        turn = self.session.turns[-1]
        return TurnDone(turn, reported(turn, result))


def reported(turn: Turn, done: dict[str, Any] | None) -> GenerationResult:
    """The result of a server's turn: the session's record of it (times as the server measured
    them), with what the reply's last event adds (the cache's source and why, drafts), and the
    decode rate its times give; the record alone when that event never came."""
    if done is None:
        return result_from_turn(turn)
    decode_s = (float(done["total_ms"]) - float(done["ttft_ms"])) / 1000
    replayed = int(done.get("replayed_tokens") or 0)  # a replayed reply has no decode rate
    rate = max(int(done["completion_tokens"]) - 1, 0) / decode_s \
        if decode_s > 0 and not replayed else 0
    return replace(
        result_from_turn(turn, rate), hit_source=str(done["hit_source"]),
        disk_hit_tokens=int(done.get("disk_hit_tokens", 0)),
        miss_detail=str(done.get("miss_detail") or ""),
        miss_reason=str(done.get("miss_reason") or ""),
        miss_label=str(done.get("miss_label") or done.get("miss_reason") or ""),
        draft_tokens=int(done.get("draft_tokens") or 0),
        draft_accepted=int(done.get("draft_accepted") or 0),
        replayed_tokens=replayed)


class ServerBackend(CacheViews):
    """A resident `kvchat serve`: its cache, its sessions."""

    owns_cache = False

    def __init__(self, client: Client, found: str) -> None:
        self.client = client
        self.found = found
        self.remote = RemoteSessions(client)
        self.sessions: Sessions = self.remote
        self.unavailable = dict(UNAVAILABLE)
        self.health = client.health()
        self._decode: Any = None
        self._tree: dict[str, Any] | None = None
        self._pinned: dict[str, list[PinInfo]] = {}  # session -> pins this chat made on it

    def exit_note(self, session: str) -> str:
        return (f"Saved {session} on the kvchat server at {self.client.url}, which keeps the "
                "cache and saves its snapshot when it stops.")

    def banner_lines(self) -> list[str]:
        stats = self.stats()
        pool = stats.pool
        plain = self.health.get("chat_template") is False
        return [
            f"model    {self.health.get('model', '?')}",
            *([PLAIN_LINE] if plain else []),
            f"device   {self.health.get('device', '?')} · {self.health.get('precision', '?')}",
            f"cache    {pool.total_blocks or 0:,} blocks × {pool.block_size} tok · "
            f"policy {stats.policy}",
            f"server   {self.client.url} ({self.found})",
        ]

    def start(self, session: Session, text: str, params: SamplingParams) -> Reply:
        self.remote.save(session)  # what the client changed is what the turn continues
        body: dict[str, Any] = {
            "prompt": text, "session": session.name, "create_session": True,
            "max_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
        }
        try:
            stream = self.client.stream(body)
        except ServerError as error:
            if error.kind == "context_length_exceeded":
                raise KvchatError(f"{error} Start over with /reset or /new.") from None
            raise
        return RemoteReply(stream, self.remote, session)

    def stats(self) -> CacheStats:
        from kvchat.client.documents import stats_from_document

        return stats_from_document(self.client.cache_stats())

    def nodes(self) -> Sequence[NodeView]:
        from kvchat.client.documents import nodes_from_document

        self._tree = self.client.cache_tree()
        return nodes_from_document(self._tree["tree"])

    def decode(self, ids: Sequence[int]) -> str:
        if self._decode is None:
            from kvchat.client.documents import tokenizer_decoder

            tree = self._tree or self.client.cache_tree(depth=1)
            found = tokenizer_decoder(tree.get("snapshot", {}).get("tokenizer_file"))
            self._decode = found or (lambda ids: " ".join(map(str, ids)))
        return str(self._decode(ids))

    def integrity(self) -> str:
        return "checked by the server (not from an attached client)"

    def save_snapshot(self) -> None:
        self.client.save()

    def clear_cache(self) -> int:
        raise KvchatError(UNAVAILABLE["clear-cache"])

    def pin(self, session: Session, what: str) -> PinInfo:
        self.remote.save(session)  # the server pins the history it holds
        try:
            doc = self.client.pin({"session": session.name, "what": what})
        except ServerError as error:
            raise KvchatError(f"Not pinned: {error}") from None
        made = _pin_info(doc)
        self._pinned.setdefault(session.name, []).append(made)
        return made

    def unpin(self, session: Session) -> list[PinInfo]:
        """The pins this chat made on the session (the server lists all: GET /cache/pins)."""
        gone = []
        for made in self._pinned.pop(session.name, []):
            try:
                gone.append(_pin_info(self.client.unpin(made.pin_id)))
            except ServerError as error:
                if error.status != 404:  # 404: already ended elsewhere
                    raise
        return gone

    def pins(self) -> PinsInfo:
        doc = self.client.pins()
        rows = [_pin_info(p) for p in doc.get("pins", [])]
        used = int(doc.get("pinned_blocks", sum(p.blocks for p in rows)))
        return PinsInfo(rows, used, int(doc.get("max_pinned_blocks", 0)))


def _pin_info(doc: dict[str, Any]) -> PinInfo:
    return PinInfo(str(doc["id"]), str(doc["label"]), int(doc["tokens"]), int(doc["blocks"]))
