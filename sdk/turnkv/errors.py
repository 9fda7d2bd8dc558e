"""What the SDK raises and warns."""

from __future__ import annotations

from typing import Any

import openai
from pydantic import ValidationError

# What a user can run to see whether a turnkv cluster is up, and where its router listens.
CHECK_HINT = "Check with `turnkv status` (start a local cluster with `turnkv up`)"


class TurnKVError(Exception):
    """Base of every error the SDK raises itself."""


class InvalidTagError(TurnKVError, ValueError):
    """A session ID, prefix ID or hint is out of range. Raised before anything is sent."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    @classmethod
    def from_validation(cls, exc: ValidationError, prefix: str = "turnkv") -> InvalidTagError:
        # The same wording as the router's 400s, so a message reads the same on both sides.
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        name = f"{prefix}.{where}" if where else prefix
        return cls(f"invalid {name}: {first['msg']}", field=name)


class SessionClosedError(TurnKVError):
    """The session was closed or released; open a new one for more turns."""


class ServerUnreachableError(TurnKVError, openai.APIConnectionError):
    """No server answers at the client's URL (refused, unreachable, no such host), after the
    retries. An `openai.APIConnectionError`, so handlers written for openai still catch it;
    openai's own message ("Connection error.") names neither the URL nor what to check."""

    def __init__(self, url: str, request: Any, cause: BaseException | None = None) -> None:
        self.url = url
        why = f" ({describe(cause)})" if cause is not None else ""
        super().__init__(message=f"no server answers at {url}{why}: is the turnkv router "
                                 f"running there? {CHECK_HINT}", request=request)


class SessionAPIError(TurnKVError):
    """The router refused a call of its session API (`hint_now`, `release`); `message` is the
    router's own, `status_code` its HTTP status."""

    def __init__(self, message: str, *, status_code: int, kind: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.kind = kind


class SessionNotFoundError(SessionAPIError):
    """The router holds no such session: its lease expired, it was released (a `final` turn,
    `release()`), or no turn of it reached this router. The next turn starts it again, with
    its whole history computed once more."""


class PlainServerWarning(UserWarning):
    """The server answered without turnkv stats: no router in front (plain vLLM or OpenAI)."""


def describe(exc: BaseException) -> str:
    """What went wrong in a few words: "connection refused", else the innermost cause's own
    words. openai's, httpx's and anyio's wrappers each add a layer that says less ("All
    connection attempts failed"); the refusal itself is the last link of the chain."""
    chain = [exc]
    while len(chain) < 10:  # a chain is a few layers deep; a cycle must not hang
        inner = chain[-1].__cause__ or chain[-1].__context__
        if inner is None or inner in chain:
            break
        chain.append(inner)
    if any(isinstance(link, ConnectionRefusedError) for link in chain):
        return "connection refused"
    return str(chain[-1]) or type(chain[-1]).__name__
