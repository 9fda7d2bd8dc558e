"""Reading the turnkv tag off a request, and OpenAI-style errors.

The tag travels in the body (`"turnkv": {...}`) or, for clients that cannot change the body,
in `X-TurnKV-*` headers. The body wins field by field. Either way it is validated by the same
pydantic models the SDK uses and removed before the request reaches an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from turnkv import protocol as p


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_response(
    status: int, message: str, *, kind: str | None = None, param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kinds = {400: "invalid_request_error", 401: "authentication_error",
             403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
             429: "rate_limit_error", 503: "service_unavailable"}
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind or kinds.get(status, "api_error"),
                           "param": param, "code": status}},
        headers=headers,
    )


_HEADER_FIELDS: dict[str, tuple[str, ...]] = {
    p.HEADER_SESSION: ("session_id",),
    p.HEADER_TURN: ("turn",),
    p.HEADER_PREFIX: ("prefix_id",),
    p.HEADER_TTL: ("hints", "ttl"),
    p.HEADER_NEXT_TURN_IN: ("hints", "next_turn_in"),
    p.HEADER_FINAL: ("hints", "final"),
    p.HEADER_PRIORITY: ("hints", "priority"),
}


def extract_tag(body: dict[str, Any], headers: Mapping[str, str]) -> p.TurnTag | None:
    """Pop the tag from ``body`` (mutates it) and merge the headers under it."""
    raw = body.pop("turnkv", None)
    if raw is not None and not isinstance(raw, dict):
        raise BadRequest("'turnkv' must be an object", param="turnkv")
    merged: dict[str, Any] = {}
    for header, path in _HEADER_FIELDS.items():
        value = headers.get(header)
        if value is None:
            continue
        target = merged
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    if raw:
        for key, value in raw.items():
            if key == "hints" and isinstance(value, dict):
                merged.setdefault("hints", {}).update(value)
            else:
                merged[key] = value
    if not merged:
        return None
    try:
        return p.TurnTag.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"invalid turnkv.{where}: {first['msg']}",
                         param=f"turnkv.{where}") from exc
