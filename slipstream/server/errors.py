"""Error objects in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through `APIError`; the exception handlers installed
by `install_error_handlers` turn FastAPI's and Starlette's own errors (422 validation, 404
unknown path, 405 wrong method) into the same shape, so a client never sees another layout.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("slipstream.server")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A failure with an HTTP status, reported to the client as an error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def format_validation_errors(errors) -> tuple[str, str | None]:
    """A one-line message (and the offending field) from pydantic / FastAPI error dicts."""
    errors = list(errors)
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        msg, param = format_validation_errors(exc.errors())
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        where = f"{request.method} {request.url.path}"
        if status == 404:
            msg = f"no such endpoint: {where}"
        elif status == 405:
            msg = f"method not allowed: {where}"
        else:
            msg = str(exc.detail)
        return error_response(status, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
