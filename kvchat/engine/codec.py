"""Text <-> token ids for one model: chat templating, encoding, decoding, end-of-sequence ids.

A model without a chat template (a base model) gets kvchat's plain-text format instead
(`kvchat.models.chat_template`): a single prompt as it is, a conversation as "User: ..." paragraphs.
Text that is not valid Unicode never reaches the tokenizer (`kvchat.text_input`): the front
ends refuse it where it enters, and `encode` refuses it again rather than crash in the
tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

from kvchat.errors import KvchatError
from kvchat.models.chat_template import TRANSCRIPT_STOPS, own_template, single_prompt, transcript
from kvchat.text_input import check_text


def vocabulary(tokenizer: Any, size: int = 8192) -> Iterator[list[tuple[int, str]]]:
    """The tokenizer's (id, token) pairs in id order, those of `size` ids at a time, without
    its whole vocabulary as one dict: a fast tokenizer's backend gives them one by one
    (`get_vocab` held about 70 MiB more for Gemma 3's 262,144 tokens, at a start's peak)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its dict is all there is
        yield from _chunks(sorted((i, t) for t, i in tokenizer.get_vocab().items()), size)
        return
    # ids in order until all `count` tokens are found (a vocabulary may leave holes), up to a
    # bound past which the dict gives the rest
    count = backend.get_vocab_size(with_added_tokens=True)
    bound = 2 * max([count, *(i + 1 for i in backend.get_added_tokens_decoder())]) + size
    found = lo = 0
    while found < count and lo < bound:
        chunk = [(i, backend.id_to_token(i)) for i in range(lo, lo + size)]
        found += sum(t is not None for _, t in chunk)
        yield [p for p in chunk if p[1] is not None]
        lo += size
    if found < count:
        yield from _chunks(sorted((i, t) for t, i in tokenizer.get_vocab().items() if i >= lo),
                           size)


def _chunks(pairs: list[tuple[int, str]], size: int) -> Iterator[list[tuple[int, str]]]:
    for lo in range(0, len(pairs), size):
        yield pairs[lo:lo + size]


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
        # the chat template in use: the model's own, or --chat-template's; None: plain text
        self.template: str | None = own_template(tokenizer)
        config = getattr(model, "config", None)
        # ids a prompt may hold: the tokenizer's, and any the model can emit beyond them
        self.vocab_size = max(len(tokenizer), int(getattr(config, "vocab_size", 0) or 0))
        self.start_text = self._start_text()

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def use_template(self, template: str | None) -> None:
        """Write conversations with `template` from now on (None: the plain-text format)."""
        self.template = template

    def _start_text(self) -> str:
        """What the tokenizer puts before any text it encodes (a BOS token, for Llama or
        Gemma; nothing for GPT-2), as text: plain prompts start with it, as templates do."""
        bare = self.encode("a")
        full = list(self.tokenizer("a")["input_ids"])
        extra = len(full) - len(bare)
        if extra <= 0 or full[extra:] != bare:
            return ""
        return self.decode(full[:extra], skip_special_tokens=False)

    @cached_property
    def longest_token(self) -> int:
        """Characters in the longest token of the vocabulary: a text of c characters is at
        least c / longest_token tokens, which bounds a prompt's length without tokenising it."""
        return max((len(t) for chunk in vocabulary(self.tokenizer) for _, t in chunk),
                   default=1) or 1

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as the chat template writes it (or as plain-text paragraphs).
        Raises ChatTemplateError when the template refuses it (e.g. roles that do not
        alternate)."""
        from jinja2 import TemplateError

        if self.template is None:
            return self.start_text + transcript(messages, add_generation_prompt)
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                    chat_template=self.template,
                )
            )
        except (TemplateError, ValueError) as exc:
            raise ChatTemplateError(f"The model's chat template cannot write this "
                                    f"conversation: {exc}") from None

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's prompt ids; without a template, a lone user message is sent as it
        is (plain completion)."""
        alone = single_prompt(messages) if self.template is None else None
        if alone is not None:
            return self.encode_prompt(alone)
        return self.encode(self.render_chat(messages, add_generation_prompt=True))

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt's ids, as /v1/completions sends it: the tokenizer's start (BOS)
        and the text."""
        return self.encode(self.start_text + text)

    def turn_stops(self, messages: Sequence[dict[str, str]], session: bool = False
                   ) -> tuple[str, ...]:
        """Stop strings a reply to `messages` needs: in the plain-text format (a session's
        turns always use it), a model goes on to write the user's next line itself."""
        if self.template is None and (session or single_prompt(messages) is None):
            return TRANSCRIPT_STOPS
        return ()

    def encode(self, text: str) -> list[int]:
        check_text(text, "The prompt")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
