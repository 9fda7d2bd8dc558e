"""Reading a request's turnkv tag: the body's `turnkv` field, the `X-TurnKV-*` headers under
it, and peers' dialects (`dialects`) under both; and what the router refuses to serve.

The body wins field by field. Either way the tag is validated by the same pydantic models the
SDK uses and removed before the request reaches an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from turnkv import protocol as p
from turnkv_server.router.dialects import read_dialects

DEFAULT_TENANT = "default"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status



_HEADER_FIELDS: dict[str, tuple[str, ...]] = {
    p.HEADER_SESSION: ("session_id",),
    p.HEADER_TURN: ("turn",),
    p.HEADER_PREFIX: ("prefix_id",),
    p.HEADER_TTL: ("hints", "ttl"),
    p.HEADER_NEXT_TURN_IN: ("hints", "next_turn_in"),
    p.HEADER_FINAL: ("hints", "final"),
    p.HEADER_PRIORITY: ("hints", "priority"),
}


def extract_tag(body: dict[str, Any], headers: Mapping[str, str],
                tenant: str = DEFAULT_TENANT) -> p.TurnTag | None:
    """Pop the tag from ``body`` (mutates it), merge the headers under it and peers' dialects
    under both; raises `DialectError` for a dialect field it cannot read."""
    return extract_tags(body, headers, tenant)[0]


def extract_tags(body: dict[str, Any], headers: Mapping[str, str],
                 tenant: str = DEFAULT_TENANT) -> tuple[p.TurnTag | None, str | None]:
    """`extract_tag`'s tag and, for a request with no session, the prefix ID a dialect named
    (`prompt_cache_key`): where the turn is placed, and nothing more."""
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
    dialects = read_dialects(body, headers, tenant)
    merged = dialects.under(merged)
    if not merged:
        return None, dialects.prefix_id
    try:
        return p.TurnTag.model_validate(merged), None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"invalid turnkv.{where}: {first['msg']}",
                         param=f"turnkv.{where}") from exc


def check_supported(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n > 1 is not supported: each choice would need its own KV transfer",
                         param="n")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # vLLM serves a list of prompts as one request per prompt, all with the same
        # kv_transfer_params: they would share one KV transfer.
        raise BadRequest("a batch of prompts is not supported: send one request per prompt",
                         param="prompt")
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params is set by the router, not by clients",
                         param="kv_transfer_params")
    for name in ("model", "cache_salt"):
        if not isinstance(body.get(name, ""), str):
            raise BadRequest(f"{name} must be a string", param=name)
