"""Pins, miss explanations and conversation moves over real HTTP with the tiny model: a pinned
system prompt outlives eviction pressure that takes everything else, the --max-pinned cap
refuses clearly, tenants never see or end each other's pins, /v1 replies carry kvchat's own
fields, and rewind, fork and retry reuse the cache as the REPL's moves do."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvchat.config import CacheConfig
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import Auth, create_app, serving
from kvchat.turns import system_prefix

SYSTEM = ("You are kvchat's test assistant. You answer every question about arithmetic in one "
          "short sentence, you never apologise, and you always give the number in digits.")
MAX_NEW = 8
BLOCK = 4
ADMIN, KEY_A, KEY_B = "admin-token", "key-a", "key-b"


class Served:
    def __init__(self, app: Any, runtime: Runtime, client: httpx.Client) -> None:
        self.app, self.runtime, self.client = app, runtime, client

    def on_engine(self, fn: Any) -> Any:
        return self.app.state.engine.call(fn).result(timeout=60)

    def check_cache(self) -> None:
        cache = self.runtime.cache
        self.on_engine(cache.check_integrity)
        assert self.on_engine(lambda: all(b.ref_count == 0 for b in cache.manager.blocks))

    def used_blocks(self) -> int:
        return int(self.on_engine(lambda: self.runtime.cache.manager.stats().used_blocks))

    def post(self, path: str, key: str | None = None, status: int = 200, **body: Any
             ) -> dict[str, Any]:
        reply = self.client.post(path, json=body, headers=bearer(key))
        assert reply.status_code == status, reply.text
        return dict(reply.json())

    def generate(self, key: str | None = None, **body: Any) -> dict[str, Any]:
        return self.post("/generate", key, max_tokens=MAX_NEW, **body)

    def get(self, path: str, key: str | None = None) -> dict[str, Any]:
        reply = self.client.get(path, headers=bearer(key))
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    def system_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        codec = self.runtime.engine.codec
        return system_prefix(codec, messages[:1], codec.encode_chat(messages))


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.contextmanager
def serve(model_dir: Path, sessions: Path, num_blocks: int = 2000, max_pinned: float = 0.5,
          auth: Auth | None = None, disk_cache_gb: float = 10.0) -> Iterator[Served]:
    cache = CacheConfig(BLOCK, num_blocks=num_blocks, max_pinned=max_pinned)
    runtime = Runtime.open(RuntimeOptions(model=str(model_dir), device="cpu",
                                          sessions_dir=sessions, cache=cache,
                                          disk_cache_gb=disk_cache_gb))
    app = create_app(runtime, batch_size=4, max_tokens=MAX_NEW, auth=auth)
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield Served(app, runtime, client)


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Served]:
    with serve(tiny_model_dir, tmp_path / "sessions") as s:
        yield s


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# ---- pins ------------------------------------------------------------------------------------


def test_a_pinned_system_prompt_survives_pressure_that_evicts_everything_else(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # 160 blocks of 4: 640 tokens, where each request below holds about 250; no disk tier,
    # so what eviction takes is gone
    with serve(tiny_model_dir, tmp_path / "s", num_blocks=160, disk_cache_gb=0) as s:
        first = chat(SYSTEM, "What is 2 plus 2?")
        reply = s.generate(messages=first, pin="system")
        expected = s.system_tokens(first)
        assert reply["pin"] == {"id": reply["pin"]["id"], "tokens": len(expected),
                                "label": "system prompt"}
        control = chat(SYSTEM.replace("kvchat's", "an unpinned"), "What is 2 plus 2?")
        s.generate(messages=control)
        for i in range(12):  # ~2,500 tokens through a 640-token pool
            s.generate(messages=chat(f"{i} is the number of this other assistant. " + SYSTEM,
                                     f"What is {i} plus {i}?"))
        s.check_cache()
        pins = s.get("/cache/pins")["pins"]
        assert [(p["id"], p["tokens"]) for p in pins] == [(reply["pin"]["id"], len(expected))]
        pin = next(iter(s.runtime.cache.pins))
        resident = s.on_engine(lambda: {b.block_id for b in s.runtime.cache.tree.all_blocks()})
        assert set(pin.block_ids) <= resident

        again = s.generate(messages=chat(SYSTEM, "What is 9 plus 9?"))
        assert len(expected) <= again["cache_hit_tokens"] < len(expected) + BLOCK
        # everything else went: the first prompt's own tokens, and the unpinned system prompt
        repeat = s.generate(messages=first)
        assert repeat["cache_hit_tokens"] < repeat["prompt_tokens"]
        assert repeat["miss_reason"] == "evicted"
        lost = s.generate(messages=control)
        assert lost["cache_hit_tokens"] < len(s.system_tokens(control)) // 2
        assert lost["miss_reason"] == "evicted"
        s.check_cache()


def test_a_pin_over_the_cap_is_refused_clearly(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 10% of 64 blocks: 6 blocks, 24 tokens; the system prefix needs ~50 blocks
    with serve(tiny_model_dir, tmp_path / "s", num_blocks=64, max_pinned=0.1) as s:
        messages = chat(SYSTEM, "What is 2 plus 2?")
        reply = s.generate(messages=messages, pin=True)
        assert reply["text"] and reply["completion_tokens"] > 0  # the reply still comes
        assert "--max-pinned" in reply["pin"]["error"]
        refused = s.post("/cache/pin", status=409, messages=messages, what="system")
        assert "--max-pinned" in refused["error"]["message"]
        assert "6 pinned blocks allowed" in refused["error"]["message"]
        uncached = s.post("/cache/pin", status=409, prompt="never sent", what="all")
        assert "run a request with them first" in uncached["error"]["message"]
        assert s.get("/cache/pins")["pins"] == []
        assert len(s.runtime.cache.pins) == 0
        s.check_cache()


def test_pin_endpoints_pin_list_and_unpin(served: Served) -> None:
    messages = chat(SYSTEM, "What is 2 plus 2?")
    served.generate(messages=messages)
    made = served.post("/cache/pin", status=201, messages=messages)
    assert made["tokens"] == len(served.system_tokens(messages))
    assert made["label"] == "system prompt" and made["blocks"] == -(-made["tokens"] // BLOCK)
    whole = served.post("/cache/pin", status=201, messages=messages, what="all")
    assert whole["label"] == "conversation" and whole["tokens"] > made["tokens"]
    listed = served.get("/cache/pins")
    assert {p["id"] for p in listed["pins"]} == {made["id"], whole["id"]}
    assert listed["max_pinned_blocks"] == 1000
    gone = served.client.request("DELETE", "/cache/pin", json={"id": made["id"]})
    assert gone.status_code == 200 and gone.json()["id"] == made["id"]
    assert served.client.delete("/cache/pin", params={"id": made["id"]}).status_code == 404
    assert served.client.delete("/cache/pin", params={"id": whole["id"]}).status_code == 200
    assert served.get("/cache/pins")["pins"] == []
    served.check_cache()


def test_a_tenant_never_sees_or_ends_another_tenants_pin(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    auth = Auth(ADMIN, (KEY_A, KEY_B))
    with serve(tiny_model_dir, tmp_path / "s", auth=auth) as s:
        reply = s.generate(KEY_A, messages=chat(SYSTEM, "What is 2 plus 2?"), pin="system")
        pin_id = reply["pin"]["id"]
        assert [p["id"] for p in s.get("/cache/pins", KEY_A)["pins"]] == [pin_id]
        assert "namespace" not in s.get("/cache/pins", KEY_A)["pins"][0]
        assert s.get("/cache/pins", KEY_B)["pins"] == []
        gone = s.client.delete("/cache/pin", params={"id": pin_id}, headers=bearer(KEY_B))
        assert gone.status_code == 404
        assert len(s.runtime.cache.pins) == 1  # still pinned
        admin = s.get("/cache/pins", ADMIN)["pins"]
        assert [p["id"] for p in admin] == [pin_id] and admin[0]["namespace"]
        mine = s.client.delete("/cache/pin", params={"id": pin_id}, headers=bearer(KEY_A))
        assert mine.status_code == 200
        assert s.get("/cache/pins", ADMIN)["pins"] == []
        s.check_cache()


def test_in_a_shared_cache_a_pin_lasts_until_its_last_owner_lets_go(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    auth = Auth(ADMIN, (KEY_A, KEY_B), share_cache=True)
    with serve(tiny_model_dir, tmp_path / "s", auth=auth) as s:
        messages = chat(SYSTEM, "What is 2 plus 2?")
        a = s.generate(KEY_A, messages=messages, pin="system")["pin"]
        assert s.get("/cache/pins", KEY_B)["pins"] == []  # A's, though in the shared space
        b = s.post("/cache/pin", KEY_B, status=201, messages=messages)
        assert a["id"] == b["id"]
        assert s.client.delete("/cache/pin", params={"id": a["id"]},
                               headers=bearer(KEY_A)).status_code == 200
        assert s.get("/cache/pins", KEY_A)["pins"] == []
        assert [p["id"] for p in s.get("/cache/pins", KEY_B)["pins"]] == [b["id"]]
        assert len(s.runtime.cache.pins) == 1  # B still relies on it


def test_a_streamed_reply_reports_its_pin_in_the_done_event(served: Served) -> None:
    body = {"prompt": "What is 2 plus 2?", "max_tokens": MAX_NEW, "stream": True, "pin": "all"}
    with served.client.stream("POST", "/generate", json=body) as stream:
        lines = list(stream.iter_lines())
    done = json.loads(lines[lines.index("event: done") + 1][6:])
    stored = done["prompt_tokens"] + done["completion_tokens"] - 1  # the last token's K/V: none
    assert done["pin"]["label"] == "conversation" and done["pin"]["tokens"] == stored
    pins = served.get("/cache/pins")["pins"]
    assert [p["id"] for p in pins] == [done["pin"]["id"]]
    served.check_cache()


# ---- /v1: kvchat's own fields -------------------------------------------------------------


def test_v1_replies_carry_the_miss_explanation(served: Served) -> None:
    body = {"messages": chat(SYSTEM, "What is 2 plus 2?"), "max_tokens": MAX_NEW,
            "temperature": 0}
    cold = served.post("/v1/chat/completions", **body)
    assert set(cold["kvchat"]) == {"miss_reason", "miss_label", "diverged_at", "miss_detail",
                                   "cache_hit_tokens"}
    assert cold["kvchat"]["miss_reason"] == "cold" and cold["kvchat"]["cache_hit_tokens"] == 0
    assert cold["kvchat"]["miss_detail"]
    other = served.post("/v1/chat/completions",
                        **{**body, "messages": chat(SYSTEM, "What is 7 plus 1?")})
    ext = other["kvchat"]
    assert ext["miss_reason"] == "diverged" and ext["diverged_at"] is not None
    assert ext["miss_label"] == "shared prefix"  # the same system prompt, then its own text
    assert ext["cache_hit_tokens"] == other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ext["cache_hit_tokens"] >= len(served.system_tokens(body["messages"]))

    pinned = served.post("/v1/chat/completions", **body, pin="system")
    assert pinned["kvchat"]["miss_reason"] == "hit"
    assert pinned["kvchat"]["pin"]["label"] == "system prompt"
    with served.client.stream("POST", "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    last = chunks[-1]
    assert last["usage"] and last["kvchat"]["miss_reason"] == "hit"
    assert last["kvchat"]["cache_hit_tokens"] == last["usage"]["prompt_tokens"]
    served.check_cache()


# ---- conversation moves --------------------------------------------------------------------


def history(served: Served, name: str, key: str | None = None) -> list[int]:
    return [int(t) for t in served.get(f"/sessions/{name}", key)["tokens"]]


def test_rewind_then_continue_hits_the_whole_earlier_history(served: Served) -> None:
    served.generate(prompt="What is 2 plus 2?", session="s", create_session=True, system=SYSTEM)
    served.generate(prompt="And 3 plus 3?", session="s")
    first_turn = served.get("/sessions/s")["turns"][0]
    rewound = served.post("/sessions/s/rewind", turns=1)
    assert rewound == {"session": "s", "rewound": 1, "turns": 1,
                       "tokens": len(history(served, "s"))}
    kept = history(served, "s")
    assert len(kept) == first_turn["prompt_tokens"] + first_turn["completion_tokens"]
    reply = served.generate(prompt="And 4 plus 4?", session="s")
    assert len(kept) <= reply["cache_hit_tokens"] < reply["prompt_tokens"]
    assert history(served, "s")[: len(kept)] == kept
    whole = served.post("/cache/pin", status=201, session="s", what="all")
    # all the history but its last reply token, whose K/V no forward computed
    assert whole["tokens"] == len(history(served, "s")) - 1
    assert served.client.delete("/cache/pin", params={"id": whole["id"]}).status_code == 200
    assert served.post("/sessions/s/rewind", turns=5)["rewound"] == 2
    served.post("/sessions/s/rewind", status=409)
    served.post("/sessions/nope/rewind", status=404)
    served.check_cache()


def test_a_fork_shares_its_history_blocks(served: Served) -> None:
    served.generate(prompt="What is 2 plus 2?", session="base", create_session=True,
                    system=SYSTEM)
    served.generate(prompt="And 3 plus 3?", session="base")
    base = history(served, "base")
    used = served.used_blocks()
    forked = served.post("/sessions/base/fork", status=201, name="branch")
    assert forked == {"session": "branch", "from": "base", "turns": 2, "tokens": len(base)}
    assert served.post("/sessions/base/fork", status=409, name="branch")["error"]["message"]
    reply = served.generate(prompt="And 5 plus 5?", session="branch")
    # all of it but the last reply token, whose K/V the base's turn never computed
    assert reply["cache_hit_tokens"] == len(base) - 1
    new = reply["prompt_tokens"] + reply["completion_tokens"] - reply["cache_hit_tokens"]
    grown = served.used_blocks() - used
    assert grown <= new // BLOCK + 2 < len(base) // BLOCK  # the history was not copied
    rows = served.get("/sessions/base/branches")["branches"]
    assert rows == [{"name": "branch", "shared_tokens": len(base), "turns": 3}]
    assert history(served, "base") == base
    served.check_cache()


def test_retry_at_temperature_0_is_the_same_reply_from_an_exact_hit(served: Served) -> None:
    served.generate(prompt="What is 2 plus 2?", session="r", create_session=True, system=SYSTEM)
    last = served.generate(prompt="And 3 plus 3?", session="r")
    before = served.get("/sessions/r")
    again = served.post("/sessions/r/retry")
    assert again["session"] == "r" and again["text"] == last["text"]
    assert again["hit_source"] == "exact"
    assert again["cache_hit_tokens"] == again["prompt_tokens"] == last["prompt_tokens"]
    after = served.get("/sessions/r")
    assert after["tokens"] == before["tokens"] and len(after["turns"]) == 2
    assert after["messages"] == before["messages"]
    served.post("/sessions/r/retry", status=400, temperature="hot")
    assert served.get("/sessions/r")["tokens"] == before["tokens"]
    served.generate(prompt="x", session="empty", create_session=True)
    served.post("/sessions/empty/rewind", turns=1)
    served.post("/sessions/empty/retry", status=409)
    served.check_cache()


def test_moves_are_the_callers_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_model_dir, tmp_path / "s", auth=Auth(ADMIN, (KEY_A, KEY_B))) as s:
        s.generate(KEY_A, prompt="What is 2 plus 2?", session="mine", create_session=True)
        for move, body in (("rewind", {}), ("retry", {}), ("fork", {"name": "theirs"})):
            s.post(f"/sessions/mine/{move}", KEY_B, status=404, **body)
        reply = s.client.get("/sessions/mine/branches", headers=bearer(KEY_B))
        assert reply.status_code == 404
        s.post("/sessions/mine/fork", KEY_A, status=201, name="copy")
        rows = s.get("/sessions/mine/branches", KEY_A)["branches"]
        assert [r["name"] for r in rows] == ["copy"]
        assert s.get("/sessions", KEY_B)["sessions"] == []
