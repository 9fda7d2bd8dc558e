"""What both adapters share: the session they carry, and the stats of the turn a call made.

The adapters send through `turnkv.http_client(session)`, whose transport records every turn
into the session as its response goes by (client-measured times included). The framework
then hands the adapter the parsed response; this module finds the recorded turn that belongs
to it, by the turn index in the response's `turnkv` field, else by the response ID.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Mapping
from typing import Any, TypeVar

from turnkv.core import SessionCore
from turnkv.sessions import session as ambient_session
from turnkv.stats import TurnStats

STATS_KEY = "turnkv"
# The threads that release collected adapters' sessions are named RELEASE_THREAD-<session>.
RELEASE_THREAD = "turnkv-release"

Owner = TypeVar("Owner", bound="SessionOwner")


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


class SessionHold:
    """The session an adapter carries, and whether the adapter opened it (and so releases it).

    A session the adapter opened is released when the adapter is closed (`close()`,
    `aclose()`, the end of a `with` / `async with` block) or, failing that, when the last
    adapter object holding it is garbage-collected. Copies of an adapter (pydantic's
    `model_copy`, `copy.deepcopy`) share this hold, so the session outlives every one of them.
    A session passed in stays the caller's: nothing here releases it.
    """

    def __init__(self, session: SessionCore, owned: bool) -> None:
        self.session = session
        self.owned = owned
        self._on_collection: weakref.finalize[Any, Any] | None = None
        if owned:
            # The callback holds the session, not the adapter, so the adapter can be collected.
            self._on_collection = weakref.finalize(self, release_in_background, session)
            # At interpreter exit nothing is sent (no request may hold the exit up, nor fail
            # while the interpreter tears down): the session's lease ends it on the router.
            self._on_collection.atexit = False

    def __copy__(self) -> SessionHold:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SessionHold:
        return self

    def take_release(self) -> bool:
        """True once, if this hold is the one to release its session now (the collection's
        release is called off)."""
        return self._on_collection is not None and self._on_collection.detach() is not None


def release_in_background(session: SessionCore) -> None:
    """The release of a collected adapter's session: in a thread of its own, because a
    garbage collection runs wherever it happens (an event loop's thread included) and must
    neither wait on the network nor raise into the code it interrupted."""
    if session.closed:
        return
    with contextlib.suppress(RuntimeError):  # no new threads while the interpreter exits
        threading.Thread(target=_release_quietly, args=(session,), daemon=True,
                         name=f"{RELEASE_THREAD}-{session.id}").start()


def _release_quietly(session: SessionCore) -> None:
    # A failed release is logged by the session (`SessionCall.quiet`); nothing may escape.
    with contextlib.suppress(Exception):
        session._closing(final=not session.keep).send()


class SessionOwner:
    """`session`, `close()` / `aclose()` and `with` / `async with` for an adapter that carries
    a turnkv session (`SessionHold`, set by the adapter as the private attribute
    `_turnkv_hold` of its pydantic model)."""

    _turnkv_hold: Any

    @property
    def session(self) -> SessionCore:
        """The turnkv session every call of this adapter belongs to."""
        session: SessionCore = self._turnkv_hold.session
        return session

    def close(self) -> None:
        """Release the session this adapter opened (unless `keep`); a session passed in is the
        caller's to close."""
        hold: SessionHold = self._turnkv_hold
        if hold.take_release():
            hold.session._closing(final=not hold.session.keep).send()

    async def aclose(self) -> None:
        hold: SessionHold = self._turnkv_hold
        if hold.take_release():
            await hold.session._closing(final=not hold.session.keep).asend()

    def __enter__(self: Owner) -> Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self: Owner) -> Owner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


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
