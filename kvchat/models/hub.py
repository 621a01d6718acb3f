"""Whether a Hugging Face Hub id can be loaded before anything asks the hub: a hub that does not
answer within PROBE_S seconds, with the model not in the Hugging Face cache, is one paragraph at
once, instead of the hub client's retries (about 23 s) before the same answer."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from kvchat.errors import HubUnreachable
from kvchat.models.embedded import EMBEDDED_NAME

PROBE_S = 2.0  # the longest wait for a connection to the hub
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_cache_dir() -> str:
    """The Hugging Face cache huggingface_hub and transformers read ($HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline_reason() -> str | None:
    """Why the hub cannot be reached from here, or None when it answers (or a proxy stands
    between, which only the hub client can try)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in _PROXIES):
        return None
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=PROBE_S):
            return None
    except OSError as error:
        return f"no connection to {host}:{port} within {PROBE_S:g} s: {error.strerror or error}"


def is_cached(repo_id: str) -> bool:
    """The model's config is in the Hugging Face cache (a download finished there before)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir())
    except (ValueError, OSError):  # not a valid repo id for the cache's layout
        return False
    return isinstance(found, str)


def cached_only(repo_id: str) -> bool:
    """Whether `repo_id` must load from the Hugging Face cache alone (the hub does not answer
    but the model is cached); raises HubUnreachable when it is neither reachable nor cached."""
    reason = offline_reason()
    if reason is None:
        return False
    if is_cached(repo_id):
        return True
    raise HubUnreachable(
        f"Could not fetch {repo_id!r} from the Hugging Face Hub: the hub is unreachable from "
        f"here ({reason}), and {repo_id!r} is not in the Hugging Face cache "
        f"({hub_cache_dir()}). --model takes the path of a .gguf file, the path of a model "
        "folder (one with config.json), or a Hub id already in that cache. To run offline, "
        f"pass a local model folder or a .gguf file with --model, or leave --model out to use "
        f"the embedded {EMBEDDED_NAME}."
    )
