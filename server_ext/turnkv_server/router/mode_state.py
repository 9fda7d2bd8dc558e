"""What the serving modes keep of a session between its turns (`Session.mode_state`): one typed
field per thing kept, each mode setting its own. Plain data (`model`) travels in the session's
record to the routers sharing the store (`session_store`); a task in flight, or an offer that
holds this router's clock, stays in this process."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass
class HeldKv:
    """bidirectional: a decode engine's offer to have the session's blocks read back, from its
    last turn."""

    params: dict[str, Any]
    token_ids: list[int]
    decode: str
    expires_at: float


@dataclass
class ModeState:
    """What the serving modes keep of a session between its turns."""

    # turnkv, affinity: the model the session's turns name (ending or renewing its engines'
    # leases takes a request of it).
    model: str | None = None
    # turnkv: the push back of the last turn's history to the other engine, in flight.
    push_back: asyncio.Task[None] | None = None
    # bidirectional: the KV the decode engine holds for the next turn to read back, or the
    # request asking it for that, in flight.
    held_kv: HeldKv | asyncio.Task[HeldKv | None] | None = None
