"""A scripted attacker against every endpoint, in all three ways tenants can relate (private
namespaces, `--share-cache`, a shared `--cache-salt` group), over real HTTP with the tiny
model: no byte of any response it gets holds text (or token ids) of the victim's prompt that it
did not send itself. The endpoints are the app's own routes, read from it: a route added
without an entry in ATTACKS fails the suite. In the shared modes the attacker's probes do hit
the victim's cached prefix (the documented `cached_tokens` and timing risk), so the probes
reach the place where a miss explanation used to print what the cache holds next."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvchat.config import CacheConfig
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import Auth, create_app, serving

ADMIN, VICTIM, ATTACKER = "admin-token", "victim-key", "attacker-key"
HEAD = "You are the vault assistant. The launch code is"  # what the attacker can guess
# what it must never read: no 4 characters of it occur in any text the server holds itself
SECRET = " ZQX-4471-PLUM/88KW#VRTJ~MOQ."
VICTIM_SESSION = "vault-ops"
MODES = ["private", "share-cache", "cache-salt"]
PROBE = "\u00a7unknown"  # starts with a byte no secret holds: a probe parts exactly where it ends
GUESS = "My"  # how the victim's user message starts, which an attacker may guess


def auth_for(mode: str) -> Auth:
    return Auth(ADMIN, (VICTIM, ATTACKER), share_cache=mode == "share-cache",
                cache_salts=("team",) if mode == "cache-salt" else ())


class Attacker:
    """Sends requests as one tenant and keeps every response byte it gets, and every text it
    sent itself."""

    def __init__(self, client: httpx.Client, key: str, salt: dict[str, str]) -> None:
        self.client, self.key, self.salt = client, key, salt
        self.received: list[bytes] = []
        self.sent: list[str] = []

    def call(self, method: str, path: str, body: Any = None, stream: bool = False,
             **params: Any) -> httpx.Response:
        if body is not None:
            self.sent.append(json.dumps(body, ensure_ascii=False))
        self.sent.append(path + json.dumps(params))
        headers = {"Authorization": f"Bearer {self.key}"}
        if stream:
            with self.client.stream(method, path, json=body, headers=headers,
                                    params=params) as reply:
                reply.read()
        else:
            reply = self.client.request(method, path, json=body, headers=headers, params=params)
        self.received.append(repr(sorted(reply.headers.items())).encode() + reply.content)
        assert reply.status_code < 500, (path, reply.text)
        return reply

    def generate(self, system: str, user: str, **extra: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}], "max_tokens": 3,
                **self.salt, **extra}
        reply = self.call("POST", "/generate", body)
        assert reply.status_code == 200, reply.text
        return dict(reply.json())


def leaked(attacker: Attacker, secret: str, ids: list[int]) -> list[str]:
    """Windows of `secret` (4 characters) anywhere in what the attacker received, and runs of
    the secret's token ids in any list of numbers it received. (A probe built from a leak
    would send the leaked text back; so what it sent is no excuse.)"""
    got = b"".join(attacker.received).decode("utf-8", "replace")
    found = [w for i in range(len(secret) - 3) if (w := secret[i : i + 4]) in got]
    numbers = [int(n) for n in re.findall(r"\d+", got)]
    run = len(ids) // 2  # half the secret's ids in a row cannot be chance
    for i in range(len(ids) - run + 1):
        part = ids[i : i + run]
        if any(numbers[j : j + run] == part for j in range(len(numbers) - run + 1)):
            found.append(f"token ids {part}")
            break
    return found


@contextlib.contextmanager
def served(model_dir: Path, sessions: Path, mode: str
           ) -> Iterator[tuple[httpx.Client, Any, FastAPI]]:
    runtime = Runtime.open(RuntimeOptions(model=str(model_dir), device="cpu",
                                          sessions_dir=sessions,
                                          cache=CacheConfig(4, num_blocks=1500)))
    app = create_app(runtime, batch_size=4, max_tokens=3, auth=auth_for(mode))
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield client, runtime, app


def victim_traffic(client: httpx.Client, salt: dict[str, str]) -> str:
    """The victim's prompts: a plain request, a session turn, an OpenAI request (whose user
    message starts with a word anyone could guess), a pin. Returns the pin's id."""
    victim = Attacker(client, VICTIM, salt)
    victim.generate(HEAD + SECRET, "Hello")
    reply = victim.call("POST", "/generate", {"prompt": "Open the vault" + SECRET,
                                              "system": HEAD + SECRET, "session": VICTIM_SESSION,
                                              "create_session": True, "max_tokens": 3, **salt})
    assert reply.status_code == 200, reply.text
    for user in ("Status?", GUESS + SECRET):
        reply = victim.call("POST", "/v1/chat/completions", {
            "messages": [{"role": "system", "content": HEAD + SECRET if user == "Status?"
                          else HEAD}, {"role": "user", "content": user}],
            "max_tokens": 3, **salt})
        assert reply.status_code == 200, reply.text
    reply = victim.call("POST", "/cache/pin", {"prompt": "Hello", "system": HEAD + SECRET,
                                               **salt})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["id"])


def probe_from(detail: str) -> str:
    """What a miss detail says the cache holds past the attacker's prompt: of "cached 'A' vs
    new 'B'", the part of A after what it shares with B (the issue's attacker built its next
    probe from it)."""
    found = re.search(r"cached '(.*?)' vs new '(.*?)'", detail)
    if not found:
        return ""
    cached, new = found.groups()
    return cached[len(os.path.commonprefix([cached, new])):]


@dataclass
class Attack:
    """What the attacker knows when it attacks a route, and what it keeps for the asserts."""

    victim_pin: str
    salt: dict[str, str]
    misses: list[dict[str, Any]] = field(default_factory=list)


Route = tuple[str, str]  # (method, path as the app declares it)
Probe = Callable[[Attacker, Attack], None]


def walk_generate(a: Attacker, at: Attack) -> None:
    """Four probes, each extending the guess by whatever the last miss detail revealed; then a
    stream."""
    guess = HEAD
    for _ in range(4):
        reply = a.generate(guess + PROBE, "Hello")
        at.misses.append(reply)
        guess += probe_from(str(reply["miss_detail"]))
    a.call("POST", "/generate", {"messages": chat(HEAD + " unknown", "Hi"), "stream": True,
                                 "max_tokens": 3, **at.salt}, stream=True)
    a.call("POST", "/generate", {"prompt": "Mine", "session": "mine", "create_session": True,
                                 "max_tokens": 3, **at.salt})


def walk_explain(a: Attacker, at: Attack) -> None:
    """/cache/explain asked where the victim's prompts part from what the attacker can guess
    (the system prompt; the first word of a user message), each probe extended by what the
    last answer said the cache holds next; and an exact prompt text."""
    for system, user in ((HEAD + PROBE, "Hello"), (HEAD, GUESS)):
        for _ in range(3):
            reply = a.call("POST", "/cache/explain", {"messages": chat(system, user),
                                                      **at.salt})
            assert reply.status_code == 200, reply.text
            learnt = reply.json()["detail"].get("cached") or probe_from(reply.json()["line"])
            if not learnt:
                break
            if user == "Hello":
                system += learnt
            else:
                user += learnt
    a.call("POST", "/cache/explain", {"prompt": "<|im_start|>system\n" + HEAD + PROBE,
                                      **at.salt})


def chat_completions(a: Attacker, at: Attack) -> None:
    for stream in (False, True):
        for system, user in ((HEAD + " unknown", "Hi"), (HEAD, GUESS)):
            a.call("POST", "/v1/chat/completions", {
                "messages": chat(system, user), "max_tokens": 3, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None, **at.salt},
                stream=stream)


def completions(a: Attacker, at: Attack) -> None:
    for stream in (False, True):
        a.call("POST", "/v1/completions", {
            "prompt": "<|im_start|>system\n" + HEAD + PROBE, "max_tokens": 3, "stream": stream,
            **at.salt}, stream=stream)


def pin(a: Attacker, at: Attack) -> None:
    a.call("POST", "/cache/pin", {"prompt": "Hello", "system": HEAD + " unknown", **at.salt})
    a.call("POST", "/cache/pin", {"prompt": "Hello", "system": HEAD, **at.salt})
    a.call("POST", "/cache/pin", {"session": VICTIM_SESSION, "what": "all"})


def put_session(a: Attacker, at: Attack) -> None:
    """A session of its own under the victim's session name, then read back."""
    a.call("PUT", f"/sessions/{VICTIM_SESSION}", {"system": HEAD, "messages": [],
                                                  "tokens": [], "turns": []})
    a.call("GET", f"/sessions/{VICTIM_SESSION}")


def calls(method: str, *paths: str, body: Any = None, **params: Any) -> Probe:
    """One request to each of `paths`; `body` may be a function of the path."""
    def probe(a: Attacker, at: Attack) -> None:
        for path in paths:
            a.call(method, path, body(path) if callable(body) else body, **params)
    return probe


def gets(*paths: str) -> Probe:
    return calls("GET", *paths)


def posts(*paths: str, body: Any = None) -> Probe:
    return calls("POST", *paths, body=body)


def drop_victim_pin(a: Attacker, at: Attack) -> None:
    a.call("DELETE", f"/cache/pin?id={at.victim_pin}")


SESSIONS = (VICTIM_SESSION, "mine")
# Every route the app serves, and how the attacker goes at it: a route without an entry here
# fails test_every_route_the_app_serves_is_attacked, so a new one is attacked or the test fails.
# Order matters only where an attack needs what an earlier one made (the "mine" session).
ATTACKS: dict[Route, Probe] = {
    ("POST", "/generate"): walk_generate,
    ("POST", "/cache/explain"): walk_explain,
    ("POST", "/v1/chat/completions"): chat_completions,
    ("POST", "/v1/completions"): completions,
    ("POST", "/cache/pin"): pin,
    ("DELETE", "/cache/pin"): drop_victim_pin,
    ("PUT", "/sessions/{name}"): put_session,
    ("GET", "/sessions"): gets("/sessions"),
    ("GET", "/sessions/{name}"): gets(*(f"/sessions/{n}" for n in SESSIONS)),
    ("GET", "/sessions/{name}/branches"): gets(*(f"/sessions/{n}/branches" for n in SESSIONS)),
    ("POST", "/sessions/{name}/rewind"): posts(*(f"/sessions/{n}/rewind" for n in SESSIONS),
                                               body={}),
    ("POST", "/sessions/{name}/fork"): posts(*(f"/sessions/{n}/fork" for n in SESSIONS),
                                             body=lambda path: {"name": "m2" + path[10:13]}),
    ("POST", "/sessions/{name}/retry"): posts(*(f"/sessions/{n}/retry" for n in SESSIONS),
                                              body={}),
    ("GET", "/cache/stats"): gets("/cache/stats"),
    ("GET", "/cache/tree"): calls("GET", "/cache/tree", "/cache/tree?session=" + VICTIM_SESSION),
    ("GET", "/cache/pins"): gets("/cache/pins"),
    ("POST", "/cache/save"): posts("/cache/save"),
    ("GET", "/metrics"): gets("/metrics"),
    ("GET", "/healthz"): gets("/healthz"),
    ("GET", "/v1/models"): gets("/v1/models"),
    ("GET", "/health"): gets("/health"),
    ("GET", "/get_server_info"): gets("/get_server_info"),
    ("GET", "/server_info"): gets("/server_info"),
    ("GET", "/get_model_info"): gets("/get_model_info"),
    ("GET", "/model_info"): gets("/model_info"),
    ("GET", "/get_load"): gets("/get_load"),
    ("GET", "/openapi.json"): gets("/openapi.json"),
    ("GET", "/docs"): gets("/docs"),
    ("GET", "/docs/oauth2-redirect"): gets("/docs/oauth2-redirect"),
    ("GET", "/redoc"): gets("/redoc"),
}


def served_routes(app: FastAPI) -> set[Route]:
    """Every (method, path) the app answers, read from the app itself (HEAD is GET's): its
    routes, and those of every router included in it, however this FastAPI nests them. The
    OpenAPI schema's operations must all be among them (a walk that missed a kind of nesting
    fails here instead of attacking less)."""
    found: set[Route] = set()

    def walk(routes: Any, prefix: str) -> None:
        for route in routes:
            included = getattr(route, "original_router", None)  # FastAPI >= 0.16x, lazily
            if included is not None:
                walk(included.routes, prefix + route.include_context.prefix)
            elif hasattr(route, "routes") and not hasattr(route, "methods"):  # a Mount
                walk(route.routes, prefix + getattr(route, "path", ""))
            for method in getattr(route, "methods", None) or ():
                if method != "HEAD":
                    found.add((method, prefix + route.path))

    walk(app.routes, "")
    schema = {(method.upper(), path) for path, ops in app.openapi()["paths"].items()
              for method in ops}
    assert schema <= found, schema - found
    return found


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_every_route_the_app_serves_is_attacked(tiny_model_dir: Path, tmp_path: Path) -> None:
    runtime = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                          sessions_dir=tmp_path / "sessions",
                                          cache=CacheConfig(4, num_blocks=64)))
    routes = served_routes(create_app(runtime, auth=auth_for("private")))
    assert ("POST", "/cache/explain") in routes
    assert routes - set(ATTACKS) == set(), "routes no attack covers"
    assert set(ATTACKS) - routes == set(), "attacks on routes the app no longer serves"


@pytest.mark.parametrize("mode", MODES)
def test_an_attacker_reads_nothing_of_another_tenants_prompt(tiny_model_dir: Path,
                                                             tmp_path: Path, mode: str) -> None:
    salt = {"cache_salt": "team"} if mode == "cache-salt" else {}
    with served(tiny_model_dir, tmp_path / "sessions", mode) as (client, runtime, app):
        victim_pin = victim_traffic(client, salt)
        attacker = Attacker(client, ATTACKER, salt)
        at = Attack(victim_pin, salt)
        for route in sorted(served_routes(app), key=list(ATTACKS).index):
            ATTACKS[route](attacker, at)
        misses = at.misses
        secret_ids = runtime.engine.codec.encode(SECRET)
        pins = client.get("/cache/pins", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        admin_sees = client.post("/generate", headers={"Authorization": f"Bearer {ADMIN}"},
                                 json={"messages": [{"role": "system", "content": HEAD + "?"},
                                                    {"role": "user", "content": "Hello"}],
                                       "max_tokens": 2, **salt}).json()
    first_probe = attacker.sent[0]  # before it could have learnt anything
    assert not any(SECRET[i : i + 4] in first_probe for i in range(len(SECRET) - 3))
    assert leaked(attacker, SECRET, secret_ids) == []
    assert victim_pin in {p["id"] for p in pins["pins"]}  # the attacker could not end it
    first = misses[0]
    if mode == "private":  # nothing of the victim's is in the attacker's namespace
        assert first["miss_reason"] in ("cold", "diverged")
    else:  # the shared prefix is a hit: where the attacker's prompt parts is all it learns
        head_tokens = len(runtime.engine.codec.encode("<|im_start|>system\n" + HEAD))
        assert first["miss_reason"] == "diverged"
        assert first["cache_hit_tokens"] == first["diverged_at"] >= head_tokens
        assert "not shown" in first["miss_detail"] and PROBE[:5] in first["miss_detail"]
        # the admin runs the cache and sees what it holds
        assert "cached '" in admin_sees["miss_detail"]
