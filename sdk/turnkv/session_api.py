"""The router's session API (`/v1/turnkv/sessions/{id}`): release and hints.

A call is decided once, as a frozen `SessionCall` (what to send and how to read the answer),
and carried out by its one-line sync or async form, as `RetryPolicy` does for retries: the
sync and async sessions share every decision and differ only in how they wait.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

import turnkv.protocol as p
from turnkv.errors import ServerUnreachableError, SessionAPIError, SessionNotFoundError

TIMEOUT_S = 10.0

log = logging.getLogger("turnkv")


def session_url(base_url: str, session_id: str) -> str:
    return f"{base_url.rstrip('/')}/turnkv/sessions/{session_id}"


def released(response: httpx.Response) -> bool:
    """True if the router held the session and released it, False if it held none."""
    if response.status_code == 404:
        return False  # already gone: ended by a final turn, expired, or never reached it
    checked(response)
    return True


def checked(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise refusal(response)
    return response.json()


def refusal(response: httpx.Response) -> SessionAPIError:
    """The router's refusal as a typed error with the router's own message (its answers are
    OpenAI-shaped: `{"error": {"message", "type", ...}}`), not the raw JSON."""
    status = response.status_code
    message, kind = response.text[:300], None
    with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
        error = response.json()["error"]
        message, kind = str(error["message"]), error.get("type")
    if status == 404:
        return SessionNotFoundError(
            f"{message}: the router does not hold this session (its lease expired, it was "
            "released, or no turn of it reached this router); its next turn starts it again, "
            "with the history computed anew",
            status_code=status, kind=kind)
    return SessionAPIError(f"{response.request.method} {response.request.url} answered "
                           f"{status}: {message}", status_code=status, kind=kind)


def _view(response: httpx.Response) -> dict[str, Any]:
    return dict(checked(response))


@dataclass(frozen=True)
class SessionCall:
    """One request to the session API, or none: with `url` None nothing is sent and `default`
    is the answer. `quiet` names what failed, for calls whose failure is logged rather than
    raised (the release on leaving a `with` block must never raise over the caller's body)."""

    url: str | None = None
    method: str = "DELETE"
    headers: Mapping[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    read: Callable[[httpx.Response], Any] = checked
    default: Any = None
    quiet: str | None = None

    def send(self) -> Any:
        if self.url is None:
            return self.default
        with self._guard(), httpx.Client(timeout=TIMEOUT_S) as client:
            return self.read(client.request(self.method, self.url, headers=dict(self.headers),
                                            json=self.body))
        return self.default  # a quiet call failed (logged)

    async def asend(self) -> Any:
        if self.url is None:
            return self.default
        with self._guard():
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                return self.read(await client.request(
                    self.method, self.url, headers=dict(self.headers), json=self.body))
        return self.default  # a quiet call failed (logged)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            with self._unreachable():
                yield
        except Exception as exc:
            if self.quiet is None:
                raise
            # never raised over the caller's body
            log.warning("turnkv: %s failed: %s", self.quiet, exc)

    @contextlib.contextmanager
    def _unreachable(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            base = (self.url or "").split("/turnkv/sessions/", 1)[0]
            raise ServerUnreachableError(base, exc.request, exc) from exc


def release(base_url: str, session_id: str, headers: Mapping[str, str],
            read: Callable[[httpx.Response], bool] = released) -> SessionCall:
    """`DELETE` the session: True if the router held it, False if it held none."""
    return SessionCall(session_url(base_url, session_id), "DELETE", headers, read=read)


def post_hints(base_url: str, session_id: str, headers: Mapping[str, str],
               hints: p.CacheHints) -> SessionCall:
    """Hints now; the answer is the router's view of the session."""
    return SessionCall(f"{session_url(base_url, session_id)}/hints", "POST", headers,
                       body=hints.model_dump(exclude_none=True), read=_view)
