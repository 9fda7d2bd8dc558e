"""The router's sessions: where each lives, what it holds, until when; and the service the turn
pipeline and the session API use to open, remember, renew and end them.

One owner of the clock (the table), bounded size, and SGLang's TTL rule: the operator sets a
default and a cap; a client's hint may only shorten the cap. Leases expire lazily on access and
in `sweep`, so no timer thread touches the table.

Each session keeps its token history (the last turn's prompt and output token IDs, as the
engines computed them). Reused KV is only correct for the positions where a new prompt's tokens
are exactly those tokens: an edited or stripped history, compacted context or assistant text
that re-tokenises differently breaks the match, and reuse must stop there
(`token_history.prefix_break`).

Each life of a session (opened again after it ended, it is a later one) has an epoch that its
requests carry: engines ignore the holds and renewals of a released life (`engine.protocol`).
It is the wall clock when the life began (`new_epoch`), so it grows across router restarts and
routers sharing a store, as far as their clocks agree (docs/protocol.md says what a skew costs).

With a shared store (`session_store`), the service reads a session's record before its turn is
routed and writes it when the turn ends. A record holds what another router needs to serve the
next turn as this one would: the pair, the history, totals, and the JSON-safe part of the
mode's state; not this process's background tasks (a push back in flight) or the in-flight flag.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from turnkv.protocol import CacheHints, TurnStats, TurnTag
from turnkv_server.router.placement import Placement
from turnkv_server.router.session_counts import COUNTED_FIELDS, SessionCounts
from turnkv_server.router.session_store import RedisStore, StoreUnavailable

_last_epoch = 0


def new_epoch() -> int:
    """A new life's epoch: microseconds of wall-clock time, strictly increasing here."""
    global _last_epoch
    _last_epoch = max(_last_epoch + 1, time.time_ns() // 1000)
    return _last_epoch


@dataclass(frozen=True)
class SessionKey:
    """Sessions are scoped by tenant: the same ID under two API keys is two sessions."""

    tenant: str
    session_id: str


@dataclass
class SessionTotals:
    """A session's turns' stats, summed."""

    turns: int = 0
    prompt_tokens: int = 0
    prefill_computed: int = 0
    # Prompt tokens the decode engine computed itself (turnkv's short deltas, failed receives).
    decode_computed: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    fallbacks: int = 0
    prefix_breaks: int = 0

    def add(self, stats: TurnStats) -> None:
        tokens = stats.prompt_tokens
        self.turns += 1
        self.prompt_tokens += tokens.total
        self.completion_tokens += stats.completion_tokens
        self.prefill_computed += tokens.prefill_computed or 0
        self.decode_computed += tokens.decode_computed or 0
        self.reused_tokens += max(0, tokens.total - (tokens.prefill_computed or 0)
                                  - (tokens.decode_computed or 0))
        self.fallbacks += 1 if stats.fallback else 0
        self.prefix_breaks += 1 if stats.prefix_break_at is not None else 0


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
    last_stats: dict[str, Any] | None = None  # the last turn's, as the client got them
    in_flight: bool = False
    # A new session's decode engine while its first turn is in flight (placement counts it
    # as home there: sessions that start together would otherwise all look homeless).
    placed: str | None = None
    epoch: int = field(default_factory=new_epoch)  # which life of the session this is
    # Turns of it waiting for admission (`admission`).
    queued: int = 0
    # The counts of the table it is in (`session_counts`), kept as its fields are set.
    counted_in: SessionCounts | None = field(default=None, init=False, repr=False,
                                             compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in COUNTED_FIELDS:
            counts = self.__dict__.get("counted_in")
            if counts is not None:
                counts.update(self)


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

    def engine_ttl(self, hints: CacheHints) -> float | None:
        """The TTL the engines' leases get: the session's own (`ttl`) whenever a hint shapes
        it, so that an engine keeps the KV as long as the router keeps the session (each engine
        still caps it); None, each engine's own default, when no hint does."""
        if hints.ttl is None and hints.next_turn_in is None:
            return None
        return self.ttl(hints)


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
        self.counts = SessionCounts()
        # Runs for each session the table drops by itself (expired on the way, evicted).
        self.on_drop: Callable[[Session], None] = lambda session: None
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
            self._remove(key)
            self.expired_total += 1
            self.on_drop(session)
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
        session.counted_in = self.counts
        self.counts.add(session)
        return session

    def renew(self, session: Session, hints: CacheHints) -> None:
        now = self.clock()
        session.last_used = now
        session.expires_at = now + self.policy.ttl(hints)
        if hints.priority is not None:
            session.priority = hints.priority
        self._sessions.move_to_end(session.key)

    def release(self, key: SessionKey) -> Session | None:
        return self._remove(key)

    def sweep(self) -> list[Session]:
        """Drop every expired, idle session; returns them so their KV can be released."""
        now = self.clock()
        gone = [s for s in self._sessions.values() if s.expires_at <= now and not s.in_flight]
        for session in gone:
            self._remove(session.key)
        self.expired_total += len(gone)
        return gone

    def _evict_one(self) -> bool:
        # Lowest priority first, then least recently used; never a session mid-turn.
        idle = [s for s in self._sessions.values() if not s.in_flight]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.priority, s.last_used))
        self._remove(victim.key)
        self.evicted_total += 1
        self.on_drop(victim)
        return True

    def _remove(self, key: SessionKey) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self.counts.remove(session)
            session.counted_in = None
        return session


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
        "mode_state": {k: v for k, v in session.mode_state.items() if _json_safe(v)},
        "epoch": session.epoch,
    }


def apply_record(session: Session, record: dict[str, Any]) -> None:
    """Make `session` what another router left: its fields, and the stored mode state over
    this router's (whose tasks, if any, stay)."""
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
    kept = {k: v for k, v in session.mode_state.items() if not _json_safe(v)}
    session.mode_state = {**dict(record.get("mode_state") or {}), **kept}


def _json_safe(value: Any) -> bool:
    """Plain JSON only: a dataclass (bidirectional's held KV, with this process's clock in it)
    or a task stays with the router that made it."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_safe(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_safe(v) for k, v in value.items())
    return False


class SessionService:
    """The router's sessions: its table, kept in step with the shared store when there is one.
    `on_end` runs for each session that ends (released, or expired on every router): the
    mode releases what it holds for it. `on_forget` runs for each session that leaves the
    table without ending (evicted when full, expired on the way or here only, ended by
    another router): the mode lets go of what it keeps for it in this process. `on_change`
    runs whenever the histories the table holds may have shrunk (a session left, a turn's
    history replaced the last): admission re-checks its queue."""

    def __init__(self, table: SessionTable, store: RedisStore | None,
                 on_end: Callable[[Session], None],
                 on_change: Callable[[], None] = lambda: None,
                 on_forget: Callable[[Session], None] = lambda session: None) -> None:
        self.table = table
        self.store = store
        self._on_end = on_end
        self._on_change = on_change
        self._on_forget = on_forget
        table.on_drop = self._forget

    async def begin_turn(self, key: SessionKey) -> tuple[Session, bool]:
        """The session a tagged turn belongs to, in flight from now on; and whether the turn
        opened it."""
        await self.sync(key)
        opened = self.table.get(key) is None
        session = self.table.open(key)
        session.in_flight = True
        return session, opened

    async def end_turn(self, session: Session, opened: bool, failed: bool) -> None:
        session.in_flight = False
        # A session whose first turn failed holds nothing worth a table entry.
        if opened and failed and session.turns == 0:
            await self.release(session)

    async def remember(self, session: Session, tag: TurnTag | None, placement: Placement,
                       stats: TurnStats, history: list[int] | None) -> None:
        """A turn served: its pair, its history (prompt and output token IDs), its stats, and a
        renewed lease (or the end of the session, on a `final` turn)."""
        # A resent turn (an index already seen) is not counted twice.
        if tag is None or tag.turn is None or tag.turn > session.turns:
            session.turns = stats.turn
            session.totals.add(stats)
        session.prefill, session.decode = placement.prefill.name, placement.decode.name
        if history is not None:
            session.tokens = history
        session.last_stats = stats.model_dump()
        if tag and tag.prefix_id:
            session.prefix_id = tag.prefix_id
        hints = tag.hints if tag else CacheHints()
        if hints.final:
            await self.release(session)
        else:
            await self.renew(session, hints)
            # An edited history may be shorter; a first turn's replaces an estimate.
            self._on_change()

    async def find(self, key: SessionKey) -> Session | None:
        await self.sync(key)
        return self.table.get(key)

    async def renew(self, session: Session, hints: CacheHints) -> None:
        self.table.renew(session, hints)
        if self.store is not None:
            await self.store.save(session.key, to_record(session),
                                  session.expires_at - self.table.clock())

    async def release(self, session: Session) -> None:
        self.table.release(session.key)
        if self.store is not None:
            await self.store.delete(session.key)
        self._on_end(session)
        self._on_change()

    async def expire(self) -> None:
        """End the sessions whose lease ran out (with a store: on every router)."""
        for gone in self.table.sweep():
            # Expired here; with a shared store, another router may have renewed it.
            if not await self._alive_elsewhere(gone.key):
                self._on_end(gone)
            else:
                self._on_forget(gone)
        self._on_change()

    async def sync(self, key: SessionKey) -> None:
        """With a shared store, take the session as the routers last left it: another router
        may have served its last turn, or ended it."""
        if self.store is None:
            return
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

    def _forget(self, session: Session) -> None:
        # (A session expired on the way may live on at another router, and its engines'
        # leases end on their own timers: the expiry sweep is what ends sessions.)
        self._on_forget(session)
        self._on_change()

    async def _alive_elsewhere(self, key: SessionKey) -> bool:
        if self.store is None:
            return False
        try:
            return await self.store.load(key) is not None
        except StoreUnavailable:
            return False

    def view(self, session: Session) -> dict[str, Any]:
        now = self.table.clock()
        return {
            "session_id": session.key.session_id,
            "turns": session.turns,
            "prefill_node": session.prefill,
            "decode_node": session.decode,
            "prefix_id": session.prefix_id,
            "priority": session.priority,
            "tokens_held": len(session.tokens),
            "expires_in_s": round(max(0.0, session.expires_at - now), 3),
            "totals": vars(session.totals),
            "last_turn": session.last_stats,
        }
