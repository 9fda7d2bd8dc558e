"""Which requests are turns, and the headers that tag them. (Which session a request
belongs to is `turnkv.context.pending_for`.)"""

from __future__ import annotations

import turnkv.protocol as p

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

