"""Request bodies, checked by pydantic before a handler runs (strict: "9" is not a number;
every string valid Unicode, as `kvchat.text_input` rules for every entrance)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvchat.sessions import SessionError, validate_name
from kvchat.text_input import json_problem

PinWhat = Literal["system", "all"]
# a request's "pin": "system" (or true) pins its system prefix, "all" its prompt and reply
PinOption = bool | PinWhat | None


def _session_name(name: str | None) -> str | None:
    if name is not None:
        try:
            validate_name(name)
        except SessionError as exc:
            raise ValueError(str(exc)) from None
    return name


class Body(BaseModel):
    """A request body. Text that is not valid Unicode anywhere in it (a lone surrogate such as
    "\\ud800") fails the whole request with a 400 naming the field, before any handler runs."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        problem = json_problem(data)
        if problem is not None:
            raise ValueError(f"text that is not valid Unicode ({problem}); send UTF-8 text, a "
                             "lone surrogate such as \\ud800 is refused, not replaced")
        return data


def _stops(stop: str | list[str] | None) -> str | list[str] | None:
    if stop is not None and "" in ([stop] if isinstance(stop, str) else stop):
        raise ValueError("a stop string must not be empty")
    return stop


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class SamplingBody(Body):
    """The sampling options of /generate (greedy by default). Unknown fields are errors, so a
    misspelt option is not silently lost."""

    model_config = ConfigDict(strict=True, extra="forbid")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    cache_salt: str | None = None  # a sharing group the server declares (--cache-salt)

    _valid_stop = field_validator("stop")(_stops)


class GenerateBody(SamplingBody):
    """POST /generate: what to answer, and the sampling options."""

    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    system: str | None = None
    session: str | None = None
    create_session: bool = False
    # false: a session turn cut short (the client hung up) is not recorded (kvchat batch's
    # lines, which --resume sends again)
    keep_interrupted: bool = True
    pin: PinOption = None
    # what vllm-router adds to every /generate it forwards: accepted while they ask for nothing
    return_logprob: Literal[False] = False
    return_hidden_states: Literal[False] = False

    _valid_name = field_validator("session")(_session_name)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" or "messages"')
        if self.session is not None and self.prompt is None:
            raise ValueError('a session turn sends the new user message as "prompt"')
        if self.create_session and self.session is None:
            raise ValueError('"create_session" needs a "session" name')
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra fields ("name", tool-call fields) are ignored, as OpenAI clients may send them
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None  # only an assistant's may be left out

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f'a {self.role} message needs "content" (a string or a list of '
                             "text parts)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)  # "yes" is not a boolean
    include_usage: bool = False


class ChatCompletionBody(Body):
    """POST /v1/chat/completions: the subset kvchat implements. Other OpenAI fields are
    accepted and ignored, so an SDK's defaults never fail a request."""

    model_config = ConfigDict(strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # as vLLM's; only the names the server declares
    pin: PinOption = None  # kvchat's own: the reply's "kvchat" object reports it

    _valid_stop = field_validator("stop")(_stops)

class CompletionBody(Body):
    """POST /v1/completions: a plain prompt (text, or token ids), with any model, chat
    template or not. Other OpenAI fields are accepted and ignored, as for chat completions."""

    model_config = ConfigDict(strict=True)
    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None

    _valid_stop = field_validator("stop")(_stops)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionBody:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) \
                and len(self.prompt) > 1:
            raise ValueError("one prompt per request (a list of several is not supported)")
        if self.echo:
            raise ValueError("echo is not supported")
        return self


class PinBody(Body):
    """POST /cache/pin: what to pin, given as a request would send it or as a session's
    history so far."""

    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    system: str | None = None
    session: str | None = None
    what: PinWhat = "system"
    cache_salt: str | None = None

    _valid_name = field_validator("session")(_session_name)

    @model_validator(mode="after")
    def _one_source(self) -> PinBody:
        given = [self.prompt is not None, self.messages is not None, self.session is not None]
        if sum(given) != 1:
            raise ValueError('give exactly one of "prompt", "messages" or "session"')
        if self.session is not None and self.system is not None:
            raise ValueError('a session has its own system prompt: leave out "system"')
        return self


class UnpinBody(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str


class RewindBody(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    turns: int = Field(1, ge=1)


class ForkBody(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str

    _valid_name = field_validator("name")(_session_name)


class RetryBody(SamplingBody):
    """POST /sessions/{name}/retry: the sampling options of /generate."""
