"""Who is calling: the access token, the API keys, and the tenant and cache namespace of each.

Every endpoint but `GET /healthz` needs `Authorization: Bearer <secret>`, the admin's access
token or an API key; anything else is a 401. The admin token is the admin tenant: namespace "",
the sessions dir's own sessions, every view. Each API key is a tenant of its own: its cache
entries are salted (namespace = HMAC-SHA256 of the key under the server secret), so tenants
never share blocks, and no tenant can tell from `cached_tokens` or from time to first token
whether another sent a prompt. The secret is created once in the sessions dir
(`.server-secret`, 0600), so a tenant finds its cached blocks again after a restart.

Sharing is opt-in: `--share-cache` puts everyone in namespace "" (and brings the timing side
channel back), a request's `cache_salt` names a sharing group the server declared
(`--cache-salt NAME`), never a namespace chosen by the client.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from fastapi import Depends, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvchat.cache.visibility import Visibility
from kvchat.errors import KvchatError
from kvchat.files import FILE_MODE, atomic_write, private_dir
from kvchat.server.errors import ApiError, error_response

SECRET_FILE = ".server-secret"
TENANTS_DIR = "tenants"  # sessions/tenants/<tenant id>/: an API key's sessions
# liveness, and what routers probe without credentials (`fleet_api`)
_OPEN_PATHS = {"/healthz", "/health", "/server_info", "/get_server_info", "/model_info",
               "/get_model_info", "/get_load"}
_HEX_LEN = 32  # of a namespace: 128 bits of the HMAC, as unguessable as the whole of it


class AuthError(KvchatError):
    """The authentication options contradict each other, or the server secret is unusable."""


@dataclass(frozen=True)
class Auth:
    """Who may call the server. `admin_token` None turns authentication off: every caller is
    then the admin. `share_cache` puts every tenant in the admin's namespace; `cache_salts` are
    the sharing groups a request may name in `cache_salt`."""

    admin_token: str | None = None
    api_keys: tuple[str, ...] = ()
    share_cache: bool = False
    cache_salts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.admin_token is None and self.api_keys:
            raise AuthError("API keys need authentication: leave out --no-auth to use "
                            "--api-key.")
        given = [k for k in (self.admin_token, *self.api_keys) if k is not None]
        if any(not k or k != k.strip() or not k.isprintable() for k in given):
            raise AuthError("An access token or API key is empty or has spaces or control "
                            "characters; use printable characters without spaces.")
        if len(set(given)) != len(given):
            raise AuthError("An API key repeats the access token or another key: each key "
                            "is its own tenant, so each must differ.")
        if any(not s or not s.isprintable() or len(s) > 256 for s in self.cache_salts):
            raise AuthError("A --cache-salt name must be 1-256 printable characters.")

    @property
    def enabled(self) -> bool:
        return self.admin_token is not None


def new_token() -> str:
    """A fresh access token (256 random bits), for a server started without one."""
    return secrets.token_urlsafe(32)


class StartupAuth(NamedTuple):
    """`kvchat serve`'s authentication, and what to tell the operator once at start-up."""

    auth: Auth
    token_line: str | None  # the generated access token, to print once on stderr
    warning: str | None  # authentication is off


NO_AUTH_WARNING = (
    "Authentication is off (--no-auth): anyone who can connect can use the model, read every "
    "prompt and reply held in the cache (/cache/tree), and read and continue every session.")


def startup_auth(token: str | None, api_keys: Sequence[str], no_auth: bool,
                 share_cache: bool, cache_salts: Sequence[str]) -> StartupAuth:
    """The serve options as an Auth: the given token, else a new one to announce; or none at
    all with `no_auth`, which then warns."""
    if no_auth and token is not None:
        raise AuthError("--no-auth turns authentication off, so it takes no --token (nor "
                        "$KVCHAT_TOKEN): leave out one of them.")
    if no_auth:
        auth = Auth(None, tuple(api_keys), share_cache, tuple(cache_salts))
        return StartupAuth(auth, None, NO_AUTH_WARNING)
    line = None
    if token is None:
        token = new_token()
        line = (f"Access token: {token}  (send 'Authorization: Bearer <token>'; set one with "
                "--token or $KVCHAT_TOKEN)")
    return StartupAuth(Auth(token, tuple(api_keys), share_cache, tuple(cache_salts)), line, None)


@dataclass(frozen=True)
class Tenant:
    """A caller: the admin (id "") or an API key's tenant. `namespace` is where its requests
    are cached unless they name a `cache_salt`; `private` says no other tenant uses it (only
    then does the tenant see that namespace's entries)."""

    id: str
    namespace: str
    private: bool = False

    @property
    def admin(self) -> bool:
        return self.id == ""

    def sees(self, namespace: str) -> Visibility:
        """What this caller may see of the tokens cached in `namespace`: all of them when it is
        the admin (who runs the cache) or the namespace is its private one; only those it sent
        when others write there too (--share-cache, a cache_salt group)."""
        if self.admin or (self.private and namespace == self.namespace):
            return Visibility.CACHE
        return Visibility.OWN

    def sid(self, session: str) -> str:
        """The cache's name for one of this tenant's sessions: tenants' names never collide
        (session names have no "/", so the admin's plain names cannot look like these)."""
        return session if self.admin else f"{self.id}/{session}"

    def own(self, sid: str) -> str | None:
        """A session name as this tenant knows it, or None for someone else's session."""
        if self.admin:
            return sid
        prefix = f"{self.id}/"
        return sid[len(prefix):] if sid.startswith(prefix) else None


ADMIN = Tenant("", "")


SECRET_ENV = "KVCHAT_SERVER_SECRET"  # the same secret on every instance of a fleet


def load_secret(sessions_dir: Path) -> bytes:
    """The server secret: $KVCHAT_SERVER_SECRET when set (a fleet's instances share one), else
    the one in the sessions dir, created (0600, in a 0700 folder) the first time."""
    shared = os.environ.get(SECRET_ENV, "").strip()
    if shared:
        if len(shared) < 32:
            raise AuthError(f"${SECRET_ENV} is too short: give at least 32 characters, e.g. "
                            "from `openssl rand -hex 32`.")
        return shared.encode()
    path = private_dir(Path(sessions_dir)) / SECRET_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        data = secrets.token_hex(32).encode()
        atomic_write(path, data, "the server secret")
        return data
    except OSError as exc:
        raise AuthError(f"Could not read the server secret {path}: {exc.strerror}.") from exc
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)  # a copy restored with looser bits: keep it private
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 32:
        raise AuthError(f"The server secret {path} is damaged (too short). Delete it to make a "
                        "new one; API-key tenants' cached prompts are then computed afresh.")
    return data


def _digest(secret: bytes, label: str, value: str, length: int) -> str:
    return hmac.new(secret, f"{label}:{value}".encode(), hashlib.sha256).hexdigest()[:length]


class Gate:
    """Turns a request's credentials into its Tenant, and a `cache_salt` into a namespace."""

    def __init__(self, auth: Auth, sessions_dir: Path) -> None:
        self.auth = auth
        needs_secret = bool(auth.api_keys or auth.cache_salts)
        secret = load_secret(sessions_dir) if needs_secret else b""
        self._credentials: list[tuple[bytes, Tenant]] = []
        if auth.admin_token is not None:
            self._credentials.append((auth.admin_token.encode(), ADMIN))
        for key in auth.api_keys:
            tenant_id = _digest(secret, "tenant", key, 16)
            namespace = "" if auth.share_cache else _digest(secret, "key", key, _HEX_LEN)
            tenant = Tenant(tenant_id, namespace, private=not auth.share_cache)
            self._credentials.append((key.encode(), tenant))
        self._salts = {name: _digest(secret, "salt", name, _HEX_LEN) for name in auth.cache_salts}

    def identify(self, authorization: str | None) -> Tenant | None:
        """The caller an `Authorization` header names, or None (no header, a wrong secret)."""
        if not self.auth.enabled:
            return ADMIN
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        offered = given.strip().encode()
        found = None
        for secret, tenant in self._credentials:  # no early exit: every check takes as long
            if hmac.compare_digest(secret, offered):
                found = tenant
        return found

    def namespace(self, tenant: Tenant, cache_salt: str | None) -> str:
        """Where a request is cached: its tenant's namespace, or a declared sharing group."""
        if cache_salt is None:
            return tenant.namespace
        namespace = self._salts.get(cache_salt)
        if namespace is None:
            declared = ("it declares none" if not self._salts
                        else "ask its operator for one of the names it declares")
            raise ApiError(400, "invalid_request_error",
                           "cache_salt names a cache-sharing group, and this server does not "
                           f"declare that one ({declared}; kvchat serve --cache-salt NAME "
                           "declares one). Leave cache_salt out to use your own cache.")
        return namespace


_UNAUTHORIZED = ("This server needs an access token: send the header 'Authorization: Bearer "
                 "TOKEN' with the token kvchat serve printed at start-up (or set with --token "
                 "or $KVCHAT_TOKEN), or with an API key given to --api-key.")


class AuthGate:
    """ASGI middleware: a request without valid credentials gets a 401 before any route runs
    (unknown paths and the API docs included); GET /healthz stays open. The caller's Tenant
    goes into the request's state for `caller`."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = self.gate.identify(Headers(scope=scope).get("authorization"))
        open_path = scope["path"] in _OPEN_PATHS and scope["method"] in ("GET", "HEAD")
        if tenant is None and not open_path:
            response = error_response(401, "authentication_error", _UNAUTHORIZED)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def caller(request: Request) -> Tenant:
    """The authenticated caller (AuthGate let the request through)."""
    tenant: Any = getattr(request.state, "tenant", None)
    if not isinstance(tenant, Tenant):
        raise ApiError(401, "authentication_error", _UNAUTHORIZED)
    return tenant


Caller = Annotated[Tenant, Depends(caller)]
