"""The service the turn pipeline and the session API use to open, remember, renew and end
sessions: the router's table (`sessions`), kept in step with the shared store when there is one
(`session_store`). With a store, the service reads a session's record before its turn is routed
and writes it when the turn ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turnkv.protocol import CacheHints, RouterTurnStats, TurnTag
from turnkv_server.router.placement import Placement
from turnkv_server.router.session_store import (
    RedisStore,
    StoreUnavailable,
    apply_record,
    to_record,
)
from turnkv_server.router.sessions import Session, SessionKey, SessionTable


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
