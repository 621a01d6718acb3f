"""Stateful property test: random interleavings of lookup, store, release, evict and clear on a
small pool, with a three-token alphabet so prefixes are shared, split and extended all the time,
in two namespaces that must never hit each other's entries.

The reference model is a causal one: K/V at position i is a function of tokens[: i + 1] (`ref_kv`),
so whatever a hit reads back must equal the reference for the matched prefix, bit for bit, however
the blocks were shared, copied, extended or recycled on the way."""

from __future__ import annotations

from collections import Counter

import torch
from _cache_helpers import assert_hit_correct, make_cache, prefix_seeds, ref_kv
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import HitSource, Lookup

NUM_BLOCKS = 12
MAX_LEN = 24
MAX_OUTSTANDING = 4
alphabet = st.integers(0, 2)
namespaces = st.sampled_from(["", "tenant"])


def logits_for(tokens: list[int]) -> torch.Tensor:
    """A logits row that identifies the sequence it was computed for."""
    return torch.tensor([float(prefix_seeds(tokens)[-1]), float(len(tokens))])


def lcp(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache = make_cache(NUM_BLOCKS, 4)
        self.outstanding: list[tuple[str, list[int], Lookup]] = []
        # every (namespace, prefix) ever cached: a hit must come from one of its namespace
        self.stored: list[tuple[str, list[int]]] = []

    @initialize(policy=st.sampled_from(["lru", "sink-lru", "h2o"]), bs=st.sampled_from([1, 3, 4]))
    def setup(self, policy: str, bs: int) -> None:
        self.cache = make_cache(NUM_BLOCKS, bs, policy=policy)

    # ---- drawing sequences -------------------------------------------------------------------

    def draw_tokens(self, data: st.DataObject) -> tuple[str, list[int]]:
        """A namespace and a sequence, often related to one stored in either namespace."""
        namespace = data.draw(namespaces, label="namespace")
        if self.stored and data.draw(st.booleans(), label="related"):
            _, base = data.draw(st.sampled_from(self.stored), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            tail = data.draw(st.lists(alphabet, max_size=8), label="tail")
            tokens = base[:cut] + tail
        else:
            tokens = data.draw(st.lists(alphabet, min_size=1, max_size=16), label="fresh")
        return namespace, tokens[:MAX_LEN] or [0]

    # ---- rules -------------------------------------------------------------------------------

    def _lookup(self, namespace: str, tokens: list[int]) -> Lookup:
        hit = self.cache.lookup(tokens, namespace=namespace)
        n = len(tokens)
        assert hit.prompt_tokens == n
        assert 0 <= hit.matched <= n
        assert len(hit.blocks) == -(-hit.matched // self.cache.block_size)
        if hit.source is HitSource.EXACT:
            assert hit.matched == n and hit.logits is not None
            assert torch.equal(hit.logits, logits_for(tokens))
        else:
            assert hit.logits is None and hit.matched <= n - 1
            assert (hit.source is HitSource.MISS) == (hit.matched == 0)
        # a hit can only come from something that was stored, in the same namespace
        assert hit.matched <= max(
            (lcp(tokens, s) for ns, s in self.stored if ns == namespace), default=0)
        assert_hit_correct(self.cache, hit, tokens)
        return hit

    @precondition(lambda self: len(self.outstanding) < MAX_OUTSTANDING)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        namespace, tokens = self.draw_tokens(data)
        self.outstanding.append((namespace, tokens, self._lookup(namespace, tokens)))

    def _store(self, namespace: str, tokens: list[int], skip: int, data: st.DataObject) -> None:
        n = len(tokens)
        logits_len = None
        logits = None
        if data.draw(st.booleans(), label="with logits"):
            # the logits of the prompt, which may be shorter than what is stored after it
            logits_len = data.draw(st.integers(max(skip, 1), n), label="logits_len")
            logits = logits_for(tokens[:logits_len])
        hold = data.draw(st.booleans(), label="hold")
        res = self.cache.write_kv(tokens, ref_kv(tokens, skip), skip, logits, logits_len, hold=hold,
                               namespace=namespace)
        self.cache.check_integrity()
        if not hold:  # blocks are the tree's: a store takes no reference unless asked
            self.ref_counts_are_the_outstanding_lookups()
        assert 0 <= res.stored <= n and res.complete == (res.stored == n)
        assert len(res.blocks) == -(-res.stored // self.cache.block_size)
        if res.stored:
            self.stored.append((namespace, tokens[: res.stored]))
            got = self.cache.gather(res.blocks, res.stored)
            want = ref_kv(tokens, 0, res.stored)
            assert all(
                torch.equal(gk, wk) and torch.equal(gv, wv)
                for (gk, gv), (wk, wv) in zip(got, want, strict=True)
            )
            assert self.cache.peek(tokens, namespace) >= res.stored
        if hold:
            holds = Counter(b.block_id for *_, hit in self.outstanding for b in hit.blocks)
            assert all(b.ref_count == holds[b.block_id] + 1 for b in res.blocks)
            self.cache.release(res.blocks)
        if logits is not None and logits_len is not None and logits_len <= res.stored:
            hit = self._lookup(namespace, tokens[:logits_len])
            assert hit.source is HitSource.EXACT
            self.cache.release(hit.blocks)

    @rule(data=st.data())
    def store_fresh(self, data: st.DataObject) -> None:
        self._store(*self.draw_tokens(data), 0, data)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def store_after_lookup(self, data: st.DataObject) -> None:
        """What a request does: compute K/V past its hit (and maybe generate more), store,
        and usually release the blocks it looked up."""
        i = data.draw(st.integers(0, len(self.outstanding) - 1), label="which lookup")
        namespace, tokens, hit = self.outstanding[i]
        generated = data.draw(st.lists(alphabet, max_size=6), label="generated")
        self._store(namespace, (tokens + generated)[:MAX_LEN], hit.matched, data)
        if data.draw(st.booleans(), label="release after"):
            self.cache.release(hit.blocks)
            del self.outstanding[i]

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.outstanding) - 1), label="which lookup")
        *_, hit = self.outstanding.pop(i)
        self.cache.release(hit.blocks)

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        before = self.cache.stats().pool.used_blocks
        done = self.cache.evict(n)
        assert 0 <= done <= n
        assert self.cache.stats().pool.used_blocks == before - done

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        assert len(self.cache.exact) == 0
        # only what an outstanding lookup holds survives, with the path leading to it
        for leaf in self.cache.tree.leaves():
            assert leaf.blocks[-1].ref_count > 0

    @rule(data=st.data())
    def attend(self, data: st.DataObject) -> None:
        blocks = list(self.cache.tree.all_blocks())
        if blocks:
            picked = data.draw(st.lists(st.sampled_from(blocks), max_size=4), label="attended")
            self.cache.record_attention(picked, [0.5] * len(picked))

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()

    @invariant()
    def ref_counts_are_the_outstanding_lookups(self) -> None:
        holds = Counter(b.block_id for *_, hit in self.outstanding for b in hit.blocks)
        for block in self.cache.manager.blocks:
            assert block.ref_count == holds[block.block_id], block

    @invariant()
    def held_kv_is_never_overwritten(self) -> None:
        for _, tokens, hit in self.outstanding:
            assert_hit_correct(self.cache, hit, tokens)

    def teardown(self) -> None:
        for *_, hit in self.outstanding:
            self.cache.release(hit.blocks)
        self.cache.check_integrity()


CacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestCacheStateMachine = CacheMachine.TestCase
