"""Eviction policies in isolation (ranking, protection) and how a policy is chosen."""

from __future__ import annotations

import pytest
from _cache_helpers import in_node

from kvchat.cache.blocks import Block
from kvchat.cache.eviction import H2O, LRU, POLICIES, SinkLRU, make_policy
from kvchat.config import POLICY_ENV_VAR, CacheConfig, ConfigError, normalise_policy
from kvchat.errors import KvchatError


def blocks(n: int) -> list[Block]:
    return [Block(i, 4) for i in range(n)]


def test_lru_stamps_strictly_increasing_times_and_picks_the_oldest() -> None:
    p = LRU()
    bs = blocks(4)
    for i in [2, 0, 3, 1]:
        p.on_access(bs[i])
    assert [b.last_accessed for b in bs] == [2, 4, 1, 3]
    assert p.select_victim(bs) is bs[2]
    p.on_access(bs[2])
    assert p.select_victim(bs) is bs[0]


def test_lru_skips_referenced_blocks_and_may_return_none() -> None:
    p = LRU()
    bs = blocks(3)
    for b in bs:
        p.on_access(b)
    bs[0].acquire()
    assert p.select_victim(bs) is bs[1]
    bs[1].acquire()
    bs[2].acquire()
    assert p.select_victim(bs) is None
    assert p.select_victim([]) is None


def test_lru_ties_break_by_block_id() -> None:
    bs = blocks(3)
    assert LRU().select_victim([bs[2], bs[1], bs[0]]) is bs[0]


def test_lru_evicts_first_blocks_but_sink_lru_does_not() -> None:
    bs = blocks(3)
    for p in (LRU(), SinkLRU()):
        for b in bs:
            p.on_access(b)
    in_node([bs[0]], [1, 2])  # a sequence's first block
    assert LRU().select_victim(bs) is bs[0]
    assert SinkLRU().select_victim(bs) is bs[1]
    assert SinkLRU().select_victim([bs[0]]) is None


def test_attention_is_ignored_by_lru_and_accumulated_by_h2o() -> None:
    b = Block(0, 4)
    LRU().record_attention(b, 5.0)
    SinkLRU().record_attention(b, 5.0)
    assert b.attn_score == 0.0
    h = H2O()
    h.record_attention(b, 1.5)
    h.record_attention(b, 0.25)
    assert b.attn_score == 1.75


def test_h2o_picks_the_lowest_attention_mass_not_the_oldest() -> None:
    h = H2O()
    bs = blocks(4)
    for b in bs:
        h.on_access(b)
    for b, score in zip(bs, [0.9, 0.5, 0.1, 0.7], strict=True):
        h.record_attention(b, score)
    assert h.select_victim(bs) is bs[2]
    bs[2].acquire()
    assert h.select_victim(bs) is bs[1]


def test_h2o_protects_first_blocks_and_breaks_ties_by_age() -> None:
    h = H2O()
    bs = blocks(3)
    for b in [bs[2], bs[1], bs[0]]:
        h.on_access(b)
    in_node([bs[2]], [1, 2])  # a first block: the oldest and unscored, yet protected
    assert h.select_victim(bs) is bs[1]


def test_policy_names() -> None:
    assert {n: type(make_policy(n)).__name__ for n in POLICIES} == {
        "lru": "LRU",
        "sink-lru": "SinkLRU",
        "h2o": "H2O",
    }
    assert all(make_policy(n).name == n for n in POLICIES)
    assert make_policy("SINK_LRU").name == "sink-lru"
    assert make_policy(" H2O ").name == "h2o"


@pytest.mark.parametrize("bad", ["lfu", "random", "lru2"])
def test_unknown_policy_lists_the_valid_ones(bad: str) -> None:
    with pytest.raises(KvchatError) as err:
        make_policy(bad)
    msg = str(err.value)
    assert bad in msg and "lru, sink-lru, h2o" in msg and "--policy" in msg
    with pytest.raises(ConfigError, match="Valid policies: lru, sink-lru, h2o"):
        CacheConfig(policy=bad)


def test_env_var_selects_the_policy_when_none_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POLICY_ENV_VAR, raising=False)
    assert make_policy(None).name == "lru"
    monkeypatch.setenv(POLICY_ENV_VAR, "h2o")
    assert make_policy(None).name == "h2o"
    assert make_policy().name == "h2o"
    assert make_policy("sink-lru").name == "sink-lru"  # an explicit name wins
    monkeypatch.setenv(POLICY_ENV_VAR, "Sink-LRU")
    assert normalise_policy(None) == "sink-lru"
    monkeypatch.setenv(POLICY_ENV_VAR, "")
    assert make_policy(None).name == "lru"


def test_bad_env_var_names_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV_VAR, "fifo")
    with pytest.raises(ConfigError, match=r"\$EVICTION_POLICY") as err:
        make_policy(None)
    assert "lru, sink-lru, h2o" in str(err.value)


def test_cache_config_normalises_the_policy() -> None:
    assert CacheConfig(policy="sink").policy == "sink-lru"
    assert CacheConfig(policy="H2O").policy == "h2o"
