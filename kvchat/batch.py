"""`kvchat batch`: JSONL request files through the shared cache and the batched scheduler.

Input lines, any mix of:
    {"prompt": "..."}                          one user turn, chat-templated
    {"messages": [{"role": ..., "content": ...}, ...]}
    {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": N, "temperature": T}}     (OpenAI Batch API)
with optional "id", "session", "system", "max_tokens", "temperature", "seed". Lines that share a
"session" form one conversation: each runs after the previous one of that session finished and
extends its token history, as in the REPL. Output lines keep input order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.config import ConfigError, SamplingParams
from kvchat.engine.backend import Backend, GenerationResult, Request
from kvchat.engine.scheduler import Scheduler, Ticket
from kvchat.sessions import Session, SessionError, validate_name
from kvchat.turns import conversation, next_prompt, record_turn

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


@dataclass
class ItemResult:
    item: BatchItem
    result: GenerationResult | None = None
    error: str | None = None


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
    if not isinstance(obj, dict):
        raise LineError("each line must be a JSON object")
    openai = "body" in obj or "custom_id" in obj
    if openai:
        unknown = set(obj) - _OPENAI - _COMMON
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
        unknown = set(obj) - _COMMON - {"prompt", "messages"}
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
    if unknown:
        raise LineError(f"unknown field(s): {', '.join(sorted(unknown))}")
    session = _typed(obj, "session", str, "a string")
    if session is not None:
        try:
            validate_name(session)
        except SessionError as exc:
            raise LineError(str(exc)) from None
    max_tokens = _typed(fields, "max_tokens", int, "an integer")
    temperature = _typed(fields, "temperature", (int, float), "a number")
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
        seed=_typed(fields, "seed", int, "an integer"),
        openai=openai,
        custom_id=custom_id,
    )


def read_batch(path: Path) -> tuple[list[BatchItem], list[tuple[int, str]]]:
    """Parsed items and (line number, error) for the lines that could not be parsed. Blank
    lines are skipped."""
    items, errors = [], []
    with open(path, encoding="utf-8") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                items.append(parse_line(text, number))
            except LineError as exc:
                errors.append((number, str(exc)))
    return items, errors


# ---- running -------------------------------------------------------------------------------


@dataclass
class BatchProgress:
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class BatchRun:
    """Feeds items to the scheduler: independent items at once, session items one after
    another. `results` keeps input order."""

    def __init__(
        self,
        backend: Backend,
        items: list[BatchItem],
        defaults: SamplingParams,
        batch_size: int = 8,
        fail_fast: bool = False,
        on_update: Callable[[ItemResult], None] | None = None,
    ) -> None:
        self.backend = backend
        self.items = items
        self.defaults = defaults
        self.fail_fast = fail_fast
        self.on_update = on_update
        self.results: dict[int, ItemResult] = {}
        self.progress = BatchProgress()
        self.scheduler = Scheduler(backend, batch_size=batch_size, on_finish=self._finished)
        self.sessions: dict[str, Session] = {}
        self._waiting: dict[str, list[BatchItem]] = {}
        self._tickets: dict[int, tuple[BatchItem, list[int]]] = {}
        self.stopped = False

    def _params(self, item: BatchItem) -> SamplingParams:
        d = self.defaults
        return SamplingParams(
            max_new_tokens=item.max_tokens if item.max_tokens is not None else d.max_new_tokens,
            temperature=item.temperature if item.temperature is not None else d.temperature,
            top_p=d.top_p,
            top_k=d.top_k,
            seed=item.seed if item.seed is not None else d.seed,
            stop=d.stop,
        )

    def _submit(self, item: BatchItem) -> None:
        try:
            params = self._params(item)
            if item.session is None:
                messages = list(item.messages)
                if item.system and not any(m["role"] == "system" for m in messages):
                    messages.insert(0, {"role": "system", "content": item.system})
                prompt = self.backend.encode_chat(messages)
            else:
                prompt = self._session_prompt(item)
        except (ConfigError, LineError, ValueError) as exc:
            self._record(ItemResult(item, error=str(exc)))
            self._advance_session(item)
            return
        ticket = self.scheduler.submit(Request(prompt, params, sid=item.session))
        self._tickets[ticket.request_id] = (item, prompt)

    def _session_prompt(self, item: BatchItem) -> list[int]:
        assert item.session is not None
        session = self.sessions.setdefault(item.session, Session(item.session))
        *earlier, last = item.messages
        if last["role"] != "user":
            raise LineError("the last message of a session line must be the user's")
        if not session.messages and not session.tokens:
            session.system = item.system or next(
                (m["content"] for m in earlier if m["role"] == "system"), None
            )
            session.messages = [m for m in earlier if m["role"] != "system"]
        elif earlier:
            raise LineError("a later line of a session gives only its new user message")
        if not session.tokens and session.messages:
            # history given as text on the first line: template it once, then extend tokens
            session.tokens = self.backend.encode(
                self.backend.render_chat(conversation(session), add_generation_prompt=False)
            )
        return next_prompt(self.backend, session, last["content"])

    def _finished(self, ticket: Ticket) -> None:
        entry = self._tickets.pop(ticket.request_id, None)
        if entry is None:  # already recorded (a finish interrupted and retried by abort)
            return
        item, prompt = entry
        if ticket.error is not None:
            self._record(ItemResult(item, error=str(ticket.error)))
        else:
            assert ticket.result is not None
            if item.session is not None:
                record_turn(self.sessions[item.session], item.messages[-1]["content"], prompt,
                            ticket.result)
            self._record(ItemResult(item, result=ticket.result))
        self._advance_session(item)

    def _advance_session(self, item: BatchItem) -> None:
        if item.session is None or self.stopped:
            return
        queue = self._waiting.get(item.session)
        if queue:
            self._submit(queue.pop(0))

    def _record(self, res: ItemResult) -> None:
        self.results[res.item.line] = res
        p = self.progress
        p.done += 1
        if res.error is not None:
            p.failed += 1
            if self.fail_fast:
                self.stop()
        elif res.result is not None:
            p.prompt_tokens += res.result.prompt_tokens
            p.hit_tokens += res.result.cache_hit_tokens
            p.completion_tokens += res.result.completion_tokens
        if self.on_update is not None:
            self.on_update(res)

    def stop(self) -> None:
        """Stop admitting; running requests finish as interrupted and keep their K/V."""
        self.stopped = True
        self.scheduler.abort()

    def run(self) -> None:
        for item in self.items:
            if item.session is None:
                self._submit(item)
            elif item.session in self._waiting:
                self._waiting[item.session].append(item)
            else:
                self._waiting[item.session] = []
                self._submit(item)
            if self.stopped:
                return
        try:
            while not self.stopped and not self.scheduler.idle:
                self.scheduler.step()
        except BaseException:
            self.stop()
            raise

    def ordered(self) -> list[ItemResult]:
        return [self.results[i.line] for i in self.items if i.line in self.results]


# ---- output --------------------------------------------------------------------------------


def result_fields(r: GenerationResult) -> dict[str, Any]:
    """What kvchat reports about one request: a batch output line, the server's /generate."""
    return {
        "text": r.text,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cache_hit_tokens": r.cache_hit_tokens,
        "hit_source": r.hit_source,
        "finish_reason": r.finish_reason,
        "ttft_ms": round(r.ttft_ms, 2),
        "total_ms": round(r.total_ms, 2),
    }


def openai_finish_reason(reason: str) -> str:
    # OpenAI has no "interrupted": the reply simply ends where it was stopped
    return reason if reason in ("stop", "length") else "stop"


def chat_completion(r: GenerationResult, completion_id: str, model: str = "kvchat") -> (
    dict[str, Any]
):
    """An OpenAI `chat.completion` object; `usage.prompt_tokens_details.cached_tokens` carries
    the cache hit."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                     "finish_reason": openai_finish_reason(r.finish_reason)}],
        "usage": {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cache_hit_tokens},
        },
    }


def output_line(res: ItemResult) -> dict[str, Any]:
    item, r = res.item, res.result
    if item.openai:
        return _openai_line(res)
    if r is None:
        return {"id": item.id, "line": item.line, "error": res.error}
    return {"id": item.id, **result_fields(r),
            **({"session": item.session} if item.session else {})}


def _openai_line(res: ItemResult) -> dict[str, Any]:
    item, r = res.item, res.result
    request_id = f"kvchat-{item.line}"
    if r is None:
        return {"id": f"batch_req_{item.line}", "custom_id": item.custom_id, "response": None,
                "error": {"code": "invalid_request", "message": res.error}}
    body = chat_completion(r, f"chatcmpl-{request_id}")
    return {"id": f"batch_req_{item.line}", "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}


def parse_error_line(line: int, message: str) -> dict[str, Any]:
    return {"id": f"line-{line}", "line": line, "error": message}


def write_jsonl(rows: Iterable[dict[str, Any]], fh: Any) -> None:
    for row in rows:
        fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    fh.flush()
