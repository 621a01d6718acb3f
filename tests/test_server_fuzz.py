"""Any body, any endpoint: hypothesis sends the request parsers arbitrary JSON (lone surrogates,
huge and odd numbers, wrong types, unknown fields, near-valid shapes), raw bytes and odd
content types, over real HTTP to the tiny model. Whatever it sends, the server answers below
500, in its one error shape, with no traceback in any byte, and keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.config import CacheConfig
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import create_app, serving

EXAMPLES = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(EXAMPLES, max_examples=30)  # several requests per example

# text of every kind, lone surrogates included (JSON writes them as "\ud800" escapes), and
# often one of the characters parsers trip on
ODD = st.sampled_from(["\ud800", "\udfff", "\udc80", "\x00", "\ufeff", "\u2028", "\U0001f600"])
TEXT = st.text(st.characters(blacklist_categories=()) | ODD, max_size=12)
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | TEXT
           | st.floats(allow_nan=True, allow_infinity=True))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
# a reply length is kept small or absurd, so that no example generates for long
SMALL = (st.integers(-2, 3) | st.sampled_from([2**63, -(2**63), 10**30])
         | JSON.filter(lambda v: isinstance(v, bool) or not isinstance(v, int)))
LENGTHS = {"max_tokens", "max_completion_tokens"}


def near(valid: st.SearchStrategy[dict[str, Any]], fields: list[str]
         ) -> st.SearchStrategy[Any]:
    """Valid bodies, the same with one field set to anything, and anything at all: most
    examples reach the checks after parsing, where a bad value used to get through."""
    field = st.sampled_from(fields)
    spoilt = st.tuples(valid, field.flatmap(lambda f: st.tuples(
        st.just(f), SMALL if f in LENGTHS else JSON))).map(lambda t: {**t[0], t[1][0]: t[1][1]})
    return valid | spoilt | JSON


ROLE = st.sampled_from(["system", "user", "assistant"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": TEXT})
OPTIONS = {"max_tokens": st.integers(1, 3), "temperature": st.sampled_from([0, 0.5, 1]),
           "stop": st.lists(TEXT, max_size=2) | TEXT, "seed": st.integers(0, 9),
           "stream": st.booleans()}
SAMPLING = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
            "cache_salt", "pin"]
GENERATE = near(st.fixed_dictionaries({"prompt": TEXT}, optional={"system": TEXT, **OPTIONS})
                | st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                        optional=OPTIONS),
                ["prompt", "messages", "system", "session", "create_session", *SAMPLING])
CHAT = near(st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={**OPTIONS, "stream_options": st.fixed_dictionaries({"include_usage":
                                                                 st.booleans()})}),
    ["messages", "max_completion_tokens", "n", "model", "stream_options", *SAMPLING])
PIN = near(st.fixed_dictionaries({"prompt": TEXT}, optional={"system": TEXT,
                                                             "what": st.sampled_from(
                                                                 ["system", "all"])}),
           ["prompt", "messages", "system", "session", "what", "cache_salt"])
TURN = st.fixed_dictionaries({"prompt_tokens": st.integers(0, 9), "hit_tokens": st.integers(0, 9),
                              "source": TEXT, "completion_tokens": st.integers(0, 9),
                              "ttft_ms": st.floats(0, 9), "prefill_ms": st.floats(0, 9),
                              "finish_reason": TEXT})
SESSION_DOC = near(st.fixed_dictionaries({}, optional={
    "system": TEXT, "messages": st.lists(MESSAGE, max_size=4),
    "tokens": st.lists(st.integers(0, 300), max_size=6), "turns": st.lists(TURN, max_size=2)}),
    ["system", "messages", "tokens", "turns", "created", "updated"])
NAME = st.sampled_from(["s1", "nope"]) | TEXT


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[httpx.Client]:
    runtime = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                          sessions_dir=tmp_path_factory.mktemp("sessions"),
                                          cache=CacheConfig(4, num_blocks=600)))
    app = create_app(runtime, batch_size=4, max_tokens=2)
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=120) as http:
        reply = http.post("/generate", json={"prompt": "hi", "session": "s1",
                                             "create_session": True})
        assert reply.status_code == 200, reply.text
        yield http
        assert http.get("/healthz").status_code == 200  # still serving after all of it


def body_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()  # ensure_ascii: lone surrogates travel as escapes


def check(reply: httpx.Response) -> None:
    assert reply.status_code < 500, (reply.request.url, reply.request.content[:300],
                                     reply.text[:500])
    assert b"Traceback" not in reply.content
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)


def post(client: httpx.Client, path: str, content: bytes,
         content_type: str = "application/json") -> None:
    check(client.post(path, content=content, headers={"Content-Type": content_type}))


@EXAMPLES
@given(body=GENERATE)
def test_generate_bodies(client: httpx.Client, body: Any) -> None:
    post(client, "/generate", body_bytes(body))


@EXAMPLES
@given(body=CHAT)
def test_chat_completion_bodies(client: httpx.Client, body: Any) -> None:
    post(client, "/v1/chat/completions", body_bytes(body))


@EXAMPLES
@given(body=PIN, unpin=TEXT)
def test_pin_bodies(client: httpx.Client, body: Any, unpin: str) -> None:
    post(client, "/cache/pin", body_bytes(body))
    check(client.request("DELETE", "/cache/pin", content=body_bytes({"id": unpin}),
                         headers={"Content-Type": "application/json"}))


@FEWER
@given(name=NAME, doc=SESSION_DOC, move=st.sampled_from(["rewind", "fork", "retry"]),
       body=near(st.fixed_dictionaries({}, optional={"turns": st.integers(1, 2), "name": NAME,
                                                    **OPTIONS}), ["turns", "name", *SAMPLING]))
def test_session_documents_and_moves(client: httpx.Client, name: str, doc: Any, move: str,
                                     body: dict[str, Any]) -> None:
    path = f"/sessions/{quote(name.encode('utf-8', 'surrogatepass'), safe='')}"
    check(client.put(path, content=body_bytes(doc), headers={"Content-Type":
                                                             "application/json"}))
    check(client.get(path))
    post(client, f"{path}/{move}", body_bytes(body))
    check(client.get(f"{path}/branches"))
    post(client, "/generate", body_bytes({"prompt": "next", "session": "s1"}))


@EXAMPLES
@given(raw=st.binary(max_size=64), path=st.sampled_from(
    ["/generate", "/v1/chat/completions", "/cache/pin", "/sessions/s1/fork"]),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; "
                                     "charset=latin-1"]))
def test_raw_bytes(client: httpx.Client, raw: bytes, path: str, content_type: str) -> None:
    post(client, path, raw, content_type)


@FEWER
@given(depth=TEXT | st.integers(-5, 10).map(str), session=TEXT)
def test_query_strings(client: httpx.Client, depth: str, session: str) -> None:
    query = f"depth={quote(depth.encode('utf-8', 'surrogatepass'))}&session=" \
            f"{quote(session.encode('utf-8', 'surrogatepass'))}"
    check(client.get(f"/cache/tree?{query}"))
    check(client.get("/cache/stats"))
    check(client.get("/metrics"))
