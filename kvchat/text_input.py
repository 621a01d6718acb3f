"""Text entering kvchat, and the one rule for text that is not valid Unicode.

The rule, the same at every entrance (batch file lines, server request bodies, chat input,
`kvchat inspect --explain`, session files): text must be valid Unicode. Bytes that are not
UTF-8, and lone surrogates (a JSON "\\ud800", or a command-line byte the locale could not
decode), are never replaced or dropped silently: the line, request or file that carries them is
refused with an error naming where, and everything else goes on (the next line of a batch, the
next request, the next chat message). A tokenizer never sees such text.

A UTF-8 byte order mark at the start of a file is not text: `strip_bom` drops it.

Torch-free: `kvchat inspect` and attached clients use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvchat.errors import KvchatError

BOM = b"\xef\xbb\xbf"
_ESCAPED = range(0xDC80, 0xDD00)  # how Python keeps undecodable bytes (surrogateescape)


class InvalidText(KvchatError, ValueError):
    """Text that is not valid Unicode; the message names where it was and what to do."""


def strip_bom(raw: bytes) -> bytes:
    """`raw` without a leading UTF-8 byte order mark (editors on Windows write one)."""
    return raw[len(BOM):] if raw.startswith(BOM) else raw


def decode_utf8(raw: bytes, what: str) -> str:
    """`raw` as text; InvalidText when it is not UTF-8 (or decodes to a lone surrogate)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        raise InvalidText(f"{what} is not UTF-8 text (byte {exc.start + 1} is 0x{bad}); save "
                          "it as UTF-8.") from None
    return check_text(text, what)


def text_problem(text: str, from_os: bool = False) -> str | None:
    """Why `text` is not valid Unicode (its first bad character), or None when it is.
    `from_os`: the text came from the OS (a command-line argument), which hands bytes it could
    not decode over as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if from_os and code in _ESCAPED:
            return f"byte 0x{code - 0xDC00:02x} at character {exc.start + 1} is not UTF-8"
        return (f"character {exc.start + 1} is a lone surrogate (\\u{code:04x}), which is not "
                "a character")
    return None


def check_text(text: str, what: str, from_os: bool = False) -> str:
    """`text` itself when it is valid Unicode; InvalidText naming `what` otherwise (`from_os`
    as in `text_problem`)."""
    problem = text_problem(text, from_os)
    if problem is not None:
        raise InvalidText(f"{what} is not valid Unicode: {problem}. Send UTF-8 text; a lone "
                          "surrogate such as \\ud800 is refused, not replaced.")
    return text


def json_problem(value: Any, where: str = "") -> str | None:
    """The first string (key or value) in a parsed JSON document that is not valid Unicode:
    where it is and why, or None when every string is valid."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                return f"{path or 'the text'}: {problem}"
        elif isinstance(item, Mapping):
            for key, child in item.items():
                if isinstance(key, str) and text_problem(key) is not None:
                    return f"a field name at {path or 'the top level'}: {text_problem(key)}"
                stack.append((f"{path}.{key}" if path else str(key), child))
        elif isinstance(item, Sequence) and not isinstance(item, bytes | bytearray):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def check_json(value: Any, what: str) -> Any:
    """`value` itself when all its strings are valid Unicode; InvalidText naming the first
    that is not."""
    problem = json_problem(value)
    if problem is not None:
        raise InvalidText(f"{what} holds text that is not valid Unicode ({problem}). Send "
                          "UTF-8 text; a lone surrogate such as \\ud800 is refused, not "
                          "replaced.")
    return value
