"""The router's sessions: where each lives, what it holds, until when (`SessionTable`), and the
service the turn pipeline and the session API open, remember, renew and end them through
(`SessionService`; with `--redis`, `session_store.StoredSessions`, in step with other routers).

One owner of the clock (the table), bounded size, and SGLang's TTL rule: the operator sets a
default and a cap; a client's hint may only shorten the cap. Leases expire lazily on access and
in `sweep`, so no timer thread touches the table.

Each session keeps its token history (the last turn's prompt and output token IDs): reused KV
is correct only as far as a new prompt repeats it, as the engines computed it (`token_history`).

What the live sessions add up to is kept as they change (`SessionCounts`): nothing sums the table.

Each life of a session (opened again after it ended, it is a later one) has an epoch that its
requests carry: engines ignore the holds and renewals of a released life (`engine.protocol`).
It is the wall clock when the life began (`new_epoch`), so it grows across router restarts and
routers sharing a store, as far as their clocks agree (docs/protocol.md says what a skew costs).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from turnkv.protocol import CacheHints, RouterTurnStats, TurnTag
from turnkv_server.router.mode_state import ModeState

if TYPE_CHECKING:  # engines imports aiohttp, which the CLI's settings (`config`) must not
    from turnkv_server.router.engines import Placement

_last_epoch = 0
_UNSET = object()


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

    def add(self, stats: RouterTurnStats) -> None:
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
    # What the serving mode keeps of it between turns.
    mode_state: ModeState = field(default_factory=ModeState)
    totals: SessionTotals = field(default_factory=SessionTotals)
    last_stats: dict[str, Any] | None = None  # the last turn's, as the client got them
    in_flight: bool = False
    # A new session's decode engine while its first turn is in flight (placement counts it
    # as home there: sessions that start together would otherwise all look homeless).
    placed: str | None = None
    epoch: int = field(default_factory=new_epoch)  # which life of the session this is
    # Turns of it waiting for admission (`admission.Admission`).
    queued: int = 0
    # The counts of the table it is in (`SessionCounts`), kept as its fields are set.
    counted_in: SessionCounts | None = field(default=None, init=False, repr=False,
                                             compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        fields = self.__dict__
        if name in COUNTED_FIELDS and fields.get(name, _UNSET) is not value:
            fields[name] = value
            counts = fields.get("counted_in")
            if counts is not None:
                counts.update(self)
        else:
            fields[name] = value


# -- the counts ---------------------------------------------------------------------------

# The session fields a share depends on: setting any of them (anew) updates the counts.
COUNTED_FIELDS = frozenset({"tokens", "last_stats", "in_flight", "queued", "decode", "placed"})


def held_tokens(session: Session) -> int:
    """The history the engines hold for a session: its token IDs, or, where the mode keeps
    none (affinity does not tokenize), its last turn's prompt and output, which add up to it."""
    if session.tokens:
        return len(session.tokens)
    last = session.last_stats or {}
    return int((last.get("prompt_tokens") or {}).get("total") or 0) \
        + int(last.get("completion_tokens") or 0)


class Share(NamedTuple):
    """One session's part of the counts. (A tuple: made and compared on every counted field
    set, which a frozen dataclass made several times dearer.)"""

    tokens: int  # the history held for it
    # Admitted, its first turn under way: it holds nothing yet, but will. (A session whose
    # turn is still queued for admission is not admitted.)
    starting: bool
    home: str | None  # its decode engine, or where its first turn was placed


def share_of(session: Session) -> Share:
    tokens = held_tokens(session)
    return Share(tokens, not tokens and session.in_flight and not session.queued,
                 session.decode or session.placed)


class SessionCounts:
    """The counts over the sessions of one table: the history the engines hold for them and
    how many hold any (admission's rule), how many admitted newcomers hold nothing yet
    (likewise), and how many sessions each engine is home to (placement balances new sessions
    by it). `SessionTable` calls `add` and `remove`, and a session in the table calls `update`
    whenever a counted field is set."""

    def __init__(self) -> None:
        self.tokens = 0  # history held by all the sessions together
        self.holding = 0  # sessions holding any history
        self.starting = 0  # sessions admitted that hold none yet
        self.homes: Counter[str] = Counter()  # engine name -> sessions home there
        self._shares: dict[SessionKey, Share] = {}

    def __len__(self) -> int:
        return len(self._shares)

    def add(self, session: Session) -> None:
        self.remove(session)
        share = self._shares[session.key] = share_of(session)
        self._count(share, 1)

    def remove(self, session: Session) -> None:
        share = self._shares.pop(session.key, None)
        if share is not None:
            self._count(share, -1)

    def update(self, session: Session) -> None:
        old = self._shares.get(session.key)
        if old is None:
            return
        new = share_of(session)
        if new != old:
            self._count(old, -1)
            self._count(new, 1)
            self._shares[session.key] = new

    def _count(self, share: Share, sign: int) -> None:
        self.tokens += sign * share.tokens
        self.holding += sign * (share.tokens > 0)
        self.starting += sign * share.starting
        if share.home is not None:
            self.homes[share.home] += sign
            if not self.homes[share.home]:
                del self.homes[share.home]


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


# -- the service ----------------------------------------------------------------------------

class SessionService:
    """The router's sessions, as the turn pipeline and the session API change them. `on_end`
    runs for each session that ends (released, or expired): the mode releases what it holds
    for it. `on_forget` runs for each session that leaves the table without ending (evicted
    when full, expired on the way; with a store, also expired here only or ended by another
    router): the mode lets go of what it keeps for it in this process. `on_change` runs
    whenever the histories the table holds may have shrunk (a session left, a turn's history
    replaced the last): admission, where there is one (None: none), re-checks its queue."""

    def __init__(self, table: SessionTable, on_end: Callable[[Session], None],
                 on_change: Callable[[], None] | None = None,
                 on_forget: Callable[[Session], None] = lambda session: None) -> None:
        self.table = table
        self._on_end = on_end
        self._on_change = on_change or (lambda: None)
        self._on_forget = on_forget
        table.on_drop = self._forget

    async def begin_turn(self, key: SessionKey, home: tuple[str | None, str] | None = None
                         ) -> tuple[Session, bool]:
        """The session a tagged turn belongs to, in flight from now on; and whether the turn
        opened it (on `home`, its (prefill, decode) engines, where one is given)."""
        opened = self.table.get(key) is None
        session = self.table.open(key)
        session.in_flight = True
        if opened and home is not None and session.decode is None:
            session.prefill, session.decode = home
        return session, opened

    def placed(self, session: Session, decode: str) -> None:
        """The turn goes to `decode`: for a new session, where the table counts it home until
        its first turn ends (sessions that start together would all look homeless)."""
        session.placed = decode

    def relay_ended(self, session: Session) -> None:
        """A streamed turn's relay is over, however it ended (`remember` came before it, if
        the turn was served)."""
        session.in_flight = False

    async def end_turn(self, session: Session, opened: bool, failed: bool) -> None:
        session.in_flight = False
        # A session whose first turn failed holds nothing worth a table entry.
        if opened and failed and session.turns == 0:
            await self.release(session)

    async def remember(self, session: Session, tag: TurnTag | None, placement: Placement,
                       stats: RouterTurnStats, history: list[int] | None) -> None:
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
        return self.table.get(key)

    async def renew(self, session: Session, hints: CacheHints) -> None:
        self.table.renew(session, hints)

    async def release(self, session: Session) -> None:
        self.table.release(session.key)
        self._on_end(session)
        self._on_change()

    async def expire(self) -> None:
        """End the sessions whose lease ran out."""
        for gone in self.table.sweep():
            self._on_end(gone)
        self._on_change()

    def _forget(self, session: Session) -> None:
        # (A session expired on the way may live on at another router, and its engines'
        # leases end on their own timers: the expiry sweep is what ends sessions.)
        self._on_forget(session)
        self._on_change()
