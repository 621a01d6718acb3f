"""Request files: one JSON object per line, parsed into BatchItems or line-numbered errors.

Input lines, any mix of:
    {"prompt": "..."}                          one user turn, chat-templated
    {"messages": [{"role": ..., "content": ...}, ...]}
    {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": N, "temperature": T}}     (OpenAI Batch API)
with optional "id", "session", "system", "max_tokens", "temperature", "seed". Lines that share a
"session" form one conversation (see run.py). Blank lines are skipped; a UTF-8 byte order mark
before the first line is dropped; a line whose text is not valid Unicode (not UTF-8, or a lone
surrogate escape such as "\\ud800") is an error of its own line, not of the file
(`kvchat.text_input`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvchat.config import ConfigError, check_fields
from kvchat.sessions import SessionError, validate_name
from kvchat.text_input import InvalidText, check_json, decode_utf8, strip_bom

_COMMON = {"id", "session", "system", "max_tokens", "temperature", "seed"}
_OPENAI = {"custom_id", "method", "url", "body"}
_ROLES = {"system", "user", "assistant"}


class LineError(ValueError):
    """A request line that cannot run; reported with its line number."""


@dataclass
class BatchItem:
    line: int  # 1-based line number in the input file
    id: str
    messages: list[dict[str, str]]  # for session lines: the new messages of this turn
    session: str | None = None
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    openai: bool = False
    custom_id: str | None = None
    digest: str = ""  # of the raw line (see line_digest)
    id_given: bool = False  # the line set "id" or "custom_id" (else id is "line-N")


def _typed(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise LineError(f'field "{key}" must be {what}, got {type(value).__name__}')
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise LineError('"messages" must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise LineError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise LineError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise LineError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def parse_line(text: str, line: int) -> BatchItem:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    try:
        check_json(obj, "the line")
    except InvalidText as exc:
        raise LineError(str(exc)) from None
    if not isinstance(obj, dict):
        raise LineError("each line must be a JSON object")
    openai = "body" in obj or "custom_id" in obj
    _refuse_unknown(obj, _OPENAI | _COMMON if openai else _COMMON | {"prompt", "messages"})
    if openai:
        body = obj.get("body")
        if not isinstance(body, dict):
            raise LineError('OpenAI batch lines need a "body" object')
        if obj.get("url", "/v1/chat/completions") != "/v1/chat/completions":
            raise LineError(f'unsupported url {obj.get("url")!r}: only /v1/chat/completions')
        if obj.get("method", "POST") != "POST":
            raise LineError('OpenAI batch lines must use "method": "POST"')
        fields = {**obj, **{k: body[k] for k in ("max_tokens", "temperature", "seed")
                            if k in body}}
        messages = _messages(body.get("messages"))
        custom_id = _typed(obj, "custom_id", str, "a string")
    else:
        fields = obj
        if ("prompt" in obj) == ("messages" in obj):
            raise LineError('give exactly one of "prompt" or "messages"')
        if "prompt" in obj:
            prompt = _typed(obj, "prompt", str, "a string")
            if prompt is None:
                raise LineError('"prompt" must be a string')
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = _messages(obj["messages"])
        custom_id = None
    session = _typed(obj, "session", str, "a string")
    if session is not None:
        try:
            validate_name(session)
        except SessionError as exc:
            raise LineError(str(exc)) from None
    max_tokens = _typed(fields, "max_tokens", int, "an integer")
    temperature = _typed(fields, "temperature", (int, float), "a number")
    seed = _typed(fields, "seed", int, "an integer")
    try:  # the rules every entrance applies: a line is refused here, wherever it would run
        check_fields(max_tokens=max_tokens, temperature=temperature, seed=seed)
    except ConfigError as exc:
        raise LineError(str(exc)) from None
    item_id = obj.get("id", custom_id)
    if item_id is not None and not isinstance(item_id, (str, int)):
        raise LineError('field "id" must be a string or an integer')
    return BatchItem(
        line=line,
        id=str(item_id) if item_id is not None else f"line-{line}",
        messages=messages,
        session=session,
        system=_typed(obj, "system", str, "a string"),
        max_tokens=max_tokens,
        temperature=None if temperature is None else float(temperature),
        seed=seed,
        openai=openai,
        custom_id=custom_id,
        id_given=item_id is not None,
    )


def _refuse_unknown(obj: dict[str, Any], known: set[str]) -> None:
    """A field kvchat does not know is named, with the known one it most looks like: a misspelt
    "promt" is not reported as a line without a prompt."""
    unknown = sorted(set(obj) - known)
    if not unknown:
        return
    named = []
    for field in unknown:
        close = difflib.get_close_matches(field, sorted(known), n=1, cutoff=0.6)
        named.append(f'"{field}"' + (f' (did you mean "{close[0]}"?)' if close else ""))
    fields = "field" if len(named) == 1 else "fields"
    raise LineError(f"unknown {fields} {', '.join(named)}; a line takes "
                    f"{', '.join(sorted(known))}")


class BadLine(NamedTuple):
    """A line that cannot run, reported in the output with its line number, and with its own
    "id" (or custom_id, for an OpenAI-form line) when that could be read."""

    line: int
    message: str
    digest: str
    custom_id: str | None = None
    id: str | None = None  # the line's own "id" (else its row's id is "line-N")


def line_digest(raw: bytes) -> str:
    """Identifies a line's text, so `--resume` can tell that a line has not changed."""
    return hashlib.sha256(raw.strip()).hexdigest()[:16]


def _own_ids(text: str) -> tuple[str | None, str | None]:
    """A bad line's own "custom_id" and "id", where it is a JSON object that has them."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    custom_id, own = obj.get("custom_id"), obj.get("id")
    return (custom_id if isinstance(custom_id, str) else None,
            str(own) if isinstance(own, (str, int)) and not isinstance(own, bool) else None)


def read_batch(path: Path) -> tuple[list[BatchItem], list[BadLine]]:
    """Parsed items and the lines that could not be parsed. Blank lines are skipped (they get
    no output row)."""
    items: list[BatchItem] = []
    errors: list[BadLine] = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number == 1:
                raw = strip_bom(raw)
            if not raw.strip():
                continue
            digest = line_digest(raw)
            try:
                text = decode_utf8(raw, "the line").rstrip("\r\n")  # columns on its own line
            except InvalidText as exc:
                errors.append(BadLine(number, str(exc), digest))
                continue
            try:
                item = parse_line(text, number)
            except LineError as exc:
                errors.append(BadLine(number, str(exc), digest, *_own_ids(text)))
                continue
            item.digest = digest
            items.append(item)
    return items, errors


def duplicate_ids(items: list[BatchItem]) -> dict[str, list[int]]:
    """Ids given to more than one line, with those lines' numbers (results are told apart by
    their "line" field, but a reader keyed on ids would lose rows)."""
    seen: dict[str, list[int]] = {}
    for item in items:
        if item.id_given:
            seen.setdefault(item.id, []).append(item.line)
    return {k: v for k, v in seen.items() if len(v) > 1}
