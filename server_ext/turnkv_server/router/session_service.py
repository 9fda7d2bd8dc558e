"""The service the turn pipeline and the session API use to open, admit, remember, renew and
end sessions: the router's table (`sessions`), kept in step with the shared store when there is
one (`session_store`). With a store, the service reads a session's record before its turn is
routed and writes it when the turn ends.

Admission (`Admission`): a new session's first turn waits while the live sessions fill the engines.

The engines hold the live sessions' histories together, in their KV caches and any tier below
them; the operator says how many tokens that is (`--admission-tokens`). Past it, each turn
evicts history that another session's next turn needs, which that turn recomputes, evicting
a third's: a preemption storm, where every turn pays for its whole history. Admitting new
sessions only while they fit keeps the sessions under way fast; newcomers start as live ones
end.

Only a cold session's turn ever waits: one whose session has served no turn (new, expired, or
its first turn not through yet). A warm session's history is what admission protects, and a
sessionless turn keeps nothing once it ends. Whether a newcomer fits is a pure rule (`fits`)
over the table's running totals (`sessions.SessionCounts`), so a re-check costs the same
however many sessions are live. Waiters go first come, first served, re-checked whenever the
histories change (a session ended, a turn remembered: `SessionService`'s `on_change`), and go
anyway after `--admission-max-wait-s`: a thrash is better than a turn that never runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from turnkv.protocol import CacheHints, RouterTurnStats, TurnTag
from turnkv_server.router.engines import Placement
from turnkv_server.router.session_store import (
    RedisStore,
    StoreUnavailable,
    apply_record,
    to_record,
)
from turnkv_server.router.sessions import Session, SessionKey, SessionTable
from turnkv_server.router.stats import RouterMetrics


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

    async def begin_turn(self, key: SessionKey, home: tuple[str | None, str] | None = None
                         ) -> tuple[Session, bool]:
        """The session a tagged turn belongs to, in flight from now on; and whether the turn
        opened it (on `home`, its (prefill, decode) engines, where one is given)."""
        await self.sync(key)
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


# -- admission -------------------------------------------------------------------------------

# Returns once the turn's client has gone (closed its connection).
ClientGone = Callable[[], Awaitable[None]]


class ClientLeft(Exception):
    """The client left while its turn was queued: the turn is over, unserved."""


def is_cold(session: Session) -> bool:
    """No turn of the session has been served. (Not `turns == 0`: that is the last turn's
    index, which a client may start at 0.)"""
    return session.last_stats is None


def fits(held: int, holding: int, starting: int, budget: int) -> bool:
    """Whether one more new session fits in `budget` tokens of history.

    `held`: the history the live sessions hold together; `holding`: how many hold any.
    `starting`: new sessions already admitted whose first turn has not ended; they hold nothing
    yet, but will. Each newcomer is expected to grow to the mean history of the live sessions
    that hold any. With none there is nothing to estimate from, nor to protect: it fits.
    """
    if not holding:
        return True
    return held + (starting + 1) * held / holding <= budget


@dataclass(eq=False)  # waiters are told apart by identity, not by their session
class _Waiter:
    session: Session
    admitted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """The router's queue of cold turns (one per router; the event loop's only). `budget`
    None: admission is off, and every turn goes at once."""

    def __init__(self, table: SessionTable, budget: int | None, max_wait_s: float,
                 metrics: RouterMetrics) -> None:
        self.table = table
        self.budget = budget
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self._queue: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def admit(self, session: Session | None, gone: ClientGone | None = None) -> float:
        """Wait until the turn may go to the engines; returns the milliseconds it waited (0.0
        when it went at once). Raises `ClientLeft` if `gone` returns first."""
        if self.budget is None or session is None or not is_cold(session):
            return 0.0
        waiter = _Waiter(session)
        # Behind every earlier waiter, even when it would fit: the head goes first.
        self._queue.append(waiter)
        session.queued += 1  # not admitted: not counted as starting
        self.recheck()
        if waiter.admitted.done():
            return 0.0
        self.metrics.admission_queued.inc()
        started = time.perf_counter()
        try:
            await self._wait(waiter, gone)
        finally:
            # Timed out, left or cancelled: out of the queue, which those behind may now lead.
            if waiter in self._queue:
                self._queue.remove(waiter)
                waiter.session.queued -= 1
                self.recheck()
        return (time.perf_counter() - started) * 1000

    def recheck(self) -> None:
        """Admit waiters from the head for as long as the next one fits. Called whenever the
        sessions' histories may have shrunk."""
        while self._queue and self._room_for_one():
            admitted = self._queue.popleft()
            admitted.session.queued -= 1  # now starting, counted as such by the next check
            admitted.admitted.set_result(None)
        self.metrics.admission_waiting.set(len(self._queue))

    async def _wait(self, waiter: _Waiter, gone: ClientGone | None) -> None:
        left = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            done, _ = await asyncio.wait([f for f in (waiter.admitted, left) if f is not None],
                                         timeout=self.max_wait_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if left is not None:
                left.cancel()
        if left in done:
            raise ClientLeft  # even if admitted meanwhile: nobody would read the answer
        if not waiter.admitted.done():
            self.metrics.admission_timeouts.inc()

    def _room_for_one(self) -> bool:
        assert self.budget is not None  # nothing queues without one
        counts = self.table.counts
        return fits(counts.tokens, counts.holding, counts.starting, self.budget)
