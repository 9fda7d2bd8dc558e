"""What an engine's turnkv connector is told about a session's lease, per request: the
engines' name for the session, which life of it (its epoch: engines ignore requests of a
released life) and the turn's hints (TTL, priority, expected return, `final`).
Shared by the modes whose engines run the connector: `turnkv` (P/D pairs) and `affinity` with
`--engine-leases` (aggregated engines)."""

from __future__ import annotations

import hashlib
from typing import Any

from turnkv.protocol import CacheHints
from turnkv_server.engine.protocol import KEY, Receive, Send, TurnParams
from turnkv_server.router.modes.base import Turn
from turnkv_server.router.sessions import LeasePolicy, Session


def lease_key(session: Session) -> str:
    """The engines' name for a session: tenant-scoped, and no IDs or tenant names in their logs."""
    raw = f"{session.key.tenant}\0{session.key.session_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def turn_hints(turn: Turn) -> CacheHints:
    return turn.tag.hints if turn.tag is not None else CacheHints()


def lease_params(turn: Turn, policy: LeasePolicy, send: Send | None = None,
                 receive: Receive | None = None) -> dict[str, Any]:
    """A request's `kv_transfer_params` for a turn: its transfers, and for a session the lease
    its blocks leave behind. The hint rides on every request of the turn that leaves a lease
    (prefill, decode, push back): each engine orders its evictions by it."""
    session = turn.session
    if session is None:
        params = TurnParams(receive=receive, send=send)
    else:
        hints = turn_hints(turn)
        params = TurnParams(session=lease_key(session), ttl_s=policy.engine_ttl(hints),
                            priority=hints.priority or 0, release=hints.final,
                            receive=receive, send=send,
                            next_turn_in_s=None if hints.final else hints.next_turn_in,
                            epoch=session.epoch)
    return {KEY: params.to_wire()}
