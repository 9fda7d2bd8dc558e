"""A streamed turn's tail, held back so that its last item can carry the turn's stats.

The session records a streamed turn only once the response has been read to its end, so a
stats field put on an item while the stream runs would hold the router's part alone. Each
adapter passes its framework's stream items through a `StreamTail`: content goes on at once;
content-less items (role, usage, the router's stats chunk) wait until the stream ends, and
then go on with the session's record of the turn on them. The adapter says what its items
are like: which carry content (`carries_content`), where the router's `turnkv` field is
(`wire`), and how the stats go on (`attach`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterable, Generator, Iterable
from typing import Any, Generic, TypeVar

from turnkv.core import SessionCore
from turnkv.integrations.turns import stats_for
from turnkv.stats import TurnStats

Item = TypeVar("Item")


class StreamTail(ABC, Generic[Item]):
    """One streamed call's items, the content-less ones held back until `finish`."""

    def __init__(self, session: SessionCore, since: int | None = None) -> None:
        self.session = session
        # The turns recorded before the call: the one recorded after it is this call's.
        self.since = len(session.turns) if since is None else since
        self.held: list[Item] = []

    def take(self, item: Item) -> list[Item]:
        """What goes on now: nothing while only content-less items came, else those held
        and this one."""
        if not self.carries_content(item):
            self.held.append(item)
            return []
        out, self.held = [*self.held, item], []
        return out

    def finish(self) -> list[Item]:
        """The items held once the stream has ended, the turn's stats on them where the
        session (or the router's field) knows them."""
        wire = next((w for item in self.held if (w := self.wire(item)) is not None), None)
        stats = stats_for(self.session, wire, since=self.since)
        if stats is None:
            return self.held
        return self.attach(self.held, stats)

    def relay(self, stream: Iterable[Item]) -> Generator[Item, None, None]:
        """The stream's items, passed through `take`, then `finish`."""
        for item in stream:
            yield from self.take(item)
        yield from self.finish()

    async def arelay(self, stream: AsyncIterable[Item]) -> AsyncGenerator[Item, None]:
        """`relay` for an async stream."""
        async for item in stream:
            for out in self.take(item):
                yield out
        for out in self.finish():
            yield out

    @abstractmethod
    def carries_content(self, item: Item) -> bool:
        """Whether the item carries text or tool calls: those are never delayed."""

    @abstractmethod
    def wire(self, item: Item) -> dict[str, Any] | None:
        """The router's `turnkv` field on the item, if it has one."""

    @abstractmethod
    def attach(self, held: list[Item], stats: TurnStats) -> list[Item]:
        """The held items (or a closing one where none was held) with `stats` on them."""
