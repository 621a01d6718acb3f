"""Pins as the server grants them: a request's `pin` option and `/cache/pin` keep a prefix's
blocks in the pool (`PagedKVCache.pin`), in the caller's namespace, and remember who asked.

A tenant sees and ends only its own pins: those in its private namespace, and those it made in
a shared one (`--share-cache`, a `cache_salt` group). A pin two tenants made in a shared
namespace is one pin in the cache (its id is its namespace and tokens); it ends when the last of
them lets go of it, so no tenant can unpin what another relies on. The admin sees and ends all.
Every method of `Pinner` touches the cache, so it runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.pins import Pin, PinError
from kvchat.engine.codec import ChatCodec
from kvchat.engine.sequence import GenerationResult
from kvchat.server.auth import Tenant
from kvchat.server.schemas import PinOption, PinWhat
from kvchat.turns import PreparedTurn, TurnError

LABELS: dict[str, str] = {"system": "system prompt", "all": "conversation"}


def pin_what(option: PinOption) -> PinWhat | None:
    if option is None or option is False:
        return None
    return "system" if option is True else option


def pin_json(pin: Pin, tenant: Tenant) -> dict[str, Any]:
    """A pin as the API shows it; only the admin sees namespaces (a tenant's is an HMAC of its
    key, and knowing another's is nobody's business)."""
    doc: dict[str, Any] = {"id": pin.pin_id, "tokens": len(pin.tokens), "label": pin.label,
                           "blocks": len(pin.block_ids)}
    if tenant.admin:
        doc["namespace"] = pin.namespace
    return doc


class Pinner:
    """The cache's pins, per tenant. `owners` (pin id -> tenant ids) lives on the ServerState
    and is only touched on the engine thread, like the cache."""

    def __init__(self, cache: PagedKVCache, owners: dict[str, set[str]]) -> None:
        self.cache = cache
        self.owners = owners

    def owns(self, tenant: Tenant, pin: Pin) -> bool:
        private = tenant.private and pin.namespace == tenant.namespace
        return tenant.admin or private or tenant.id in self.owners.get(pin.pin_id, ())

    def pin(self, tenant: Tenant, tokens: Sequence[int], namespace: str, label: str) -> Pin:
        """Pin `tokens` (cached in `namespace`) for `tenant`; PinError when they are not all
        cached or the pin would pass --max-pinned (nothing changes then)."""
        pin = self.cache.pin(tokens, namespace, label)
        self.owners.setdefault(pin.pin_id, set()).add(tenant.id)
        return pin

    def listing(self, tenant: Tenant) -> list[Pin]:
        live = {p.pin_id for p in self.cache.pins}
        for gone in set(self.owners) - live:  # cleared with the cache, or by a restart
            del self.owners[gone]
        return [p for p in self.cache.pins if self.owns(tenant, p)]

    def unpin(self, tenant: Tenant, pin_id: str) -> Pin | None:
        """Let go of a pin; None when there is none of that id that `tenant` may see. The
        blocks become evictable once no tenant holds the pin any more."""
        pin = self.cache.pins.get(pin_id)
        if pin is None or not self.owns(tenant, pin):
            return None
        owners = self.owners.get(pin_id, set())
        owners.discard(tenant.id)
        private = tenant.private and pin.namespace == tenant.namespace
        if tenant.admin or private or not owners:
            self.cache.unpin(pin_id)
            self.owners.pop(pin_id, None)
        return pin


class PinJob:
    """A request's `pin` option: what to pin once the request's tokens are stored, and how that
    went (`outcome`, the reply's "pin" object: id, tokens and label, or an error)."""

    def __init__(self, what: PinWhat, pinner: Pinner, tenant: Tenant, namespace: str,
                 codec: ChatCodec) -> None:
        self.what, self.pinner, self.tenant, self.namespace = what, pinner, tenant, namespace
        self.codec = codec
        self.prompt_ids: list[int] = []
        self.system_tokens: list[int] = []
        self.outcome: dict[str, Any] | None = None

    def prepared(self, turn: PreparedTurn) -> PreparedTurn:
        """After preparation (worker thread): find the system prefix while the template is at
        hand, so the engine thread only does bookkeeping."""
        self.prompt_ids = list(turn.prompt_ids)
        if self.what == "system":
            try:
                self.system_tokens = turn.system_tokens(self.codec)
            except TurnError as exc:
                self.outcome = {"error": str(exc)}
        return turn

    def after(self, result: GenerationResult) -> None:
        """On the engine thread, right after the request stored its tokens: pin them."""
        if self.outcome is not None:
            return
        if self.what == "system":
            tokens = self.system_tokens
        else:  # what the model saw: the prompt and the reply's tokens whose K/V exists
            tokens = (self.prompt_ids + list(result.token_ids))[: result.stored_tokens]
        try:
            pin = self.pinner.pin(self.tenant, tokens, self.namespace, LABELS[self.what])
        except PinError as exc:
            self.outcome = {"error": pin_message(str(exc))}
            return
        self.outcome = {"id": pin.pin_id, "tokens": len(pin.tokens), "label": pin.label}


def pin_message(message: str) -> str:
    """PinError messages start lower-case (they read well after "cannot pin: ")."""
    text = message[:1].upper() + message[1:]
    return text if text.endswith(".") else text + "."
