"""turnkv: session-aware KV reuse for multi-turn agents on disaggregated vLLM.

The client SDK: openai's clients with sessions, cache hints and per-turn stats. See
docs/sdk.md. Names load on first use, so that `turnkv.protocol` (which the router imports)
does not pull in openai.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnkv.async_sessions import AsyncSession
    from turnkv.client import AsyncOpenAI, OpenAI
    from turnkv.context import current_session
    from turnkv.errors import (
        InvalidTagError,
        PlainServerWarning,
        ServerUnreachableError,
        SessionAPIError,
        SessionClosedError,
        SessionNotFoundError,
        TurnKVError,
    )
    from turnkv.http import async_http_client, http_client
    from turnkv.ids import new_session_id, prefix_id
    from turnkv.protocol import CacheHints, TurnTag
    from turnkv.render import session_stats_table, stats_table, turn_stats_table
    from turnkv.retry import RetryPolicy
    from turnkv.sessions import Session, session
    from turnkv.stats import SessionStats, TurnStats
    from turnkv.streams import AsyncTurnStream, TurnStream
    from turnkv.turn import Turn

__version__ = "0.1.0"

_WHERE = {
    "AsyncOpenAI": "turnkv.client",
    "AsyncSession": "turnkv.async_sessions",
    "AsyncTurnStream": "turnkv.streams",
    "CacheHints": "turnkv.protocol",
    "InvalidTagError": "turnkv.errors",
    "OpenAI": "turnkv.client",
    "PlainServerWarning": "turnkv.errors",
    "RetryPolicy": "turnkv.retry",
    "ServerUnreachableError": "turnkv.errors",
    "Session": "turnkv.sessions",
    "SessionAPIError": "turnkv.errors",
    "SessionClosedError": "turnkv.errors",
    "SessionNotFoundError": "turnkv.errors",
    "SessionStats": "turnkv.stats",
    "Turn": "turnkv.turn",
    "TurnKVError": "turnkv.errors",
    "TurnStats": "turnkv.stats",
    "TurnStream": "turnkv.streams",
    "TurnTag": "turnkv.protocol",
    "async_http_client": "turnkv.http",
    "current_session": "turnkv.context",
    "http_client": "turnkv.http",
    "new_session_id": "turnkv.ids",
    "prefix_id": "turnkv.ids",
    "session": "turnkv.sessions",
    "session_stats_table": "turnkv.render",
    "stats_table": "turnkv.render",
    "turn_stats_table": "turnkv.render",
}

__all__ = [
    "AsyncOpenAI",
    "AsyncSession",
    "AsyncTurnStream",
    "CacheHints",
    "InvalidTagError",
    "OpenAI",
    "PlainServerWarning",
    "RetryPolicy",
    "ServerUnreachableError",
    "Session",
    "SessionAPIError",
    "SessionClosedError",
    "SessionNotFoundError",
    "SessionStats",
    "Turn",
    "TurnKVError",
    "TurnStats",
    "TurnStream",
    "TurnTag",
    "__version__",
    "async_http_client",
    "current_session",
    "http_client",
    "new_session_id",
    "prefix_id",
    "session",
    "session_stats_table",
    "stats_table",
    "turn_stats_table",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'turnkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
