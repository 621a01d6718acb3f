"""Which rows of a decode step carry a draft from the cache, and how long.

A forward over a few more query rows costs about what a one-row step costs here (decode is bound
by reading the weights), so a step may carry up to DRAFT_ROWS query rows in all: rows x (1 +
draft), every row padded to the longest draft. Beyond that, a query row costs about what a row
of its own does (the int4 kernel's work grows with its rows), so longer drafts are taken only
while at least half the step's query rows are real tokens to verify: a batch of repeats drafting
their twins' stored replies, not one drafting row padding all the others. A row drafts when it
decodes greedily (its verification then keeps exactly the tokens one-at-a-time decoding gives;
sampled rows never draft) and the cache holds what follows its tokens (`PagedKVCache.draft`). A
row whose lookup finds nothing looks again only after DRAFT_RETRY more tokens: once a sequence
leaves the tree it rarely meets it again.
"""

from __future__ import annotations

from kvchat.cache.kvcache import PagedKVCache
from kvchat.engine.sequence import Sequence, Status

DRAFT_ROWS = 16  # query rows a drafting step may carry in all
DRAFT_MAX = 8  # most draft tokens per row and step
DRAFT_RETRY = 16  # tokens to wait before looking for a draft again after a miss


def plan_drafts(rows: list[Sequence], cache: PagedKVCache, draft_max: int) -> list[list[int]]:
    """Per row of the step, its draft ([] for none); [] when no row drafts."""
    if draft_max < 1 or not rows:
        return []
    drafts: list[list[int]] = []
    for seq in rows:
        draft: list[int] = []
        room = seq.params.max_new_tokens - len(seq.generated) - 1  # the last one needs no draft
        if seq.status is Status.RUNNING and seq.params.greedy and room > 0 \
                and seq.length >= seq.draft_retry_at:
            draft = cache.draft(seq.tokens(), seq.request.namespace, min(draft_max, room))
            if not draft:
                seq.draft_retry_at = seq.length + DRAFT_RETRY
        drafts.append(draft)
    k = draft_length(len(rows), [len(d) for d in drafts], draft_max)
    return [d[:k] for d in drafts] if k else []


def draft_length(rows: int, lengths: list[int], draft_max: int) -> int:
    """The longest draft a step of `rows` rows carries (each padded to it): within DRAFT_ROWS
    query rows, or longer while real draft tokens fill at least half of the query rows."""
    best = 0
    for k in range(1, min(draft_max, max(lengths, default=0)) + 1):
        query_rows = rows * (1 + k)
        real = rows + sum(min(n, k) for n in lengths)
        if query_rows <= DRAFT_ROWS or 2 * real >= query_rows:
            best = k
    return best
