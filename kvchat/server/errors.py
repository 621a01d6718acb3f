"""Errors as every endpoint answers them: {"error": {message, type, param, code}}, the shape of
OpenAI's error objects, so its clients parse ours."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvchat.config import ConfigError
from kvchat.engine.handle import PromptTooLongError, RequestCancelled
from kvchat.errors import KvchatError
from kvchat.server.worker import EngineStopped
from kvchat.sessions import SessionError
from kvchat.text_input import InvalidText, decode_utf8

log = logging.getLogger(__name__)

_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class ApiError(Exception):
    """An error the client caused or should know about, sent as {"error": {message, type}}."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    # param and code as OpenAI's error objects carry them, so its clients parse ours
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP form of an error raised while preparing or running a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, "context_length_exceeded", str(exc))
    if isinstance(exc, (SessionError, ConfigError)):
        return ApiError(400, "invalid_request_error", str(exc))
    if isinstance(exc, RequestCancelled):
        return ApiError(499, "cancelled", "The request was cancelled before it started.")
    if isinstance(exc, EngineStopped):
        return ApiError(503, "unavailable", str(exc))
    if isinstance(exc, KvchatError):
        return ApiError(400, "invalid_request_error", str(exc))
    return ApiError(500, "server_error", f"{type(exc).__name__}: {exc}")


def validation_message(exc: RequestValidationError) -> str:
    """One line naming each invalid field, or where the body stops being JSON."""
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"The body is not valid JSON ({detail} at position {err['loc'][-1]})."
        where = ".".join(str(p) for p in err.get("loc", ())[1:]) or "body"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.kind, exc.message)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and "json" not in content_type and await request.body():
        return error_response(415, "invalid_request_error",
                              "Send the body as JSON with Content-Type: application/json.")
    invalid_json = any(e.get("type") == "json_invalid" for e in exc.errors())
    return error_response(400, "invalid_json" if invalid_json else "invalid_request_error",
                          validation_message(exc))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = _HTTP_KINDS.get(exc.status_code, "invalid_request_error")
    message = str(exc.detail)
    if exc.status_code == 400 and request.method in ("POST", "PUT"):
        try:  # the framework could not parse the body: say so if it is not UTF-8 at all
            decode_utf8(await request.body(), "The body")
        except InvalidText as bad:
            message = str(bad)
    return error_response(exc.status_code, kind, message)


async def _crash(request: Request, exc: Exception) -> JSONResponse:
    log.exception("Unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "server_error", f"{type(exc).__name__}: {exc}")


def add_error_handlers(app: FastAPI) -> None:
    """Every error, the app's own or the framework's, leaves in the one JSON shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)
