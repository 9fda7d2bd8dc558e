"""What every session keeps, whichever way its turns are sent: identity, turn counter, hints,
recorded turns and stats; its turns on their way (`PendingTurn`); and its calls to the
router's session API (release, hints), decided here and sent by the sync or async session.

A session and its pending turns call each other (a session allocates a pending turn, which
records its answer back into the session), so they live in one module.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import warnings
from collections.abc import Mapping
from contextvars import Token
from typing import Any

import httpx
from pydantic import ValidationError

import turnkv.protocol as p
import turnkv.session_api as session_api
from turnkv.errors import InvalidTagError, PlainServerWarning, SessionClosedError, TurnKVError
from turnkv.ids import check_id, new_session_id, prefix_id
from turnkv.observe import Observed
from turnkv.retry import RetryPolicy
from turnkv.session_api import SessionCall
from turnkv.stats import SessionStats, TurnStats
from turnkv.tagging import base_url_of, tag_headers
from turnkv.turn import Turn

RETRY_COUNT_HEADER = "x-stainless-retry-count"


class WarnOnce:
    """One plain-server warning per holder (a client, or a session bound to no client)."""

    def __init__(self) -> None:
        self.warned = False


def make_hints(**values: Any) -> p.CacheHints:
    try:
        return p.CacheHints(**values)
    except ValidationError as exc:
        raise InvalidTagError.from_validation(exc, "turnkv.hints") from None


class SessionCore:
    """State shared by `Session` and `AsyncSession`; see those for the API."""

    def __init__(
        self, id: str | None = None, *, ttl: float | None = None, priority: int | None = None,
        prefix_id: str | None = None, keep: bool = False, client: Any = None,
        retry: RetryPolicy | None = None, timeout: float | None = None,
    ) -> None:
        self._id = check_id(new_session_id() if id is None else id, "session_id")
        self._prefix_id = None if prefix_id is None else check_id(prefix_id, "prefix_id")
        self._lasting = make_hints(ttl=ttl, priority=priority)  # sent with every turn
        self._once: dict[str, Any] = {}  # next_turn_in / final: the next turn only
        self.keep = keep
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self._client = client
        self._no_retry_client: Any = None
        self._warn_once: WarnOnce = getattr(client, "_turnkv_warn_once", None) or WarnOnce()
        self._next = 1
        self._lock = threading.Lock()
        self.turns: list[Turn] = []
        self._base_url: str | None = None
        self._authorization: str | None = None
        self._saw_turnkv = False
        self.closed = False
        self.released = False
        # One context token per `with` block that made this the ambient session
        # (turnkv.context), innermost last.
        self._tokens: list[Token[Any]] = []

    # -- identity and hints ----------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def turn(self) -> int:
        """The index the next turn will carry (the first turn is 1, as on the router)."""
        return self._next

    @property
    def prefix_id(self) -> str | None:
        return self._prefix_id

    @property
    def base_url(self) -> str | None:
        """Where the session lives: the client's base URL, or that of the first request the
        session tagged."""
        if self._client is not None:
            return str(self._client.base_url).rstrip("/")
        return self._base_url

    @property
    def hints(self) -> p.CacheHints:
        """The hints the next turn will carry."""
        return p.CacheHints.model_validate({**self._lasting.model_dump(), **self._once})

    def hint(self, *, ttl: float | None = None, next_turn_in: float | None = None,
             final: bool | None = None, priority: int | None = None) -> None:
        """Hints for the NEXT turn. `ttl` and `priority` then stay for later turns;
        `next_turn_in` and `final` go with the next turn only. Validated here. A closed
        session takes no hints, as it takes no turns."""
        self._check_open()
        lasting = {k: v for k, v in (("ttl", ttl), ("priority", priority)) if v is not None}
        once = {k: v for k, v in (("next_turn_in", next_turn_in), ("final", final))
                if v is not None}
        checked = make_hints(**{**self._lasting.model_dump(exclude_defaults=True),
                                **lasting, **self._once, **once})
        self._lasting = make_hints(ttl=checked.ttl, priority=checked.priority)
        self._once = {**self._once, **once}

    def tag(self, turn: int | None = None, hints: p.CacheHints | None = None) -> p.TurnTag:
        """The tag of the next turn (or of turn `turn`)."""
        try:
            return p.TurnTag(session_id=self._id, turn=self._next if turn is None else turn,
                             prefix_id=self._prefix_id, hints=hints or self.hints)
        except ValidationError as exc:
            raise InvalidTagError.from_validation(exc) from None

    # -- turns -----------------------------------------------------------------------------

    def openai_client(self) -> Any:
        """The session's openai client with openai's own retries off: `chat` / `stream` retry
        under `self.retry`, and a second layer of retries would multiply attempts."""
        if self._client is None:
            raise TurnKVError(
                "this session is bound to no client: use client.session() for chat()/stream(),"
                " or send requests with any openai client inside `with turnkv.session()`")
        if self._no_retry_client is None:
            self._no_retry_client = self._client.with_options(max_retries=0)
        return self._no_retry_client

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self._id} is closed: open a new one for more "
                                     "turns")

    def begin_turn(self, managed: bool = True) -> PendingTurn:
        self._check_open()
        with self._lock:
            pending = PendingTurn(self, self._next, self.hints, managed)
            self._next += 1
            self._once = {}
        return pending

    def abandon(self, pending: PendingTurn) -> None:
        """A turn that never got an answer gives its index and one-shot hints back, unless
        later turns already went out."""
        with self._lock:
            if pending.index == self._next - 1:
                self._next -= 1
                once = pending.hints.model_dump(include={"next_turn_in", "final"},
                                                exclude_defaults=True)
                self._once = {**once, **self._once}

    def note_endpoint(self, base_url: str, authorization: str | None) -> None:
        if self._base_url is None:
            self._base_url, self._authorization = base_url, authorization

    def note_first_body(self, body: Any) -> None:
        """The prefix ID comes from the first turn's stable head unless it was given."""
        if self._prefix_id is not None or not isinstance(body, Mapping):
            return
        model, messages = body.get("model"), body.get("messages")
        if isinstance(model, str) and isinstance(messages, list):
            self._prefix_id = prefix_id(model=model, messages=messages, tools=body.get("tools"))

    def record(
        self, stats: p.RouterTurnStats | Mapping[str, Any] | None,
        client_ttft_ms: float | None = None,
        *, client_total_ms: float | None = None, retries: int = 0,
        usage: Mapping[str, Any] | None = None, turn: int | None = None, text: str = "",
        message: Any = None, response: Any = None, early_headers: Mapping[str, str] | None = None,
        final: bool = False,
    ) -> Turn:
        """Record a finished turn. `stats` is the response's `turnkv` field; None means the
        server did not speak turnkv (stats then come from `usage`, with one warning)."""
        index = turn if turn is not None else self._next
        early_headers = {k.lower(): v for k, v in (early_headers or {}).items()}
        client = {"client_ttft_ms": client_ttft_ms, "client_total_ms": client_total_ms,
                  "retries": retries}
        if stats is not None:
            turn_stats = TurnStats.from_wire(stats, **client)
            self._saw_turnkv = True
        elif early_headers and early_headers.get(p.HEADER_SESSION.lower()):
            turn_stats = TurnStats.from_headers(early_headers, turn=index, usage=usage,
                                                **client)
            self._saw_turnkv = True
        else:
            turn_stats = TurnStats.from_usage(usage, session_id=self._id, turn=index, **client)
            self._warn_plain()
        recorded = Turn(index=index, stats=turn_stats, text=text, message=message,
                        response=response)
        with self._lock:
            self.turns.append(recorded)
            self._next = max(self._next, index + 1)
        if final and turn_stats.served_by_turnkv:
            self.released = True  # the router ended the session with this turn
        return recorded

    def _warn_plain(self) -> None:
        if self._warn_once.warned:
            return
        self._warn_once.warned = True
        warnings.warn(PlainServerWarning(
            f"{self.base_url or 'the server'} answered without turnkv stats: it is not a "
            "turnkv router (plain vLLM or OpenAI?). Turns still work; their stats come from "
            "`usage` alone."), stacklevel=2)

    @property
    def last(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    @property
    def stats(self) -> SessionStats:
        return SessionStats.from_turns((t.stats for t in self.turns), session_id=self._id)

    # -- the session API: each call decided here, sent with `.send()` or `.asend()` ----------

    def _endpoint(self) -> tuple[str, dict[str, str]] | None:
        """Base URL and auth headers for the session API; None where there is nothing to
        release (no turn reached a turnkv router)."""
        base = self.base_url
        if base is None:
            return None
        headers: dict[str, str] = {}
        if self._client is not None:
            api_key = getattr(self._client, "api_key", None)
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
        elif self._authorization:
            headers["Authorization"] = self._authorization
        return base, headers

    def _release_call(self) -> SessionCall:
        """Release the session on the router: True if the router held it, False if not."""
        endpoint = self._endpoint()
        if endpoint is None:
            return SessionCall(default=False)
        return session_api.release(endpoint[0], self._id, endpoint[1], read=self._released)

    def _released(self, response: httpx.Response) -> bool:
        found = session_api.released(response)
        self.released = True
        return found

    def _closing(self, final: bool) -> SessionCall:
        """Close the session now (no more turns); the release to send, if `final` and the
        session is still held on a turnkv router. A failed release is logged, not raised."""
        self.closed = True
        if not final or self.released or not self._saw_turnkv:
            return SessionCall()
        return dataclasses.replace(self._release_call(), quiet=f"releasing session {self._id}")

    def _hints_call(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                   final: bool | None = None, priority: int | None = None) -> SessionCall:
        """Hints now (`POST /v1/turnkv/sessions/{id}/hints`), validated here; the answer is the
        router's view of the session, `{}` on a plain server (nothing to tell it)."""
        hints = make_hints(ttl=ttl, next_turn_in=next_turn_in, final=bool(final),
                           priority=priority)
        if self.turns and not self._saw_turnkv:
            return SessionCall(default={})
        endpoint = self._endpoint()
        if endpoint is None:
            raise SessionClosedError(
                f"session {self._id} has no server yet: send a turn before hint_now()")
        if hints.final:
            self.released = True
        return session_api.post_hints(endpoint[0], self._id, endpoint[1], hints)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self._id!r}, turn={self._next})"


class PendingTurn:
    """A turn on its way: its index, the hints it carries, its timing, and how it ends.

    Allocated when a turn is first sent; every attempt carries the same turn index, so the
    router counts a retried turn once. `managed` turns belong to `Session.chat` / `stream`
    (or a stock openai call inside `turnkv.session()`), which decide when a failed turn is
    given up; other turns give their index back on the first failure (openai's own retry then
    allocates the same index again). It is the `turnkv.observe.Listener` of its responses."""

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
        """The response was watched to its end: record what it said."""
        if self.settled:
            return
        self.settled = True
        self.turn = self.session.record(
            observed.wire, observed.ttft_ms if observed.streamed else None,
            client_total_ms=observed.total_ms, retries=self.retries, usage=observed.usage,
            turn=self.index, text=observed.text, message=observed.message(),
            response=observed.response(), early_headers=observed.headers,
            final=self.hints.final)

    def settle(self, wire: Mapping[str, Any] | None, usage: Mapping[str, Any] | None,
               text: str = "") -> Turn:
        """Record the turn from what openai's parsed answer carried (its `turnkv` field and
        usage): the response went by unwatched, through an http client turnkv does not know."""
        self.settled = True
        self.turn = self.session.record(
            wire, None, retries=self.retries, usage=usage, turn=self.index, text=text,
            early_headers=self.early_headers, final=self.hints.final)
        return self.turn

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
