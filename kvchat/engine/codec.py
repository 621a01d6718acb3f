"""Text <-> token ids for one model: chat templating, encoding, decoding, end-of-sequence ids.

Text that is not valid Unicode never reaches the tokenizer (`kvchat.text_input`): the front
ends refuse it where it enters, and `encode` refuses it again rather than crash in the
tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from kvchat.text_input import check_text


class ChatCodec:
    def __init__(self, tokenizer: Any, model: Any = None) -> None:
        self.tokenizer = tokenizer
        eos: set[int] = set()
        for source in (getattr(model, "generation_config", None), tokenizer):
            ids = getattr(source, "eos_token_id", None)
            if ids is not None:
                eos.update([ids] if isinstance(ids, int) else ids)
        self.eos_ids = frozenset(eos)
        config = getattr(model, "config", None)
        # ids a prompt may hold: the tokenizer's, and any the model can emit beyond them
        self.vocab_size = max(len(tokenizer), int(getattr(config, "vocab_size", 0) or 0))

    @cached_property
    def longest_token(self) -> int:
        """Characters in the longest token of the vocabulary: a text of c characters is at
        least c / longest_token tokens, which bounds a prompt's length without tokenising it."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        check_text(text, "The prompt")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
