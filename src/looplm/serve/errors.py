"""The HTTP API's errors as OpenAI's body `{"error": {"message", "type", "param", "code"}}`.

`APIError` is raised where the server refuses a request; `HANDLERS` (the app's exception handlers)
turn it, and the errors raised elsewhere, into that body: a body that fails validation is a 400 (the
first problem, naming its field), a full engine queue a 429, a stopped engine a 503, and Starlette's
own HTTP errors (an unknown path: 404; a wrong method: 405) keep their status, and anything else (a
bug) is a 500 in the same body, logged with its traceback. `bad_request` makes a `ValueError`
raised while a request is read or checked the client's 400.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from looplm.serve.engine import ContextOverflow, EngineFull, EngineStopped

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@contextmanager
def bad_request(param: str | None = None) -> Iterator[None]:
    """A `ValueError` raised inside is the request's fault: a 400 with its message (naming `param`)."""
    try:
        yield
    except ValueError as err:
        code = "context_length_exceeded" if isinstance(err, ContextOverflow) else None  # OpenAI's code
        raise APIError(400, str(err), param=param, code=code) from None


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "unknown_field":
        return msg, first["ctx"]["first"]
    if first.get("type") == "invalid_text":  # the message starts with the field's path
        return msg, first["ctx"]["field"]
    return (f"{param}: {msg}" if param else msg), param


async def _api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
    return err.response()


async def _invalid(_: HTTPRequest, err: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(err)
    return APIError(400, message, param=param).response()


async def _http_error(_: HTTPRequest, err: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return APIError(err.status_code, str(err.detail), kind).response()


async def _queue_full(_: HTTPRequest, err: EngineFull) -> JSONResponse:
    return APIError(429, str(err), "rate_limit_exceeded", code="queue_full").response()


async def _stopped(_: HTTPRequest, err: EngineStopped) -> JSONResponse:
    return APIError(503, str(err), "server_error", code="shutting_down").response()


def internal(err: Exception) -> APIError:
    """A 500 for an unexpected error (logged with its traceback where it is caught)."""
    return APIError(500, f"internal server error: {type(err).__name__}: {err}", "server_error")


async def _internal(_: HTTPRequest, err: Exception) -> JSONResponse:
    log.error("request failed", exc_info=err)
    return internal(err).response()


HANDLERS = {
    APIError: _api_error,
    RequestValidationError: _invalid,
    StarletteHTTPException: _http_error,
    EngineFull: _queue_full,
    EngineStopped: _stopped,
    Exception: _internal,
}
"""The app's exception handlers (`FastAPI(exception_handlers=...)`), by the exception they answer."""
