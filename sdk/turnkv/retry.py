"""Retrying a turn (tenacity): connection errors, 429 and 503, honouring Retry-After.

Only `Session.chat` / `stream` retry, and only before the first byte of an answer; openai's
own retries are off inside them so that attempts do not multiply. A retried turn keeps its
turn index, so the router counts it once.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3  # in all, the first included
    initial_wait_s: float = 0.5  # doubled per attempt
    max_wait_s: float = 8.0
    max_retry_after_s: float = 30.0  # a server's Retry-After is honoured up to this
    statuses: frozenset[int] = field(default_factory=lambda: frozenset({429, 503}))
    retry_timeouts: bool = False  # a timed-out turn may still be generating

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")

    def should_retry(self, exc: BaseException) -> bool:
        if isinstance(exc, openai.APITimeoutError):
            return self.retry_timeouts
        if isinstance(exc, openai.APIConnectionError):
            return True
        return isinstance(exc, openai.APIStatusError) and exc.status_code in self.statuses

    def wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = retry_after_s(exc)
        if after is not None:
            return min(after, self.max_retry_after_s)
        return min(self.max_wait_s, self.initial_wait_s * 2 ** (state.attempt_number - 1))

    def retrying(self) -> Retrying:
        return Retrying(stop=stop_after_attempt(self.attempts), wait=self.wait,
                        retry=retry_if_exception(self.should_retry), reraise=True)

    def async_retrying(self) -> AsyncRetrying:
        return AsyncRetrying(stop=stop_after_attempt(self.attempts), wait=self.wait,
                             retry=retry_if_exception(self.should_retry), reraise=True)

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, retried under this policy; the last error is raised."""
        return self.retrying()(fn, *args, **kwargs)

    async def acall(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """`await fn(*args, **kwargs)`, retried under this policy."""

        # tenacity awaits only what it recognises as a coroutine function, and openai wraps
        # its async methods in plain functions that return a coroutine.
        async def attempt() -> T:
            return await fn(*args, **kwargs)

        return await self.async_retrying()(attempt)


def retry_after_s(exc: BaseException | None) -> float | None:
    """Seconds from a Retry-After header (seconds or an HTTP date), if the error has one."""
    response: Any = getattr(exc, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, parsed.timestamp() - time.time())
