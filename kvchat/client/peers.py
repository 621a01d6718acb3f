"""Which engine answers at a URL: kvchat serve, llama.cpp's llama-server, vLLM, SGLang, or some
other OpenAI-compatible server, told from what each one's API says about itself.

GET /v1/models must answer (that is what makes a server OpenAI-compatible); its `owned_by` names
llama.cpp ("llamacpp"), vLLM ("vllm"), SGLang ("sglang") and kvchat ("kvchat"). Each engine's own
info endpoint then adds what it reports: llama.cpp's /health and /props (slots, context, build),
SGLang's /get_server_info (whether it reports cached tokens), vLLM's /version, kvchat's /healthz.
Nothing is guessed: a fact the server does not report is not shown.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvchat.client.errors import ReplyTimeout, ServerError
from kvchat.client.openai_http import OpenAIClient, json_or_none, refused
from kvchat.errors import KvchatError

KVCHAT = "kvchat"
LLAMA_CPP = "llama.cpp"
VLLM = "vLLM"
SGLANG = "SGLang"
GENERIC = "OpenAI-compatible"
_OWNERS = {"kvchat": KVCHAT, "llamacpp": LLAMA_CPP, "vllm": VLLM, "sglang": SGLANG}
# How each engine is told to report `cached_tokens`, for when a reply carries none.
CACHE_REPORT_HINT = {
    VLLM: "vLLM reports them when started with --enable-prompt-tokens-details",
    SGLANG: "SGLang reports them when started with --enable-cache-report",
    LLAMA_CPP: "llama-server reports them by default",
    GENERIC: "this server may not report them",
}

# What a client cannot know: whether the engine still holds what it cached.
CACHE_NOTE = {
    LLAMA_CPP: "what llama-server holds now is its own: each slot keeps the last prompt it "
    "computed, its RAM prompt cache (--cache-ram) earlier ones while they fit",
    VLLM: "what vLLM holds now is its own: its prefix cache frees the least recently used "
    "blocks when the pool needs them",
    SGLANG: "what SGLang holds now is its own: its radix cache evicts the least recently used "
    "prefixes when the pool needs them",
    GENERIC: "what the server holds now is its own to say",
}


class NotOpenAICompatible(KvchatError):
    """The URL answers, but not as an OpenAI-compatible server."""


class PeerInfo(NamedTuple):
    """An engine as its API describes itself."""

    kind: str  # KVCHAT, LLAMA_CPP, VLLM, SGLANG or GENERIC
    url: str
    model: str
    version: str | None = None
    found_by: tuple[str, ...] = ()  # the endpoints that answered
    facts: tuple[tuple[str, str], ...] = ()  # what it reports of itself, for people
    slots: int | None = None  # llama.cpp's parallel slots, each with a KV cache of its own

    @property
    def is_kvchat(self) -> bool:
        return self.kind == KVCHAT

    @property
    def per_slot_cache(self) -> bool:
        """Each of its slots caches only the prompts it computed (llama.cpp): a prefix shared
        by requests running at once is computed in each one's slot. vLLM's, SGLang's and
        kvchat's prefix caches are one for all requests."""
        return self.kind == LLAMA_CPP

    def name(self) -> str:
        return f"{self.kind} {self.version}" if self.version else self.kind

    def describe(self) -> str:
        """One line: "llama.cpp b1-0c1e570 at URL (from /v1/models, /props)"."""
        return f"{self.name()} at {self.url} (from {', '.join(self.found_by)})"

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.kind, "url": self.url, "model": self.model,
                "version": self.version, "found_by": list(self.found_by),
                "facts": dict(self.facts)}


def detect(client: OpenAIClient) -> PeerInfo:
    """The engine at the client's URL. Raises ServerGone (unreachable), ReplyTimeout (a bound
    passed), ServerError (a 401: credentials; a 5xx) or NotOpenAICompatible."""
    response = client.get("/v1/models")
    if response.status_code in (401, 403) or response.status_code >= 500:
        raise refused(client.url, response)
    models = json_or_none(response)
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        said = (f"answered HTTP {response.status_code}" if response.status_code >= 400 else
                "answered no JSON" if models is None else "answered JSON without `data`")
        raise NotOpenAICompatible(
            f"The server at {client.url} is not an OpenAI-compatible server: GET /v1/models "
            f"{said}, not a model list. --connect takes the base URL of kvchat serve, "
            "llama-server, vLLM or SGLang (such as http://127.0.0.1:8080).")
    card = data[0]
    model = str(card.get("id", "?"))
    kind = _OWNERS.get(str(card.get("owned_by", "")).lower())
    probes = {KVCHAT: _kvchat, LLAMA_CPP: _llama_cpp, VLLM: _vllm, SGLANG: _sglang}
    order = [kind] if kind is not None else [LLAMA_CPP, SGLANG, VLLM, KVCHAT]
    for candidate in order:
        try:
            found = probes[candidate](client, card)
        except ReplyTimeout:
            raise  # the next probe would wait as long again
        except ServerError:
            found = None  # an info endpoint behind credentials: the model list still answered
        if found is not None:
            version, by, facts = found
            slots = next((int(v) for k, v in facts if k == "slots"), None)
            return PeerInfo(candidate, client.url, model, version, ("/v1/models", *by),
                              facts, slots)
    return PeerInfo(kind or GENERIC, client.url, model, None, ("/v1/models",), ())


Probe = tuple[str | None, tuple[str, ...], tuple[tuple[str, str], ...]] | None


def _kvchat(client: OpenAIClient, card: dict[str, Any]) -> Probe:
    health = client.get_json("/healthz")
    if not isinstance(health, dict) or "precision" not in health:
        return None
    facts = (("device", str(health.get("device", "?"))),
             ("precision", str(health.get("precision", "?"))))
    return None, ("/healthz",), facts


def _llama_cpp(client: OpenAIClient, card: dict[str, Any]) -> Probe:
    props = client.get_json("/props")
    if not isinstance(props, dict) or "default_generation_settings" not in props:
        return None
    health = client.get_json("/health")
    by = ("/health", "/props") if isinstance(health, dict) else ("/props",)
    settings = props.get("default_generation_settings") or {}
    facts = [("slots", str(props["total_slots"])) if "total_slots" in props else None,
             ("context per slot", f"{settings['n_ctx']:,}") if "n_ctx" in settings else None]
    return (str(props["build_info"]) if props.get("build_info") else None, by,
            tuple(f for f in facts if f is not None))


def _vllm(client: OpenAIClient, card: dict[str, Any]) -> Probe:
    version = client.get_json("/version")
    if not isinstance(version, dict) or "version" not in version:
        return None
    facts = (("max model len", f"{card['max_model_len']:,}"),) \
        if isinstance(card.get("max_model_len"), int) else ()
    return str(version["version"]), ("/version",), facts


def _sglang(client: OpenAIClient, card: dict[str, Any]) -> Probe:
    for path in ("/get_server_info", "/server_info"):
        info = client.get_json(path)
        if isinstance(info, dict) and ("model_path" in info or "internal_states" in info):
            facts = []
            if "enable_cache_report" in info:
                facts.append(("cache report", "on" if info["enable_cache_report"] else
                              "off (start it with --enable-cache-report)"))
            if isinstance(info.get("page_size"), int):
                facts.append(("page size", str(info["page_size"])))
            version = info.get("version")
            return (str(version) if version else None), (path,), tuple(facts)
    return None
