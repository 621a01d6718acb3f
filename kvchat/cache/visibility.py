"""What a caller may see of the cache it reads, and the one function that decodes a preview
for it.

A caller always sees its own prompt: how many of its tokens were cached, why the cached prefix
ended there, and where its prompt stopped matching (`diverged_at`). What the cache holds past
that point is somebody's prompt, and the caller sees it only when that somebody can only be
itself:

- `Visibility.CACHE`: every token cached in the namespace is the caller's own, or the caller
  runs the cache: a local `kvchat chat` or `batch`, a server's admin, an API key's tenant in
  its private namespace.
- `Visibility.OWN`: the namespace is shared with other callers (`kvchat serve --share-cache`,
  a `cache_salt` group): only tokens the caller sent are shown, never one it did not send.

`preview` is the only place a decoded preview of cached tokens is made for a caller (a miss's
`miss_detail`, the chat panel's "why" line, `kvchat inspect --explain`); the tree and the exact
entries (`/cache/tree`) are shown only under `Visibility.CACHE`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

Decode = Callable[[list[int]], str]


class Visibility(StrEnum):
    CACHE = "cache"  # the caller may see every token its namespace caches
    OWN = "own"  # the namespace is shared: only the tokens the caller sent


def preview(ids: Sequence[int], decode: Decode | None, visibility: Visibility,
            sent: bool) -> str | None:
    """The text of `ids` for a caller who sees `visibility`: decoded (token ids without a
    decoder), or None when it may not see them. `sent`: the ids are a slice of the caller's own
    prompt; otherwise they were read from the cache."""
    if not sent and visibility is not Visibility.CACHE:
        return None
    return decode(list(ids)) if decode is not None else " ".join(map(str, ids))
