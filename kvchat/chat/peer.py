"""`kvchat chat --connect URL` on a remote engine (llama.cpp's llama-server, vLLM, SGLang, any
OpenAI-compatible server): the REPL's ChatBackend over streamed /v1/chat/completions.

The sessions stay here, in the sessions dir (the engine keeps none): each turn sends the whole
conversation, so /retry, /rewind, /fork and /branches work as they do in kvchat, resending
prefixes the engine has most likely cached. The panels show what the engine reported
(cached_tokens, its timings), the TTFT this client measured, and this client's record of what it
sent (`ledger`). What the engine cannot report (its pool, its tree, pinning) is not shown.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvchat.chat.backend import PinInfo, PinsInfo, Reply, Sessions, TurnDone, TurnFailed
from kvchat.client.errors import BadReply, ReplyTimeout, ServerError
from kvchat.client.ledger import Ledger
from kvchat.client.openai_http import CompletionStream, OpenAIClient, Usage
from kvchat.client.peer_turns import conversation, record, request_body
from kvchat.client.peers import CACHE_REPORT_HINT, PeerInfo
from kvchat.errors import KvchatError
from kvchat.responses import result_from_turn
from kvchat.sessions import Session, SessionStore
from kvchat.ui.peer_view import ClientTotals, PeerFacts

if TYPE_CHECKING:
    from rich.console import RenderableType

    from kvchat.config import SamplingParams
    from kvchat.sessions import Turn
    from kvchat.ui.views import TurnView

NOT_HERE = "{engine} keeps its own cache, and its API has no way to {what}"


def facts_of(engine: PeerInfo) -> PeerFacts:
    return PeerFacts(engine.kind, engine.name(), engine.url, engine.model, engine.facts,
                       CACHE_REPORT_HINT.get(engine.kind, ""))


class PeerReply:
    cancel_event: threading.Event | None = None  # Ctrl-C hangs up the stream

    def __init__(self, backend: PeerBackend, stream: CompletionStream, session: Session,
                 user_text: str, messages: list[dict[str, str]]) -> None:
        self.backend = backend
        self.stream = stream
        self.session = session
        self.user_text = user_text
        self.messages = messages
        self.parts: list[str] = []
        self.ttft_ms: float | None = None

    def __iter__(self) -> Iterator[str]:
        import time

        started = time.perf_counter()
        for text in self.stream:
            if self.ttft_ms is None:
                self.ttft_ms = (time.perf_counter() - started) * 1000
            self.parts.append(text)
            yield text

    def close(self) -> None:
        self.stream.close()

    def finish(self) -> TurnDone | TurnFailed:
        self.stream.close()
        reply, text = self.stream.result, "".join(self.parts)
        if reply is None and self.stream.failure is not None:  # a bound passed, a bad reply
            kept = " The text shown so far is not kept in the session." if text else ""
            return TurnFailed(f"{self.stream.failure}{kept}")
        if reply is None and not text:
            return TurnFailed(self.stream.error or "The reply stopped before it started.")
        ttft = reply.ttft_ms if reply is not None and reply.ttft_ms is not None else self.ttft_ms
        turn = record(self.session, self.user_text, reply, text, ttft, self.backend.kind)
        if reply is not None:
            self.backend.sent(self.messages, reply.usage)
        decode_s = (reply.total_ms - (reply.ttft_ms or 0)) / 1000 if reply is not None else 0
        rate = max(turn.completion_tokens - 1, 0) / decode_s if decode_s > 0 else 0.0
        return TurnDone(turn, result_from_turn(turn, rate))


class PeerBackend:
    """A remote engine's replies, with this client's sessions and record of what it sent."""

    owns_cache = True  # what it saves is the record of what it sent (the REPL's saves)
    history = "messages"  # sessions are compared by messages: the engine's tokens are its own

    def __init__(self, client: OpenAIClient, engine: PeerInfo, store: SessionStore,
                 ledger: Ledger) -> None:
        self.client = client
        self.engine = engine
        self.kind = engine.kind
        self.store = store
        self.sessions: Sessions = store
        self.ledger = ledger
        self.facts = facts_of(engine)
        self.totals = ClientTotals(0, 0, 0, 0)
        self._last_reported = False
        self._path: list[dict[str, str]] = []
        what = {"clear-cache": "clear it", "pin": "pin a prefix", "unpin": "unpin a prefix",
                "pins": "list pinned prefixes"}
        self.unavailable = {k: NOT_HERE.format(engine=engine.kind, what=v)
                            for k, v in what.items()}

    def banner_lines(self) -> list[str]:
        facts = " · ".join(f"{k} {v}" for k, v in self.engine.facts)
        return [
            f"model    {self.engine.model}",
            f"engine   {self.engine.describe()}",
            *([f"reports  {facts}"] if facts else []),
            "cache    the engine's own: panels show the cached_tokens it reports and what "
            "this client sent",
            f"sessions {self.store.root}",
        ]

    def start(self, session: Session, text: str, params: SamplingParams) -> Reply:
        messages = conversation(session, text)
        try:
            stream = self.client.chat(request_body(self.engine.model, messages, params))
        except (ReplyTimeout, BadReply) as error:
            raise KvchatError(str(error)) from None
        except ServerError as error:
            if error.status >= 500:  # its message names the server and the status
                raise KvchatError(str(error)) from None
            raise KvchatError(f"{self.engine.kind} refused the turn: {error}") from None
        self._path = messages
        return PeerReply(self, stream, session, text, messages)

    def sent(self, messages: Sequence[dict[str, str]], usage: Usage) -> None:
        """Count a finished request and add it to the record (saved as the REPL saves a
        snapshot: every few turns and on the way out)."""
        self.ledger.record(messages, usage)
        reported = usage.cached_tokens is not None
        t = self.totals
        self.totals = ClientTotals(t.requests + 1, t.prompt_tokens + (usage.prompt_tokens or 0),
                                   t.cached_tokens + (usage.cached_tokens or 0),
                                   t.reported + int(reported))
        self._last_reported = reported

    # ---- views ----

    def turn_panels(self, view: TurnView, mode: str, highlight: str) -> RenderableType:
        from kvchat.ui.peer_view import peer_turn_panels

        return peer_turn_panels(view, self.facts, self.totals, self._last_reported,
                                  self.ledger.roots, mode, self._path)

    def stats_view(self, turns: Sequence[Turn]) -> RenderableType:
        from rich.console import Group

        from kvchat.ui.peer_view import peer_panel
        from kvchat.ui.views import turns_table

        parts: list[RenderableType] = [peer_panel(self.facts, self.totals)]
        if turns:
            parts.append(turns_table(turns))
        return Group(*parts)

    def tree_view(self, highlight: str) -> RenderableType:
        from kvchat.ui.peer_view import sent_tree

        return sent_tree(self.ledger.roots, self.engine.kind, depth=8, max_children=8,
                         highlight=self._path)

    def saved(self) -> str:
        return f"the record of what this client sent ({self.ledger.path})"

    def exit_note(self, session: str) -> str:
        return (f"Saved {session} in {self.store.root} and {self.saved()}; the "
                f"{self.kind} peer keeps its own cache.")

    def save_snapshot(self) -> None:
        self.ledger.save()

    # ---- what only kvchat's own cache has ----

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))  # no tokenizer here: /branches compares messages

    def clear_cache(self) -> int:
        raise KvchatError(self.unavailable["clear-cache"])

    def pin(self, session: Session, what: str) -> PinInfo:
        raise KvchatError(self.unavailable["pin"])

    def unpin(self, session: Session) -> list[PinInfo]:
        raise KvchatError(self.unavailable["unpin"])

    def pins(self) -> PinsInfo:
        raise KvchatError(self.unavailable["pins"])
