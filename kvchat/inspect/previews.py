"""Text previews of token sequences: one line, nothing a terminal executes, showing what tells
branches apart (where an edge starts and ends, what a sequence adds to its most similar sibling).
The tree documents (`kvchat.inspect.documents`) and the terminal views use them. Torch-free.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
PREVIEW_CHARS = 24
# Decoding more than this many tokens per edge could never add to a 24-character preview.
PREVIEW_TOKENS = 32


def _clean(text: str) -> str:
    """Newlines become ⏎, other control characters ·: one line, nothing a terminal executes."""
    out = []
    for ch in text.replace("\r\n", "\n"):
        if ch in "\n\r":
            out.append("⏎")
        elif unicodedata.category(ch) == "Cc":
            out.append("·")
        else:
            out.append(ch)
    return "".join(out)


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """One line of at most `limit` characters (see _clean)."""
    line = _clean(text)
    return line if len(line) <= limit else line[: limit - 1] + "…"


def ids_preview(ids: Sequence[int], limit: int = PREVIEW_CHARS) -> str:
    """A preview from token ids, for when no tokenizer is at hand."""
    return preview(" ".join(map(str, ids[:PREVIEW_TOKENS])), limit)


def edge_preview(tokens: Sequence[int], decode: Decode | None, limit: int = PREVIEW_CHARS) -> str:
    """Start and end of an edge ("<|im_start|>sy…you today?"): where a branch diverges and
    where it stops are what tell branches apart."""
    if decode is None:
        return ids_preview(tokens, limit)
    text = _clean(decode(tokens[:PREVIEW_TOKENS]))
    if len(tokens) <= PREVIEW_TOKENS and len(text) <= limit:
        return text
    tail = _clean(decode(tokens[-PREVIEW_TOKENS:]))
    head_chars = (limit - 1) // 2
    return text[:head_chars] + "…" + tail[-(limit - 1 - head_chars) :]


def distinct_offsets(seqs: Sequence[Sequence[int]]) -> list[int]:
    """For each sequence, how many leading tokens it shares with the most similar other one.
    In sorted order the most similar sequence is a neighbour, so this is one sort and a pass."""
    order = sorted(range(len(seqs)), key=lambda i: tuple(seqs[i]))
    out = [0] * len(seqs)
    for prev, cur in zip(order, order[1:], strict=False):
        a, b = seqs[prev], seqs[cur]
        n = min(len(a), len(b))
        shared = next((i for i in range(n) if a[i] != b[i]), n)
        out[prev] = max(out[prev], shared)
        out[cur] = max(out[cur], shared)
    return out


def distinct_preview(
    tokens: Sequence[int], shared: int, decode: Decode | None, limit: int = PREVIEW_CHARS
) -> str:
    """What sets a sequence apart from its most similar sibling: the text after the `shared`
    leading tokens, or its end when it is a prefix of another."""
    if shared >= len(tokens):
        return tail_preview(tokens, decode, limit)
    return edge_preview(tokens[shared:], decode, limit)


def tail_preview(tokens: Sequence[int], decode: Decode | None, limit: int = PREVIEW_CHARS) -> str:
    """The end of a sequence, where exact-index entries differ from each other."""
    tail = tokens[-PREVIEW_TOKENS:]
    text = ids_preview(tail, 10**6) if decode is None else preview(decode(tail), 10**6)
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]
