"""What the SDK raises and warns."""

from __future__ import annotations

from pydantic import ValidationError


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


class PlainServerWarning(UserWarning):
    """The server answered without turnkv stats: no router in front (plain vLLM or OpenAI)."""
