"""The session identities clients of other stacks send, and OpenAI's cache retention: read
from a request (and removed from its body) for the order `tags.read_keys` applies.

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
  (`tags.read_keys`).
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
from turnkv_server.router.dialects import DialectError

HEADER_VLLM_SESSION = "X-Session-ID"
HEADER_CLAUDE_CODE_SESSION = "x-claude-code-session-id"
HEADERS_CODEX_SESSION = ("session_id", "session-id")
_VLLM_SESSION = HEADER_VLLM_SESSION.lower()  # as `tags.Headers` keeps the names
# A foreign ID outside turnkv's alphabet is named by this and its hash.
FOREIGN_PREFIX = "h-"
# OpenAI's values; `24h` asks for the longest lease the router allows.
RETENTION_KEEP = "24h"
RETENTION_DEFAULT = "in_memory"


@dataclass(frozen=True)
class PeerSessions:
    """What a request's peers' fields name, each already a turnkv session ID."""

    vllm: str | None = None
    agent: str | None = None  # Claude Code's or Codex's own session header
    from_codex: bool = False
    retention_ttl: float | None = None  # `24h`: the longest TTL (the router caps it)


def read_peer_sessions(body: dict[str, Any], headers: Mapping[str, str]) -> PeerSessions:
    """Pop the peers' fields from `body` (mutates it) and read them with the headers
    (`tags.Headers`: names in lower case)."""
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
