"""Text <-> token ids for one model: chat templating, encoding, decoding, end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvchat.errors import KvchatError


class ChatTemplateError(KvchatError):
    """The chat template refused a conversation; the message says what it said."""


class ChatCodec:
    def __init__(self, tokenizer: Any, model: Any = None) -> None:
        self.tokenizer = tokenizer
        eos: set[int] = set()
        for source in (getattr(model, "generation_config", None), tokenizer):
            ids = getattr(source, "eos_token_id", None)
            if ids is not None:
                eos.update([ids] if isinstance(ids, int) else ids)
        self.eos_ids = frozenset(eos)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as the model's chat template writes it. Raises ChatTemplateError
        when the template refuses it (e.g. roles that do not alternate)."""
        from jinja2 import TemplateError

        try:
            return str(
                self.tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        except (TemplateError, ValueError) as exc:
            raise ChatTemplateError(f"The model's chat template cannot write this "
                                    f"conversation: {exc}") from None

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
