"""A scripted attacker against every endpoint, in all three ways tenants can relate (private
namespaces, `--share-cache`, a shared `--cache-salt` group), over real HTTP with the tiny
model: no byte of any response it gets holds text (or token ids) of the victim's prompt that it
did not send itself. In the shared modes the attacker's probes do hit the victim's cached
prefix (the documented `cached_tokens` and timing risk), so the probes reach the place where a
miss explanation used to print what the cache holds next."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

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
def served(model_dir: Path, sessions: Path, mode: str) -> Iterator[tuple[httpx.Client, Any]]:
    runtime = Runtime.open(RuntimeOptions(model=str(model_dir), device="cpu",
                                          sessions_dir=sessions,
                                          cache=CacheConfig(4, num_blocks=1500)))
    app = create_app(runtime, batch_size=4, max_tokens=3, auth=auth_for(mode))
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield client, runtime


def victim_traffic(client: httpx.Client, salt: dict[str, str]) -> str:
    """The victim's prompts: a plain request, a session turn, an OpenAI request, a pin.
    Returns the pin's id."""
    victim = Attacker(client, VICTIM, salt)
    victim.generate(HEAD + SECRET, "Hello")
    reply = victim.call("POST", "/generate", {"prompt": "Open the vault" + SECRET,
                                              "system": HEAD + SECRET, "session": VICTIM_SESSION,
                                              "create_session": True, "max_tokens": 3, **salt})
    assert reply.status_code == 200, reply.text
    reply = victim.call("POST", "/v1/chat/completions", {
        "messages": [{"role": "system", "content": HEAD + SECRET},
                     {"role": "user", "content": "Status?"}], "max_tokens": 3, **salt})
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


def attack(attacker: Attacker, victim_pin: str) -> list[dict[str, Any]]:
    """Everything a tenant can ask, built from what it learns; returns the miss replies."""
    salt = attacker.salt
    misses, guess = [], HEAD
    for _ in range(4):  # each probe extends the guess by whatever the last one revealed
        reply = attacker.generate(guess + PROBE, "Hello")
        misses.append(reply)
        guess += probe_from(str(reply["miss_detail"]))
    system = [{"role": "system", "content": HEAD + " unknown"}, {"role": "user", "content": "Hi"}]
    attacker.call("POST", "/generate", {"messages": system, "stream": True, "max_tokens": 3,
                                        **salt}, stream=True)
    for stream in (False, True):
        attacker.call("POST", "/v1/chat/completions", {
            "messages": system, "max_tokens": 3, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None, **salt},
            stream=stream)
    attacker.call("POST", "/cache/pin", {"prompt": "Hello", "system": HEAD + " unknown", **salt})
    attacker.call("POST", "/cache/pin", {"prompt": "Hello", "system": HEAD, **salt})
    attacker.call("POST", "/generate", {"prompt": "Mine", "session": "mine",
                                        "create_session": True, "max_tokens": 3, **salt})
    for method, path, body in [
        ("GET", "/cache/stats", None), ("GET", "/cache/tree", None), ("GET", "/metrics", None),
        ("GET", "/cache/pins", None), ("GET", "/sessions", None), ("GET", "/healthz", None),
        ("GET", "/v1/models", None), ("GET", "/openapi.json", None), ("GET", "/docs", None),
        ("GET", f"/sessions/{VICTIM_SESSION}", None),
        ("GET", f"/sessions/{VICTIM_SESSION}/branches", None),
        ("GET", "/sessions/mine/branches", None),
        ("POST", f"/sessions/{VICTIM_SESSION}/rewind", {}),
        ("POST", f"/sessions/{VICTIM_SESSION}/fork", {"name": "stolen"}),
        ("POST", f"/sessions/{VICTIM_SESSION}/retry", {}),
        ("POST", "/sessions/mine/retry", {}), ("POST", "/sessions/mine/fork", {"name": "m2"}),
        ("POST", "/cache/pin", {"session": VICTIM_SESSION, "what": "all"}),
        ("DELETE", f"/cache/pin?id={victim_pin}", None), ("POST", "/cache/save", None),
    ]:
        attacker.call(method, path, body)
    attacker.call("GET", "/cache/tree", session=VICTIM_SESSION)
    return misses


@pytest.mark.parametrize("mode", MODES)
def test_an_attacker_reads_nothing_of_another_tenants_prompt(tiny_model_dir: Path,
                                                             tmp_path: Path, mode: str) -> None:
    salt = {"cache_salt": "team"} if mode == "cache-salt" else {}
    with served(tiny_model_dir, tmp_path / "sessions", mode) as (client, runtime):
        victim_pin = victim_traffic(client, salt)
        attacker = Attacker(client, ATTACKER, salt)
        misses = attack(attacker, victim_pin)
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
