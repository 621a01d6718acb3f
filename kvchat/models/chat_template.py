"""Chat templates: whether a model has one, `--chat-template FILE|NAME`, and the plain-text
format kvchat uses for a model without one (a base model).

Without a chat template, a single prompt is sent as it is (plain completion, as /v1/completions
does), and a conversation is joined as plain text:

    System: <system prompt>

    User: <message>

    Assistant: <reply>

    User: <message>

    Assistant:

a reply ending at the model's end-of-sequence token, at max_tokens, or where the model starts
a "User:" line of its own (TRANSCRIPT_STOPS). A reply is written back exactly as generated, so
the next turn's prompt extends the tokens the model saw and the whole history is a cache hit.
Torch-free: `kvchat inspect --explain` renders prompts with it too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError

Message = Mapping[str, str]

TRANSCRIPT_STOPS = ("\n\nUser:", "\nUser:")
PLAIN = "plain"  # --chat-template plain: the plain-text format even if the model has a template
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN = {"chatml": CHATML}
NO_TEMPLATE = (
    "has no chat template, so kvchat sends plain text: a single prompt as it is, a "
    "conversation as 'System:', 'User:' and 'Assistant:' paragraphs (docs/models.md: Models "
    "without a chat template). --chat-template FILE|NAME sets one (names: chatml, or the "
    "model's own named templates)."
)


class ChatTemplateOptionError(KvchatError):
    """--chat-template names neither a file nor a template kvchat knows."""


def single_prompt(messages: Sequence[Message]) -> str | None:
    """The text of a conversation that is one user message and nothing else."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return None


def transcript(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The conversation as plain-text paragraphs, "Role: content" (a content that starts with
    a space, as a generated reply does, keeps it instead of gaining another)."""
    parts = []
    for message in messages:
        content = message["content"]
        sep = "" if content[:1].isspace() else " "
        parts.append(f"{message['role'].capitalize()}:{sep}{content}")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "\n\n".join(parts)


def own_template(tokenizer: Any) -> str | None:
    """The template a tokenizer uses by default (named templates: "default"), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def resolve(value: str, tokenizer: Any) -> str | None:
    """The template `--chat-template value` names: a file (a Jinja template, or a JSON file
    with a "chat_template" field, as tokenizer_config.json is), one of the model's own named
    templates, a built-in name (chatml), or `plain` for the plain-text format (None)."""
    if value.strip().lower() == PLAIN:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return _read_file(path)
    named = getattr(tokenizer, "chat_template", None)
    if isinstance(named, dict) and isinstance(named.get(value), str):
        return str(named[value])
    if value.lower() in BUILTIN:
        return BUILTIN[value.lower()]
    own = sorted(named) if isinstance(named, dict) else []
    names = ", ".join([*BUILTIN, PLAIN, *own])
    raise ChatTemplateOptionError(
        f"--chat-template {value!r} is not a file, nor a template name kvchat knows ({names}). "
        "Give the path of a Jinja chat template (a .jinja file, or a tokenizer_config.json "
        "holding one) or one of those names."
    )


def _read_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateOptionError(f"Cannot read the chat template {path}: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            template = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            template = None
        if not isinstance(template, str):
            raise ChatTemplateOptionError(f"{path} is JSON without a \"chat_template\" string; "
                                          "give a .jinja template file instead.")
        return template
    if not text.strip():
        raise ChatTemplateOptionError(f"The chat template file {path} is empty.")
    return text


def folder_has_template(folder: Path) -> bool:
    """Whether a model folder (or a converted GGUF's) carries a chat template, read from its
    files alone: chat_template.jinja / .json, or tokenizer_config.json's "chat_template"."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    template = config.get("chat_template") if isinstance(config, dict) else None
    return bool(template)
