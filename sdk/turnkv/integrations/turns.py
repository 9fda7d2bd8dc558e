"""What both adapters share: the session they carry, and the stats of the turn a call made.

The adapters send through `turnkv.http_client(session)`, whose transport records every turn
into the session as its response goes by (client-measured times included). The framework
then hands the adapter the parsed response; this module finds the recorded turn that belongs
to it, by the turn index in the response's `turnkv` field, else by the response ID.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from turnkv.core import SessionCore
from turnkv.sessions import session as ambient_session
from turnkv.stats import TurnStats

STATS_KEY = "turnkv"


def open_session(
    session: SessionCore | None, *, session_id: str | None, ttl: float | None,
    priority: int | None, prefix_id: str | None, keep: bool,
) -> tuple[SessionCore, bool]:
    """The adapter's session and whether the adapter owns it (and so releases it on close).
    A given session belongs to the caller; otherwise one is made from the parameters
    (validated here: bad values raise `turnkv.InvalidTagError` before anything is sent)."""
    if session is not None:
        if any(v is not None for v in (session_id, ttl, priority, prefix_id)) or keep:
            raise TypeError("pass either session= or session_id/ttl/priority/prefix_id/keep")
        return session, False
    return ambient_session(session_id, ttl=ttl, priority=priority, prefix_id=prefix_id,
                           keep=keep), True


class SessionOwner:
    """`session`, `close()` and `aclose()` for an adapter that carries a turnkv session.

    The adapter sets `_turnkv_session` and `_turnkv_owns_session` (from `open_session`) as
    private attributes of its pydantic model.
    """

    _turnkv_session: Any
    _turnkv_owns_session: bool

    @property
    def session(self) -> SessionCore:
        """The turnkv session every call of this adapter belongs to."""
        session: SessionCore = self._turnkv_session
        return session

    def close(self) -> None:
        """Release the session this adapter opened (unless `keep`); a session passed in is the
        caller's to close."""
        if self._turnkv_owns_session:
            self._turnkv_session.close(final=not self._turnkv_session.keep)

    async def aclose(self) -> None:
        if self._turnkv_owns_session:
            await self._turnkv_session.aclose(final=not self._turnkv_session.keep)


def wire_of(raw: Any) -> dict[str, Any] | None:
    """The `turnkv` field of an openai response or chunk object, or of its dict."""
    if isinstance(raw, Mapping):
        value = raw.get(STATS_KEY)
    else:
        value = (getattr(raw, "model_extra", None) or {}).get(STATS_KEY)
    return dict(value) if isinstance(value, Mapping) else None


def stats_for(session: SessionCore, wire: Mapping[str, Any] | None = None,
              response_id: str | None = None, since: int | None = None) -> TurnStats | None:
    """The stats the session recorded for one call.

    Found by the router's turn index (`wire`), else by response ID (non-streamed turns keep
    their response), else as the single turn recorded since `since` (the number of turns
    before the call). Falls back to the router's own stats where the session recorded
    nothing for it, without the client-side times; None where nothing is known.
    """
    turns = list(session.turns)
    if wire is not None and wire.get("session_id") in (None, session.id):
        index = wire.get("turn")
        for turn in reversed(turns):
            if turn.index == index:
                return turn.stats
    if response_id is not None:
        for turn in reversed(turns):
            if turn.response is not None and getattr(turn.response, "id", None) == response_id:
                return turn.stats
    if since is not None and len(turns) == since + 1:
        return turns[-1].stats
    if wire is not None:
        return TurnStats.from_wire(wire)
    return None


def cache_read(stats: TurnStats) -> int | None:
    """Prompt tokens the prefill engine did not compute (its own cache plus KV read back):
    what frameworks call a cache read. None where the server measured no split."""
    return stats.reused_tokens
