"""Drafts from the cache: the tokens the radix tree already holds after a sequence.

When every token of a running sequence is cached (an exact repeat whose reply was stored, a
retried or rewound turn, a continuation another request of the namespace produced), the tree
knows what followed those tokens before. The engine proposes them as a draft and verifies them
in one forward; a greedy sequence keeps exactly the tokens it would have produced without.
Plain Python over the tree's tokens: no K/V is read, so on-disk nodes draft too.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.cache.radix import RadixTree


def continuation(tree: RadixTree, tokens: Sequence[int], namespace: str, k: int) -> list[int]:
    """Up to k tokens that followed `tokens` in the tree (`namespace` only), or [] when the
    tree does not hold all of `tokens`. Where the path branches, the longest edge is followed."""
    if k <= 0 or not tokens:
        return []
    match = tree.find_prefix(tokens, namespace)
    node = match.node
    if match.matched < len(tokens) or node is None:
        return []
    out = list(node.tokens[len(tokens) - node.start : len(tokens) - node.start + k])
    while len(out) < k and node.children:
        node = max(node.child_list(), key=lambda child: len(child.tokens))
        out.extend(node.tokens[: k - len(out)])
    return out
