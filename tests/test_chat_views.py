"""The chat and inspect views: pure functions of plain data, checked as the exact text they
print in an 80-column terminal; and the plain-data adapters from a live cache and a snapshot."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from rich.console import Console

from kvchat.cache.stats import CacheStats, PoolStats, SessionCounters
from kvchat.inspect import documents as cv
from kvchat.inspect import previews as pv
from kvchat.inspect.documents import ExactView, NodeView
from kvchat.ui import inspect_view, views
from kvchat.ui.views import TurnView


def render(renderable, width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def letters(ids) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


TURN = TurnView(
    number=2, prompt_tokens=412, hit_tokens=398, source="radix", ttft_ms=38.2, prefill_ms=31.0,
    completion_tokens=48, decode_tokens_per_s=61.3, finish_reason="stop", saved_ms=240.0,
)
STATS = CacheStats(
    policy="lru", pool=PoolStats(block_size=16, total_blocks=4096, used_blocks=52),
    tree_tokens=830, tree_nodes=5, exact_entries=3, hit_count=3, miss_count=1, exact_hits=1,
    hit_tokens=700, lookup_tokens=760, eviction_count=0, stored_tokens=830,
    sessions={"demo": SessionCounters(2, 1, 300, 250)},
)
NODES = (
    NodeView(0, tuple(range(16)), 1, 0, ("demo", "other", "x"), (
        NodeView(16, tuple(range(40, 70)), 2, 1, ("other",)),
        NodeView(16, tuple(range(16, 36)), 2, 0, ("demo",)),
        NodeView(16, (5,), 1, 0, ("x",)),
        NodeView(16, (6,), 1, 0, ("x",), (NodeView(32, (7, 8), 1, 0, ("x",)),)),
    )),
)


def test_hit_panel_full_and_compact():
    assert render(views.hit_panel(TURN)) == "\n".join([
        "╭─ turn 2 · cache ─────────────────╮",
        "│ cached 398 / 412 tok  96.6%      │",
        "│ ███████████████████████░ radix   │",
        "│ computed 14 tok · prefill 31 ms  │",
        "│ TTFT 38 ms · saved ≈ 240 ms est. │",
        "│ reply 48 tok · 61 tok/s · stop   │",
        "╰──────────────────────────────────╯",
    ])
    assert render(views.hit_panel(TURN, "compact")) == (
        "turn 2 · 398/412 cached 96.6% radix · TTFT 38 ms · saved ≈ 240 ms est."
    )


def test_hit_panel_says_how_much_of_the_reply_was_drafted():
    drafted = TurnView(3, 412, 412, "exact", 1.0, 0.5, 48, 240.0, "stop", 240.0,
                       draft_tokens=42, draft_accepted=40)
    lines = render(views.hit_panel(drafted)).splitlines()
    assert "reply 48 tok · 240 tok/s · stop" in lines[5]
    assert "drafted 40 of 48 reply tok from the cache (42 proposed)" in lines[6]
    assert "drafted" not in render(views.hit_panel(TURN))


def test_hit_panel_says_a_reply_was_replayed_with_no_forward():
    replayed = TurnView(3, 412, 412, "exact", 1.0, 0.5, 48, 0.0, "length", 240.0,
                        replayed_tokens=48)
    lines = render(views.hit_panel(replayed)).splitlines()
    assert "reply 48 tok · replayed · length" in lines[5]
    assert "replayed 48 reply tok from the cache: no forward" in lines[6]
    assert "replayed" not in render(views.hit_panel(TURN))


def test_hit_panel_without_a_rate_says_so():
    first = TurnView(1, 100, 0, "miss", 1500.0, 1490.0, 3, 10.0, "interrupted", None)
    text = render(views.hit_panel(first))
    assert "cached 0 / 100 tok  0.0%" in text
    assert "░" * 24 + " miss" in text
    assert "TTFT 1.50 s · saved —" in text
    assert "reply 3 tok · 10 tok/s · interrupted" in text


def test_pool_panel_full_and_compact():
    assert render(views.pool_panel(STATS)) == "\n".join([
        "╭─ block pool · lru ───────────────╮",
        "│ used 52 / 4,096 blocks · 1.3%    │",
        "│ █░░░░░░░░░░░░░░░░░░░░░░░         │",
        "│ free 4,044 · evictions 0         │",
        "│ hit rate 75.0% (92.1% of tokens) │",
        "│ cached 830 tok in 5 nodes        │",
        "╰──────────────────────────────────╯",
    ])
    assert render(views.pool_panel(STATS, "compact")) == (
        "pool 52/4,096 blk 1.3% · 0 evicted · hit rate 75.0% · 830 tok cached"
    )


def test_pool_panel_of_an_old_snapshot_without_pool_size():
    old = replace(STATS, pool=replace(STATS.pool, total_blocks=None))
    text = render(views.pool_panel(old))
    assert "used 52 blocks (pool size not recorded)" in text
    assert "free ? · evictions 0" in text


def test_tree_view_collapses_siblings_and_depth_and_puts_the_session_first():
    text = render(views.tree_view(NODES, letters, depth=2, max_children=3, highlight="demo"))
    assert text == "\n".join([
        "radix tree · 6 nodes · 70 tok",
        '└── 16 tok · 1 blk · ref 0 "abcdefghijklmnop" demo, other +1',
        '    ├── 20 tok · 2 blk · ref 0 "qrstuvwxyzabcdefghij" demo',
        '    ├── 30 tok · 2 blk · ref 1 "opqrstuvwxy…ghijklmnopqr" other',
        '    ├── 1 tok · 1 blk · ref 0 "f" x',
        "    └── … 1 more",
    ])
    deep = render(views.tree_view(NODES, None, depth=2, max_children=4))
    assert '├── 30 tok · 2 blk · ref 1 "40 41 42 43 44 45 46 47…" other' in deep
    assert '└── 1 tok · 1 blk · ref 0 "6" x' in deep
    assert "        └── … 1 more below" in deep


def test_tree_view_of_an_empty_cache():
    assert render(views.tree_view((), None)) == "radix tree · 0 nodes · 0 tok\n└── (empty)"


def test_turn_panels_fit_80_columns_and_modes():
    full = render(views.turn_panels(TURN, STATS, NODES, letters, "full", "demo"))
    assert max(len(line) for line in full.splitlines()) <= 80
    first = full.splitlines()[0]
    assert first.startswith("╭─ turn 2 · cache") and "╭─ block pool · lru" in first
    assert "radix tree · 6 nodes · 70 tok" in full
    compact = render(views.turn_panels(TURN, STATS, NODES, letters, "compact", "demo"))
    assert compact.splitlines() == [
        "turn 2 · 398/412 cached 96.6% radix · TTFT 38 ms · saved ≈ 240 ms est.",
        "pool 52/4,096 blk 1.3% · 0 evicted · hit rate 75.0% · 830 tok cached",
        "tree 6 nodes · 70 tok · demo: 36 tok in 2 nodes",
    ]
    assert render(views.turn_panels(TURN, STATS, NODES, letters, "off")) == ""


def test_previews_escape_control_characters_and_truncate():
    assert pv.preview("a\nb\r\nc\td\x1b") == "a⏎b⏎c·d·"
    assert pv.preview("x" * 30) == "x" * 23 + "…"
    assert pv.tail_preview(list(range(40)), letters, 10) == "…fghijklmn"
    assert pv.ids_preview([1, 22, 333]) == "1 22 333"
    # a long edge shows where it starts and where it ends
    assert pv.edge_preview(list(range(40)), letters) == "abcdefghijk…cdefghijklmn"
    assert pv.edge_preview(list(range(5)), letters) == "abcde"


def test_printable_shows_terminal_controls_instead_of_running_them():
    assert views.printable("ok\n\tgo\x1b[2J\x07\x7f\x85é") == "ok\n\tgo␛[2J␇␡�é"


def test_bar_never_rounds_a_little_to_nothing():
    assert views.bar(0.0, 10) == "░" * 10
    assert views.bar(0.01, 10) == "█" + "░" * 9
    assert views.bar(0.999, 10) == "█" * 9 + "░"
    assert views.bar(1.0, 10) == "█" * 10


def test_prefill_rate_is_the_fastest_of_the_long_prefills():
    # short prefills are mostly fixed cost; a busy moment's slow prefill (the issue: 22.6 s
    # "saved" on a turn whose TTFT was 1.4 s) must not set the rate
    assert views.prefill_rate([(200, 100.0), (5, 30.0), (0, 1.0)]) == pytest.approx(0.5)
    assert views.prefill_rate([(500, 25_000.0), (100, 60.0), (40, 40.0)]) == pytest.approx(0.6)
    assert views.prefill_rate([(5, 30.0), (8, 16.0)]) == pytest.approx(2.0)  # none long enough
    assert views.prefill_rate([(0, 2.0)]) is None
    assert views.prefill_rate([]) is None
    assert views.estimate_saved_ms(398, 0.5) == pytest.approx(199.0)
    assert views.estimate_saved_ms(398, None) is None


def test_tree_json_schema_and_depth_limit():
    doc = cv.tree_json(NODES, letters, depth=1)
    assert doc == [{
        "start": 0, "n_tokens": 16, "n_blocks": 1, "disk_blocks": 0, "max_ref": 0,
        "owners": ["demo", "other", "x"], "pinned": False, "preview": "abcdefghijklmnop",
        "tokens": list(range(16)), "children": [], "children_omitted": 4,
    }]
    full = cv.tree_json(NODES)
    assert [c["n_tokens"] for c in full[0]["children"]] == [30, 20, 1, 1]
    assert full[0]["children"][3]["children"][0]["tokens"] == [7, 8]
    assert full[0]["children"][0]["preview"] == "40 41 42 43 44 45 46 47…"


def test_owned_by_keeps_the_sessions_branches_only():
    mine = cv.owned_by(NODES, "demo")
    assert [n.tokens for n in cv.walk(mine)] == [tuple(range(16)), tuple(range(16, 36))]
    assert cv.owned_by(NODES, "nobody") == ()
    assert cv.covers(mine, list(range(20)))
    assert cv.covers(mine, list(range(36)))
    assert not cv.covers(mine, list(range(37)))
    assert not cv.covers(mine, [0, 1, 2, 9])


def test_adapters_agree_between_a_live_cache_and_its_snapshot_meta():
    import random

    import torch

    from kvchat.cache.kvcache import PagedKVCache
    from kvchat.cache.tree_index import export_index
    from kvchat.config import CacheConfig

    cache = PagedKVCache.create(CacheConfig(4, num_blocks=64), 1, 1, 2)
    rng = random.Random(0)
    shared = [rng.randrange(100) for _ in range(9)]
    for i, tail in enumerate(([1, 2, 3], [4, 5, 6, 7, 8], [9])):
        tokens = shared + tail
        kv = [(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))]
        cache.write_kv(tokens, kv, 0, sid=f"s{i}")
    held = cache.lookup(shared + [1, 2, 3], sid="s0")
    reading = cv.nodes_from_cache(cache)
    assert [n.max_ref for n in cv.walk(reading)] == [1, 1, 0, 0]  # the lookup holds a path
    cache.release(held.blocks)
    meta = json.loads(json.dumps(export_index(cache)))  # as index.json holds it
    live, saved = cv.nodes_from_cache(cache), cv.nodes_from_meta(meta)
    assert live == saved
    assert [n.owners for n in cv.walk(live)] == [("s0", "s1", "s2"), ("s0",), ("s1",), ("s2",)]
    assert cv.exact_from_cache(cache) == cv.exact_from_meta(meta)
    live_stats = cache.stats()
    pool = {"total_blocks": 64, "bytes_per_block": live_stats.pool.bytes_per_block}
    from_meta = cv.stats_from_meta(meta | {"pool": pool}, saved)
    assert from_meta == live_stats
    assert from_meta.tree_tokens == cache.tree.num_tokens
    assert from_meta.sessions["s0"] == SessionCounters(1, 1, 12, 11)
    # a snapshot from before the pool size was recorded: occupancy only
    old = cv.stats_from_meta(meta, saved)
    assert (old.pool.total_blocks, old.pool.free_blocks, old.pool.utilisation) == (None,) * 3
    assert old.pool.used_blocks == live_stats.pool.used_blocks


def test_meta_that_is_not_a_cache_is_a_format_error():
    with pytest.raises(cv.SnapshotFormatError, match="does not describe a cache"):
        cv.nodes_from_meta({"tree": [{"start": 0}], "blocks": []})
    with pytest.raises(cv.SnapshotFormatError):
        cv.nodes_from_meta({"tree": [{"start": 0, "blocks": [3], "children": []}], "blocks": []})
    with pytest.raises(cv.SnapshotFormatError):
        cv.stats_from_meta({"tree": [], "blocks": 3, "block_size": 4}, ())


def test_exact_table_lists_newest_first_and_counts_the_rest():
    # each entry is a prefix of the next: only the longest has a part of its own
    entries = [ExactView(tuple(range(n)), n // 4 + 1, n % 2 == 0) for n in range(1, 14)]
    text = render(inspect_view.exact_table(entries, letters, limit=2))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    assert lines[0] == "exact index · 13 entries"
    assert lines[1].split() == ["tokens", "blocks", "logits", "what", "sets", "it", "apart"]
    assert lines[3].split() == ["13", "4", "no", "m"]
    assert lines[4].split() == ["12", "4", "yes", "abcdefghijkl"]
    assert lines[5].split(maxsplit=1) == ["…", "11 more (--json lists all)"]


def test_previews_skip_what_a_sequence_shares_with_its_closest_sibling():
    a, b, c = (1, 2, 3, 4, 5), (1, 2, 3, 9), (7, 8)
    assert pv.distinct_offsets([a, b, c]) == [3, 3, 0]
    assert pv.distinct_offsets([a, a[:2]]) == [2, 2]
    assert pv.distinct_offsets([]) == []
    assert pv.distinct_preview(a, 3, letters) == "ef"
    assert pv.distinct_preview(a[:2], 2, letters) == "bc"  # a prefix of a sibling: its end
    siblings = (NodeView(4, a, 2, 0, ()), NodeView(4, b, 1, 0, ()))
    tree = render(views.tree_view(siblings, letters))
    assert '5 tok · 2 blk · ref 0 "ef"' in tree and '4 tok · 1 blk · ref 0 "j"' in tree
    assert [n["preview"] for n in cv.tree_json(siblings, letters)] == ["ef", "j"]
    exact = cv.exact_json([ExactView(a, 2, True), ExactView(b, 1, False)], letters)
    assert [(e["distinct_from"], e["preview"]) for e in exact] == [(3, "ef"), (3, "j")]


def test_stats_json_round_trips_and_derives_the_rates_once():
    doc = STATS.to_json()
    assert CacheStats.from_json(doc) == STATS
    assert CacheStats.from_json(json.loads(json.dumps(doc))) == STATS
    assert (doc["hit_rate"], doc["token_hit_rate"]) == (0.75, 700 / 760)
    assert doc["sessions"] == {"demo": {"lookups": 2, "hits": 1, "prompt_tokens": 300,
                                        "hit_tokens": 250, "hit_rate": 250 / 300}}
    assert doc["pool"] == {"block_size": 16, "total_blocks": 4096, "used_blocks": 52,
                           "free_blocks": 4044, "utilisation": 52 / 4096,
                           "bytes_per_block": None, "cached_tokens": 830}
    old = replace(STATS, pool=PoolStats(block_size=16, total_blocks=None, used_blocks=52))
    assert CacheStats.from_json(old.to_json()) == old
    assert old.to_json()["pool"]["free_blocks"] is None
    empty = CacheStats(policy="lru", pool=PoolStats(4, 8, 0), tree_nodes=0, tree_tokens=0,
                       exact_entries=0)
    assert (empty.hit_rate, empty.token_hit_rate, SessionCounters().hit_rate) == (0.0, 0.0, 0.0)


def test_inspect_document_filters_the_tree_by_session_but_not_the_stats():
    exact = (ExactView(tuple(range(20)), 2, True), ExactView((40, 41, 42), 1, False))
    where = {"path": "p", "saved_at": 1.0, "model_label": "m", "tokenizer_file": None}
    doc = cv.inspect_document({"model": "m"}, where, STATS, NODES, exact, letters, None, "demo")
    assert set(doc) == {"fingerprint", "snapshot", "stats", "pool", "tiers", "tree", "exact"}
    assert doc["snapshot"] == {**where, "session": "demo"}
    assert doc["stats"] == STATS.to_json() and doc["pool"] == doc["stats"]["pool"]
    assert [n["n_tokens"] for n in doc["tree"]] == [16]
    assert [c["n_tokens"] for c in doc["tree"][0]["children"]] == [20]
    assert [e["n_tokens"] for e in doc["exact"]] == [20]
    whole = cv.inspect_document({}, where, STATS, NODES, exact, None, 1)
    assert whole["snapshot"]["session"] is None and len(whole["exact"]) == 2
    assert whole["tree"][0]["children_omitted"] == 4


def test_streamed_text_wraps_between_words():
    from kvchat.chat.terminal import WordWrap

    out: list[str] = []
    wrap = WordWrap(out.append, 20, column=11)  # after "assistant> "
    for delta in ["The radix tree sh", "ares the str", "ucture of every prompt.\nNew line", "s"]:
        wrap.feed(delta)
    wrap.close()
    lines = "".join(out).split("\n")
    assert lines == ["The radix", "tree shares the ", "structure of every ", "prompt.",
                     "New lines"]  # no word is split ("str / ucture" was)
    assert all(len(line) <= 20 for line in lines[1:]) and 11 + len(lines[0]) <= 20
    hard: list[str] = []
    long = WordWrap(hard.append, 8)
    long.feed("abcdefghijkl mn")
    long.close()
    assert "".join(hard).split("\n") == ["abcdefgh", "ijkl mn"]


def test_pinned_nodes_are_marked_and_the_hit_panel_says_why_it_ended():
    pinned = (replace(NODES[0], pinned=True),)
    assert "pinned" in render(views.tree_view(pinned, letters))
    assert "pinned" not in render(views.tree_view(NODES, letters))
    assert cv.tree_json(pinned, letters)[0]["pinned"] is True
    why = replace(TURN, miss="diverged at token 37 of 90: cached 'date: 30' vs new 'date: 31'")
    assert "why diverged at token 37" in render(views.hit_panel(why))
    assert "why" not in render(views.hit_panel(TURN))
