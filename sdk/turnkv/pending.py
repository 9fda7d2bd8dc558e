"""A turn on its way: its index, the hints it carries, its timing, and how it ends."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from turnkv import protocol as p
from turnkv.tagging import base_url_of, tag_headers

if TYPE_CHECKING:
    from turnkv.core import SessionCore
    from turnkv.observe import Observed
    from turnkv.turn import Turn

RETRY_COUNT_HEADER = "x-stainless-retry-count"


class PendingTurn:
    """Allocated when a turn is first sent; every attempt carries the same turn index, so the
    router counts a retried turn once. `managed` turns belong to `Session.chat` / `stream`,
    which decide when a failed turn is given up; other turns give their index back on the
    first failure (openai's own retry then allocates the same index again)."""

    def __init__(self, session: SessionCore, index: int, hints: p.CacheHints,
                 managed: bool) -> None:
        self.session = session
        self.index = index
        self.hints = hints
        self.managed = managed
        self.started = time.perf_counter()
        self.attempts = 0
        self.retries_seen = 0
        self.turn: Turn | None = None
        self.early_headers: dict[str, str] = {}
        self.settled = False

    def tag(self) -> p.TurnTag:
        return self.session.tag(turn=self.index, hints=self.hints)

    def headers_for(self, url: str, body: bytes | None, request_headers: Any) -> dict[str, str]:
        """Called once per attempt, right before it is sent."""
        self.attempts += 1
        retry_count = request_headers.get(RETRY_COUNT_HEADER)
        if retry_count is not None and str(retry_count).isdigit():
            self.retries_seen = max(self.retries_seen, int(retry_count))
        self.session.note_endpoint(base_url_of(url), request_headers.get("authorization"))
        if body:
            self.session.note_first_body(_json_or_none(body))
        return tag_headers(self.tag())

    @property
    def retries(self) -> int:
        return max(self.attempts - 1, self.retries_seen)

    def complete(self, observed: Observed) -> None:
        if self.settled:
            return
        self.settled = True
        self.turn = self.session.record_observed(self, observed)

    def fail(self) -> None:
        """This attempt got no usable answer."""
        if not self.managed:
            self.give_up()

    def give_up(self) -> None:
        if self.settled:
            return
        self.settled = True
        self.session.abandon(self)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None
