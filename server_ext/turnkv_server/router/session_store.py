"""Where sessions outlive the router: a Redis server that several routers share (`--redis`).

With a store, every turn reads its session's record before it is routed and writes it back when
it ends (`StoredSessions`, the session service over the store), so that the routers share
placement, history and totals, and a restarted router loses no session. Redis owns the shared
clock: a record lives as long as the session's lease (`PX`), renewed by every write. Without
one (the default), a router's sessions live in its memory only (`sessions.SessionService`).

The engines never depend on any of it for correctness: their caches are content-addressed, so
a lost or stale record costs reuse (a recompute), never a wrong token.

A record (`to_record`, `apply_record`) holds what another router needs to serve the next turn
as this one would: the pair, the history, totals, the session's epoch, and the JSON-safe part of
the mode's state; not this process's background tasks (a push back in flight) or the in-flight
flag.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import orjson
import redis.asyncio as redis
from redis.exceptions import RedisError

from turnkv.protocol import CacheHints
from turnkv_server.router.sessions import (
    Session,
    SessionKey,
    SessionService,
    SessionTable,
    SessionTotals,
)

log = logging.getLogger(__name__)

PREFIX = "turnkv:"


class StoreUnavailable(Exception):
    """The shared store did not answer: whether it holds the session is unknown."""


class Key(Protocol):
    """A session's key: sessions are scoped by tenant."""

    @property
    def tenant(self) -> str: ...

    @property
    def session_id(self) -> str: ...


class RedisStore:
    """Session records in Redis, one JSON value a session, keyed by a hash of tenant and ID."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=5.0,
                                           socket_connect_timeout=5.0)

    async def start(self) -> bytes:
        """Connect; returns the routers' shared secret for cache salts. The first router to
        start picks it; the others (and restarts) read it, so a tenant's cache salt is the same
        whichever router serves it."""
        await self._redis.set(f"{PREFIX}salt-secret", secrets.token_bytes(32), nx=True)
        secret = await self._redis.get(f"{PREFIX}salt-secret")
        assert isinstance(secret, bytes)
        return secret

    async def load(self, key: Key) -> dict[str, Any] | None:
        """The session's record; None if there is none. Raises `StoreUnavailable`."""
        try:
            raw = await self._redis.get(_redis_key(key))
        except RedisError as exc:
            _unreachable(exc)
            raise StoreUnavailable(str(exc)) from exc
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
        except ValueError:
            log.warning("turnkv: unreadable session record in Redis; starting it afresh")
            return None
        return record if isinstance(record, dict) else None

    async def save(self, key: Key, record: dict[str, Any], ttl_s: float) -> None:
        try:
            await self._redis.set(_redis_key(key), orjson.dumps(record),
                                  px=max(1, int(ttl_s * 1000)))
        except RedisError as exc:
            _unreachable(exc)

    async def delete(self, key: Key) -> None:
        try:
            await self._redis.delete(_redis_key(key))
        except RedisError as exc:
            _unreachable(exc)

    async def close(self) -> None:
        await self._redis.aclose()


def _unreachable(exc: Exception) -> None:
    # Turns go on from this router's memory: only reuse across routers is lost meanwhile.
    log.warning("turnkv: Redis unreachable (%s); serving from this router's sessions", exc)


def _redis_key(key: Key) -> str:
    # No tenant names or session IDs in Redis's keyspace (or its logs): a hash of both.
    digest = hashlib.sha256(f"{key.tenant}\0{key.session_id}".encode()).hexdigest()[:40]
    return f"{PREFIX}session:{digest}"


def to_record(session: Session) -> dict[str, Any]:
    return {
        "prefill": session.prefill,
        "decode": session.decode,
        "prefix_id": session.prefix_id,
        "priority": session.priority,
        "tokens": session.tokens,
        "turns": session.turns,
        "totals": vars(session.totals),
        "last_stats": session.last_stats,
        "mode_state": {"model": session.mode_state.model},
        "epoch": session.epoch,
    }


def apply_record(session: Session, record: dict[str, Any]) -> None:
    """Make `session` what another router left: its fields, and the stored mode state over
    this router's (whose tasks and offers, if any, stay)."""
    session.prefill = record.get("prefill")
    session.decode = record.get("decode")
    session.prefix_id = record.get("prefix_id")
    session.priority = int(record.get("priority") or 0)
    session.tokens = [int(t) for t in record.get("tokens") or []]
    session.turns = int(record.get("turns") or 0)
    epoch = record.get("epoch")
    if isinstance(epoch, int) and not isinstance(epoch, bool):
        session.epoch = epoch
    totals = record.get("totals") or {}
    session.totals = SessionTotals(**{k: int(v) for k, v in totals.items()
                                      if k in SessionTotals.__dataclass_fields__})
    last = record.get("last_stats")
    session.last_stats = last if isinstance(last, dict) else None
    model = (record.get("mode_state") or {}).get("model")
    session.mode_state.model = model if isinstance(model, str) else None


class StoredSessions(SessionService):
    """The session service kept in step with the store: a session is read from it before its
    turn (and before the session API finds it), written to it with every renewal, deleted
    from it when it ends; and it expires only once no router has renewed it."""

    def __init__(self, table: SessionTable, store: RedisStore,
                 on_end: Callable[[Session], None],
                 on_change: Callable[[], None] | None = None,
                 on_forget: Callable[[Session], None] = lambda session: None) -> None:
        super().__init__(table, on_end, on_change, on_forget)
        self.store = store

    async def begin_turn(self, key: SessionKey, home: tuple[str | None, str] | None = None
                         ) -> tuple[Session, bool]:
        await self.sync(key)
        return await super().begin_turn(key, home)

    async def find(self, key: SessionKey) -> Session | None:
        await self.sync(key)
        return await super().find(key)

    async def renew(self, session: Session, hints: CacheHints) -> None:
        await super().renew(session, hints)
        await self.store.save(session.key, to_record(session),
                              session.expires_at - self.table.clock())

    async def release(self, session: Session) -> None:
        await super().release(session)
        await self.store.delete(session.key)

    async def expire(self) -> None:
        """End the sessions whose lease ran out on every router."""
        for gone in self.table.sweep():
            # Expired here; another router may have renewed it.
            if not await self._alive_elsewhere(gone.key):
                self._on_end(gone)
            else:
                self._on_forget(gone)
        self._on_change()

    async def sync(self, key: SessionKey) -> None:
        """Take the session as the routers last left it: another router may have served its
        last turn, or ended it."""
        try:
            record = await self.store.load(key)
        except StoreUnavailable:
            return  # serve from this router's copy, if any
        local = self.table.get(key)
        if local is not None and local.in_flight:
            return  # a turn of it is under way here; it writes the record when it ends
        if record is None:
            if local is not None:
                self.table.release(key)
                self._forget(local)  # ended by another router, which told the engines
            return
        apply_record(self.table.open(key), record)

    async def _alive_elsewhere(self, key: SessionKey) -> bool:
        try:
            return await self.store.load(key) is not None
        except StoreUnavailable:
            return False
