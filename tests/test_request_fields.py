"""One set of rules for a request's sampling fields at every entrance: a batch line (run here,
on a kvchat server or on another engine: each parses the line with `parse_line`), each HTTP
route, and the SamplingParams that CLI options build. A value one entrance refuses, all refuse,
naming the field; a value one accepts, all accept (a batch line on a server used to run
`max_tokens: 0` with the default length)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server_input import Served, serve

from kvchat.config import ConfigError, SamplingParams, check_fields
from kvchat.request_file import LineError, parse_line

# (field, value, accepted); the CLI's and SamplingParams' names differ only for max_tokens
CASES: list[tuple[str, Any, bool]] = [
    ("max_tokens", 0, False), ("max_tokens", -3, False), ("max_tokens", 1, True),
    ("temperature", -1, False), ("temperature", 1e-9, False), ("temperature", 0, True),
    ("temperature", 3.0, True), ("temperature", 1e-5, True),
    ("seed", -1, False), ("seed", 2**64, False), ("seed", 0, True), ("seed", 2**64 - 1, True),
    ("top_p", 0, False), ("top_p", 1.5, False), ("top_p", 1e-300, True), ("top_p", 1, True),
]
BATCH_FIELDS = {"max_tokens", "temperature", "seed"}  # what a batch line may set
ROUTES: dict[str, dict[str, Any]] = {
    "/generate": {"prompt": "Hi"}, "/v1/completions": {"prompt": "Hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]}}


def params_accept(name: str, value: Any) -> bool:
    key = "max_new_tokens" if name == "max_tokens" else name
    try:
        SamplingParams(**{key: value})
    except ConfigError as exc:
        assert name in str(exc)
        return False
    return True


def line_accepts(name: str, value: Any, openai: bool) -> bool:
    line = ({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "Hi"}], name: value}}
            if openai else {"prompt": "Hi", name: value})
    try:
        parse_line(json.dumps(line), 1)
    except LineError as exc:
        assert name in str(exc)
        return False
    return True


@pytest.mark.parametrize(("name", "value", "accepted"), CASES)
def test_check_fields_is_what_sampling_params_and_batch_lines_apply(name: str, value: Any,
                                                                    accepted: bool) -> None:
    try:
        check_fields(**{name: value})
        checked = True
    except ConfigError:
        checked = False
    assert checked == params_accept(name, value) == accepted
    if name in BATCH_FIELDS:
        assert line_accepts(name, value, openai=False) == accepted
        assert line_accepts(name, value, openai=True) == accepted


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(tiny_model_dir, tmp_path_factory.mktemp("sessions")) as s:
        yield s


def test_every_route_applies_the_same_rules(served: Served) -> None:
    verdicts: dict[tuple[str, Any], set[bool]] = {}
    for path, body in ROUTES.items():
        for name, value, accepted in CASES:
            reply = served.client.post(path, json={**body, name: value, "max_tokens": 2}
                                       if name != "max_tokens" else {**body, name: value})
            assert reply.status_code in (200, 400), (path, name, value, reply.text)
            if reply.status_code == 400:
                message = reply.json()["error"]["message"]
                assert name in message, (path, message)
            verdicts.setdefault((name, value), set()).add(reply.status_code == 200)
            assert (reply.status_code == 200) == accepted, (path, name, value, reply.text)
    assert all(len(v) == 1 for v in verdicts.values())
