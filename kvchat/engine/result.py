"""What one finished request produced: the engine's result, and the one type every front end
reports from (batch rows, the server's replies, the chat's panels; `kvchat.responses` converts).
Torch-free, so a client of a kvchat server holds the same type without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens (EOS included when the model emitted it)
    prompt_tokens: int
    cache_hit_tokens: int
    hit_source: str  # exact | radix | disk | shared | miss | off
    computed_tokens: int  # prompt tokens this request ran through the model
    prefill_ms: float
    ttft_ms: float
    decode_tokens_per_s: float
    total_ms: float
    finish_reason: str  # stop | length | interrupted | error
    stored_tokens: int  # tokens of prompt + reply now cached
    step_logits: list[torch.Tensor] | None = None
    disk_hit_tokens: int = 0  # of cache_hit_tokens, those loaded back from the disk tier
    shared_hit_tokens: int = 0  # of cache_hit_tokens, blocks other instances put in the store
    miss_reason: str = "off"  # hit | cold | evicted | diverged (`kvchat.cache.explain`) | off
    diverged_at: int | None = None  # diverged: the first prompt token the cache lacks
    miss_detail: str = ""  # one line for people, as the caller may see it (`describe`)
    miss_label: str = "off"  # miss_reason as people read it: new, shared prefix (`label`), ...
    draft_tokens: int = 0  # tokens the cache proposed as drafts (`kvchat.cache.drafts`)
    draft_accepted: int = 0  # of those, the ones verification kept
    decode_forwards: int = 0  # decode forwards this request took part in
    replayed_tokens: int = 0  # reply tokens taken from a stored greedy reply (engine/replay.py)
    # a result read back from a server's reply (`responses.result_from_fields`) has no token
    # ids, only their count
    reported_completion_tokens: int | None = None

    @property
    def completion_tokens(self) -> int:
        if self.reported_completion_tokens is not None:
            return self.reported_completion_tokens
        return len(self.token_ids)
