"""Admission: a new session's first turn waits while the live sessions fill the engines
(`--admission-tokens`; without it this module is never entered and every turn goes at once).

The engines hold the live sessions' histories together, in their KV caches and any tier below
them; the operator says how many tokens that is. Past it, each turn evicts history that another
session's next turn needs, which that turn recomputes, evicting a third's: a preemption storm,
where every turn pays for its whole history. Admitting new sessions only while they fit keeps
the sessions under way fast; newcomers start as live ones end.

Only a cold session's turn ever waits: one whose session has served no turn (new, expired, or
its first turn not through yet). A warm session's history is what admission protects, and a
sessionless turn keeps nothing once it ends. Whether a newcomer fits is a pure rule (`fits`)
over the table's running totals (`sessions.SessionCounts`), so a re-check costs the same
however many sessions are live. Waiters go first come, first served, re-checked whenever the
histories change (a session ended, a turn remembered: `sessions.SessionService`'s
`on_change`), and go anyway after `--admission-max-wait-s`: a thrash is better than a turn
that never runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from turnkv_server.router.sessions import Session, SessionTable
from turnkv_server.router.stats import RouterMetrics

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
