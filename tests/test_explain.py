"""Why a prompt missed: cold, evicted (when, by which policy) or diverged at token i, including a
divergence in the middle of a block, on the live tree and on a snapshot's views."""

from __future__ import annotations

from kvchat.explain import MissReason, Tombstones, explain
from kvchat.ui.cache_view import NodeView


def node(tokens, *children) -> NodeView:
    return NodeView(0, tuple(tokens), 1, 0, (), tuple(children))


SYSTEM = list(range(100, 140))  # 40 tokens: ends in the middle of a 16-token block
TREE = [node(SYSTEM, node([1, 2, 3, 4, 5, 6]), node([7, 8, 9]))]


def test_a_prompt_sharing_only_what_is_cached_is_a_hit():
    e = explain(SYSTEM + [1, 2, 3, 4, 5, 6, 99], TREE)
    assert e.reason is MissReason.HIT and e.cached == 46


def test_cold_when_nothing_like_it_was_seen():
    e = explain([5, 5, 5, 5], TREE)
    assert (e.reason, e.cached, e.diverged_at) == (MissReason.COLD, 0, None)
    beyond = explain(SYSTEM + [7, 8, 9, 10, 11, 12], TREE)  # a cached path, then new ground
    assert (beyond.reason, beyond.cached) == (MissReason.COLD, 43)


def test_diverged_in_the_middle_of_a_block_says_where_and_what_the_cache_holds():
    changed = SYSTEM[:37] + [999] + SYSTEM[38:] + [1, 2]  # one token of the system prompt
    e = explain(changed, TREE)
    assert e.reason is MissReason.DIVERGED and e.diverged_at == 37 and e.cached == 37
    assert e.cached_next[0] == SYSTEM[37]
    at_branch = explain(SYSTEM + [1, 2, 3, 50, 51], TREE)  # parts inside a child's edge
    assert (at_branch.diverged_at, at_branch.cached_next) == (43, (4, 5, 6))


def test_evicted_says_when_and_by_which_policy():
    dead = Tombstones(capacity=8)
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    dead.record("", prompt[:56], "lru", when=1700000000.0)
    e = explain(prompt, TREE, tombstones=dead)
    assert e.reason is MissReason.EVICTED and e.cached == 46
    assert (e.evicted_through, e.evicted_at, e.evicted_by) == (56, 1700000000.0, "lru")
    assert explain(prompt, TREE, namespace="tenant", tombstones=dead).reason is MissReason.COLD
    restored = Tombstones.from_json(dead.to_json())
    assert explain(prompt, TREE, tombstones=restored).reason is MissReason.EVICTED
    for k in range(20):  # bounded: the oldest are forgotten
        dead.record("", [k], "lru")
    assert len(dead) == 8 and explain(prompt, TREE, tombstones=dead).reason is MissReason.COLD
