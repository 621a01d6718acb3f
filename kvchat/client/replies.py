"""Reading what another server answered, strictly: a body or an event stream's line that is not
UTF-8, not JSON, or JSON of the wrong shape raises `BadReply` saying which (never decoded with
replacement characters, never skipped as if the reply had merely ended early).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from kvchat.client.errors import BadReply

SSE_FIELDS = ("data:", "event:", "id:", "retry:", ":")
# The longest event-stream line read: a chunk of a chat completion is under 1 KiB, a kvchat
# server's `done` event a few; a server sending bytes with no newline fails here, not at
# --request-timeout (never, with it off), holding 1 MiB at most.
MAX_LINE = 1 << 20


def preview(text: str, width: int = 60) -> str:
    """The start of a reply, for a message: one line, quoted."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[:width] + "...")


def utf8(where: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadReply(where, f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                       f"{exc.start})") from None


def json_text(where: str, text: str, what: str = "is not JSON") -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        said = f"{what} ({exc.msg})" if isinstance(exc, json.JSONDecodeError) else what
        raise BadReply(where, f"{said}: it begins {preview(text)}" if text.strip()
                       else f"{what}: it is empty") from None


def json_body(where: str, response: httpx.Response) -> Any:
    """A whole body's JSON (read already)."""
    return json_text(where, utf8(where, response.content))


def json_object(where: str, response: httpx.Response, needs: tuple[str, ...]) -> dict[str, Any]:
    """A whole body that must be a JSON object with the fields `needs`."""
    body = json_body(where, response)
    if not isinstance(body, dict):
        raise BadReply(where, f"is not a JSON object: it is {preview(json.dumps(body))}")
    missing = [f"`{name}`" for name in needs if name not in body]
    if missing:
        raise BadReply(where, f"has no {', '.join(missing)}: it begins "
                       f"{preview(json.dumps(body))}")
    return body


def lines(where: str, response: httpx.Response) -> Iterator[str]:
    """An event stream's lines (LF or CRLF), each decoded as UTF-8. Each piece is scanned
    once (only the unfinished line is kept); a line past MAX_LINE raises BadReply."""
    pending = bytearray()  # the line not yet ended
    for piece in response.iter_bytes():
        start = 0
        while (end := piece.find(b"\n", start)) >= 0:
            pending += piece[start:end]
            _check_length(where, pending)
            yield utf8(where, bytes(pending.rstrip(b"\r")))
            pending.clear()
            start = end + 1
        pending += piece[start:]
        _check_length(where, pending)
    if pending:
        yield utf8(where, bytes(pending.rstrip(b"\r")))


def _check_length(where: str, line: bytearray) -> None:
    if len(line) > MAX_LINE:
        raise BadReply(where, f"sent a line of over {MAX_LINE >> 20} MiB without ending it: "
                       f"it begins {preview(line[:200].decode('utf-8', 'replace'))}")


def events(where: str, response: httpx.Response) -> Iterator[tuple[str, str]]:
    """An event stream's (event, data) pairs: "message" when no `event:` line named it.
    A stream that holds no event at all but other text is not an event stream."""
    event, other = "message", None
    seen = False
    for line in lines(where, response):
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            seen = True
            yield event, line[5:].strip()
            event = "message"
        elif line.strip() and not line.startswith(SSE_FIELDS) and other is None:
            other = line
    if not seen and other is not None:
        raise BadReply(where, f"is not an event stream: it begins {preview(other)}")
