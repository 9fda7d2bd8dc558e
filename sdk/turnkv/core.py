"""What every session keeps, whichever way its turns are sent: identity, turn counter, hints,
recorded turns and stats, and where to release it."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Mapping
from contextvars import Token
from typing import Any

from pydantic import ValidationError

from turnkv import context, session_api
from turnkv import protocol as p
from turnkv.errors import InvalidTagError, PlainServerWarning, SessionClosedError
from turnkv.ids import check_id, new_session_id, prefix_id
from turnkv.observe import Observed
from turnkv.pending import PendingTurn
from turnkv.retry import RetryPolicy
from turnkv.stats import SessionStats, TurnStats
from turnkv.turn import Turn

log = logging.getLogger("turnkv")


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
        from turnkv.openai_patch import install

        self._id = check_id(new_session_id() if id is None else id, "session_id")
        self._prefix_id = None if prefix_id is None else check_id(prefix_id, "prefix_id")
        self._lasting = make_hints(ttl=ttl, priority=priority)  # sent with every turn
        self._once: dict[str, Any] = {}  # next_turn_in / final: the next turn only
        self.keep = keep
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self._client = client
        self._warn_once: WarnOnce = getattr(client, "_turnkv_warn_once", None) or WarnOnce()
        self._next = 1
        self._lock = threading.Lock()
        self.turns: list[Turn] = []
        self._base_url: str | None = None
        self._authorization: str | None = None
        self._saw_turnkv = False
        self.closed = False
        self.released = False
        self._tokens: list[Token[SessionCore | None]] = []
        # Stock openai clients are tagged through a patch of openai's request building.
        install()

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
        `next_turn_in` and `final` go with the next turn only. Validated here."""
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

    def begin_turn(self, managed: bool = True) -> PendingTurn:
        if self.closed:
            raise SessionClosedError(f"session {self._id} is closed")
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
        self, stats: p.TurnStats | Mapping[str, Any] | None, client_ttft_ms: float | None = None,
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

    def record_observed(self, pending: PendingTurn, observed: Observed) -> Turn:
        return self.record(
            observed.wire, observed.ttft_ms if observed.streamed else None,
            client_total_ms=observed.total_ms, retries=pending.retries, usage=observed.usage,
            turn=pending.index, text=observed.text, message=observed.message(),
            response=observed.response(), early_headers=observed.headers,
            final=pending.hints.final)

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

    # -- the ambient session ---------------------------------------------------------------

    def _enter(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self._id} is closed")
        self._tokens.append(context.activate(self))

    def _leave(self) -> None:
        if self._tokens:
            context.deactivate(self._tokens.pop())

    # -- releasing ---------------------------------------------------------------------------

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

    def _should_release(self) -> bool:
        return not self.released and self._saw_turnkv

    def _release_sync(self) -> bool:
        endpoint = self._endpoint()
        if endpoint is None:
            return False
        found = session_api.release(endpoint[0], self._id, endpoint[1])
        self.released = True
        return found

    async def _release_async(self) -> bool:
        endpoint = self._endpoint()
        if endpoint is None:
            return False
        found = await session_api.arelease(endpoint[0], self._id, endpoint[1])
        self.released = True
        return found

    def _hints_endpoint(self, hints: p.CacheHints) -> tuple[str, dict[str, str]] | None:
        """Where to post hints now; None on a plain server (nothing to tell it)."""
        if self.turns and not self._saw_turnkv:
            return None
        endpoint = self._endpoint()
        if endpoint is None:
            raise SessionClosedError(
                f"session {self._id} has no server yet: send a turn before hint_now()")
        if hints.final:
            self.released = True
        return endpoint

    def _close_sync(self, final: bool) -> None:
        self.closed = True
        if final and self._should_release():
            try:
                self._release_sync()
            except Exception as exc:  # noqa: BLE001 -- never raised over the caller's body
                log.warning("turnkv: releasing session %s failed: %s", self._id, exc)

    async def _close_async(self, final: bool) -> None:
        self.closed = True
        if final and self._should_release():
            try:
                await self._release_async()
            except Exception as exc:  # noqa: BLE001 -- never raised over the caller's body
                log.warning("turnkv: releasing session %s failed: %s", self._id, exc)

    def __enter__(self) -> Any:
        self._enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()
        self._close_sync(final=not self.keep)

    async def __aenter__(self) -> Any:
        self._enter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._leave()
        await self._close_async(final=not self.keep)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self._id!r}, turn={self._next})"

