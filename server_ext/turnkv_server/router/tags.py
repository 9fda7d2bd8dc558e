"""Reading a request's keys: turnkv's own tag (the body's `turnkv` field, the `X-TurnKV-*`
headers under it), then the session keys of other stacks in one order (docs/protocol.md,
"Session keys"): Dynamo's, vLLM's, the Responses lineage, the coding agents' headers
(`peer_sessions`), Codex's `prompt_cache_key`. A request none of them names is left
to the content (`inferred_sessions`). And what the router refuses to serve.

The turnkv tag wins field by field; the first key that names a session names it, and the
tag's hints go with that session. Either way the tag is validated by the same pydantic models
the SDK uses, and every key is removed before the request reaches an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from turnkv import protocol as p
from turnkv_server.router.peer_sessions import (
    BODY_FIELDS,
    HEADER_FIELDS,
    Dialects,
    PeerSessions,
    foreign_id,
    read_dialects,
    read_peer_sessions,
)

DEFAULT_TENANT = "default"
# What a request without peers' fields names by them: nothing.
NO_DIALECTS, NO_PEERS = Dialects(), PeerSessions()


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status



_HEADER_FIELDS: dict[str, tuple[str, ...]] = {name.lower(): path for name, path in {
    p.HEADER_SESSION: ("session_id",),
    p.HEADER_TURN: ("turn",),
    p.HEADER_PREFIX: ("prefix_id",),
    p.HEADER_TTL: ("hints", "ttl"),
    p.HEADER_NEXT_TURN_IN: ("hints", "next_turn_in"),
    p.HEADER_FINAL: ("hints", "final"),
    p.HEADER_PRIORITY: ("hints", "priority"),
}.items()}


class Headers(dict[str, str]):
    """A request's headers, read once: each name's first value, under the name in lower case,
    where its readers look it up (`dict.get`, in C: a turn looks up a dozen names among its
    keys, and Starlette's own mapping scans every header for each)."""

    @classmethod
    def of_raw(cls, raw: list[tuple[bytes, bytes]]) -> Headers:
        # Reversed: a name sent twice keeps its first value, as Starlette's `get` does.
        return cls({name.decode("latin-1").lower(): value.decode("latin-1")
                    for name, value in reversed(raw)})

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Headers:
        """`headers` under lower-case names (a caller's mapping of any case)."""
        if isinstance(headers, Headers):
            return headers
        return cls({name.lower(): value for name, value in headers.items()})


@dataclass(frozen=True)
class RequestKeys:
    """What a request names: its tag (the session and hints, from whichever key named it),
    which key that was, and for a request with no session the prefix that places it."""

    tag: p.TurnTag | None
    source: p.SessionSource | None  # None: no key named a session
    prefix_id: str | None  # a sessionless request's (`prompt_cache_key`)
    # turnkv's own tag came (the body's field or an `X-TurnKV-*` header): its client reads
    # the stats chunk of a stream.
    native: bool = False
    # `prompt_cache_retention: 24h`: the TTL asked for, for a session named later (inferred).
    retention_ttl: float | None = None


def extract_tag(body: dict[str, Any], headers: Mapping[str, str],
                tenant: str = DEFAULT_TENANT) -> p.TurnTag | None:
    """Pop the tag from ``body`` (mutates it), merge the headers under it and peers' keys
    under both; raises `DialectError` for a peer's field it cannot read."""
    return read_keys(body, headers, tenant).tag


def extract_tags(body: dict[str, Any], headers: Mapping[str, str],
                 tenant: str = DEFAULT_TENANT) -> tuple[p.TurnTag | None, str | None]:
    """`extract_tag`'s tag and, for a request with no session, the prefix ID a dialect named
    (`prompt_cache_key`): where the turn is placed, and nothing more."""
    keys = read_keys(body, headers, tenant)
    return keys.tag, keys.prefix_id


def read_keys(body: dict[str, Any], headers: Mapping[str, str],
              tenant: str = DEFAULT_TENANT, lineage: str | None = None) -> RequestKeys:
    """The request's keys, in the documented order (docs/protocol.md, "Session keys"); pops
    every one from `body` (mutates it). `lineage`: the session a chain of Responses names (its
    root response's ID, or its `conversation`), from the Responses route; None elsewhere."""
    headers = Headers.of(headers)
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
    native = bool(merged)
    # Peers' fields are read where the request carries one: most carry none. (Codex's
    # `originator` and `User-Agent` alone name nothing: they say what its cache key is.)
    peered = not (BODY_FIELDS.isdisjoint(body) and HEADER_FIELDS.isdisjoint(headers))
    dialects = read_dialects(body, headers, tenant) if peered else NO_DIALECTS
    peers = read_peer_sessions(body, headers) if peered else NO_PEERS
    source: p.SessionSource | None = "tag" if "session_id" in merged else None
    if source is None:
        # Codex sends its conversation ID as the key; anyone else's names a shared prefix.
        codex_key = foreign_id(dialects.cache_key) if peers.from_codex and dialects.cache_key \
            else None
        named: tuple[tuple[p.SessionSource, str | None], ...] = (
            ("dynamo", dialects.session_id), ("vllm", peers.vllm),
            ("lineage", foreign_id(lineage) if lineage else None), ("agent", peers.agent),
            ("prompt_cache_key", codex_key))
        source, session_id = next(((s, i) for s, i in named if i is not None), (None, None))
        if session_id is not None:
            merged["session_id"] = session_id
    if peered:
        merged = dialects.under(merged)
    if not merged:
        return RequestKeys(None, None, dialects.prefix_id, retention_ttl=peers.retention_ttl)
    if peers.retention_ttl is not None and "session_id" in merged \
            and isinstance(merged.get("hints", {}), dict):
        merged["hints"] = {"ttl": peers.retention_ttl, **merged.get("hints", {})}
    try:
        return RequestKeys(p.TurnTag.model_validate(merged), source, None, native,
                           peers.retention_ttl)
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
