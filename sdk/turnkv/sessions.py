"""`Session`: a multi-turn conversation with a turnkv router, for sync code; and
`turnkv.session(...)`, the ambient session that tags whatever is sent inside it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from turnkv import context, session_api
from turnkv.core import SessionCore, make_hints
from turnkv.errors import TurnKVError
from turnkv.pending import PendingTurn
from turnkv.retry import RetryPolicy
from turnkv.stats import TurnStats
from turnkv.turn import Turn


class Session(SessionCore):
    """A session: `with client.session() as s:` (or `with turnkv.session() as s:`).

    Inside the `with` block the session is also the ambient one: requests sent by turnkv,
    stock openai and `turnkv.http_client()` clients are tagged with it. On exit it is
    released on the router (`DELETE /v1/turnkv/sessions/{id}`) unless `keep=True`; a failed
    release is logged, never raised. It also works with `async with` (release is then
    asynchronous), for ambient sessions in async code.
    """

    def _openai(self) -> Any:
        if self._client is None:
            raise TurnKVError(
                "this session is bound to no client: use client.session() for chat()/stream(),"
                " or send requests with any openai client inside `with turnkv.session()`")
        cached = getattr(self, "_no_retry_client", None)
        if cached is None:
            # Session calls retry with tenacity; openai retrying too would multiply attempts.
            cached = self._client.with_options(max_retries=0)
            self._no_retry_client = cached
        return cached

    def _kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.timeout is not None:
            kwargs.setdefault("timeout", self.timeout)
        return kwargs

    def chat(self, *, messages: Any, model: str, **openai_kwargs: Any) -> Turn:
        """One non-streamed turn; every openai `chat.completions.create` argument passes
        through."""
        if openai_kwargs.get("stream"):
            raise TypeError("Session.chat() does not stream: use Session.stream()")
        client = self._openai()
        kwargs = self._kwargs(openai_kwargs)
        pending = self.begin_turn(managed=True)
        try:
            with context.pinning(pending):
                for attempt in self.retry.retrying():
                    with attempt:
                        response = client.chat.completions.create(
                            messages=messages, model=model, **kwargs)
        except BaseException:
            pending.give_up()
            raise
        return finish_chat(self, pending, response)

    def stream(self, *, messages: Any, model: str, **openai_kwargs: Any) -> TurnStream:
        """One streamed turn: iterate the returned `TurnStream` for the chunks. Asks for
        `stream_options.include_usage` unless given (usage-based stats on plain servers)."""
        client = self._openai()
        kwargs = self._kwargs(openai_kwargs)
        kwargs["stream"] = True
        kwargs.setdefault("stream_options", {"include_usage": True})
        pending = self.begin_turn(managed=True)
        try:
            with context.pinning(pending):
                for attempt in self.retry.retrying():
                    with attempt:
                        raw = client.chat.completions.create(
                            messages=messages, model=model, **kwargs)
        except BaseException:
            pending.give_up()
            raise
        return TurnStream(self, pending, raw)

    def hint_now(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                 final: bool | None = None, priority: int | None = None) -> dict[str, Any]:
        """Send hints now (`POST /v1/turnkv/sessions/{id}/hints`), e.g. `next_turn_in` before
        a long tool call; returns the router's view of the session."""
        hints = make_hints(ttl=ttl, next_turn_in=next_turn_in, final=bool(final),
                           priority=priority)
        endpoint = self._hints_endpoint(hints)
        if endpoint is None:
            return {}
        return session_api.post_hints(endpoint[0], self.id, endpoint[1], hints)

    async def ahint_now(self, *, ttl: float | None = None, next_turn_in: float | None = None,
                        final: bool | None = None, priority: int | None = None
                        ) -> dict[str, Any]:
        hints = make_hints(ttl=ttl, next_turn_in=next_turn_in, final=bool(final),
                           priority=priority)
        endpoint = self._hints_endpoint(hints)
        if endpoint is None:
            return {}
        return await session_api.apost_hints(endpoint[0], self.id, endpoint[1], hints)

    def release(self) -> bool:
        """Release the session on the router now. True if the router held it."""
        return self._release_sync()

    async def arelease(self) -> bool:
        return await self._release_async()

    def close(self, final: bool = True) -> None:
        """No more turns. `final=True` releases the session on the router (errors logged);
        `final=False` leaves it to its lease."""
        self._close_sync(final)

    async def aclose(self, final: bool = True) -> None:
        await self._close_async(final)


class StreamState:
    """What a streamed turn has received so far; shared by `TurnStream` and its async twin."""

    def __init__(self, session: SessionCore, pending: PendingTurn, raw: Any) -> None:
        self._session = session
        self._pending = pending
        self._raw = raw
        self._text: list[str] = []
        self._extras: dict[str, Any] = {}
        self._turn: Turn | None = None
        self._ended = False

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def turn(self) -> Turn | None:
        return self._turn

    @property
    def stats(self) -> TurnStats | None:
        return self._turn.stats if self._turn else None

    @property
    def early_headers(self) -> dict[str, str]:
        """The router's `X-TurnKV-*` response headers: what it knew before the first token."""
        return dict(self._pending.early_headers)


class TurnStream(StreamState):
    """The chunks of a streamed turn (openai `ChatCompletionChunk`s with at least one choice;
    the usage and stats chunks go into `stats`). `text` grows as chunks arrive; `stats` and
    `turn` are set once the stream has ended."""

    def __iter__(self) -> Iterator[Any]:
        try:
            for chunk in self._raw:
                if _take(chunk, self._text, self._extras):
                    yield chunk
        finally:
            self._end()

    def finish(self) -> Turn:
        """Read the rest of the stream; returns the finished turn."""
        for _ in self:
            pass
        if self._turn is None:
            raise TurnKVError("the stream ended without a complete turn")
        return self._turn

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._raw.close()
        self._turn = end_stream(self._session, self._pending, self._extras, "".join(self._text))

    def close(self) -> None:
        self._end()

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _take(chunk: Any, text: list[str], extras: dict[str, Any]) -> bool:
    """Collect a chunk; False for chunks without choices (usage, turnkv stats)."""
    extra = getattr(chunk, "model_extra", None) or {}
    if isinstance(extra.get("turnkv"), dict):
        extras["turnkv"] = extra["turnkv"]
    usage = getattr(chunk, "usage", None)
    if usage is not None:
        extras["usage"] = usage.model_dump()
    if not chunk.choices:
        return False
    delta = chunk.choices[0].delta
    if getattr(delta, "content", None):
        text.append(delta.content)
    return True


def end_stream(session: SessionCore, pending: PendingTurn, extras: dict[str, Any], text: str
               ) -> Turn | None:
    if pending.turn is not None:
        return pending.turn
    if "turnkv" not in extras and "usage" not in extras:
        pending.give_up()  # cut short: nothing says the turn happened
        return None
    # The response was not watched on its way in (an http client turnkv does not know):
    # record from what the chunks carried.
    pending.settled = True
    pending.turn = session.record(
        extras.get("turnkv"), None, retries=pending.retries, usage=extras.get("usage"),
        turn=pending.index, text=text, early_headers=pending.early_headers,
        final=pending.hints.final)
    return pending.turn


def finish_chat(session: SessionCore, pending: PendingTurn, response: Any) -> Turn:
    turn = pending.turn
    if turn is None:
        usage = response.usage.model_dump() if getattr(response, "usage", None) else None
        extra = getattr(response, "model_extra", None) or {}
        pending.settled = True
        turn = session.record(
            extra.get("turnkv"), None, retries=pending.retries, usage=usage, turn=pending.index,
            early_headers=pending.early_headers, final=pending.hints.final)
        pending.turn = turn
    turn.response = response
    if getattr(response, "choices", None):
        turn.message = response.choices[0].message
        turn.text = turn.message.content or ""
    return turn


def session(id: str | None = None, *, ttl: float | None = None, priority: int | None = None,
            prefix_id: str | None = None, keep: bool = False, retry: RetryPolicy | None = None,
            timeout: float | None = None) -> Session:
    """An ambient session, bound to no client: `with turnkv.session() as s:` (or
    `async with`) tags every turn request sent inside it by a turnkv or stock openai client
    or a `turnkv.http_client()`. It releases itself on exit through the base URL of the
    first request it tagged."""
    return Session(id, ttl=ttl, priority=priority, prefix_id=prefix_id, keep=keep, retry=retry,
                   timeout=timeout)
