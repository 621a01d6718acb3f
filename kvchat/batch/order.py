"""The order a batch's lines go to a remote engine, so that its prefix cache is warm when a
shared-prefix group arrives.

A remote engine (vLLM, SGLang, llama.cpp's server) caches the prompts it computes, but requests
that arrive together each compute the prefix they share: none is cached yet. So lines are
grouped by the prompt text they share (at least MIN_SHARED_CHARS characters of their messages,
as a client sees them: the engine's tokens are its own), and each group's first line goes
alone; the rest of its group follows once the engine has prefilled it (its first streamed
text), and the next group's first line once every line of this group has been sent. Lines that
share nothing are groups of one and flow freely. Session lines are chains: each turn goes after
the previous one finished. The dispatcher keeps at most --concurrency lines in flight.

    input:   A1 B1 A2 B2 A3 B3        groups (sorted by text): A = A1 A2 A3, B = B1 B2 B3
    sent:    A1 | (A1 prefilled) A2 A3 B1 | (B1 prefilled) B2 B3
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

MIN_SHARED_CHARS = 64  # ~16 tokens: less is a template header, not a shared prompt
ORDERS = ("cache-aware", "input")


def prompt_text(messages: Sequence[dict[str, str]]) -> str:
    """A line's messages as one string (roles and contents, with separators no text holds),
    so that a shared prefix of messages is a shared prefix of strings."""
    return "".join(f"\x1e{m['role']}\x1f{m['content']}" for m in messages)


class Group(NamedTuple):
    """Lines sharing `shared` leading characters, in the order they go; the first leads."""

    lines: tuple[int, ...]
    shared: int



def shared_prefix_groups(prompts: Sequence[tuple[int, str]],
                         min_shared: int = MIN_SHARED_CHARS) -> list[Group]:
    """`prompts` ((line, text) pairs) grouped by shared prefix: neighbours in sorted order
    sharing at least `min_shared` characters join one group, sent in sorted order (a depth-
    first walk of the prompts' tree: each next prompt shares the most with the one before).
    Groups come in the order of their earliest line."""
    ordered = sorted(prompts, key=lambda p: (p[1], p[0]))
    groups: list[tuple[list[int], int]] = []
    previous = None
    for line, text in ordered:
        shared = len(os.path.commonprefix([previous, text])) if previous is not None else 0
        if groups and shared >= min_shared:
            lines, common = groups[-1]
            groups[-1] = ([*lines, line], min(common, shared))
        else:
            groups.append(([line], len(text)))
        previous = text
    out = [Group(tuple(lines), common if len(lines) > 1 else 0) for lines, common in groups]
    return sorted(out, key=lambda g: min(g.lines))


class SendQueue:
    """Which line may go next (`take`), told when a line's prompt is prefilled and when it is
    done. Plain bookkeeping: the caller holds the lock and counts what is in flight."""

    def __init__(self, groups: Sequence[Group], chains: Sequence[Sequence[int]] = ()) -> None:
        self.groups = [list(g.lines) for g in groups]
        self.chains = [list(c) for c in chains if c]
        self._cursor = 0  # the group being sent
        self._released = False  # its leader's prompt is prefilled
        self._leader: int | None = None
        self._chain_busy = [False] * len(self.chains)
        self._chain_of = {line: i for i, chain in enumerate(self.chains) for line in chain}

    def take(self) -> int | None:
        """The next line to send now, or None when nothing may go until a line is prefilled
        or done."""
        for i, chain in enumerate(self.chains):
            if chain and not self._chain_busy[i]:
                self._chain_busy[i] = True
                return chain.pop(0)
        while self._cursor < len(self.groups):
            group = self.groups[self._cursor]
            if self._leader is None:
                if not group:
                    self._advance()
                    continue
                self._leader = group.pop(0)
                self._released = not group  # a group of one holds nothing back
                return self._leader
            if not self._released:
                return None
            if group:
                return group.pop(0)
            self._advance()
        return None

    def _advance(self) -> None:
        self._cursor += 1
        self._leader, self._released = None, False

    def prefilled(self, line: int) -> None:
        """The engine computed `line`'s prompt: its group may follow."""
        if line == self._leader:
            self._released = True

    def done(self, line: int) -> None:
        """`line` finished (or failed): a chain's next turn may go, a leader's group too."""
        self.prefilled(line)
        chain = self._chain_of.get(line)
        if chain is not None:
            self._chain_busy[chain] = False

    @property
    def empty(self) -> bool:
        """Nothing is left to send."""
        return not any(self.chains) and not any(self.groups[self._cursor:])


def input_order(lines: Sequence[int]) -> list[Group]:
    """Every line a group of its own, in file order: nothing held back."""
    return [Group((line,), 0) for line in lines]
