"""What a serving mode is: the hooks the router's turn pipeline (`router.turn`) and session
service (`router.sessions`) call, between them and vLLM's `kv_transfer_params`.

A turn runs as one or more attempts: an engine that fails before the client has a byte is taken
out and the turn replayed on another pair (`Turns._attempts`), and a failed read-back of held KV
is replayed without reuse. Per turn, in this order:

- `begin(turn)`: once, before the first attempt (after admission);
- `plan(turn, placement)`: once per attempt, before the attempt's engine requests;
- `prefilled(turn)`: once per attempt with a prefill request, when that request answered;
- `first_token(turn)`: once per streamed attempt, when its first output reached the router;
- `finish(turn, plan, end)`: once per attempt whose decode request went out, when it ended.

Per session, outside its turns: `hinted` (hints sent between turns), `drop_session` (the
session ended), `forget_session` (it left this router's table without ending). Each hook's
docstring below says when it is called, how often, what it may do and what it must not.

Everything runs on the router's one event loop (uvicorn's), and nothing else touches a mode:
no hook needs a lock, and none may block (no blocking I/O, no sleeping; engine requests go
through `ctx.upstream`, awaited in the coroutines `begin` and `plan` or spawned as tasks from
the others). A hook never raises on the engines' account, but `plan`, whose engine requests
(`/tokenize`) may fail with `EngineConnectionError`: that attempt is then replayed elsewhere.

The pipeline owns everything else: the engine requests of the turn and their ends, the stats,
the session's history. A mode's state per session (its model, a push back in flight, an offer
of held KV) lives in `Session.mode_state`, a typed record (`mode_state.ModeState`) whose plain
data the session's record carries to other routers; state the mode keeps itself, keyed by
session (a pending prefetch, a pool's home), must be let go of in `drop_session` and
`forget_session`, or it outlives the session.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from turnkv.protocol import CacheHints, FallbackReason, PrefetchOutcome, RouterTurnStats, TurnTag
from turnkv_server.engine.requests import tokenize_request
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.decisions import Choice, Decision
from turnkv_server.router.engines import Engine, EnginePool, Placement, Upstream
from turnkv_server.router.sessions import LeasePolicy, Session


@dataclass
class Turn:
    """One client request as it goes through the router; replayed attempts share it."""

    path: str
    body: dict[str, Any]  # the client's, tag removed, tenant's cache salt added
    tag: TurnTag | None
    session: Session | None
    want_token_ids: bool  # the client asked for token IDs (the router always does)
    stream: bool
    accepted_at: float = field(default_factory=time.perf_counter)
    # Per attempt (the pipeline sets them): the engine requests' ID, and the token IDs the
    # engines report.
    request_id: str = ""
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # The prefix it shares with other sessions' turns (the tag's, or for a turn with no
    # session, OpenAI's `prompt_cache_key`): placed where that prefix is warm.
    prefix_id: str | None = None
    # Whether a prefetch of its history had finished when it arrived (`modes.prefetch`): the
    # turn's, set once by `Mode.begin`, whichever attempt serves it.
    prefetch: PrefetchOutcome | None = None
    # How long it waited for admission, in ms (`admission.Admission`).
    queued_ms: float = 0.0
    planned_ms: float = 0.0  # the planning of the attempt that serves it
    # The size of its request's JSON (where the mode measures it: a prompt grows with it).
    request_bytes: int = 0
    # Which key named its session (`router.app.read_keys`), or "inferred".
    session_source: str | None = None
    # An inferred session's turn as `InferredSessions` knows it (`Inference.ticket`).
    inferred_ticket: int | None = None
    # What a streamed turn relays besides the answer: the engine's usage chunk (the client
    # asked for `stream_options.include_usage`; the router always asks the engine) and the
    # turn's stats chunk (the client asked for either, or sent turnkv's own tag).
    usage_in_stream: bool = True
    stats_in_stream: bool = True
    # The API it came in on (`router.apis`; None: chat or completions, by `path`).
    api: TurnApi | None = None


class TurnApi(Protocol):
    """What the modes need to know of the API a turn came in on (`router.apis.base.Api`)."""

    @property
    def gives_token_ids(self) -> bool:
        """The engines report the turn's prompt and output token IDs on its route."""

    def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The `/tokenize` request that renders the prompt alone; None where there is none."""

    def engine_request_id(self, request_id: str) -> str:
        """The ID the engines give a request sent with `X-Request-Id: request_id`."""


def tokenize_body(turn: Turn) -> dict[str, Any] | None:
    """The engines' `/tokenize` request for the turn's prompt; None where its API has none (the
    Responses and Messages APIs)."""
    return tokenize_request(turn.body) if turn.api is None else \
        turn.api.tokenize_request(turn.body)


async def tokenize(upstream: Upstream, engine: Engine, turn: Turn) -> list[int] | None:
    """The turn's prompt as `engine` renders it; None where its API renders no prompt alone:
    the modes then plan as for a turn the router does not tokenize (`affinity`)."""
    request = tokenize_body(turn)
    return None if request is None else await upstream.tokenize(engine, request)


def gives_token_ids(turn: Turn) -> bool:
    """Whether the engines report the turn's token IDs: without them its session keeps no
    history (nothing to push back, no prefix to check)."""
    return turn.api is None or turn.api.gives_token_ids


def engine_request_id(turn: Turn) -> str:
    """The ID the engines give the attempt's requests."""
    if turn.api is not None:
        return turn.api.engine_request_id(turn.request_id)
    prefix = "chatcmpl" if turn.path.endswith("/chat/completions") else "cmpl"
    return f"{prefix}-{turn.request_id}"


@dataclass(frozen=True)
class DecodeAlone:
    """The decode engine serves the turn by itself, as a single engine would: it computes the
    `new_tokens` the prompt adds to the session's history it holds (a short delta), or, when no
    prefill engine is up, every token it does not hold."""

    # None: the router did not tokenize the prompt (affinity); the engine's usage counts it.
    prompt_token_ids: list[int] | None
    new_tokens: int
    # Whether it was meant to hold the session's history: only then does what it computed
    # tell whether its lease was lost (a first turn computes everything, and that says nothing).
    held: bool = True


@dataclass(frozen=True)
class TurnPlan:
    """What each engine does for one attempt of a turn."""

    placement: Placement
    # The prefill request's kv_transfer_params; None when the decode engine serves alone.
    prefill_params: dict[str, Any] | None
    alone: DecodeAlone | None = None
    # The decode request goes out together with the prefill request, carrying
    # `decode_params`; otherwise (vLLM's pull P/D) it follows the prefill, carrying the params
    # the prefill's response returned. A decode engine serving alone carries `decode_params`.
    concurrent: bool = False
    decode_params: dict[str, Any] | None = None
    # The prefill request reads the session's KV back: its failure (a 5xx) is a failed
    # read-back, replayed without reuse, not an unavailable engine.
    reuse: bool = False
    # Why the prefill reads nothing back although the session held KV.
    reuse_note: tuple[FallbackReason, str] | None = None
    # vLLM's cached_tokens on the prefill engine are its own prefix hits (False: they include
    # what it read back, and vLLM does not report the split).
    cached_is_local: bool = True
    # turnkv: the sends the engines keep for a receiver that registers later, by transfer ID:
    # the prefill engine's for the decode request, the decode engine's for the push back.
    # `finish` gives up those no receiver will register for.
    prefill_send: str | None = None
    decode_send: str | None = None
    # Why the turn went where it did when that is no fallback (the stats' `note`): a short
    # delta the ITL target sent to the prefill engine.
    note: str | None = None
    # turnkv's planner: what it decided for the turn, and why (the stats' `placement`).
    decision: Decision | None = None


@dataclass(frozen=True)
class TurnEnd:
    """How a planned attempt's decode request ended."""

    how: Literal["complete", "cut", "refused"]
    # complete: the decode engine's kv_transfer_params (in non-streamed responses only) and
    # the turn's stats.
    reply: dict[str, Any] | None = None
    stats: RouterTurnStats | None = None


@dataclass(frozen=True)
class NixlPeer:
    """Where an engine's NIXL side channel listens (push and turnkv need it up front)."""

    engine_id: str
    host: str
    port: int

    @classmethod
    def parse(cls, spec: str) -> NixlPeer:
        """``ENGINE_ID@HOST:PORT``"""
        match = re.fullmatch(r"([^@\s]+)@([^:\s]+):(\d+)", spec)
        if not match:
            raise ValueError(f"expected ENGINE_ID@HOST:PORT, got {spec!r}")
        return cls(match.group(1), match.group(2), int(match.group(3)))


@dataclass
class ModeContext:
    upstream: Upstream
    prefill_peers: dict[str, NixlPeer]  # prefill engine name -> its NIXL side channel
    decoder_kv_ttl: float
    clock: Any = time.monotonic
    # turnkv: every engine's connector side channel, engine name -> HOST:PORT.
    side_channels: dict[str, str] = field(default_factory=dict)
    pool: EnginePool | None = None
    # turnkv: a turn adding at most this many tokens to a session is computed on its decode
    # engine alone (0: never).
    short_delta_tokens: int = 0
    # turnkv: the ITL a short delta may stall the decode engine's other requests by, in ms
    # (None: no target).
    itl_target_ms: float | None = None
    # affinity: the engines run the turnkv connector and hold each session's lease.
    engine_leases: bool = False
    # turnkv: each session lives on one engine of its pair, which serves its turns whole.
    pair_pool: bool = False
    # turnkv: the P/D form (prefill engines compute, decode engines decode); else the planner
    # places each turn, with KV moving at `transfer_tokens_per_ms` and, for diagnostics, the
    # placements of each session's turns pinned (cycling).
    fixed_pools: bool = False
    transfer_tokens_per_ms: float = 50.0
    pins: tuple[Choice, ...] = ()
    # turnkv: the engines share a tier below their caches (`--shared-tier`).
    shared_tier: bool = False
    # turnkv: a prompt waits for a turn that moves KV to land on its engine (`router.landings`).
    landing_holds: bool = True
    # The router's session TTLs (turnkv passes the engines the TTL a session's hints give it).
    session_policy: LeasePolicy = field(default_factory=LeasePolicy)
    # Counts each renew-only request sent for a hint between turns, by outcome ("sent",
    # "refused", "failed"): the router's metrics.
    count_renewal: Callable[[str], None] = lambda outcome: None

    @classmethod
    def of(cls, config: RouterConfig, upstream: Upstream, pool: EnginePool,
           clock: Callable[[], float],
           count_renewal: Callable[[str], None] = lambda outcome: None) -> ModeContext:
        """The context of a router's mode, from its settings."""
        peers = {engine.name: NixlPeer.parse(spec)
                 for engine, spec in zip(pool.prefill, config.prefill_nixl, strict=False)}
        decode_peers = {engine.name: NixlPeer.parse(spec)
                        for engine, spec in zip(pool.decode, config.decode_nixl, strict=False)}
        side_channels = {name: f"{peer.host}:{peer.port}"
                         for name, peer in {**peers, **decode_peers}.items()}
        return cls(upstream=upstream, prefill_peers=peers, decoder_kv_ttl=config.decoder_kv_ttl,
                   clock=clock, side_channels=side_channels, pool=pool,
                   short_delta_tokens=config.short_delta_tokens,
                   itl_target_ms=config.itl_target_ms, engine_leases=config.engine_leases,
                   pair_pool=config.pair_pool, fixed_pools=config.fixed_pools,
                   transfer_tokens_per_ms=config.transfer_tokens_per_ms, pins=config.pins(),
                   shared_tier=config.shared_tier, landing_holds=not config.no_landing_holds,
                   session_policy=LeasePolicy(config.default_ttl, config.max_ttl),
                   count_renewal=count_renewal)


class Mode:
    """A serving mode; `standard` is the plainest. See the module docstring for the order of
    the hooks; each says its own contract."""

    # Whether a session's turns stick to the pair that served it.
    affinity = False
    # Whether the decode engines serve turns alone while no prefill engine is up.
    serves_without_prefill = False

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx

    async def begin(self, turn: Turn) -> None:
        """The turn arrived, and is about to be placed and planned.

        When: once per turn, tagged or not, after admission let it go and before its first
        attempt's `plan`; never again for a replay. Not for a turn that ended before (its
        client left while it was queued).
        Does: whatever belongs to the turn rather than to one attempt of it, set on the `Turn`
        (`turn.prefetch`: whether the session's prefetch was in time, waiting for one in
        flight). It may await (a prefetch, at most `prefetch.WAIT_S`): the turn waits with it.
        Must not: send the turn's own requests (its attempts do), fail the turn (what it
        waits for is advisory), or depend on the placement (not made yet)."""

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        """What each engine does for this attempt (`TurnPlan`).

        When: once per attempt, so one to `retries + 2` times per turn, each time with the
        attempt's own `placement` and `turn.request_id`; before any engine request of the
        attempt.
        Does: may ask an engine first (`/tokenize`), and may take state meant for one use
        (bidirectional's offer of held KV: a replay after a failed read-back finds none, and
        recomputes). An `EngineConnectionError` it lets through fails the attempt as an
        unavailable engine.
        Must not: consume what belongs to the turn (`begin` took it: an attempt may be
        replayed), send the attempt's prefill or decode request (the pipeline does, from the
        plan), or assume its sends will be received: only `finish` says how the attempt
        ended, and an attempt that fails before its decode request went out gets none (what
        its plan left on the engines, a send kept for a receiver, ends by the engines'
        timers)."""
        raise NotImplementedError

    def prefilled(self, turn: Turn) -> None:
        """The attempt's prefill request answered (its decode request may be out already).

        When: once per attempt whose plan has a prefill request, on the turn's task, after
        that request ended well; never where it failed.
        Does: notes the prompt as computed (`turnkv`: prompts held back for it go).
        Must not: block or await, or raise."""

    def first_token(self, turn: Turn) -> None:
        """The attempt's first output reached the router, streamed.

        When: at most once per streamed attempt, from the relay; never for a whole reply
        (`finish` comes then), nor for an attempt cut before any output.
        Does: notes the turn as landed on its decode engine (`turnkv`: prompts held back for
        it go).
        Must not: block or await, or raise."""

    def finish(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        """The attempt's decode request ended (`TurnEnd`): `complete` (with the decode engine's
        reply params, in non-streamed responses, and the turn's stats), `cut` (its stream
        broke, the client left, the turn failed elsewhere) or `refused` (it never started).

        When: exactly once per attempt that tried its decode request (`plan` is the one that
        attempt used), unless that request was cancelled before the engine answered (the
        concurrent prefill failed first); never for an attempt whose prefill failed before a
        decode request that follows it. From the turn's task, the streamed response's, or a
        done-callback (`drop_decode`): not awaitable.
        Does: arranges what follows a whole turn (a push back, a prefetch), or gives up what
        the plan arranged (`TurnParams.abandon`), by spawning tasks. It may keep per-session
        state in `Session.mode_state` (`mode_state.ModeState`: a field of its own).
        Must not: block or await, or raise: the turn's response is past it."""

    def drop_session(self, session: Session) -> None:
        """The session ended: released (`final`, DELETE) or expired on every router.

        When: once per session ending, from the task that ended it (a route's, the turn's,
        the expiry sweep's); possibly while a turn of it is in flight (a DELETE during the
        turn), whose `finish` still comes.
        Does: releases what the mode holds for the session, here and on the engines (their
        leases, by spawned one-token requests), and everything `forget_session` lets go of.
        Must not: block or await, or raise."""

    def forget_session(self, session: Session) -> None:
        """The session left this router's table without ending: evicted from the full table,
        expired here while a router sharing the store keeps it, or ended by another router.

        When: at most once per session leaving, from the task that made the table drop it.
        Does: lets go of what the mode keeps in this process for the session (a pending
        prefetch, a home); the engines are told nothing (the session may go on elsewhere, or
        their leases end on their own timers).
        Must not: block or await, or raise."""

    def hinted(self, session: Session, hints: CacheHints) -> None:
        """The client sent `hints` between turns (`POST .../hints`; not `final`, which ends
        the session) and the router renewed the session with them: a mode whose engines hold
        the session's KV under leases passes them on.

        When: once per such call, from its route's task; possibly while a turn is in flight
        (`session.in_flight`).
        Does: spawns renewals; advisory, it never fails the call.
        Must not: block or await, or raise."""
