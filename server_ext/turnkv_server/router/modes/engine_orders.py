"""Instructions to turnkv engines that are not part of a turn: give a send up, end a session's
leases, renew them for a hint. Each is a one-token request through the engine's HTTP API (the
router reaches engines no other way), sent in the background and never failing the caller:
the engine's own timers end whatever an instruction that did not arrive would have ended."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from turnkv_server.engine.protocol import KEY, TurnParams
from turnkv_server.engine.requests import one_token_request
from turnkv_server.router.engines import Engine, EngineConnectionError
from turnkv_server.router.modes.base import ModeContext

log = logging.getLogger(__name__)

# An instruction waits this long for its one-token request.
CONTROL_TIMEOUT_S = 30.0


class EngineOrders:
    def __init__(self, ctx: ModeContext, wait_before_renewal_s: float) -> None:
        self._ctx = ctx  # its upstream and renewal counter, read when used
        self._wait_s = wait_before_renewal_s
        # A task nobody references may be collected before it ends.
        self._background: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def abandon(self, engine: Engine, model: str | None, transfer_id: str | None) -> None:
        """Tell `engine` to give up its send under `transfer_id` now: nobody will register for
        it, and until it times out its blocks stay allocated."""
        if transfer_id is not None and engine.healthy:
            # (A lost engine's request was aborted: it sends nothing.)
            self.spawn(self.tell(model, [(engine, TurnParams(abandon=(transfer_id,)))]))

    async def tell(self, model: str | None, orders: list[tuple[Engine, TurnParams]]) -> None:
        """Send each engine its instruction (end the session's leases now rather than at their
        TTL, give a send up)."""
        for engine, params in orders:
            request = one_token_request(model, [0], {KEY: params.to_wire()})
            with contextlib.suppress(EngineConnectionError):
                await self._ctx.upstream.post(engine, "/v1/completions", request,
                                          timeout=CONTROL_TIMEOUT_S)

    async def renew(self, engine: Engine, model: str, params: TurnParams,
                    after: asyncio.Task[None] | None) -> None:
        """Send `engine` the renew-only request, once `after` (a push back) has ended; a
        failure is logged and counted, never raised: a hint is advisory."""
        if after is not None:
            await asyncio.wait([after], timeout=self._wait_s)
            if after.cancelled():
                return  # the session ended: its leases are being released
        request = one_token_request(model, [0], {KEY: params.to_wire()})
        outcome = "sent"
        try:
            reply = await self._ctx.upstream.post(engine, "/v1/completions", request,
                                              timeout=CONTROL_TIMEOUT_S)
            if not reply.ok:
                outcome = "refused"
                log.warning("renewing a session's lease on %s for a hint: answered %s: %s",
                            engine.name, reply.status, reply.content[:200])
        except EngineConnectionError as exc:
            outcome = "failed"
            log.warning("renewing a session's lease on %s for a hint failed: %s",
                        engine.name, exc)
        self._ctx.count_renewal(outcome)
