"""This client's record of what it sent to a remote engine, and what the engine reported it had
cached of each request: the only view of a remote prefix cache a client can honestly give.

A remote engine's cache is its own; its API reports one number per reply,
`usage.prompt_tokens_details.cached_tokens`. The ledger keeps the prompts this client sent as a
tree of messages (a chat's turns are one path, a few-shot file's shared system prompt one node)
and, where each request's prompt ended, what the engine reported for it. Chat's tree panel and
`kvchat inspect` draw it; `kvchat inspect --explain` answers from it ("this client sent ...").

One file per engine URL, `<sessions-dir>/sent/<host_port>.json` (0600: it holds prompt text),
bounded to MAX_NODES messages (the least recently sent leaves go first).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from kvchat.client.openai_http import Usage
from kvchat.files import atomic_write, private_dir

FOLDER = "sent"
MAX_NODES = 4096
REPORTS_KEPT = 3  # per message where requests ended: the newest reports
Message = dict[str, str]


class Report(NamedTuple):
    """What the engine reported for one request (None: it did not say)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    at: float


@dataclass
class SentNode:
    """One message of prompts this client sent, under the messages that came before it."""

    role: str
    content: str
    sent: int = 0  # requests whose prompt went through this message
    last: float = 0.0  # when one last did
    reports: list[Report] = field(default_factory=list)  # requests whose prompt ended here
    children: list[SentNode] = field(default_factory=list)

    def child(self, role: str, content: str) -> SentNode | None:
        return next((c for c in self.children if c.role == role and c.content == content),
                    None)

    def walk(self) -> Iterator[SentNode]:
        yield self
        for c in self.children:
            yield from c.walk()

    def newest_report(self) -> Report | None:
        found = [r for n in self.walk() for r in n.reports]
        return max(found, key=lambda r: r.at, default=None)

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, "sent": self.sent,
                "last": self.last, "reports": [list(r) for r in self.reports],
                "children": [c.to_json() for c in self.children]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SentNode:
        return cls(str(doc["role"]), str(doc["content"]), int(doc.get("sent", 0)),
                   float(doc.get("last", 0.0)), [Report(*r) for r in doc.get("reports", [])],
                   [cls.from_json(c) for c in doc.get("children", [])])


class SentMatch(NamedTuple):
    """How much of a prompt this client already sent: its first `messages` messages whole,
    then `chars` characters of the next one (of `next_chars`); `requests` sent that prefix,
    the newest of them reported as `report`."""

    messages: int
    total_messages: int
    chars: int
    next_chars: int
    requests: int
    report: Report | None
    sent_next: str  # what the closest sent prompt had after the shared part ("": it ended)
    prompt_next: str  # what this prompt has there


def ledger_path(sessions_dir: Path, url: str) -> Path:
    parts = urlsplit(url)
    where = (parts.netloc or url) + parts.path.rstrip("/")
    return Path(sessions_dir) / FOLDER / (re.sub(r"[^A-Za-z0-9.-]+", "_", where) + ".json")


class Ledger:
    """The record for one engine; `record` is safe from several threads (a batch's)."""

    def __init__(self, path: Path, engine: str, url: str,
                 roots: list[SentNode] | None = None) -> None:
        self.path = path
        self.engine = engine
        self.url = url
        self.roots: list[SentNode] = roots or []
        self._lock = threading.Lock()
        self._count = sum(1 for r in self.roots for _ in r.walk())

    @classmethod
    def open(cls, sessions_dir: Path, url: str, engine: str) -> Ledger:
        """The saved record for `url` (a new one when there is none or it does not parse)."""
        found = cls.read(ledger_path(sessions_dir, url))
        if found is None:
            return cls(ledger_path(sessions_dir, url), engine, url)
        found.engine = engine
        return found

    @classmethod
    def read(cls, path: Path) -> Ledger | None:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            roots = [SentNode.from_json(r) for r in doc.get("tree", [])]
            return cls(path, str(doc.get("engine", "?")), str(doc.get("url", "?")), roots)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def record(self, messages: Sequence[Message], usage: Usage, at: float | None = None
               ) -> None:
        """One request sent (`messages`, the whole prompt) and what the engine reported."""
        if not messages:
            return
        now = time.time() if at is None else at
        with self._lock:
            level, node = self.roots, None
            for m in messages:
                node = next((c for c in level if c.role == m["role"]
                             and c.content == m["content"]), None)
                if node is None:
                    node = SentNode(m["role"], m["content"])
                    level.append(node)
                    self._count += 1
                node.sent += 1
                node.last = now
                level = node.children
            assert node is not None
            node.reports.append(Report(usage.prompt_tokens, usage.cached_tokens, now))
            del node.reports[:-REPORTS_KEPT]
            while self._count > MAX_NODES and self._drop_oldest_leaf():
                pass

    def _drop_oldest_leaf(self) -> bool:
        leaves = [(n.last, i, level) for level in self._levels() for i, n in enumerate(level)
                  if not n.children]
        if not leaves:
            return False
        _, i, level = min(leaves, key=lambda t: t[0])
        del level[i]
        self._count -= 1
        return True

    def _levels(self) -> Iterator[list[SentNode]]:
        stack = [self.roots]
        while stack:
            level = stack.pop()
            yield level
            stack.extend(n.children for n in level)

    def closest(self, messages: Sequence[Message]) -> SentMatch:
        """The longest prefix of `messages` this client sent: whole messages, then where the
        next message parts from the closest one sent after the same messages."""
        with self._lock:
            level, node, whole = self.roots, None, 0
            for m in messages:
                found = next((c for c in level if c.role == m["role"]
                              and c.content == m["content"]), None)
                if found is None:
                    break
                node, level, whole = found, found.children, whole + 1
            rest = messages[whole] if whole < len(messages) else None
            chars, near = 0, list[SentNode]()  # next messages sent sharing the most with it
            if rest is not None:
                for c in level:
                    same_role = c.role == rest["role"]
                    n = len(os.path.commonprefix([c.content, rest["content"]])) if same_role else 0
                    if n and n >= chars:
                        near = [*near, c] if n == chars else [c]
                        chars = n
            if near:
                requests = sum(c.sent for c in near)
                reports = [r for r in (c.newest_report() for c in near) if r is not None]
                report = max(reports, key=lambda r: r.at, default=None)
                newest = max(near, key=lambda c: c.last)
                sent_next = newest.content[chars:]
            else:
                requests = node.sent if node is not None else 0
                report = node.newest_report() if node is not None else None
                sent_next = level[0].content if level and rest is None else ""
            prompt_next = rest["content"][chars:] if rest is not None else ""
            return SentMatch(whole, len(messages), chars,
                             len(rest["content"]) if rest is not None else 0, requests, report,
                             sent_next, prompt_next)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {"engine": self.engine, "url": self.url,
                    "tree": [r.to_json() for r in self.roots]}

    def save(self) -> None:
        """Written atomically, 0600 in a 0700 folder; raises WriteError on failure."""
        private_dir(self.path.parent, "the record of sent prompts")
        atomic_write(self.path, json.dumps(self.to_json(), ensure_ascii=False).encode(),
                     "the record of sent prompts")

