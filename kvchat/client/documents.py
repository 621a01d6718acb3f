"""The server's JSON documents (/cache/stats, /cache/tree) turned back into the views the
terminal renders, so that attached commands draw what standalone ones draw."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvchat.cache.stats import CacheStats
from kvchat.inspect.documents import ExactView, NodeView

Decode = Callable[[Sequence[int]], str]


def stats_from_document(doc: Mapping[str, Any]) -> CacheStats:
    """/cache/stats (or a /cache/tree's "stats") as CacheStats."""
    return CacheStats.from_json(doc)


def nodes_from_document(tree: Sequence[Mapping[str, Any]]) -> tuple[NodeView, ...]:
    """A /cache/tree "tree" as NodeViews (reference counts are the server's)."""

    def view(rec: Mapping[str, Any]) -> NodeView:
        kids = nodes_from_document(rec.get("children", []))
        return NodeView(int(rec["start"]), tuple(int(t) for t in rec["tokens"]),
                        int(rec["n_blocks"]), int(rec.get("max_ref", 0)),
                        tuple(str(o) for o in rec.get("owners", [])), kids,
                        pinned=bool(rec.get("pinned", False)),
                        disk_blocks=int(rec.get("disk_blocks", 0)))

    return tuple(view(rec) for rec in tree)


def exact_from_document(exact: Sequence[Mapping[str, Any]]) -> tuple[ExactView, ...]:
    # The document keeps no token ids for exact entries, only their previews and sizes.
    return tuple(ExactView((), int(e["n_blocks"]), bool(e.get("has_logits")),
                           length=int(e.get("n_tokens", 0)), preview=str(e.get("preview", "")))
                 for e in exact)


def tokenizer_decoder(tokenizer_file: str | None) -> Decode | None:
    """Decode token ids with the tokenizer file alone (no transformers, no torch); None when
    none is recorded or it cannot be read (previews then show token ids)."""
    if not tokenizer_file or not Path(tokenizer_file).is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception:  # a damaged tokenizer file only costs the previews
        return None

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode
