"""The prefetch before a hinted return: a session that said it comes back in T seconds has its
history made resident on its engines shortly before T, so that its turn finds the KV in their
caches instead of loading it from a lower tier (or computing it) on arrival. Owned by the modes
whose engines run the turnkv connector: `turnkv` (`modes.turnkv`) and `affinity` with
`--engine-leases`.

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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnkv.protocol import PrefetchOutcome
from turnkv_server.engine.requests import one_token_request
from turnkv_server.router.engines import Engine, EngineConnectionError, EngineRejected, Upstream
from turnkv_server.router.modes.base import Turn, tokenize
from turnkv_server.router.modes.engine_orders import CONTROL_TIMEOUT_S, EngineOrders
from turnkv_server.router.sessions import SessionKey

log = logging.getLogger(__name__)

# The prefetch is sent this long before the hinted return.
LEAD_S = 1.0
# Hinted pauses shorter than this get no prefetch.
MIN_PAUSE_S = 2.0
# A turn waits at most this long for a prefetch in flight, then goes on (and races it).
WAIT_S = 30.0


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
        # Session -> its prefetch, scheduled or done: its next turn waits for it or cancels it.
        self.pending: dict[SessionKey, _Prefetch] = {}

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
        pending = self.pending.get(key)
        if pending is None or pending.started or pause_s is None or pause_s < MIN_PAUSE_S:
            return
        self.cancel(key)
        self._start(key, _Prefetch(pending.engines, pending.turn, lease), pause_s)

    async def before_turn(self, key: SessionKey) -> PrefetchOutcome | None:
        """The session's turn arrived: wait for its prefetch in flight, or cancel one that has
        not started; what happened, for the turn's stats."""
        pending = self.pending.pop(key, None)
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
        pending = self.pending.pop(key, None)
        if pending is not None and pending.task is not None and not pending.started:
            pending.task.cancel()

    def _start(self, key: SessionKey, pending: _Prefetch, pause_s: float) -> None:
        self.pending[key] = pending
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
