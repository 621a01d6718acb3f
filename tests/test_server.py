"""`kvchat serve` over real HTTP on 127.0.0.1 with the tiny model: every endpoint, streaming,
OpenAI-client-shaped requests, bad input, a client that disconnects mid-stream, a bounded
concurrent load, and the snapshot written on SIGINT/SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from _server_helpers import wait_healthy
from typer.testing import CliRunner

from kvchat.cli import app as cli_app
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.sequence import Request
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import bind_warning, create_app, serving
from kvchat.session_lock import SessionsLocked, sessions_lock
from kvchat.snapshots import read_snapshot_meta

T = TypeVar("T")
SYSTEM = ("You are kvchat's test assistant. You answer every question about arithmetic in one "
          "short sentence, you never apologise, and you always give the number in digits.")
MAX_NEW = 8


@dataclass
class Served:
    url: str
    app: Any
    runtime: Runtime
    client: httpx.Client

    def on_engine(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread (the only thread that may touch the cache)."""
        return self.app.state.engine.call(fn).result(timeout=60)

    def wait_idle(self, timeout: float = 60.0) -> None:
        engine = self.app.state.engine.engine
        deadline = time.monotonic() + timeout
        while not self.on_engine(lambda: engine.idle):
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.02)

    def check_cache(self) -> None:
        cache = self.runtime.cache
        self.on_engine(cache.check_integrity)
        assert self.on_engine(lambda: all(b.ref_count == 0 for b in cache.manager.blocks))

    def cold(self, messages: list[dict[str, str]], max_new: int = MAX_NEW) -> list[int]:
        """Greedy tokens of the same model without any cache: the reference output."""
        b = self.runtime.engine
        request = Request(b.codec.encode_chat(messages), SamplingParams(max_new_tokens=max_new))
        return self.on_engine(lambda: b.without_cache().generate(request).token_ids)

    def decode(self, ids: list[int]) -> str:
        return self.runtime.engine.codec.decode(ids)


def open_runtime(model_dir: Path, sessions: Path) -> Runtime:
    return Runtime.open(RuntimeOptions(model=str(model_dir), device="cpu", sessions_dir=sessions,
                                       cache=CacheConfig(4, num_blocks=4000)))


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Served]:
    runtime = open_runtime(tiny_model_dir, tmp_path / "sessions")
    app = create_app(runtime, batch_size=4, max_tokens=MAX_NEW)
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield Served(url, app, runtime, client)


def sse_events(lines: Iterable[str]) -> list[tuple[str | None, str]]:
    """(event name, data) per server-sent event."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- endpoints -------------------------------------------------------------------------------


def test_healthz_and_models(served: Served) -> None:
    health = served.client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = served.client.get("/v1/models").json()
    # a local folder is reported by its name, not its full path
    assert models["object"] == "list"
    assert models["data"][0]["id"] == Path(str(served.runtime.options.model)).name


def test_generate_returns_the_cold_output_and_the_cache_hit(served: Served) -> None:
    first = served.client.post("/generate", json={"prompt": "What is 2 plus 2?"})
    again = served.client.post("/generate", json={"prompt": "What is 2 plus 2?"})
    assert first.status_code == again.status_code == 200
    a, b = first.json(), again.json()
    assert set(a) == {"text", "prompt_tokens", "completion_tokens", "cache_hit_tokens",
                      "disk_hit_tokens", "shared_hit_tokens", "hit_source", "ttft_ms",
                      "total_ms", "finish_reason", "miss_reason", "miss_label", "diverged_at",
                      "miss_detail", "draft_tokens", "draft_accepted", "replayed_tokens"}
    cold = served.cold(user("What is 2 plus 2?"))
    assert a["text"] == b["text"] == served.decode(cold)
    assert a["completion_tokens"] == len(cold) and a["finish_reason"] == "length"
    codec = served.runtime.engine.codec
    assert a["prompt_tokens"] == len(codec.encode_chat(user("What is 2 plus 2?")))
    # the template's default system prompt was new the first time; the repeat is an exact hit
    assert (a["hit_source"], a["cache_hit_tokens"]) == ("miss", 0)
    assert (b["hit_source"], b["cache_hit_tokens"]) == ("exact", b["prompt_tokens"])
    assert (a["miss_reason"], b["miss_reason"], a["diverged_at"]) == ("cold", "hit", None)
    assert (a["miss_label"], b["miss_label"]) == ("cold", "hit")
    # the repeat replayed the first one's reply, which reached its max_tokens: no forward
    assert a["replayed_tokens"] == a["draft_tokens"] == b["draft_tokens"] == 0
    assert b["replayed_tokens"] == b["completion_tokens"] == a["completion_tokens"]
    # a repeat asking for more drafts the stored reply, then decodes past it
    more = a["completion_tokens"] + 4
    c = served.client.post("/generate", json={"prompt": "What is 2 plus 2?",
                                              "max_tokens": more}).json()
    assert c["text"].startswith(a["text"]) and c["completion_tokens"] == more
    assert c["replayed_tokens"] == 0 and c["draft_accepted"] == c["draft_tokens"] > 0
    metrics = served.client.get("/metrics").text
    assert f"kvchat:draft_accepted_tokens_total {float(c['draft_accepted'])}" in metrics
    assert f"kvchat:replayed_tokens_total {float(b['replayed_tokens'])}" in metrics
    served.check_cache()


def test_generate_messages_and_system(served: Served) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "3 + 4?"}]
    by_messages = served.client.post("/generate", json={"messages": messages, "max_tokens": 5})
    by_system = served.client.post("/generate", json={"prompt": "3 + 4?", "system": SYSTEM,
                                                      "max_tokens": 5})
    assert by_messages.json()["text"] == served.decode(served.cold(messages, 5))
    assert by_system.json()["text"] == by_messages.json()["text"]
    assert by_system.json()["hit_source"] == "exact"


def test_generate_streams_tokens_then_stats(served: Served) -> None:
    body = {"prompt": "Count to three.", "max_tokens": 6, "stream": True}
    with served.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    names = [name for name, _ in events]
    assert names[-1] == "done" and set(names[:-1]) == {"token"} and len(names) > 2
    done = json.loads(events[-1][1])
    text = "".join(json.loads(data)["text"] for _, data in events[:-1])
    assert text == done["text"] == served.decode(served.cold(user("Count to three."), 6))
    assert done["completion_tokens"] == 6 and done["finish_reason"] == "length"


def test_session_turns_extend_the_session_history(served: Served, tmp_path: Path) -> None:
    post = served.client.post
    unknown = post("/generate", json={"prompt": "Hi", "session": "alice"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "session_not_found"
    one = post("/generate", json={"prompt": "Hi", "session": "alice", "create_session": True,
                                  "system": SYSTEM}).json()
    two = post("/generate", json={"prompt": "And then?", "session": "alice"}).json()
    assert one["session"] == two["session"] == "alice"
    # the second turn's prompt starts with everything the model saw in the first
    assert two["cache_hit_tokens"] >= one["prompt_tokens"] + one["completion_tokens"] - 1
    saved = json.loads((tmp_path / "sessions" / "alice.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["Hi", "And then?"]
    assert saved["system"] == SYSTEM and len(saved["turns"]) == 2
    assert len(saved["tokens"]) == two["prompt_tokens"] + two["completion_tokens"]
    stats = served.client.get("/cache/stats").json()
    assert stats["sessions"]["alice"]["lookups"] == 2
    assert stats["sessions"]["alice"]["hit_tokens"] == one["cache_hit_tokens"] + two[
        "cache_hit_tokens"]


def test_cache_stats(served: Served) -> None:
    for _ in range(2):
        served.client.post("/generate", json={"prompt": "Same question", "max_tokens": 3})
    stats = served.client.get("/cache/stats").json()
    assert (stats["hit_count"], stats["miss_count"], stats["hit_rate"]) == (1, 1, 0.5)
    assert stats["hit_tokens"] == stats["lookup_tokens"] / 2 > 0
    pool = stats["pool"]  # the same "stats" object as in /cache/tree and `kvchat inspect --json`
    assert pool["total_blocks"] == 4000
    assert pool["used_blocks"] + pool["free_blocks"] == 4000 and pool["used_blocks"] > 0
    assert pool["utilisation"] == pool["used_blocks"] / 4000
    assert (stats["policy"], stats["eviction_count"], stats["sessions"]) == ("lru", 0, {})
    server = stats["server"]
    assert (server["requests"], server["completed"], server["errors"]) == (2, 2, 0)
    assert server["batch_size"] == 4 and server["running"] == server["pending"] == 0


def _shape(doc: Any) -> Any:
    """The keys of a JSON document, recursively (lists by their first item)."""
    if isinstance(doc, dict):
        return {k: _shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_shape(doc[0])] if doc else []
    return None


def test_cache_tree_has_the_schema_of_inspect_json(served: Served, tmp_path: Path) -> None:
    served.client.post("/generate", json={"prompt": "Hi", "session": "bob",
                                          "create_session": True, "max_tokens": 4})
    served.client.post("/generate", json={"prompt": "Another question", "max_tokens": 4})
    live = served.client.get("/cache/tree").json()
    served.on_engine(served.runtime.save)
    result = CliRunner().invoke(cli_app, ["inspect", "--json", "--sessions-dir",
                                          str(tmp_path / "sessions")])
    assert result.exit_code == 0, result.output
    saved = json.loads(result.output)
    assert _shape(live) == _shape(saved)
    assert live["tree"] == saved["tree"] and live["exact"] == saved["exact"]
    assert live["stats"] == saved["stats"] and live["pool"] == saved["pool"]
    assert len(live["tree"]) == 1 and live["tree"][0]["children"]  # one shared template prefix
    bob = served.client.get("/cache/tree", params={"session": "bob", "depth": 1}).json()
    assert bob["snapshot"]["session"] == "bob"
    assert [n["owners"] for n in bob["tree"]] == [["bob"]]
    assert bob["tree"][0]["children"] == [] and bob["tree"][0]["children_omitted"] == 1


# ---- OpenAI-compatible ---------------------------------------------------------------------

# What the official Python client sends with every request.
OPENAI_HEADERS = {
    "Authorization": "Bearer sk-not-checked",
    "Content-Type": "application/json",
    "Accept": "application/json",
    "User-Agent": "OpenAI/Python 1.99.9",
    "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "1.99.9",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Runtime-Version": "3.11.7",
    "X-Stainless-Async": "false",
    "X-Stainless-Retry-Count": "0",
    "X-Stainless-Read-Timeout": "600",
}


def openai_post(served: Served, body: dict[str, Any]) -> httpx.Response:
    # the client joins base_url ".../v1" and "/chat/completions"
    return served.client.post(f"{served.url}/v1/chat/completions",
                              content=json.dumps(body), headers=OPENAI_HEADERS)


def test_openai_chat_completion(served: Served) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "5 + 5?"}]
    body = {"messages": messages, "model": "tiny-model", "max_tokens": 6, "temperature": 0}
    first, again = openai_post(served, body), openai_post(served, body)
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    out = first.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert isinstance(out["created"], int) and out["model"].startswith("tiny-model")
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == served.decode(served.cold(messages, 6))
    assert choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == usage[
        "prompt_tokens"]
    # content as text parts, the "developer" role, and fields kvchat ignores
    parts = {"messages": [{"role": "developer", "content": SYSTEM},
                          {"role": "user", "content": [{"type": "text", "text": "5 + "},
                                                       {"type": "text", "text": "5?"}]}],
             "model": "x", "max_completion_tokens": 6, "temperature": 0, "n": 1,
             "frequency_penalty": 0, "user": "someone"}
    assert openai_post(served, parts).json()["choices"] == out["choices"]


def test_openai_stream(served: Served) -> None:
    body = {"messages": user("Say hi."), "model": "tiny", "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with served.client.stream("POST", f"{served.url}/v1/chat/completions",
                              content=json.dumps(body), headers=OPENAI_HEADERS) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert content == served.decode(served.cold(user("Say hi."), 5))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


# ---- bad input -------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}
LONG = "many words " * 400  # > 2048 tokens of the byte-level tiny tokenizer

BAD: list[tuple[str, str, str, bytes, dict[str, str], int, str]] = [
    # (case, method, path, body, headers, status, error type)
    ("invalid json", "POST", "/generate", b'{"prompt": "x"', JSON, 400, "invalid_json"),
    ("not an object", "POST", "/generate", b"[1, 2]", JSON, 400, "invalid_request_error"),
    ("no body", "POST", "/generate", b"", JSON, 400, "invalid_request_error"),
    ("no prompt", "POST", "/generate", b'{"max_tokens": 3}', JSON, 400,
     "invalid_request_error"),
    ("prompt and messages", "POST", "/generate",
     b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', JSON, 400,
     "invalid_request_error"),
    ("prompt type", "POST", "/generate", b'{"prompt": 5}', JSON, 400, "invalid_request_error"),
    ("max_tokens type", "POST", "/generate", b'{"prompt": "x", "max_tokens": "9"}', JSON, 400,
     "invalid_request_error"),
    ("stream type", "POST", "/generate", b'{"prompt": "x", "stream": "yes"}', JSON, 400,
     "invalid_request_error"),
    ("messages type", "POST", "/generate", b'{"messages": "hello"}', JSON, 400,
     "invalid_request_error"),
    ("bad role", "POST", "/generate", b'{"messages": [{"role": "robot", "content": "x"}]}',
     JSON, 400, "invalid_request_error"),
    ("unknown field", "POST", "/generate", b'{"prompt": "x", "colour": "red"}', JSON, 400,
     "invalid_request_error"),
    ("oversize prompt", "POST", "/generate", json.dumps({"prompt": LONG}).encode(), JSON, 400,
     "context_length_exceeded"),
    ("max_tokens 0", "POST", "/generate", b'{"prompt": "x", "max_tokens": 0}', JSON, 400,
     "invalid_request_error"),
    ("max_tokens above context", "POST", "/generate", b'{"prompt": "x", "max_tokens": 5000}',
     JSON, 400, "invalid_request_error"),
    ("negative temperature", "POST", "/generate", b'{"prompt": "x", "temperature": -1}', JSON,
     400, "invalid_request_error"),
    ("invalid session name", "POST", "/generate", b'{"prompt": "x", "session": "../etc"}',
     JSON, 400, "invalid_request_error"),
    ("unknown session", "POST", "/generate", b'{"prompt": "x", "session": "nobody"}', JSON,
     404, "session_not_found"),
    ("create without name", "POST", "/generate", b'{"prompt": "x", "create_session": true}',
     JSON, 400, "invalid_request_error"),
    ("session with messages", "POST", "/generate",
     b'{"session": "s", "messages": [{"role": "user", "content": "y"}]}', JSON, 400,
     "invalid_request_error"),
    ("not json content type", "POST", "/generate", b'{"prompt": "x"}',
     {"Content-Type": "text/plain"}, 415, "invalid_request_error"),
    ("body too large", "POST", "/generate", b" " * (9 * 1024 * 1024), JSON, 413,
     "request_too_large"),
    ("wrong method", "GET", "/generate", b"", {}, 405, "method_not_allowed"),
    ("unknown path", "GET", "/nowhere", b"", {}, 404, "not_found"),
    ("tree depth", "GET", "/cache/tree?depth=0", b"", {}, 400, "invalid_request_error"),
    ("tree session", "GET", "/cache/tree?session=..%2Fx", b"", {}, 400,
     "invalid_request_error"),
    ("openai no messages", "POST", "/v1/chat/completions", b'{"model": "m"}', JSON, 400,
     "invalid_request_error"),
    ("openai n=2", "POST", "/v1/chat/completions",
     b'{"model": "m", "n": 2, "messages": [{"role": "user", "content": "y"}]}', JSON, 400,
     "invalid_request_error"),
    ("openai temperature", "POST", "/v1/chat/completions",
     b'{"temperature": -1, "messages": [{"role": "user", "content": "y"}]}', JSON, 400,
     "invalid_request_error"),
    ("openai tool role", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "tool", "content": "y"}]}', JSON, 400, "invalid_request_error"),
    ("openai oversize", "POST", "/v1/chat/completions",
     json.dumps({"messages": user(LONG)}).encode(), JSON, 400, "context_length_exceeded"),
]


def test_bad_input_gets_a_4xx_json_error_and_the_server_keeps_serving(served: Served) -> None:
    for case, method, path, body, headers, status, kind in BAD:
        response = served.client.request(method, path, content=body, headers=headers)
        assert response.status_code == status, (case, response.text)
        error = response.json()["error"]
        assert error["type"] == kind and error["message"], case
        assert served.client.get("/healthz").status_code == 200, case
    assert not (Path(served.runtime.options.sessions_dir) / "nobody.json").exists()
    ok = served.client.post("/generate", json={"prompt": "Still there?"})
    assert ok.status_code == 200 and ok.json()["completion_tokens"] == MAX_NEW
    served.wait_idle()
    stats = served.client.get("/cache/stats").json()
    assert stats["server"]["errors"] == 0 and stats["server"]["completed"] == 1
    served.check_cache()


# ---- disconnects -----------------------------------------------------------------------------


def test_a_bad_sampling_value_is_a_400_and_cuts_off_nobody(served: Served) -> None:
    """Values that once crashed a batched step (1e-40 overflows the softmax, 2**70 does not fit
    a seed) are refused where they are parsed; a stream running meanwhile ends normally."""
    import threading

    long_body = {"prompt": "Tell me a long story.", "max_tokens": 40, "stream": True}
    events: list[tuple[str | None, str]] = []

    def stream() -> None:
        with served.client.stream("POST", "/generate", json=long_body) as response:
            events.extend(sse_events(response.iter_lines()))

    runner = threading.Thread(target=stream)
    runner.start()
    bad = [{"prompt": "x", "temperature": 1e-40}, {"prompt": "x", "seed": 2**70},
           {"prompt": "x", "top_p": 0}]
    for body in bad:
        res = served.client.post("/generate", json=body)
        assert res.status_code == 400, res.text
        assert res.json()["error"]["type"] == "invalid_request_error"
    chat = served.client.post("/v1/chat/completions", json={
        "messages": user("x"), "temperature": 1e-40})
    assert chat.status_code == 400
    runner.join(60)
    done = [json.loads(data) for name, data in events if name == "done"]
    assert done and done[0]["finish_reason"] in ("stop", "length")
    served.wait_idle()
    served.check_cache()


def test_disconnect_mid_stream_cancels_and_keeps_the_kv(served: Served) -> None:
    long = 1500  # far more tokens than the test waits for
    body = {"prompt": "Tell me a long story.", "max_tokens": long, "stream": True}
    with served.client.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: token"
    # the with block closed the connection after the first event
    deadline = time.monotonic() + 60
    while served.client.get("/cache/stats").json()["server"]["cancelled"] < 1:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.02)
    served.wait_idle()
    served.check_cache()
    stats = served.client.get("/cache/stats").json()
    prompt_tokens = len(served.runtime.engine.codec.encode_chat(user("Tell me a long story.")))
    assert stats["server"]["decode_steps"] < long - 1
    # prompt and the tokens generated before the cancel are stored
    assert prompt_tokens <= stats["tree_tokens"] < prompt_tokens + long
    again = served.client.post("/generate", json={"prompt": "Tell me a long story.",
                                                  "max_tokens": 3}).json()
    assert (again["hit_source"], again["cache_hit_tokens"]) == ("exact", prompt_tokens)


@pytest.mark.parametrize("keep", [True, False])
def test_a_session_turn_cut_by_a_disconnect_is_kept_unless_asked_not(served: Served,
                                                                     keep: bool) -> None:
    """As the REPL, a session keeps a reply its client hung up on; `"keep_interrupted": false`
    (kvchat batch's session lines, which --resume sends again) leaves the session as it was."""
    name = f"cut-{keep}"
    first = served.client.post("/generate", json={"prompt": "Hello.", "max_tokens": 2,
                                                  "session": name, "create_session": True})
    assert first.status_code == 200
    cancelled = served.client.get("/cache/stats").json()["server"]["cancelled"]
    body = {"prompt": "Tell me a long story.", "max_tokens": 1500, "stream": True,
            "session": name, "keep_interrupted": keep}
    with served.client.stream("POST", "/generate", json=body) as response:
        assert next(response.iter_lines()) == "event: token"
    deadline = time.monotonic() + 60
    while served.client.get("/cache/stats").json()["server"]["cancelled"] <= cancelled:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.02)
    served.wait_idle()
    turns = served.client.get(f"/sessions/{name}").json()["turns"]
    assert len(turns) == (2 if keep else 1)
    if keep:
        assert turns[-1]["finish_reason"] == "interrupted"


def test_disconnect_while_waiting_for_a_whole_reply(served: Served) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Another long story.", "max_tokens": 1500}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while not served.client.get("/cache/stats").json()["server"]["running"]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    deadline = time.monotonic() + 60
    while served.client.get("/cache/stats").json()["server"]["cancelled"] < 1:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.02)
    served.wait_idle()
    served.check_cache()
    assert served.client.get("/cache/stats").json()["server"]["decode_steps"] < 1499


def test_shutdown_interrupts_a_stream_then_saves(tiny_model_dir: Path, tmp_path: Path) -> None:
    runtime = open_runtime(tiny_model_dir, tmp_path / "sessions")
    app = create_app(runtime)
    body = {"prompt": "An endless story.", "max_tokens": 1900, "stream": True}
    with serving(app, grace_s=0.1) as (url, server), httpx.stream(
        "POST", f"{url}/generate", json=body, timeout=60
    ) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: token"
        server.should_exit = True  # what SIGINT and SIGTERM do
        events = sse_events(lines)
    assert events[-1][0] == "done"
    done = json.loads(events[-1][1])
    assert done["finish_reason"] == "interrupted" and done["completion_tokens"] < 1900
    info = read_snapshot_meta(tmp_path / "sessions")
    assert info is not None and info.cached_tokens >= done["prompt_tokens"]
    assert app.state.engine.counters.cancelled == 1


# ---- load ------------------------------------------------------------------------------------


def test_concurrent_clients_share_the_system_prompt(served: Served) -> None:
    clients, per_client = 8, 20
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=served.url, timeout=120) as http:
            for i in range(per_client):
                r = http.post("/generate", json={"system": SYSTEM, "max_tokens": 4,
                                                 "prompt": f"Client {k}, question {i}: {k} + {i}?"})
                with lock:
                    (results.append(r.json()) if r.status_code == 200
                     else failures.append(r.text))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and len(results) == clients * per_client
    hit = sum(r["cache_hit_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    # only the first request computes the system prompt; every later one looks it up
    assert [r["hit_source"] for r in results].count("miss") == 1
    assert hit / prompt > 0.8
    stats = served.client.get("/cache/stats").json()
    assert stats["server"]["completed"] == clients * per_client
    # decode steps were shared between concurrent requests
    assert stats["server"]["decode_steps"] < sum(r["completion_tokens"] - 1 for r in results)
    served.wait_idle()
    served.check_cache()


# ---- the command -----------------------------------------------------------------------------


def test_bind_warning_only_off_loopback() -> None:
    assert bind_warning("127.0.0.1") is None and bind_warning("::1") is None
    assert bind_warning("localhost") is None
    assert "not a loopback address" in (bind_warning("0.0.0.0") or "")
    assert "no authentication" in (bind_warning("example.org") or "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_saves_the_snapshot_on_shutdown(
    sig: signal.Signals, tiny_model_dir: Path, tmp_path: Path
) -> None:
    sessions, port = tmp_path / "sessions", _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "serve", "--model", str(tiny_model_dir), "--device",
         "cpu", "--port", str(port), "--block-size", "4", "--cache-mb", "4",
         "--sessions-dir", str(sessions)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "KVCHAT_TOKEN": "test-token"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        wait_healthy(url, deadline, proc)
        with pytest.raises(SessionsLocked), sessions_lock(sessions, "test", wait_s=0):
            pass
        reply = httpx.post(f"{url}/generate", json={"prompt": "Remember me.", "max_tokens": 4},
                           headers={"Authorization": "Bearer test-token"})
        assert reply.status_code == 200
        assert not (sessions / "cache" / "index.json").exists()
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Saved the cache snapshot" in output, output
    info = read_snapshot_meta(sessions)
    assert info is not None and info.cached_tokens >= reply.json()["prompt_tokens"]
    runtime = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                          sessions_dir=sessions,
                                          cache=CacheConfig(4, cache_mb=4)))
    assert runtime.notice is None and runtime.restored_tokens == info.cached_tokens
    runtime.cache.check_integrity()
