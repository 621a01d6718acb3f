"""What a call to another server (kvchat serve, or any OpenAI-compatible engine) fails with, each
one paragraph for the user.

A batch tells them apart: `ServerGone` stops the run (nothing more can be sent there), any other
`ServerError` fails only the line it answered (`ReplyTimeout`, `BadReply`, an HTTP error).
"""

from __future__ import annotations

from kvchat.config import BOUND_OPTIONS
from kvchat.errors import BackendGone, KvchatError


class ServerError(KvchatError):
    """The server answered with an error (its {"error": {...}} body, made one paragraph)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class ServerGone(BackendGone):
    """The server cannot be reached, or went away mid-reply."""


class HungUp(ServerGone):
    """This client hung up the call (`close()`: Ctrl-C, SIGTERM) before the reply began: the
    server did nothing wrong, and the client takes no more calls."""

    def __init__(self, url: str) -> None:
        super().__init__(f"The call to {url} was hung up by this client before the server "
                         "answered: the command was interrupted.")


class ReplyTimeout(ServerError):
    """One of a call's bounds passed (`kvchat.client.bounds`): `bound` is "connect", "idle" or
    "total", `seconds` its value. The call is hung up; the server may still be fine."""

    def __init__(self, url: str, bound: str, seconds: float) -> None:
        option = BOUND_OPTIONS[bound]
        said = {
            "connect": f"The server at {url} did not accept the connection within {seconds:g} s",
            "idle": f"The server at {url} sent nothing for {seconds:g} s",
            "total": f"The reply from {url} was not complete after {seconds:g} s",
        }[bound]
        super().__init__(504, "timeout", f"{said} ({option}); the request was hung up.")
        self.bound = bound
        self.seconds = seconds


class BadReply(ServerError):
    """The server answered, but not with what the call asks for: not UTF-8, not JSON, or JSON
    of the wrong shape. `where` is the URL of the endpoint."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(502, "bad_reply", f"The reply from {where} {what}.")
