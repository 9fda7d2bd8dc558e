"""The router's errors, shaped as the client's API shapes them: OpenAI's
`{"error": {"message", "type", "param", "code"}}` everywhere, Anthropic's
`{"type": "error", "error": {"type", "message"}}` on `/v1/messages` and under it.

Every error the router answers goes through `error_response`, and `install_error_handlers`
routes what FastAPI and Starlette would answer in their own shape (`{"detail": "Not Found"}`
for an unknown route or method, a 422 for a body its routes' models refuse, a bare 500 for
anything raised) through it too: the openai and anthropic clients read the message from their
own shape only (openai-python puts `error.message` into the exception's text), so any other
shape reaches the caller as a status code with no reason.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnkv_server.router.engines import Engine

ANTHROPIC_PREFIX = "/v1/messages"
# What a 503 tells the client to wait before it tries again.
RETRY_AFTER_S = "2"

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 422: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable"}
# Anthropic's error types by status (its API reference, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


class BadRequest(Exception):
    """A request the router refuses to read (a 4xx), naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class EngineUnavailable(Exception):
    """The engine cannot serve the turn now (unreachable, or a 5xx): it is taken out of
    service and the turn replayed elsewhere."""

    def __init__(self, engine: Engine, detail: str) -> None:
        super().__init__(f"{engine.name} ({engine.url}) unavailable: {detail}")
        self.engine = engine


def is_anthropic(path: str | None) -> bool:
    """Whether `path` is the Anthropic Messages API's (its errors take Anthropic's shape)."""
    return path is not None and (path == ANTHROPIC_PREFIX
                                 or path.startswith(ANTHROPIC_PREFIX + "/"))


def error_body(status: int, message: str, *, kind: str | None = None,
               param: str | None = None, path: str | None = None) -> dict[str, object]:
    """An error in the shape of `path`'s API (OpenAI's unless it is `/v1/messages`): a
    response's body, or a stream's error event's data."""
    if is_anthropic(path):
        return {"type": "error", "error": {
            "type": kind or _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": kind or _OPENAI_TYPES.get(status, "api_error"),
                      "param": param, "code": status}}


def error_response(
    status: int, message: str, *, kind: str | None = None, param: str | None = None,
    headers: dict[str, str] | None = None, path: str | None = None,
) -> JSONResponse:
    """An error response in the shape of `path`'s API (`error_body`)."""
    return JSONResponse(status_code=status, headers=headers, content=error_body(
        status, message, kind=kind, param=param, path=path))


def install_error_handlers(app: FastAPI) -> None:
    """Answer FastAPI's and Starlette's own errors, and anything raised, with
    `error_response`."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path, method = request.url.path, request.method
        if exc.status_code == 404:
            message = f"Invalid URL ({method} {path}): the turnkv router has no such route"
        elif exc.status_code == 405:
            message = f"{method} is not allowed on {path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, path=path,
                              headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a malformed request with a 400 naming the field, not a 422.
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = f"invalid {where or 'request'}: {first.get('msg', 'invalid')}"
        return error_response(400, message, param=where or None, path=request.url.path)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        # Starlette raises the exception on after this answer, and the server logs it.
        return internal_error(request.url.path, exc)


def internal_error(path: str, exc: Exception) -> JSONResponse:
    """The answer to what the router did not expect: a 500 in `path`'s API's shape, with no
    internals (the router's log has them)."""
    return error_response(500, f"internal router error ({type(exc).__name__}); the router's "
                          "log has the details", path=path)
