"""The turnkv wire protocol: what a client adds to a request and what the router returns.

Shared by the SDK (which validates before sending) and the router (which validates on
arrival), so both sides reject the same bad values with the same messages. See
docs/protocol.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

# Session and prefix IDs travel in headers and URLs: keep them to a safe, bounded alphabet.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)

SessionId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]

MAX_TTL_SECONDS = 24 * 3600.0
MIN_PRIORITY, MAX_PRIORITY = -10, 10

# Request headers, for clients that cannot change the body.
HEADER_SESSION = "X-TurnKV-Session"
HEADER_TURN = "X-TurnKV-Turn"
HEADER_PREFIX = "X-TurnKV-Prefix"
HEADER_TTL = "X-TurnKV-TTL"
HEADER_NEXT_TURN_IN = "X-TurnKV-Next-Turn-In"
HEADER_FINAL = "X-TurnKV-Final"
HEADER_PRIORITY = "X-TurnKV-Priority"

# Response headers: what the router knows before the first token.
HEADER_PREFILL_NODE = "X-TurnKV-Prefill-Node"
HEADER_DECODE_NODE = "X-TurnKV-Decode-Node"
HEADER_PREFILL_COMPUTED = "X-TurnKV-Prefill-Computed"
HEADER_PREFILL_CACHED = "X-TurnKV-Prefill-Cached"
HEADER_PREFIX_BREAK_AT = "X-TurnKV-Prefix-Break-At"
HEADER_FALLBACK = "X-TurnKV-Fallback"


def is_valid_id(value: str) -> bool:
    # fullmatch: `$` alone would also accept a trailing newline.
    return bool(_ID_RE.fullmatch(value))


class CacheHints(BaseModel):
    """What the client knows about the session's future. All optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttl: float | None = Field(
        default=None, gt=0, le=MAX_TTL_SECONDS,
        description="Keep the session's KV this many seconds after the turn (the router caps it).",
    )
    next_turn_in: float | None = Field(
        default=None, ge=0, le=MAX_TTL_SECONDS,
        description="The next turn is expected in about this many seconds (e.g. tool time).",
    )
    final: bool = Field(default=False, description="This is the session's last turn.")
    priority: int | None = Field(
        default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY,
        description="Higher keeps the session's KV longer under memory pressure.",
    )


class TurnTag(BaseModel):
    """The `turnkv` field of a request body."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: SessionId
    turn: int | None = Field(default=None, ge=0, le=1_000_000)
    prefix_id: SessionId | None = None
    hints: CacheHints = Field(default_factory=CacheHints)


class PromptTokens(BaseModel):
    """Where each prompt token of a turn came from, on each engine.

    On each engine the parts sum to `total`. A part is None where the serving mode gives no
    per-request measurement of it (upstream connectors do not report the decode engine's own
    cache hits per request); it is never guessed.
    """

    total: int = 0
    # On the prefill engine.
    prefill_cached: int | None = None
    prefill_received: int | None = Field(default=None,
                                         description="read back from the decode engine")
    prefill_restored: int | None = Field(
        default=None, description="loaded from the engine's lower tier (host memory)")
    prefill_computed: int | None = None
    # Cached, received and restored, where the mode does not report the split.
    prefill_reused: int | None = None
    # On the decode engine.
    decode_cached: int | None = None
    decode_received: int | None = Field(default=None,
                                        description="moved from the prefill engine")
    decode_restored: int | None = Field(
        default=None, description="loaded from the engine's lower tier (host memory)")
    decode_computed: int | None = None


class KvMoved(BaseModel):
    """KV moved between the engines for this turn; None where the mode does not report it."""

    to_decode_tokens: int | None = None
    to_decode_bytes: int | None = None
    to_prefill_tokens: int | None = None
    to_prefill_bytes: int | None = None


class TurnTimes(BaseModel):
    """Milliseconds. `queue_ms`, `prefill_ms`, `first_token_ms` and `total_ms` are measured
    at the router: `queue_ms` is how long the turn waited for admission (a new session's first
    turn while the live sessions' histories fill the engines; 0.0 when it did not wait), and
    `first_token_ms` and `total_ms` run from the moment it accepted the turn, so they include
    it. `engine_queue_ms` and `engine_prefill_ms` are the engine's own figures for the request
    that computed the prompt (vLLM's per-request metrics: the prefill engine's, or the decode
    engine's for a turn it served alone).

    None where not measured (an engine started without `--enable-per-request-metrics`, a
    streamed turn without usage).
    """

    queue_ms: float = 0.0
    # How long the router planned the attempt that served the turn: reading its prompt
    # (`/tokenize`) and asking the engines' loads where the mode does; in `first_token_ms`.
    plan_ms: float = 0.0
    engine_queue_ms: float | None = None
    prefill_ms: float = 0.0
    # From the engine scheduling the request to its first token: the prompt's computation
    # without the HTTP round trip or the engine's queue (vLLM schedules a request that loads KV
    # from another engine once it has arrived: that wait is in `engine_queue_ms`).
    engine_prefill_ms: float | None = None
    first_token_ms: float | None = None
    total_ms: float = 0.0
    # How long the request waited for the engine's lower tier to load the KV it restored
    # (`prompt_tokens`'s `*_restored`) into its blocks, as the engine's scheduler saw it: from
    # the blocks' allocation to the load's end, so at the granularity of its steps; 0 where the
    # tier loaded it in the step that computed the rest. None where no tier loaded anything, or
    # the engine's reply was not read (a streamed turn's decode side).
    restore_ms: float | None = None

    @field_validator("queue_ms", mode="before")
    @classmethod
    def _null_is_unqueued(cls, value: object) -> object:
        # Routers before admission sent the engine's queue time here, null where unmeasured:
        # their stats still parse.
        return 0.0 if value is None else value


PrefetchOutcome = Literal["in_time", "awaited", "early"]

FallbackReason = Literal[
    "engine_unavailable", "session_moved", "lease_expired", "transfer_failed",
]


# Which of a request's keys named its session (docs/protocol.md, "Session keys"), in the
# router's order: turnkv's own tag, Dynamo's session, vLLM's session ID, the Responses
# lineage, a coding agent's own session header, Codex's prompt cache key; or the router
# inferred the session from the conversation's content.
SessionSource = Literal["tag", "dynamo", "vllm", "lineage", "agent", "prompt_cache_key",
                        "inferred"]


class TurnPlacement(BaseModel):
    """Where the `turnkv` mode's planner ran the turn and what it moved, and why (routers in
    fixed pools, and other modes, decide nothing per turn: the field is null).

    `where`: "whole" (the session's home computed and decoded), "split" (`prefill` computed
    the prompt and wrote the KV the home lacked) or "move" (the session's home changed to
    `home`: its history pulled from the old home, `prefill`, or recomputed when `pulled` is
    false). `push_back`: a copy of the history went to the other engine after the turn. A plain
    string, so that a later router's placements still parse."""

    where: str
    home: str
    prefill: str
    push_back: bool = False
    pulled: bool = False
    pinned: bool = False  # a diagnostic router option chose it, not the costs
    why: str = ""


class RouterTurnStats(BaseModel):
    """The `turnkv` field of a response (the final SSE chunk when streaming)."""

    session_id: str | None = None
    # A `SessionSource` from this router; a plain string so that stats from a later router,
    # which may name another source, still parse (None: no session, or an older router).
    session_source: str | None = None
    turn: int = Field(default=0, ge=0)
    mode: str
    prefill_node: str | None = None
    decode_node: str | None = None
    moved: bool = False
    prompt_tokens: PromptTokens = Field(default_factory=PromptTokens)
    completion_tokens: int = 0
    kv: KvMoved = Field(default_factory=KvMoved)
    times: TurnTimes = Field(default_factory=TurnTimes)
    prefix_break_at: int | None = None
    fallback: FallbackReason | None = None
    fallback_detail: str | None = None
    # What the other fields do not say, when it is no fallback: why the turn reused none of
    # the history it shares with its session (reuse comes in whole KV blocks, and that history
    # was under one), or why a short delta went to the prefill engine (the router's ITL
    # target).
    note: str | None = None
    # A prefetch of the session's history before this turn (after a `next_turn_in` hint):
    # "in_time" (done before the turn arrived), "awaited" (the turn waited for it), "early"
    # (the turn came before it started; it was called off); None: none was scheduled.
    prefetch: PrefetchOutcome | None = None
    # The planner's decision (the `turnkv` mode; None elsewhere).
    placement: TurnPlacement | None = None


__all__ = [
    "CacheHints",
    "KvMoved",
    "PromptTokens",
    "SessionSource",
    "RouterTurnStats",
    "TurnPlacement",
    "TurnTag",
    "TurnTimes",
    "is_valid_id",
]
