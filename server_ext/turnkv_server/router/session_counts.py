"""What a router's live sessions add up to, kept as they change: the history the engines hold for
them and how many hold any (admission's rule), how many admitted newcomers hold nothing yet
(likewise), and how many sessions each engine is home to (placement balances new sessions by
it).

Admission re-checks its queue whenever a history may have shrunk, and placement counts homes
for every new session: summing the table each time costs O(sessions) per change. Instead each
session's share is recorded when it enters the table, updated whenever one of the fields it
depends on is set (`Session.__setattr__` calls `update`) and taken back when it leaves, so
every total is O(1) to read and to keep.

This module knows sessions only by the fields it reads (`Counted`): the session table owns it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

# The session fields a share depends on: setting any of them updates the counts.
COUNTED_FIELDS = frozenset({"tokens", "last_stats", "in_flight", "queued", "decode", "placed"})


class Counted(Protocol):
    """What the counts read of a session (`sessions.Session`)."""

    @property
    def key(self) -> Hashable: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def last_stats(self) -> dict[str, Any] | None: ...
    @property
    def in_flight(self) -> bool: ...
    @property
    def queued(self) -> int: ...
    @property
    def decode(self) -> str | None: ...
    @property
    def placed(self) -> str | None: ...


def held_tokens(session: Counted) -> int:
    """The history the engines hold for a session: its token IDs, or, where the mode keeps
    none (affinity does not tokenize), its last turn's prompt and output, which add up to it."""
    if session.tokens:
        return len(session.tokens)
    last = session.last_stats or {}
    return int((last.get("prompt_tokens") or {}).get("total") or 0) \
        + int(last.get("completion_tokens") or 0)


@dataclass(frozen=True)
class Share:
    """One session's part of the counts."""

    tokens: int  # the history held for it
    # Admitted, its first turn under way: it holds nothing yet, but will. (A session whose
    # turn is still queued for admission is not admitted.)
    starting: bool
    home: str | None  # its decode engine, or where its first turn was placed

    @classmethod
    def of(cls, session: Counted) -> Share:
        tokens = held_tokens(session)
        return cls(tokens, starting=not tokens and session.in_flight and not session.queued,
                   home=session.decode or session.placed)


class SessionCounts:
    """The counts over the sessions of one table; `SessionTable` calls `add` and `remove`, and a
    session in the table calls `update` whenever a counted field is set."""

    def __init__(self) -> None:
        self.tokens = 0  # history held by all the sessions together
        self.holding = 0  # sessions holding any history
        self.starting = 0  # sessions admitted that hold none yet
        self.homes: Counter[str] = Counter()  # engine name -> sessions home there
        self._shares: dict[Hashable, Share] = {}

    def __len__(self) -> int:
        return len(self._shares)

    def add(self, session: Counted) -> None:
        self.remove(session)
        share = self._shares[session.key] = Share.of(session)
        self._count(share, 1)

    def remove(self, session: Counted) -> None:
        share = self._shares.pop(session.key, None)
        if share is not None:
            self._count(share, -1)

    def update(self, session: Counted) -> None:
        old = self._shares.get(session.key)
        if old is None:
            return
        new = Share.of(session)
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
