"""The router's session table: where each session lives, what it holds, until when.

One owner of the clock (the table), bounded size, and SGLang's TTL rule: the operator sets a
default and a cap; a client's hint may only shorten the cap. Leases expire lazily on access and
in `sweep`, so no timer thread touches the table.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from turnkv.protocol import CacheHints


@dataclass(frozen=True)
class SessionKey:
    """Sessions are scoped by tenant: the same ID under two API keys is two sessions."""

    tenant: str
    session_id: str


@dataclass
class SessionTotals:
    turns: int = 0
    prompt_tokens: int = 0
    prefill_computed: int = 0
    # Prompt tokens the decode engine computed itself (turnkv's short deltas, failed receives).
    decode_computed: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    fallbacks: int = 0
    prefix_breaks: int = 0


@dataclass
class Session:
    key: SessionKey
    created_at: float
    last_used: float
    expires_at: float
    prefill: str | None = None
    decode: str | None = None
    prefix_id: str | None = None
    priority: int = 0
    # Token IDs the engines hold for this session: last prompt + its output.
    tokens: list[int] = field(default_factory=list)
    turns: int = 0
    # Per-mode state, e.g. the decode engine's kv_transfer_params in bidirectional mode.
    mode_state: dict[str, Any] = field(default_factory=dict)
    totals: SessionTotals = field(default_factory=SessionTotals)
    in_flight: bool = False


@dataclass(frozen=True)
class LeasePolicy:
    default_ttl: float = 300.0
    max_ttl: float = 900.0

    def __post_init__(self) -> None:
        if not 0 < self.default_ttl <= self.max_ttl:
            raise ValueError("lease policy needs 0 < default_ttl <= max_ttl")

    def ttl(self, hints: CacheHints) -> float:
        """The lease a turn gets: the client's ttl hint, never above the operator's cap."""
        wanted = hints.ttl if hints.ttl is not None else self.default_ttl
        if hints.next_turn_in is not None:
            # Keep at least until the announced next turn, with slack, within the cap.
            wanted = max(wanted, hints.next_turn_in * 1.5)
        return min(wanted, self.max_ttl)


class SessionTable:
    def __init__(
        self,
        policy: LeasePolicy | None = None,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.policy = policy or LeasePolicy()
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self.expired_total = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def get(self, key: SessionKey) -> Session | None:
        """The live session, or None; an expired lease is dropped on the way."""
        session = self._sessions.get(key)
        if session is None:
            return None
        if session.expires_at <= self.clock() and not session.in_flight:
            del self._sessions[key]
            self.expired_total += 1
            return None
        return session

    def open(self, key: SessionKey) -> Session:
        """The live session for ``key``, created if needed (evicting the least recently used
        idle session when the table is full)."""
        session = self.get(key)
        if session is not None:
            self._sessions.move_to_end(key)
            return session
        now = self.clock()
        while len(self._sessions) >= self.max_sessions and self._evict_one():
            pass
        session = Session(key=key, created_at=now, last_used=now,
                          expires_at=now + self.policy.default_ttl)
        self._sessions[key] = session
        return session

    def renew(self, session: Session, hints: CacheHints) -> None:
        now = self.clock()
        session.last_used = now
        session.expires_at = now + self.policy.ttl(hints)
        if hints.priority is not None:
            session.priority = hints.priority
        self._sessions.move_to_end(session.key)

    def release(self, key: SessionKey) -> Session | None:
        return self._sessions.pop(key, None)

    def sweep(self) -> list[Session]:
        """Drop every expired, idle session; returns them so their KV can be released."""
        now = self.clock()
        gone = [s for s in self._sessions.values() if s.expires_at <= now and not s.in_flight]
        for session in gone:
            del self._sessions[session.key]
        self.expired_total += len(gone)
        return gone

    def _evict_one(self) -> bool:
        # Lowest priority first, then least recently used; never a session mid-turn.
        idle = [s for s in self._sessions.values() if not s.in_flight]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.priority, s.last_used))
        del self._sessions[victim.key]
        self.evicted_total += 1
        return True
