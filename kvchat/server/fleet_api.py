"""What the routers in front of a fleet ask a worker: kvchat serve as an SGLang/vLLM-style worker.

Found by running them against a worker that logs every request (sglang-router 0.3.2,
vllm-router 0.1.17):
- both probe `GET /health` without credentials, at registration and then periodically; a worker
  that does not answer 200 there is never used (sglang-router: `no_available_workers`);
- sglang-router then reads `GET /server_info` (its `served_model_name` becomes the model id its
  own /v1/models lists) and `GET /model_info`, falling back to `/get_server_info` and
  `/get_model_info` on a 404, and polls `GET /get_load` (a list per data-parallel rank; it reads
  `num_tokens`) for its load-aware policies; vllm-router's power_of_two polls `/get_load` too;
- requests are forwarded with the client's own `Authorization` header (sglang-router with
  `--api-key K` checks K and sends K instead); both rewrite the JSON body through their own
  request types, so fields outside OpenAI's and SGLang's (kvchat's `session`, `pin`,
  `cache_salt`) do not survive /v1/chat/completions through either;
- session affinity: sglang-router `--policy manual` keys on `X-SMG-Routing-Key` (and forwards
  it), vllm-router `--policy consistent_hash` on `x-session-id` (it forwards every header).

These endpoints are open like /healthz (auth's open paths): they say whether the engine runs,
the model's public name (as /healthz does) and how busy the server is, never a path, a prompt
or a tenant's data.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request

from kvchat import __version__
from kvchat.server.errors import error_response
from kvchat.server.state import State

router = APIRouter()

AFFINITY_HEADERS = ("x-session-id", "x-smg-routing-key")
_AFFINITY = re.compile(r"[A-Za-z0-9._-]{1,128}")


def affinity(request: Request) -> str | None:
    """The session-affinity key a router routed this request by (x-session-id, or
    sglang-router's X-SMG-Routing-Key): the cache counts the request's hits under it, so
    /cache/stats shows each routed session's hit rate on this instance. Ignored unless it is
    a plain name."""
    for header in AFFINITY_HEADERS:
        value = request.headers.get(header)
        if value is not None and _AFFINITY.fullmatch(value):
            return value
    return None


@router.get("/health", response_model=None)
async def health(state: State) -> Any:
    """200 while the engine runs (SGLang's and vLLM's liveness path), 503 once it stopped."""
    if not state.worker.alive:
        return error_response(503, "unavailable", "The engine thread is not running.")
    return {"status": "ok"}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(state: State) -> dict[str, Any]:
    info = state.worker.info
    return {"served_model_name": info.model_id, "model_path": info.model_id, "dp_size": 1,
            "tp_size": 1, "engine": "kvchat", "version": __version__,
            "page_size": state.worker.runtime.cache.block_size}


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(state: State) -> dict[str, Any]:
    # no tokenizer_path: a router given one would load the tokenizer itself
    return {"model_path": state.worker.info.model_id, "is_generation": True}


@router.get("/get_load")
async def get_load(state: State) -> list[dict[str, int]]:
    """SGLang's shape: one entry per data-parallel rank (kvchat has one). num_tokens are the
    tokens the pool holds (cached or in use)."""
    stats = await state.on_engine(state.worker.stats)
    server, pool = stats["server"], stats["pool"]
    return [{"dp_rank": 0, "num_reqs": server["running"] + server["pending"],
             "num_waiting_reqs": server["pending"],
             "num_tokens": pool["used_blocks"] * pool["block_size"]}]
