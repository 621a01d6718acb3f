"""One result type on its way to the chat's panels: the converters from a session's record of a
turn and from a server's reply into a `GenerationResult`, and from that into the panels' view."""

from __future__ import annotations

from kvchat.chat.server import reported
from kvchat.responses import result_from_turn
from kvchat.sessions import Turn
from kvchat.ui.views import turn_view

TURN = Turn(prompt_tokens=40, hit_tokens=28, source="radix", completion_tokens=5, ttft_ms=12.5,
            prefill_ms=7.25, finish_reason="stop", start_tokens=28)


def test_a_turns_record_reads_as_its_result():
    r = result_from_turn(TURN, decode_tokens_per_s=80.0)
    assert (r.prompt_tokens, r.cache_hit_tokens, r.computed_tokens, r.completion_tokens) == (
        40, 28, 12, 5)
    assert (r.hit_source, r.ttft_ms, r.prefill_ms, r.finish_reason) == (
        "radix", 12.5, 7.25, "stop")
    assert (r.decode_tokens_per_s, r.miss_reason, r.miss_label, r.miss_detail) == (
        80.0, "", "", "")


def test_a_servers_turn_adds_what_its_last_event_says():
    done = {"total_ms": 112.5, "ttft_ms": 12.5, "completion_tokens": 5, "hit_source": "disk",
            "disk_hit_tokens": 16, "miss_detail": "tokens 28-39 of 40 were never cached",
            "miss_reason": "cold", "miss_label": "", "draft_tokens": 3, "draft_accepted": 2,
            "replayed_tokens": 0}
    r = reported(TURN, done)
    assert r.decode_tokens_per_s == 4 / 0.1  # 4 tokens after the first, in 100 ms
    assert (r.hit_source, r.disk_hit_tokens, r.miss_reason, r.miss_label) == (
        "disk", 16, "cold", "cold")  # no label: the reason stands for it
    assert (r.draft_tokens, r.draft_accepted, r.replayed_tokens, r.prefill_ms) == (3, 2, 0, 7.25)
    assert reported(TURN, None) == result_from_turn(TURN)
    # a reply replayed from the cache was not decoded: it has no rate
    replayed = reported(TURN, {**done, "draft_tokens": 0, "draft_accepted": 0,
                               "replayed_tokens": 5})
    assert (replayed.replayed_tokens, replayed.decode_tokens_per_s) == (5, 0)


def test_the_panels_view_takes_counts_from_the_turn_and_the_story_from_the_result():
    r = reported(TURN, {"total_ms": 12.5, "ttft_ms": 12.5, "completion_tokens": 5,
                        "hit_source": "radix", "miss_detail": "diverged at token 28",
                        "miss_reason": "diverged", "miss_label": "shared prefix"})
    view = turn_view(3, TURN, r, saved_ms=20.0)
    assert (view.number, view.prompt_tokens, view.hit_tokens, view.computed_tokens) == (
        3, 40, 28, 12)
    assert (view.ttft_ms, view.prefill_ms, view.decode_tokens_per_s, view.saved_ms) == (
        12.5, 7.25, 0, 20.0)
    assert (view.miss, view.miss_label) == ("diverged at token 28", "shared prefix")
    hit = turn_view(3, TURN, result_from_turn(TURN), None)
    assert (hit.miss, hit.miss_label) == ("", "")  # nothing explained: no "why" line
