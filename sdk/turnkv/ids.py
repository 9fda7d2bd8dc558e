"""Session IDs and prefix IDs.

A prefix ID names the stable head of a conversation: the model, the leading system (or
developer) messages and the tool schemas. It is a hash of their canonical JSON, so every
process that starts the same kind of conversation computes the same ID, and the router can
place new sessions where that head is already cached.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from turnkv import protocol as p
from turnkv.errors import InvalidTagError

_HEAD_ROLES = ("system", "developer")


def new_session_id() -> str:
    return f"s-{uuid.uuid4().hex}"


def check_id(value: str, field: str) -> str:
    if not isinstance(value, str) or not p.is_valid_id(value):
        raise InvalidTagError(
            f"invalid turnkv.{field}: {value!r} must be 1-128 characters of [A-Za-z0-9._:-], "
            "starting with a letter or digit", field=f"turnkv.{field}")
    return value


def _plain(value: Any) -> Any:
    """JSON-ready data: pydantic models dumped, None values dropped (absent and null are the
    same head on the wire)."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        value = dump(exclude_none=True)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def stable_head(model: str, messages: Iterable[Any], tools: Iterable[Any] | None = None
                ) -> dict[str, Any]:
    head: list[Any] = []
    for message in messages:
        plain = _plain(message)
        if not isinstance(plain, Mapping) or plain.get("role") not in _HEAD_ROLES:
            break
        head.append(plain)
    return {"model": model, "system": head, "tools": _plain(list(tools or []))}


def prefix_id(*, model: str, messages: Iterable[Any], tools: Iterable[Any] | None = None) -> str:
    """`p-` + 24 hex digits of the SHA-256 of the stable head's canonical JSON."""
    canonical = json.dumps(stable_head(model, messages, tools), sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return "p-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:24]
