"""`kvchat serve` is private: over real HTTP with the tiny model, every endpoint but /healthz
needs the access token or an API key; each API key is a tenant whose cache entries are salted
(no cross-tenant hit, so neither `cached_tokens` nor time to first token tells one tenant what
another sent), whose sessions and cache views are its own; sharing happens only when the server
says so (`--share-cache`, a declared `cache_salt`); namespaces survive a restart."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server_helpers import wait_healthy
from typer.testing import CliRunner

from kvchat.cli import app as cli_app
from kvchat.config import CacheConfig
from kvchat.inspect import documents as cv
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import Auth, AuthError, create_app, serving, startup_auth
from kvchat.server.auth import SECRET_FILE, TENANTS_DIR, Tenant

ADMIN, KEY_A, KEY_B = "admin-token", "key-a", "key-b"
PROMPT = "What is the capital of France?"
MAX_NEW = 4


class Served:
    def __init__(self, app: Any, runtime: Runtime, client: httpx.Client) -> None:
        self.app, self.runtime, self.client = app, runtime, client

    def on_engine(self, fn: Any) -> Any:
        return self.app.state.engine.call(fn).result(timeout=60)

    def tenant(self, key: str) -> Tenant:
        tenant = self.app.state.server.gate.identify(f"Bearer {key}")
        assert isinstance(tenant, Tenant)
        return tenant

    def nodes(self) -> list[cv.NodeView]:
        return list(cv.walk(self.on_engine(lambda: cv.nodes_from_cache(self.runtime.cache))))

    def check_cache(self) -> None:
        cache = self.runtime.cache
        self.on_engine(cache.check_integrity)
        assert self.on_engine(lambda: all(b.ref_count == 0 for b in cache.manager.blocks))

    def generate(self, key: str, **body: Any) -> dict[str, Any]:
        reply = self.client.post("/generate", json={"prompt": PROMPT, "max_tokens": MAX_NEW,
                                                    **body}, headers=bearer(key))
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    def chat_cached(self, key: str, **body: Any) -> int:
        """cached_tokens of an OpenAI chat completion of PROMPT."""
        reply = self.client.post("/v1/chat/completions", headers=bearer(key), json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_NEW,
            "temperature": 0, **body})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def get(self, key: str, path: str, **params: Any) -> dict[str, Any]:
        reply = self.client.get(path, headers=bearer(key), params=params)
        assert reply.status_code == 200, reply.text
        return dict(reply.json())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.contextmanager
def serve(model_dir: Path, sessions: Path, auth: Auth | None) -> Iterator[Served]:
    runtime = Runtime.open(RuntimeOptions(model=str(model_dir), device="cpu",
                                          sessions_dir=sessions,
                                          cache=CacheConfig(4, num_blocks=2000)))
    app = create_app(runtime, batch_size=4, max_tokens=MAX_NEW, auth=auth)
    with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        yield Served(app, runtime, client)


def tree_nodes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], list(doc["tree"])
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node["children"])
    return out


# ---- authentication --------------------------------------------------------------------------


def test_every_endpoint_but_healthz_needs_the_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_model_dir, tmp_path / "sessions", Auth(ADMIN, (KEY_A,))) as s:
        refused = [("GET", "/cache/stats"), ("GET", "/cache/tree"), ("GET", "/v1/models"),
                   ("POST", "/generate"), ("POST", "/v1/chat/completions"),
                   ("GET", "/nowhere"), ("GET", "/docs"), ("GET", "/openapi.json"),
                   ("POST", "/healthz")]
        wrong = [{}, bearer("wrong"), bearer(ADMIN + "x"), {"Authorization": ADMIN},
                 {"Authorization": f"Basic {ADMIN}"}, {"Authorization": "Bearer"}]
        for method, path in refused:
            for headers in wrong:
                reply = s.client.request(method, path, headers=headers,
                                         json={"prompt": "Hi"} if method == "POST" else None)
                assert reply.status_code == 401, (method, path, headers)
                assert reply.headers["www-authenticate"] == "Bearer"
                error = reply.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "authentication_error"
                assert "Authorization: Bearer" in error["message"]
        health = s.client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["model"] == tiny_model_dir.name  # never a local path to strangers
        assert s.get(ADMIN, "/healthz")["model"] == s.runtime.model_label
        assert s.generate(ADMIN)["completion_tokens"] == MAX_NEW
        assert s.generate(KEY_A)["completion_tokens"] == MAX_NEW
        lower = s.client.get("/v1/models", headers={"Authorization": f"bearer {KEY_A}"})
        assert lower.status_code == 200
    assert s.app.state.engine.counters.completed == 2  # the refused requests never ran


def test_auth_options_that_contradict_each_other_are_refused() -> None:
    with pytest.raises(AuthError, match="--api-key"):
        Auth(None, (KEY_A,))
    with pytest.raises(AuthError, match="differ"):
        Auth(ADMIN, (KEY_A, KEY_A))
    with pytest.raises(AuthError, match="differ"):
        Auth(ADMIN, (ADMIN,))
    with pytest.raises(AuthError, match="spaces"):
        Auth(" padded ")
    with pytest.raises(AuthError, match="--token"):
        startup_auth("t", (), True, False, ())
    made = startup_auth(None, (KEY_A,), False, False, ())
    assert made.auth.admin_token and len(made.auth.admin_token) >= 40 and made.warning is None
    assert made.token_line is not None and made.auth.admin_token in made.token_line
    assert startup_auth(None, (), False, False, ()).auth.admin_token != made.auth.admin_token
    given = startup_auth(ADMIN, (), False, False, ())
    assert given.auth.admin_token == ADMIN and given.token_line is None
    off = startup_auth(None, (), True, False, ())
    assert not off.auth.enabled and off.warning and "--no-auth" in off.warning


# ---- tenants and the cache -------------------------------------------------------------------


def test_tenants_never_hit_each_others_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_model_dir, tmp_path / "sessions", Auth(ADMIN, (KEY_A, KEY_B))) as s:
        a1, b1, admin = s.generate(KEY_A), s.generate(KEY_B), s.generate(ADMIN)
        a2, b2 = s.generate(KEY_A), s.generate(KEY_B)
        for first in (a1, b1, admin):  # the same prompt, cold for each tenant
            assert (first["hit_source"], first["cache_hit_tokens"]) == ("miss", 0)
        for repeat in (a2, b2):  # while a tenant's own repeat is an exact hit
            assert (repeat["hit_source"], repeat["cache_hit_tokens"]) == (
                "exact", repeat["prompt_tokens"])
        assert a1["text"] == b1["text"] == admin["text"] == a2["text"] == b2["text"]
        # OpenAI clients read the hit from usage.prompt_tokens_details.cached_tokens
        assert s.chat_cached(KEY_A) == a1["prompt_tokens"]
        s.generate(ADMIN, prompt="Something else")
        namespaces = {n.namespace for n in s.nodes()}
        assert namespaces == {"", s.tenant(KEY_A).namespace, s.tenant(KEY_B).namespace}
        assert len(namespaces) == 3
        s.check_cache()


def test_share_cache_lets_tenants_hit_each_others_prompts(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    auth = Auth(ADMIN, (KEY_A, KEY_B), share_cache=True)
    with serve(tiny_model_dir, tmp_path / "sessions", auth) as s:
        a, b, admin = s.generate(KEY_A), s.generate(KEY_B), s.generate(ADMIN)
        assert a["cache_hit_tokens"] == 0
        assert b["hit_source"] == admin["hit_source"] == "exact"
        assert s.chat_cached(KEY_B) == a["prompt_tokens"]
        # the shared entries hold everyone's prompts: a tenant sees its counters, not them
        tree = s.get(KEY_A, "/cache/tree")
        assert tree["tree"] == [] and tree["exact"] == []
        assert s.get(ADMIN, "/cache/tree")["tree"]
        s.check_cache()


def test_a_declared_cache_salt_is_a_sharing_group(tiny_model_dir: Path, tmp_path: Path) -> None:
    auth = Auth(ADMIN, (KEY_A, KEY_B), cache_salts=("team",))
    with serve(tiny_model_dir, tmp_path / "sessions", auth) as s:
        a = s.generate(KEY_A, cache_salt="team")
        b = s.generate(KEY_B, cache_salt="team")
        assert (a["cache_hit_tokens"], b["hit_source"]) == (0, "exact")
        assert s.generate(KEY_B)["cache_hit_tokens"] == 0  # B's own namespace is still B's
        assert s.chat_cached(ADMIN, cache_salt="team") == a["prompt_tokens"]
        for path, body in [("/generate", {"prompt": PROMPT, "cache_salt": "other"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": PROMPT}],
                             "cache_salt": "ns-of-someone"})]:
            reply = s.client.post(path, json=body, headers=bearer(KEY_A))
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "cache_salt" in error["message"] and "--cache-salt" in error["message"]
        # a client cannot name a namespace itself, not even one it knows
        raw = s.tenant(KEY_B).namespace
        reply = s.client.post("/generate", json={"prompt": PROMPT, "cache_salt": raw},
                              headers=bearer(KEY_A))
        assert reply.status_code == 400
        s.check_cache()


# ---- what a tenant sees --------------------------------------------------------------------


def test_a_tenant_sees_only_its_own_entries_sessions_and_counters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sessions = tmp_path / "sessions"
    with serve(tiny_model_dir, sessions, Auth(ADMIN, (KEY_A, KEY_B))) as s:
        s.generate(KEY_A, prompt="Alice's plan", session="notes", create_session=True)
        s.generate(KEY_A, prompt="And then?", session="notes")
        s.generate(KEY_B, prompt="Bob's diary", session="diary", create_session=True)
        s.generate(ADMIN, prompt="The admin's own", session="ops", create_session=True)
        # neither can read nor continue the other's session: unknown, as any other name
        for key, name in [(KEY_A, "diary"), (KEY_B, "notes"), (KEY_A, "ops")]:
            reply = s.client.post("/generate", json={"prompt": "Hi", "session": name},
                                  headers=bearer(key))
            assert reply.status_code == 404 and name not in os.listdir(sessions)
            assert reply.json()["error"]["type"] == "session_not_found"
        nodes = s.nodes()
        for key, mine in [(KEY_A, "notes"), (KEY_B, "diary")]:
            namespace = s.tenant(key).namespace
            tree, stats = s.get(key, "/cache/tree"), s.get(key, "/cache/stats")
            own = [n for n in nodes if n.namespace == namespace]
            assert {(n["start"], tuple(n["tokens"])) for n in tree_nodes(tree)} == {
                (n.start, n.tokens) for n in own}
            assert {o for n in tree_nodes(tree) for o in n["owners"]} == {mine}
            text = "".join(s.runtime.engine.codec.decode(n["tokens"]) for n in tree_nodes(tree))
            assert (mine == "notes") == ("Alice" in text) and (mine == "diary") == ("Bob" in text)
            assert "admin" not in text
            assert len(tree["exact"]) == sum(1 for e in s.on_engine(
                lambda: cv.exact_from_cache(s.runtime.cache)) if e.namespace == namespace)
            assert list(stats["sessions"]) == [mine] == list(tree["stats"]["sessions"])
            assert stats["tree_tokens"] == sum(n.n_tokens for n in own)
            assert stats["pool"]["used_blocks"] == sum(n.blocks for n in own)
            for doc in (tree, stats):  # no local path: not the model's, not the tokenizer's
                assert str(tmp_path) not in json.dumps(doc)
                assert str(tiny_model_dir) not in json.dumps(doc)
            assert tree["snapshot"]["tokenizer_file"] is None
            assert s.get(key, "/cache/tree", session="ops")["tree"] == []
        a_stats = s.get(KEY_A, "/cache/stats")
        assert a_stats["sessions"]["notes"]["lookups"] == 2
        assert (a_stats["hit_count"], a_stats["miss_count"]) == (1, 1)
        assert a_stats["server"]["requests"] == a_stats["server"]["completed"] == 2
        # the admin sees everything: every namespace, every tenant's sessions
        admin_tree, admin_stats = s.get(ADMIN, "/cache/tree"), s.get(ADMIN, "/cache/stats")
        assert len(tree_nodes(admin_tree)) == len(nodes)
        names = {sid.rpartition("/")[2] for sid in admin_stats["sessions"]}
        assert names == {"notes", "diary", "ops"}
        assert len(admin_stats["server"]["tenants"]) == 2
        tenant_a = s.tenant(KEY_A)
    # private files: the secret and tenants' sessions 0600, in 0700 folders
    folder = sessions / TENANTS_DIR / tenant_a.id
    for path, mode in [(sessions, 0o700), (sessions / SECRET_FILE, 0o600),
                       (sessions / TENANTS_DIR, 0o700), (folder, 0o700),
                       (folder / "notes.json", 0o600)]:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    saved = json.loads((folder / "notes.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == [
        "Alice's plan", "And then?"]
    assert sorted(p.name for p in sessions.glob("*.json")) == ["ops.json"]


def test_namespaces_survive_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    with serve(tiny_model_dir, sessions, Auth(ADMIN, (KEY_A, KEY_B))) as s:
        first = s.generate(KEY_A)
        namespace = s.tenant(KEY_A).namespace
    secret = (sessions / SECRET_FILE).read_bytes()
    index = json.loads((sessions / "cache" / "index.json").read_text())
    assert {rec["namespace"] for rec in index["tree"]} == {namespace}
    # a new admin token; the API keys, and so their namespaces, are the same
    with serve(tiny_model_dir, sessions, Auth("another-admin", (KEY_A, KEY_B))) as s:
        assert s.tenant(KEY_A).namespace == namespace
        again = s.generate(KEY_A)
        assert (again["hit_source"], again["cache_hit_tokens"]) == (
            "exact", first["prompt_tokens"])
        assert again["text"] == first["text"]
        assert s.generate(KEY_B)["cache_hit_tokens"] == 0
        assert s.generate("another-admin")["cache_hit_tokens"] == 0
        s.check_cache()
    assert (sessions / SECRET_FILE).read_bytes() == secret


# ---- the command -----------------------------------------------------------------------------


def test_serve_help_documents_sharing_and_its_timing_risk() -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in ("--token", "--api-key", "--no-auth", "--share-cache", "--cache-salt"):
        assert option in result.output
    assert "time to first token" in " ".join(result.output.split())


def test_serve_refuses_api_keys_without_auth(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--no-auth", "--api-key", KEY_A,
                                          "--sessions-dir", str(tmp_path / "s")])
    assert result.exit_code != 0
    assert "--api-key" in result.output and "Traceback" not in result.output


def test_serve_prints_a_new_token_once_and_requires_it(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "KVCHAT_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "serve", "--model", str(tiny_model_dir), "--device",
         "cpu", "--port", str(port), "--block-size", "4", "--cache-mb", "4",
         "--sessions-dir", str(tmp_path / "sessions")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        assert proc.stderr is not None
        token, deadline = None, time.monotonic() + 60
        while token is None:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited"
            if "Access token:" in line:
                token = line.split("Access token:", 1)[1].split()[0]
            assert time.monotonic() < deadline, "no token was printed"
        wait_healthy(url, deadline)
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{url}/generate", json=body).status_code == 401
        reply = httpx.post(f"{url}/generate", json=body, headers=bearer(token), timeout=60)
        assert reply.status_code == 200
        proc.terminate()
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert token not in rest  # printed once, at start-up


def test_cache_explain_answers_from_the_live_cache_and_hides_what_others_sent(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """POST /cache/explain (what `kvchat inspect --explain --connect` shows): the live cache's
    answer in the caller's namespace; in a shared one a tenant learns where a prompt parted
    from what is cached, never the tokens another tenant sent."""
    auth = Auth(ADMIN, (KEY_A, KEY_B), share_cache=True)
    other = "What is the capital of Spain? Answer in one word."
    with serve(tiny_model_dir, tmp_path / "sessions", auth) as s:
        s.generate(KEY_A, prompt=other)

        def explain(key: str, **body: Any) -> dict[str, Any]:
            reply = s.client.post("/cache/explain", headers=bearer(key), json=body)
            assert reply.status_code == 200, reply.text
            return dict(reply.json())

        ask = {"messages": [{"role": "user", "content": PROMPT}]}
        admin, b = explain(ADMIN, **ask), explain(KEY_B, **ask)
        assert admin["miss_reason"] == b["miss_reason"] == "diverged"
        assert admin["diverged_at"] == b["diverged_at"] == admin["cached_tokens"] > 0
        assert admin["detail"]["cached_ids"] and "Spain"[:2] in admin["detail"]["cached"]
        assert b["detail"]["cached_ids"] == [] and "Spain" not in json.dumps(b)
        assert b["line"].startswith(f"diverged at token {b['diverged_at']}")
        s.generate(KEY_B, prompt=PROMPT)
        assert explain(KEY_B, **ask)["miss_reason"] == "hit"
        raw = explain(ADMIN, prompt="no template: a text never sent")
        assert raw["miss_reason"] == "cold" and raw["detail"]["templated"] is False
        bad = s.client.post("/cache/explain", headers=bearer(ADMIN), json={})
        assert bad.status_code == 400
