"""Which requests are turns, which session they belong to, and the headers that tag them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from turnkv import context
from turnkv import protocol as p

if TYPE_CHECKING:
    from turnkv.core import SessionCore
    from turnkv.pending import PendingTurn

TURN_PATHS = ("/chat/completions", "/completions")


def is_turn_request(method: str, path: str) -> bool:
    return method.upper() == "POST" and path.rstrip("/").endswith(TURN_PATHS)


def base_url_of(url: str) -> str:
    """The API base (e.g. `http://host:8000/v1`) of a turn request's URL."""
    url = url.split("?", 1)[0].rstrip("/")
    for suffix in TURN_PATHS:
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def tag_headers(tag: p.TurnTag) -> dict[str, str]:
    headers = {p.HEADER_SESSION: tag.session_id}
    if tag.turn is not None:
        headers[p.HEADER_TURN] = str(tag.turn)
    if tag.prefix_id:
        headers[p.HEADER_PREFIX] = tag.prefix_id
    hints = tag.hints
    if hints.ttl is not None:
        headers[p.HEADER_TTL] = repr(hints.ttl)
    if hints.next_turn_in is not None:
        headers[p.HEADER_NEXT_TURN_IN] = repr(hints.next_turn_in)
    if hints.final:
        headers[p.HEADER_FINAL] = "true"
    if hints.priority is not None:
        headers[p.HEADER_PRIORITY] = str(hints.priority)
    return headers


def pending_for(bound: SessionCore | None) -> PendingTurn | None:
    """The turn a request should carry: the one `Session.chat` pinned, else a new turn of the
    bound or ambient session, else None (the request goes out untagged)."""
    pinned = context.pinned_turn()
    if pinned is not None and (bound is None or pinned.session is bound):
        return pinned
    session = bound or context.current_session()
    if session is None:
        return None
    return session.begin_turn(managed=False)
