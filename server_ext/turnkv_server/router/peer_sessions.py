"""Peers' session keys: what clients of other serving stacks already send to name a session or
hint at its future, read (and removed from the body) for the order `app.read_keys` applies.

1. Dialects read under the turnkv tag (docs/protocol.md, "Peers' dialects"), `read_dialects`.

- NVIDIA Dynamo's `nvext.session_control` names the session (`session_id`); `action: "open"`
  with a `timeout` asks for that lease, `action: "close"` ends the session after the turn.
- Dynamo's `X-Dynamo-Session-ID` header names the session; `X-Dynamo-Session-Final: true`
  ends it after the turn.
- Dynamo's `nvext.agent_hints.priority` is the session's priority, clamped to turnkv's range.
- OpenAI's `prompt_cache_key` is a prefix ID: clients share one key across many
  conversations (a user, a prompt template), and one turnkv session holds one conversation's
  history, one turn at a time. (Codex sends its conversation ID as the key: for a Codex
  request `app.read_keys` reads it as the session too.)

The turnkv tag (body and `X-TurnKV-*` headers) wins field by field. A dialect's lifecycle
(its TTL, its end) acts only on the session its own field names, so that a dialect can never
end or re-time a session the turnkv tag named. Session IDs are scoped by tenant where every tag
is (`SessionKey`), and a prompt cache key is hashed with its tenant into the prefix ID.
The fields are removed from the body: engines see a session only as the router's hash of it.

2. The session identities of other stacks and OpenAI's cache retention, `read_peer_sessions`.

- vLLM's own (its `GenerateBaseServing._get_session_id`, vLLM 0.32
  `entrypoints/generate/base/serving.py`): the `session_id` body field, else the
  `X-Session-ID` header, else `vllm_xargs.session_id`; and the `conversation_id` body field
  that vLLM's multi-turn benchmark client sends with `--send-conversation-id` (beside the
  header, the same value), which vLLM itself ignores.
- The coding agents' native headers: Claude Code's `x-claude-code-session-id`; Codex CLI's
  `session_id` (openai/codex, `codex-api/src/requests/headers.rs`,
  `build_conversation_headers`: its conversation ID), or `session-id` as later Codex
  releases spell it.
- Codex: whether the request comes from Codex at all (its `originator` header, or a
  `User-Agent` starting `codex`), which decides what its `prompt_cache_key` is
  (`app.read_keys`).
- OpenAI's `prompt_cache_retention`: `in_memory` (the default) or `24h`.

These IDs are any string to their clients (vLLM sets no alphabet; Codex and Claude Code send
UUIDs): one outside turnkv's ID alphabet is named by its hash (`foreign_id`) rather than
refused, so that a stock client that works against vLLM works here. vLLM uses a request's
`session_id` only to label its KV cache events (`BlockStored.session_id`,
`v1/core/block_pool.py`), which nothing of turnkv subscribes to: the fields are removed from
the body, and engines see a session only as the router's hash of tenant and ID, as for every
tag. The headers never reach an engine (the router sends its own).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from turnkv import protocol as p

HEADER_DYNAMO_SESSION = "X-Dynamo-Session-ID"
HEADER_DYNAMO_FINAL = "X-Dynamo-Session-Final"
# As `app.Headers` keeps the names.
_DYNAMO_SESSION, _DYNAMO_FINAL = HEADER_DYNAMO_SESSION.lower(), HEADER_DYNAMO_FINAL.lower()
# Prefix IDs made from a prompt cache key start with this, so that they read as such.
PROMPT_CACHE_PREFIX = "pck-"

_ID_RULE = "must be 1-128 characters of [A-Za-z0-9._:-], starting with a letter or digit"
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class DialectError(ValueError):
    """A dialect field the router cannot read: a 400 that names it."""

    status = 400

    def __init__(self, param: str, problem: str) -> None:
        self.param = param
        self.message = f"invalid {param}: {problem}"
        super().__init__(self.message)


@dataclass(frozen=True)
class Dialects:
    """A request's dialect fields, in turnkv's terms."""

    # session_control's, else the header's: a body field wins over a header, as turnkv's own.
    session_id: str | None = None
    prefix_id: str | None = None
    # The `prompt_cache_key` as sent (`app.read_keys` decides whether it names a session).
    cache_key: str | None = None
    priority: int | None = None
    # Hints that act only on the session their own field named: (that session ID, hints).
    bound: tuple[tuple[str, dict[str, Any]], ...] = ()

    def under(self, native: dict[str, Any]) -> dict[str, Any]:
        """`native` (the turnkv tag's fields as sent, not yet validated) with these filling
        what it leaves unset; as it is when neither names a session (a dialect's hints on a
        one-off request are no tag)."""
        session_id = native.get("session_id", self.session_id)
        if session_id is None:
            return native
        merged = {**native, "session_id": session_id}
        if self.prefix_id is not None:
            merged.setdefault("prefix_id", self.prefix_id)
        if not isinstance(merged.get("hints", {}), dict):
            return merged  # malformed: the tag's validation names it
        hints = dict(merged.get("hints") or {})
        if self.priority is not None:
            hints.setdefault("priority", self.priority)
        for named, bound in self.bound:
            if named == session_id:
                for name, value in bound.items():
                    hints.setdefault(name, value)
        if hints:
            merged["hints"] = hints
        return merged


def read_dialects(body: dict[str, Any], headers: Mapping[str, str], tenant: str) -> Dialects:
    """Pop the dialect fields from `body` (mutates it) and read them with the headers'
    (`app.Headers`: names in lower case)."""
    control, agent_hints = None, None
    nvext = body.get("nvext")
    if nvext is not None:
        if not isinstance(nvext, dict):
            raise DialectError("nvext", "must be an object")
        control = nvext.pop("session_control", None)
        agent_hints = nvext.pop("agent_hints", None)
        # Dynamo's other extensions go on as they came (vLLM ignores them); an empty nvext
        # would be all that is left of the dialect.
        if not nvext:
            del body["nvext"]
    cache_key = body.pop("prompt_cache_key", None)
    prefix_id = _prefix_id(cache_key, tenant)
    priority = _priority(agent_hints)
    controlled = _session_control(control)
    header_id = _header_session(headers.get(_DYNAMO_SESSION))
    final = _header_final(headers.get(_DYNAMO_FINAL))
    bound: list[tuple[str, dict[str, Any]]] = []
    if controlled is not None and controlled[1]:
        bound.append(controlled)
    named = header_id or (controlled[0] if controlled else None)
    if final and named is not None:
        bound.append((named, {"final": True}))
    return Dialects(session_id=controlled[0] if controlled else header_id,
                    prefix_id=prefix_id, cache_key=cache_key if prefix_id else None,
                    priority=priority, bound=tuple(bound))


def _session_control(raw: Any) -> tuple[str, dict[str, Any]] | None:
    """Dynamo's `SessionControl`: the session, and the hints its action asks for."""
    where = "nvext.session_control"
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise DialectError(where, "must be an object")
    session_id = raw.get("session_id")
    if session_id is None:
        raise DialectError(f"{where}.session_id", "required")
    if not isinstance(session_id, str) or not p.is_valid_id(session_id):
        raise DialectError(f"{where}.session_id", _ID_RULE)
    action = raw.get("action")
    if action not in (None, "open", "close"):
        raise DialectError(f"{where}.action", 'must be "open", "close" or absent')
    timeout = raw.get("timeout")
    if timeout is not None and not (_is_int(timeout) and timeout >= 0):
        raise DialectError(f"{where}.timeout", "must be a whole number of seconds >= 0")
    if action == "close":
        return session_id, {"final": True}
    # Dynamo reads `timeout` with "open" only: later turns re-arm the lease the open bound.
    if action == "open" and timeout is not None:
        if timeout == 0:
            raise DialectError(f"{where}.timeout", "must be above 0 to open a session")
        # Above turnkv's own bound the router's --max-ttl caps it anyway.
        return session_id, {"ttl": float(min(timeout, p.MAX_TTL_SECONDS))}
    return session_id, {}


def _priority(raw: Any) -> int | None:
    """Dynamo's `AgentHints`: its priority (higher is more important, as turnkv's) within
    turnkv's range. Its other fields (`osl`, `speculative_prefill`, `latency_sensitivity`)
    mean nothing to a session and are only checked; unknown ones are ignored, as Dynamo does."""
    where = "nvext.agent_hints"
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise DialectError(where, "must be an object")
    for name, fits, rule in (
            ("osl", lambda v: _is_int(v) and 0 <= v < 2**32, "must be a whole number >= 0"),
            ("speculative_prefill", lambda v: isinstance(v, bool), "must be true or false"),
            ("latency_sensitivity", _is_number, "must be a number")):
        if raw.get(name) is not None and not fits(raw[name]):
            raise DialectError(f"{where}.{name}", rule)
    priority = raw.get("priority")
    if priority is None:
        return None
    if not _is_int(priority):
        raise DialectError(f"{where}.priority", "must be an integer")
    return max(p.MIN_PRIORITY, min(p.MAX_PRIORITY, priority))


def _prefix_id(key: Any, tenant: str) -> str | None:
    """OpenAI's `prompt_cache_key` as a prefix ID: any string, hashed with the tenant (OpenAI
    scopes keys by organization), so that two tenants' equal keys never share a warm prefix."""
    if key is None or key == "":
        return None
    if not isinstance(key, str):
        raise DialectError("prompt_cache_key", "must be a string")
    scoped = f"{tenant}\0{key}".encode("utf-8", "surrogatepass")
    return PROMPT_CACHE_PREFIX + hashlib.sha256(scoped).hexdigest()[:32]


def _header_session(value: str | None) -> str | None:
    # As Dynamo: surrounding blanks are no part of the ID, and a blank header is no header.
    value = (value or "").strip()
    if not value:
        return None
    if not p.is_valid_id(value):
        raise DialectError(HEADER_DYNAMO_SESSION, _ID_RULE)
    return value


def _header_final(value: str | None) -> bool:
    value = (value or "").strip().lower()
    if value in ("", *_FALSE):
        return False
    if value in _TRUE:
        return True
    raise DialectError(HEADER_DYNAMO_FINAL, "must be true or false")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- the session identities of other stacks ---------------------------------------------------

HEADER_VLLM_SESSION = "X-Session-ID"
HEADER_CLAUDE_CODE_SESSION = "x-claude-code-session-id"
HEADERS_CODEX_SESSION = ("session_id", "session-id")
_VLLM_SESSION = HEADER_VLLM_SESSION.lower()  # as `app.Headers` keeps the names
# A foreign ID outside turnkv's alphabet is named by this and its hash.
FOREIGN_PREFIX = "h-"
# OpenAI's values; `24h` asks for the longest lease the router allows.
RETENTION_KEEP = "24h"
RETENTION_DEFAULT = "in_memory"


# Every field the readers above look for, in the body and among the headers (as `app.Headers`
# keeps the names): a request that carries none of them (most) has nothing here to read.
BODY_FIELDS = frozenset({"nvext", "prompt_cache_key", "session_id", "vllm_xargs",
                         "conversation_id", "prompt_cache_retention"})
HEADER_FIELDS = frozenset({_DYNAMO_SESSION, _DYNAMO_FINAL, _VLLM_SESSION,
                           HEADER_CLAUDE_CODE_SESSION, *HEADERS_CODEX_SESSION})


@dataclass(frozen=True)
class PeerSessions:
    """What a request's peers' fields name, each already a turnkv session ID."""

    vllm: str | None = None
    agent: str | None = None  # Claude Code's or Codex's own session header
    from_codex: bool = False
    retention_ttl: float | None = None  # `24h`: the longest TTL (the router caps it)


def read_peer_sessions(body: dict[str, Any], headers: Mapping[str, str]) -> PeerSessions:
    """Pop the peers' fields from `body` (mutates it) and read them with the headers
    (`app.Headers`: names in lower case)."""
    vllm = _first(
        _body_id(body, "session_id"),
        _header_id(headers.get(_VLLM_SESSION)),
        _xargs_id(body),
        _body_id(body, "conversation_id"),
    )
    agent = _first(_header_id(headers.get(HEADER_CLAUDE_CODE_SESSION)),
                   *(_header_id(headers.get(name)) for name in HEADERS_CODEX_SESSION))
    originator = (headers.get("originator") or "").strip().lower()
    agent_name = (headers.get("user-agent") or "").strip().lower()
    return PeerSessions(vllm=vllm, agent=agent,
                        from_codex=originator.startswith("codex")
                        or agent_name.startswith("codex"),
                        retention_ttl=_retention(body.pop("prompt_cache_retention", None)))


def foreign_id(value: str) -> str:
    """A client's session ID as a turnkv session ID: itself when it fits turnkv's alphabet,
    else `h-` and 32 hex digits of its sha256 (the same ID always names the same session)."""
    if p.is_valid_id(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return FOREIGN_PREFIX + digest


def _first(*ids: str | None) -> str | None:
    return next((i for i in ids if i is not None), None)


def _body_id(body: dict[str, Any], name: str) -> str | None:
    value = body.pop(name, None)
    if value is None or value == "":
        return None  # as vLLM: an empty session ID is none
    if not isinstance(value, str):
        raise DialectError(name, "must be a string")
    return foreign_id(value)


def _header_id(value: str | None) -> str | None:
    value = (value or "").strip()
    return foreign_id(value) if value else None


def _xargs_id(body: dict[str, Any]) -> str | None:
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict) or "session_id" not in xargs:
        return None  # (vLLM checks vllm_xargs' own type)
    value = xargs.pop("session_id")
    if not xargs:
        del body["vllm_xargs"]
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DialectError("vllm_xargs.session_id", "must be a string")
    return foreign_id(value)


def _retention(value: Any) -> float | None:
    if value is None or value == RETENTION_DEFAULT:
        return None
    if value == RETENTION_KEEP:
        return p.MAX_TTL_SECONDS
    raise DialectError("prompt_cache_retention",
                       f'must be "{RETENTION_DEFAULT}" or "{RETENTION_KEEP}"')
