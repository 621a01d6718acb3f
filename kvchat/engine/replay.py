"""Exact repeats answered from a stored greedy reply, without a forward.

kvchat's forward is batch-invariant where `ModelRunner.invariant` says so (the default on CPU):
a sequence's logits are bitwise the same whatever else is in the step. A greedy reply is then a
function of its prompt alone, and the reply an earlier request decoded after the same prompt is
the one this request would decode. The engine keeps each greedy reply with the prompt's exact
entry (`ExactIndex.remember_reply`; saved, restored and parked on disk with it, under a
fingerprint that pins the weights and the numerics). An exact repeat that decodes greedily takes
that reply's tokens one by one through the same stops a sampled token meets (EOS, stop strings,
max_tokens, the context), and ends without running the model, when the stored reply is long
enough to reach one of those stops:

- it holds an EOS (and the request does not ignore EOS), or
- it is at least the request's max_tokens long, or
- it reaches the end of the model's context.

Otherwise (an earlier reply cut shorter by its own max_tokens or stop strings) the repeat decodes
as before, drafting the stored reply and verifying it. A request that records its logits always
decodes. Two replies to one prompt that differ where both run would mean the forward is not
invariant: the entry then keeps no reply, and the engine logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from kvchat.cache.kvcache import PagedKVCache
from kvchat.engine.sequence import Sequence

log = logging.getLogger("kvchat.engine")


def remember_reply(cache: PagedKVCache, seq: Sequence) -> None:
    """Keep a finished greedy reply with its prompt's exact entry, for repeats to replay (the
    caller's forward is batch-invariant)."""
    if not seq.params.greedy or not seq.generated or seq.prompt_logits is None:
        return
    if not cache.exact.remember_reply(seq.prompt_ids, seq.request.namespace, seq.generated,
                                      seq.prompt_logits):
        log.warning("Two greedy replies to one prompt differ although the forward is "
                    "batch-invariant; repeats of that prompt will decode again.")


def replayable(seq: Sequence, eos_ids: frozenset[int], max_context: int) -> bool:
    """Whether `seq`, just looked up, ends within the stored reply of its exact hit."""
    lookup, params = seq.lookup, seq.params
    if lookup is None or lookup.logits is None or not lookup.reply or not params.greedy \
            or seq.step_logits is not None:
        return False
    reply = lookup.reply
    if int(torch.argmax(lookup.logits.float()).item()) != reply[0]:
        return False  # the stored logits are not those the reply began from: decode
    return reaches_a_stop(reply, params.max_new_tokens, params.ignore_eos, eos_ids,
                          len(seq.prompt_ids), max_context)


def reaches_a_stop(reply: Seq[int], max_new_tokens: int, ignore_eos: bool,
                   eos_ids: frozenset[int], prompt_tokens: int, max_context: int) -> bool:
    """Whether a request taking `reply` token by token stops within it, whatever its stop
    strings (they can only stop it sooner)."""
    return (not ignore_eos and any(t in eos_ids for t in reply)) \
        or len(reply) >= max_new_tokens or prompt_tokens + len(reply) >= max_context
