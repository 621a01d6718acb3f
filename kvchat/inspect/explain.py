"""`kvchat inspect --explain`: why a prompt would miss, answered from the saved cache alone.

The prompt is built the way `kvchat chat` and `kvchat batch` build a new conversation's (the
model's chat template, rendered here with jinja2 as transformers renders it, then tokenised with
tokenizer.json, no special tokens added), and `explain` walks the tree rebuilt from index.json
with the snapshot's tombstones. Torch-free and transformers-free: it answers in the time it
takes to read the index, while loading the model would take seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvchat.cache.explain import CONTEXT, Explanation, MissReason, explain
from kvchat.cache.tombstones import Tombstones
from kvchat.cache.visibility import Visibility, preview
from kvchat.errors import KvchatError
from kvchat.text_input import check_text, decode_utf8, strip_bom

Message = dict[str, str]
RERUN = "run `kvchat chat` (or `kvchat batch`) once with this version of kvchat to save it"


class ExplainError(KvchatError):
    """The snapshot lacks what explaining a text prompt needs (tokenizer, chat template), or
    the prompt file cannot be used; the message says what to do."""


@dataclass(frozen=True)
class PromptSpec:
    """What to explain: chat messages to template, or (`raw`) the exact prompt text."""

    messages: tuple[Message, ...] = ()
    raw: str | None = None

    @classmethod
    def of_text(cls, text: str, system: str | None, raw: bool) -> PromptSpec:
        """InvalidText when the text (or the system prompt) is not valid Unicode: a command
        line byte that is not UTF-8 is refused here, not blamed on the snapshot."""
        check_text(text, "The --explain text", from_os=True)
        if system is not None:
            check_text(system, "The --system text", from_os=True)
        if raw:
            return cls(raw=text)
        head = [{"role": "system", "content": system}] if system is not None else []
        return cls(tuple([*head, {"role": "user", "content": text}]))

    @classmethod
    def of_file(cls, path: Path, system: str | None, raw: bool) -> PromptSpec:
        """The file's text as the user message (or raw prompt); a file holding one JSON
        object with "messages" or "prompt" (a `kvchat batch` row) gives that row's turn."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ExplainError(f"Cannot read the prompt file {path}: {exc}") from None
        text = decode_utf8(strip_bom(data), f"The prompt file {path}")
        row = _batch_row(text)
        if row is None or raw:
            return cls.of_text(text, system, raw)
        return cls._of_row(row, system)

    @classmethod
    def all_of_file(cls, path: Path, system: str | None, raw: bool
                    ) -> list[tuple[int | None, PromptSpec]]:
        """The prompts of a file, by line: each line of a JSONL request file (two lines or
        more, the first a `kvchat batch` row; every line must be one), else the file as one
        prompt (`of_file`, line None)."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ExplainError(f"Cannot read the prompt file {path}: {exc}") from None
        text = decode_utf8(strip_bom(data), f"The prompt file {path}")
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if raw or len(lines) < 2 or _batch_row(lines[0][1]) is None:
            return [(None, cls.of_file(path, system, raw))]
        out: list[tuple[int | None, PromptSpec]] = []
        for number, line in lines:
            row = _batch_row(line, number)
            if row is None:
                raise ExplainError(f"{path} line {number} is not a batch row (JSON with "
                                   "\"messages\" or \"prompt\"), unlike line 1.")
            out.append((number, cls._of_row(row, system)))
        return out

    @classmethod
    def _of_row(cls, row: Any, system: str | None) -> PromptSpec:
        msgs = [dict(m) for m in row.messages]
        system = row.system if row.system is not None else system
        if system is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system})  # as prepare_turn does
        return cls(tuple(msgs))


def _batch_row(text: str, line: int = 1) -> Any:
    """The text as one batch row, or None when it is not a JSON object with a turn."""
    from kvchat.request_file import LineError, parse_line

    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not ({"messages", "prompt", "body"} & obj.keys()):
        return None
    try:
        return parse_line(text.strip(), line)
    except LineError as exc:
        where = f" (line {line})" if line > 1 else ""
        raise ExplainError(f"The prompt file{where} is a JSON object but not a batch row: {exc}"
                           ) from None


def _compile(template: str) -> Any:
    """The template in the environment transformers renders chat templates in: sandboxed,
    trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `tojson` without HTML
    escaping, `strftime_now`, and `{% generation %}` blocks rendered as their body."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_chat(template: str, special_tokens: Mapping[str, str],
                messages: Sequence[Message]) -> str:
    """`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`: the
    special tokens (bos_token, eos_token...) are template variables there too."""
    import jinja2

    try:
        return str(_compile(template).render(**dict(special_tokens), messages=list(messages),
                                             tools=None, documents=None,
                                             add_generation_prompt=True))
    except jinja2.TemplateError as exc:
        raise ExplainError(f"The model's chat template failed on this prompt: {exc}") from None


@dataclass(frozen=True)
class SnapshotTokenizer:
    """tokenizer.json through the `tokenizers` library, as ChatCodec.encode/decode use it."""

    backend: Any

    @classmethod
    def load(cls, path: str | None) -> SnapshotTokenizer:
        if not path:
            raise ExplainError("The cache snapshot records no tokenizer file (the model folder "
                               "has no tokenizer.json), so a text prompt cannot be tokenised.")
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(path))
        except Exception as exc:  # missing, unreadable or not a tokenizer file
            raise ExplainError(f"The tokenizer file the snapshot records, {path}, cannot be "
                               f"read ({exc}).") from None

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=False))


def prompt_ids(meta: Mapping[str, Any], spec: PromptSpec, tok: SnapshotTokenizer) -> list[int]:
    """The token ids `kvchat chat` would send for `spec` with the snapshot's model."""
    if spec.raw is not None:
        return tok.encode(spec.raw)
    template = meta.get("chat_template")
    if template is None and isinstance(meta.get("plain_start"), str):
        # a model without a chat template: chat's plain-text format (`kvchat.models.chat_template`)
        from kvchat.models.chat_template import transcript

        return tok.encode(meta["plain_start"] + transcript(spec.messages, True))
    if not isinstance(template, str) or not template:
        raise ExplainError("The cache snapshot records no chat template; "
                           f"{RERUN}, or pass --raw with the exact prompt text.")
    special = {str(k): str(v) for k, v in (meta.get("special_tokens") or {}).items()}
    return tok.encode(render_chat(template, special, spec.messages))


def snapshot_tree(meta: Mapping[str, Any]) -> Any:
    """The saved radix tree, keyed like the cache that wrote it (so tombstones match)."""
    from kvchat.cache.block_keys import root_key
    from kvchat.cache.radix import RadixTree
    from kvchat.cache.tree_index import tree_from_records

    fp = dict(meta.get("fingerprint") or {})
    tree = RadixTree(int(meta["block_size"]), lambda ns: root_key(fp, ns))
    return tree_from_records(tree, meta["tree"])


@dataclass(frozen=True)
class PromptExplanation:
    """An explanation with what a person needs to read it: the prompt's ids, the one-line
    description, and the decoded text around where the cached prefix ended."""

    explanation: Explanation
    prompt_ids: tuple[int, ...]
    line: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.explanation.to_json(), "detail": self.detail}


def explain_snapshot(meta: Mapping[str, Any], spec: PromptSpec) -> PromptExplanation:
    """Why `spec` would (not) be served from the snapshot `meta` (index.json), namespace "".
    Raises ExplainError when the tokenizer or template is missing, ValueError when the index
    is damaged."""
    tok = SnapshotTokenizer.load(meta.get("tokenizer_file"))
    ids = prompt_ids(meta, spec, tok)
    if not ids:
        raise ExplainError("The prompt is empty: nothing to explain.")
    tombstones = Tombstones.from_json(meta.get("tombstones") or [])
    exact = any(not rec.get("namespace") and list(rec.get("tokens", ())) == ids
                for rec in meta.get("exact") or [])
    why = explain(snapshot_tree(meta), ids, "", tombstones, exact)
    # the snapshot is the user's own cache: all of it is theirs to see
    sees = Visibility.CACHE
    return PromptExplanation(why, tuple(ids), why.describe(ids, tok.decode, sees),
                             explanation_detail(why, ids, tok.decode, spec, len(tombstones),
                                                sees))


def explanation_detail(why: Explanation, ids: Sequence[int],
                       decode: Callable[[list[int]], str], spec: PromptSpec,
                       tombstones: int, visibility: Visibility) -> dict[str, Any]:
    """Decoded text on each side of where the cached prefix ends (for diverged: what the
    cache holds next against what the prompt has, as far as the caller may see it: `cached`
    is None and `cached_ids` empty where the namespace is shared with others), and when an
    eviction happened."""
    c = why.cached
    out: dict[str, Any] = {"prompt_tokens": len(ids), "templated": spec.raw is None,
                           "tombstones": tombstones,
                           "before": decode(list(ids[max(c - CONTEXT, 0) : c])),
                           "new": decode(list(ids[c : c + CONTEXT]))}
    if why.reason is MissReason.DIVERGED:
        cached = preview(why.cached_next, decode, visibility, sent=False)
        out.update(cached=cached, cached_ids=list(why.cached_next) if cached is not None else [],
                   new_ids=list(ids[c : c + CONTEXT]))
    if why.reason is MissReason.EVICTED and why.evicted_at is not None:
        through = why.evicted_through or c
        out.update(evicted_tokens=through - c,
                   evicted_text=decode(list(ids[c : min(through, c + CONTEXT)])),
                   evicted_at_local=time.strftime("%Y-%m-%d %H:%M:%S",
                                                  time.localtime(why.evicted_at)))
    return out
