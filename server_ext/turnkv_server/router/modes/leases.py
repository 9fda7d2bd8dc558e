"""A session's lease on its engines, as their turnkv connector is told it: per request, the
engines' name for the session, which life of it (its epoch: engines ignore requests of a
released life) and the turn's hints (TTL, priority, expected return, `final`); and before a
hinted return, the prefetch that makes the leased history resident again. Shared by the modes
whose engines run the connector: `turnkv` (P/D pairs) and `affinity` with `--engine-leases`
(aggregated engines). The `turnkv` mode's forms keep them through `LeasedMode`, which is all a
turn served whole by one engine needs of the mode's machinery, and back off engines whose
leases lost a held history (`Backoff`, which the P/D form also uses for failed push backs).

The prefetch: a session that said it comes back in T seconds has its history
made resident on its engines shortly before T, so that its turn finds the KV in their caches
instead of loading it from a lower tier (or computing it) on arrival.

The router reaches engines only through their HTTP API, so a prefetch is a request: a one-token
completion over the session's history (the last turn's prompt and output, as token IDs, with
the turn's cache salt: block hashes include it) carrying the session's lease, sent to each
engine that holds the session (the pair in `turnkv` mode, the engine in `affinity` mode with
`--engine-leases`) `LEAD_S` before the expected return. vLLM's prefix cache serves what is
resident, its offloading connector loads what a lower tier holds, and it computes the rest; the
connector then holds the history under the session's lease, expected back `LEAD_S` later.

A turn is never raced with its prefetch: a turn that arrives while the prefetch runs waits for
it (at most `WAIT_S`); one that arrives before it started cancels it. The turn's stats say
which (`TurnStats.prefetch`): "in_time" (done before the turn arrived), "awaited", "early".
Pauses shorter than `MIN_PAUSE_S` are left to the leases alone: the history is resident anyway
unless pressure evicted it within seconds, and a prefetch would compete with the turn itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnkv.protocol import CacheHints, PrefetchOutcome
from turnkv_server.engine.protocol import KEY, Receive, Send, TurnParams
from turnkv_server.engine.requests import one_token_request
from turnkv_server.router.engines import Engine, EngineConnectionError, EngineRejected, Upstream
from turnkv_server.router.modes.base import Mode, ModeContext, Turn, TurnPlan, tokenize
from turnkv_server.router.modes.engine_orders import CONTROL_TIMEOUT_S, EngineOrders
from turnkv_server.router.sessions import LeasePolicy, Session, SessionKey

log = logging.getLogger(__name__)


def lease_key(session: Session) -> str:
    """The engines' name for a session: tenant-scoped, and no IDs or tenant names in their logs."""
    raw = f"{session.key.tenant}\0{session.key.session_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def engine_ttl(policy: LeasePolicy, hints: CacheHints) -> float | None:
    """The TTL the engines' leases get: the session's own (`LeasePolicy.ttl`) whenever a hint
    shapes it, so that an engine keeps the KV as long as the router keeps the session (each
    engine still caps it); None, each engine's own default, when no hint does."""
    if hints.ttl is None and hints.next_turn_in is None:
        return None
    return policy.ttl(hints)


def send_or_none(transfer_id: str | None) -> Send | None:
    return Send(transfer_id) if transfer_id is not None else None


def turn_hints(turn: Turn) -> CacheHints:
    return turn.tag.hints if turn.tag is not None else CacheHints()


def lease_params(turn: Turn, policy: LeasePolicy, send: Send | None = None,
                 receive: Receive | None = None) -> dict[str, Any]:
    """A request's `kv_transfer_params` for a turn: its transfers, and for a session the lease
    its blocks leave behind. The hint rides on every request of the turn that leaves a lease
    (prefill, decode, push back): each engine orders its evictions by it."""
    session = turn.session
    if session is None:
        params = TurnParams(receive=receive, send=send)
    else:
        hints = turn_hints(turn)
        params = TurnParams(session=lease_key(session), ttl_s=engine_ttl(policy, hints),
                            priority=hints.priority or 0, release=hints.final,
                            receive=receive, send=send,
                            next_turn_in_s=None if hints.final else hints.next_turn_in,
                            epoch=session.epoch)
    return {KEY: params.to_wire()}


# -- the prefetch before a hinted return -----------------------------------------------------

# The prefetch is sent this long before the hinted return.
LEAD_S = 1.0
# Hinted pauses shorter than this get no prefetch.
MIN_PAUSE_S = 2.0
# A turn waits at most this long for a prefetch in flight, then goes on (and races it).
WAIT_S = 30.0


def prefetch_lease(session: Session, hints: CacheHints, policy: LeasePolicy) -> dict[str, Any]:
    """A prefetch's `kv_transfer_params`: the session's lease, with the session expected back
    `LEAD_S` after the prefetch (when it is sent)."""
    params = TurnParams(session=lease_key(session), ttl_s=engine_ttl(policy, hints),
                        priority=session.priority, next_turn_in_s=LEAD_S, epoch=session.epoch)
    return {KEY: params.to_wire()}


@dataclass
class _Prefetch:
    engines: list[Engine]
    turn: Turn  # the last turn: its prompt (or body, to tokenize), output, model and salt
    lease: dict[str, Any]
    task: asyncio.Task[None] | None = None
    started: bool = False


class Prefetches:
    """The router's pending prefetches, one per session at most, owned by a mode."""

    def __init__(self, upstream: Upstream, orders: EngineOrders) -> None:
        self._upstream = upstream
        self._orders = orders
        self._pending: dict[SessionKey, _Prefetch] = {}

    def schedule(self, key: SessionKey, engines: list[Engine], turn: Turn,
                 lease: dict[str, Any], pause_s: float | None,
                 pays: Callable[[Engine], bool] | None = None) -> None:
        """After `turn`: prefetch its history on `engines` (those where it `pays`, asked only
        when a prefetch is due) `LEAD_S` before `pause_s` (its `next_turn_in`) is over, under
        `lease`; nothing without a long enough pause."""
        self.cancel(key)
        if pause_s is None or pause_s < MIN_PAUSE_S or not turn.output_token_ids:
            return
        engines = [e for e in engines if pays is None or pays(e)]
        if engines:
            self._start(key, _Prefetch(engines, turn, lease), pause_s)

    def rescheduled(self, key: SessionKey, pause_s: float | None,
                    lease: dict[str, Any]) -> None:
        """A hint between turns moved the expected return: prefetch for the new time."""
        pending = self._pending.get(key)
        if pending is None or pending.started or pause_s is None or pause_s < MIN_PAUSE_S:
            return
        self.cancel(key)
        self._start(key, _Prefetch(pending.engines, pending.turn, lease), pause_s)

    async def before_turn(self, key: SessionKey) -> PrefetchOutcome | None:
        """The session's turn arrived: wait for its prefetch in flight, or cancel one that has
        not started; what happened, for the turn's stats."""
        pending = self._pending.pop(key, None)
        if pending is None or pending.task is None:
            return None
        if not pending.started:
            pending.task.cancel()
            return "early"
        if pending.task.done():
            return "in_time"
        await asyncio.wait([pending.task], timeout=WAIT_S)
        return "awaited"

    def cancel(self, key: SessionKey) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None and pending.task is not None and not pending.started:
            pending.task.cancel()

    def _start(self, key: SessionKey, pending: _Prefetch, pause_s: float) -> None:
        self._pending[key] = pending
        pending.task = self._orders.spawn(self._run(pending, pause_s - LEAD_S))

    async def _run(self, pending: _Prefetch, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        pending.started = True
        engines = [engine for engine in pending.engines if engine.healthy]
        turn = pending.turn
        prompt = turn.prompt_token_ids
        if prompt is None and engines:
            # The affinity router does not tokenize its turns: the engine says what it read.
            with contextlib.suppress(EngineConnectionError, EngineRejected):
                prompt = await tokenize(self._upstream, engines[0], turn)
        if prompt is None:
            return
        request = one_token_request(turn.body.get("model"), [*prompt, *turn.output_token_ids],
                                    pending.lease, cache_salt=turn.body.get("cache_salt"))
        # Done, it stays pending for the turn to find ("in_time"); the session's end drops it.
        await asyncio.gather(*(self._warm(engine, request) for engine in engines))

    async def _warm(self, engine: Engine, request: dict[str, Any]) -> None:
        # Advisory like every instruction outside a turn: a failure costs the turn a restore.
        status = None
        with contextlib.suppress(EngineConnectionError):
            status = (await self._upstream.post(engine, "/v1/completions", request,
                                                timeout=CONTROL_TIMEOUT_S)).status
        if status is None or status >= 400:
            log.info("prefetch on %s failed (%s); the turn restores what it needs itself",
                     engine.name, status or "unreachable")


# -- the modes that keep leases, and their backoffs --------------------------------------------

class LeasedMode(Mode):
    """A mode whose engines hold the sessions' leases (the `turnkv` mode, each of its forms):
    every request of a turn carries the lease (`_params`), a turn waits for its session's
    prefetch in flight (`begin`), and a hinted pause after it gets one (`_schedule_prefetch`).
    A turn its home serves alone, with nothing sent, needs nothing else of the mode's
    machinery."""

    def __init__(self, ctx: ModeContext, orders: EngineOrders) -> None:
        super().__init__(ctx)
        # Push backs, releases, give-ups, renewals and prefetches run on after their turn.
        self._orders = orders
        self._prefetches = Prefetches(ctx.upstream, orders)

    async def begin(self, turn: Turn) -> None:
        if turn.session is not None:
            turn.prefetch = await self._prefetches.before_turn(turn.session.key)

    def _params(self, turn: Turn, send: Send | None = None,
                receive: Receive | None = None) -> dict[str, Any]:
        return lease_params(turn, self.ctx.session_policy, send, receive)

    def _schedule_prefetch(self, turn: Turn, plan: TurnPlan) -> None:
        """After a whole reply, a hinted pause ahead: the turn's engines make the history
        resident shortly before the session is back (a prefill engine's copy arrives with
        the push back)."""
        hints = turn_hints(turn)
        if turn.session is None or hints.final:
            return
        prefill, decode = plan.placement.prefill, plan.placement.decode
        self._prefetches.schedule(
            turn.session.key, [decode] if prefill is decode else [prefill, decode], turn,
            prefetch_lease(turn.session, hints, self.ctx.session_policy), hints.next_turn_in,
            pays=self._prefetch_pays)

    def _prefetch_pays(self, engine: Engine) -> bool:
        """Whether a prefetch on `engine` can pay: the P/D form does not count what its
        engines hold, so always; the planner says where it does (`Turnkv`)."""
        return True


class Backoff:
    """Per-engine backoffs: after a miss (a decode engine whose leases lost a held history, a
    push back whose receive failed), an engine is avoided for a while, twice as long after
    each further miss (up to a cap), and no longer once a try succeeds."""

    def __init__(self, first_s: float, max_s: float, clock: Callable[[], float]) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._clock = clock
        # Engine name -> (until when it is avoided, the current backoff).
        self._until: dict[str, tuple[float, float]] = {}

    def active(self, engine: str) -> bool:
        until, _ = self._until.get(engine, (0.0, 0.0))
        return self._clock() < until

    def record(self, engine: str, missed: bool) -> float | None:
        """A try on `engine` missed (start or double its backoff: returns its length in
        seconds) or succeeded (end it: None)."""
        if not missed:
            self._until.pop(engine, None)
            return None
        _, backoff = self._until.get(engine, (0.0, self.first_s / 2))
        backoff = min(backoff * 2, self.max_s)
        self._until[engine] = (self._clock() + backoff, backoff)
        return backoff
