"""OpenAI-style error bodies and the FastAPI exception handlers that produce them.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with a matching HTTP status;
unexpected exceptions are logged here and answered with a generic 500, never a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mooncake_server.api.backend import BackendError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
GENERIC_500 = "internal server error; the incident was logged"


def error_type(status: int) -> str:
    """The OpenAI error `type` for an HTTP status."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


class APIError(Exception):
    """An error the API answers with `status` and an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type or error_type(status)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body `{"error": {...}}`."""
        return error_body(self.message, self.err_type, self.param, self.code)

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_backend(cls, exc: BackendError) -> APIError:
        """Map a backend failure (its status and code) onto the API error shape."""
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return cls(str(exc), exc.status, code=exc.code, headers=headers)


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI error body."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def sse_error_event(exc: BaseException) -> str:
    """An SSE `data:` event carrying an error (for failures after the stream started)."""
    return f"data: {json.dumps(to_api_error(exc).body())}\n\n"


def _param(loc: Sequence[int | str]) -> str | None:
    # FastAPI prefixes body locations with "body"; pydantic adds the union member tried
    # (e.g. "str", "list[TextPart]") which means nothing to a client.
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if not (("[" in p and p.endswith("]")) or p in ("str", "int"))]
    return ".".join(parts) or None


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def validation_api_error(errors: Sequence[Any]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad field."""
    if not errors:
        return APIError("invalid request body")
    # NOTE: a union field fails once per member; the deepest location is the most specific
    # (e.g. content.0.type: "Input should be 'text'" rather than content: "not a string").
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(f"malformed JSON body: {detail}".rstrip(": "), param=None)
    param = _param(first.get("loc", ()))
    msg = _clean(str(first.get("msg", "invalid value")))
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(message, param=param)


def parse_body(raw: bytes, model: type[Any]) -> Any:
    """Parse a JSON request body into `model`, raising APIError(400) on any problem."""
    if not raw.strip():
        raise APIError("request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_api_error(exc.errors(include_url=False)) from None


def to_api_error(exc: BaseException) -> APIError:
    """The API error for any exception; unknown ones become a generic 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BackendError):
        return APIError.from_backend(exc)
    if isinstance(exc, RequestValidationError):
        return validation_api_error(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        return APIError(str(exc.detail), exc.status_code, headers=headers)
    return APIError(GENERIC_500, 500)


def is_expected(exc: BaseException) -> bool:
    """True for errors we raise on purpose (no traceback needed in the log)."""
    return isinstance(exc, (APIError, BackendError, RequestValidationError, StarletteHTTPException))


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    if not is_expected(exc):
        log.error(
            "unhandled error serving %s %s", request.method, request.url.path, exc_info=exc
        )
    return to_api_error(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of `app` an OpenAI error body (call before the app starts)."""
    for exc_class in (APIError, BackendError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(exc_class, _handle)
    # NOTE: Starlette re-raises after answering a bare Exception (so servers log it); the API
    # routes catch their own failures first, this is the last line for everything else.
    app.add_exception_handler(Exception, _handle)
