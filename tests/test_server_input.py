"""What the server refuses, and how, over real HTTP with the tiny model: text that is not valid
Unicode in any body (a 400 naming the field, never a 500), OpenAI bodies kvchat cannot honour
as written (a user message without content, an empty stop string, a non-boolean
include_usage), prompts too long to tokenise (refused by size before any tokenising), request
counters whose outcomes add up to the requests, and sampling options at the edges of what the
API accepts (a top_p of 1e-300, a temperature of 1e308), which sample like any others."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvchat.config import CacheConfig, SamplingParams
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import create_app, serving

JSON = {"Content-Type": "application/json"}


class Served:
    def __init__(self, app: Any, runtime: Runtime, client: httpx.Client) -> None:
        self.app, self.runtime, self.client = app, runtime, client

    def on_engine(self, fn: Any) -> Any:
        return self.app.state.engine.call(fn).result(timeout=60)

    def error(self, method: str, path: str, body: bytes, status: int = 400) -> str:
        reply = self.client.request(method, path, content=body, headers=JSON)
        assert reply.status_code == status, (path, body, reply.text)
        error = reply.json()["error"]
        assert "Traceback" not in error["message"]
        return str(error["message"])


@contextlib.contextmanager
def serve(model_dir: Path, sessions: Path) -> Iterator[Served]:
    runtime = Runtime.open(RuntimeOptions(model=str(model_dir), device="cpu",
                                          sessions_dir=sessions,
                                          cache=CacheConfig(4, num_blocks=2000)))
    app = create_app(runtime, batch_size=4, max_tokens=3)
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield Served(app, runtime, client)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(tiny_model_dir, tmp_path_factory.mktemp("sessions")) as s:
        yield s


SURROGATE_BODIES = [
    ("POST", "/generate", b'{"prompt": "\\ud800 hi"}', "prompt: character 1 is a lone surrogate"),
    ("POST", "/generate", b'{"prompt": "\xed\xa0\x80"}', "prompt: character 1 is a lone surrogate"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}]}',
     "messages[0].content: character 2 is a lone surrogate"),
    ("POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("POST", "/cache/pin", b'{"prompt": "x", "system": "\\udc80"}', "system: character 1"),
    ("POST", "/sessions/fine/fork", b'{"name": "\\ud800"}', "name: character 1"),
    ("PUT", "/sessions/fine", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content: character 1 is a lone surrogate"),
]


@pytest.mark.parametrize(("method", "path", "body", "where"), SURROGATE_BODIES)
def test_text_that_is_not_unicode_is_a_400_naming_the_field(served: Served, method: str,
                                                            path: str, body: bytes,
                                                            where: str) -> None:
    message = served.error(method, path, body)
    assert "not valid Unicode" in message and where in message
    ok = served.client.post("/generate", json={"prompt": "Say hi"})
    assert ok.status_code == 200 and ok.json()["completion_tokens"] > 0  # it keeps serving


def test_a_body_that_is_not_utf8_says_so(served: Served) -> None:
    message = served.error("POST", "/generate", b'{"prompt": "caf\xe9"}')
    assert message.startswith("The body is not UTF-8 text (byte 16 is 0xe9)")


def test_openai_bodies_kvchat_cannot_honour_are_refused(served: Served) -> None:
    hi = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user"}]}, 'a user message needs "content"'),
        ({"messages": [{"role": "system", "content": None}, *hi]}, 'a system message needs'),
        ({"messages": hi, "stop": [""]}, "a stop string must not be empty"),
        ({"messages": hi, "stop": ""}, "a stop string must not be empty"),
        ({"messages": hi, "stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "text"),
    ]
    for body, fragment in cases:
        reply = served.client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert reply.status_code == 400, (body, reply.text)
        assert fragment in reply.json()["error"]["message"], body
    native = served.client.post("/generate", json={"prompt": "hi", "stop": ["ok", ""]})
    assert native.status_code == 400 and "stop string" in native.text
    # what OpenAI allows still works: an assistant turn without content, an empty user text
    fine = served.client.post("/v1/chat/completions", json={
        "messages": [*hi, {"role": "assistant", "content": None}, {"role": "user", "content": ""}],
        "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert fine.status_code == 200, fine.text


def post_ok(served: Served, path: str, body: dict[str, Any], **options: Any) -> Any:
    reply = served.client.post(path, json={**body, "max_tokens": 6, **options})
    assert reply.status_code == 200, (path, options, reply.text)
    return reply.json()


def test_any_sampling_options_the_api_accepts_sample(served: Served) -> None:
    """A top_p below float32's smallest (1e-300) is a nucleus of the most likely token alone:
    the greedy reply, never a 500; a huge temperature or top_k samples too."""
    hi = [{"role": "user", "content": "Say hi"}]
    routes = [("/generate", {"prompt": "Say hi"}, lambda r: r["text"]),
              ("/v1/chat/completions", {"messages": hi},
               lambda r: r["choices"][0]["message"]["content"]),
              ("/v1/completions", {"prompt": "Say hi"}, lambda r: r["choices"][0]["text"])]
    for path, body, text in routes:
        greedy = text(post_ok(served, path, body, temperature=0))
        for top_p in (1e-300, 5e-324, 1e-45):
            for seed in (1, 2):
                sampled = post_ok(served, path, body, temperature=1, top_p=top_p, seed=seed)
                assert text(sampled) == greedy, (path, top_p)
        reply = post_ok(served, path, body, temperature=2, top_p=1.0, seed=3)
        assert reply.get("usage", reply)["completion_tokens"] >= 1, path  # /generate: top-level
    for extreme in ({"temperature": 1e308, "top_k": 1}, {"temperature": 1e-5, "top_p": 1e-300},
                    {"temperature": 1e300, "top_p": 0.5, "top_k": 10**9}):
        assert post_ok(served, "/generate", {"prompt": "Say hi"}, **extreme)["completion_tokens"]


def test_a_session_turn_the_server_cannot_save_says_so(served: Served, monkeypatch) -> None:
    import errno

    import kvchat.sessions as sessions_module
    from kvchat.batch import parse_line
    from kvchat.batch.attached import AttachedRun
    from kvchat.client import Client

    real_write = sessions_module.atomic_write

    def full(path: Path, data: bytes, what: str = "a file") -> None:
        if path.name == "full.json" and json.loads(data)["turns"]:  # created, then the disk fills
            raise sessions_module.write_error(what, path, OSError(errno.ENOSPC, "full"))
        real_write(path, data, what)

    monkeypatch.setattr(sessions_module, "atomic_write", full)
    ok = served.client.post("/generate", json={"prompt": "hi", "session": "fine-s",
                                               "create_session": True})
    assert ok.status_code == 200 and "session_error" not in ok.json()
    items = [parse_line(json.dumps({"session": name, "prompt": "hi"}), n)
             for n, name in enumerate(["full", "fine-s", "full"], 1)]
    with Client(str(served.client.base_url)) as client:
        run = AttachedRun(client, items, SamplingParams(max_new_tokens=3), False,
                          lambda res: None)
        run.run()
    assert [(f.line, f.session) for f in run.save_errors] == [(1, "full"), (3, "full")]
    assert "the disk is full" in run.save_errors[0].message
    assert run.behind() == {"full": "the server could not save its last turn"}
    stream = served.client.post("/generate", json={"prompt": "again", "session": "full",
                                                   "stream": True})
    done = [line for line in stream.text.splitlines() if line.startswith("data:")][-1]
    assert "the disk is full" in json.loads(done[5:])["session_error"]


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(
    served: Served, monkeypatch
) -> None:
    codec = served.runtime.engine.codec
    encoded: list[int] = []
    real_encode = codec.encode

    def counting(text: str) -> list[int]:
        encoded.append(len(text))
        return real_encode(text)

    monkeypatch.setattr(codec, "encode", counting)
    context = served.runtime.engine.max_context
    huge = "word " * 400_000  # 2 MB: hundreds of times the context, whatever the tokenizer
    for path, body in [("/generate", {"prompt": huge}),
                       ("/generate", {"prompt": "hi", "system": huge}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                       ("/cache/pin", {"prompt": huge})]:
        reply = served.client.post(path, json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "context_length_exceeded"
        assert f"the model's context is {context:,} tokens" in error["message"]
        assert "refused without being tokenised" in error["message"]
    assert encoded == []  # no tokenising at all
    # a prompt that might fit is tokenised, and refused only if it does not
    near = "x" * (context + 10)
    reply = served.client.post("/generate", json={"prompt": near})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "context_length_exceeded"
    assert encoded and max(encoded) < 2 * len(near)


def wait_idle(served: Served) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + 60
    while True:
        server = served.client.get("/cache/stats").json()["server"]
        if server["running"] == server["pending"] == 0:
            return dict(server)
        assert time.monotonic() < deadline, server
        time.sleep(0.05)


def test_request_outcomes_add_up_to_the_requests(served: Served) -> None:
    before = wait_idle(served)
    for i in range(3):
        assert served.client.post("/generate", json={"prompt": f"q{i}"}).status_code == 200
    body = {"prompt": "Tell me a long story.", "max_tokens": 500, "stream": True}
    with served.client.stream("POST", "/generate", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                break  # the first token: hang up on a reply that is still being written
    chat = {"messages": [{"role": "user", "content": "Another long one."}], "max_tokens": 500,
            "stream": True}
    with served.client.stream("POST", "/v1/chat/completions", json=chat) as reply:
        next(reply.iter_lines())
    after = wait_idle(served)
    delta = {k: after[k] - before[k] for k in ("requests", "completed", "cancelled", "errors")}
    assert delta == {"requests": 5, "completed": 3, "cancelled": 2, "errors": 0}
    assert after["requests"] == after["completed"] + after["cancelled"] + after["errors"]
    metrics = served.client.get("/metrics").text
    assert f'kvchat:request_outcomes_total{{outcome="cancelled"}} {after["cancelled"]}.0' in metrics


def test_a_session_document_with_wrong_shapes_is_a_400_and_the_session_goes_on(
    served: Served,
) -> None:
    name = "shaped"
    assert served.client.post("/generate", json={"prompt": "hi", "session": name,
                                                 "create_session": True}).status_code == 200
    turn = served.client.get(f"/sessions/{name}").json()["turns"][0]
    for doc, fragment in [
        ({"system": {"not": "text"}}, '"system" must be a string'),
        ({"messages": [{"role": "user", "content": 3}]}, '"messages" must be a list'),
        ({"messages": [["role", "user"]]}, '"messages" must be a list'),
        ({"tokens": [1, -2]}, "whole numbers >= 0"),
        ({"tokens": [10**9]}, "past this model's vocabulary"),
        ({"turns": [{**turn, "hit_tokens": "many"}]}, "turns.hit_tokens"),
        ({"turns": [turn]}, "each turn needs its user and assistant message"),
    ]:
        reply = served.client.put(f"/sessions/{name}", json=doc)
        assert reply.status_code == 400, (doc, reply.text)
        assert fragment in reply.json()["error"]["message"], doc
    again = served.client.post("/generate", json={"prompt": "and now?", "session": name})
    assert again.status_code == 200, again.text
    retry = served.client.post(f"/sessions/{name}/retry")
    assert retry.status_code == 200, retry.text


def test_a_pin_with_an_empty_system_prompt_is_answered(served: Served) -> None:
    reply = served.client.post("/cache/pin", json={"prompt": "", "system": ""})
    assert reply.status_code in (201, 409), reply.text
