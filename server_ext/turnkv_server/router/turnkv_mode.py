"""The `turnkv` mode: the turnkv connector on every engine, session KV kept on both sides.

Per turn (see docs/architecture.md for the picture):
1. Prefill and decode are dispatched at the same time under one transfer ID. The decode engine
   registers the blocks it lacks beyond its own prefix hit (the session's lease keeps the last
   turn there), and the prefill engine writes exactly those when its prefill ends.
2. When the decode engine finishes, it keeps the turn's blocks (for the session's lease, and
   until the push back below); the router then sends the prefill engine a one-token warm-up
   request over the session's whole history, during the agent's tool time. The prefill engine
   registers what it lacks (the generated tokens), the decode engine writes it, and the next
   turn's prefill computes only the new message.
3. Both engines hold the session's blocks under a lease: the client's TTL and priority hints
   ride along, the engines cap them; `final` and DELETE release them.

Everything reaches the engines as `kv_transfer_params["turnkv"]` (`connector.params`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from turnkv.protocol import CacheHints, PromptTokens
from turnkv_server.connector.params import KEY, Receive, Send, TurnParams
from turnkv_server.router.modes import Mode, ModeContext, PrefillResult
from turnkv_server.router.placement import Engine, Placement
from turnkv_server.router.sessions import Session
from turnkv_server.router.upstream import EngineConnectionError

if TYPE_CHECKING:
    from turnkv_server.router.turn import Turn

log = logging.getLogger(__name__)

PUSH_BACK = "turnkv_push_back"
MODEL = "turnkv_model"
# The next turn waits this long for the previous push back to land on the prefill engine.
PUSH_BACK_WAIT_S = 5.0
PUSH_BACK_TIMEOUT_S = 120.0
# The decode engine's blocks are ready when the push back starts: a peer that does not answer
# within this is gone, and the prefill engine recomputes instead of waiting.
PUSH_BACK_RECEIVE_S = 10.0


def lease_key(session: Session) -> str:
    """The engines' name for a session: tenant-scoped, and no IDs or tenant names in their logs."""
    raw = f"{session.key.tenant}\0{session.key.session_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


class Turnkv(Mode):
    name = "turnkv"
    affinity = True
    concurrent = True

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._releases: set[asyncio.Task[None]] = set()
        names = [e.name for e in ctx.pool.engines()] if ctx.pool is not None else []
        missing = [name for name in names if name not in ctx.side_channels]
        if missing:
            raise ValueError(f"turnkv mode needs the side channel (HOST:PORT) of every engine; "
                             f"missing: {', '.join(missing)}")

    async def prefill_transfer_params(self, turn: Turn, placement: Placement) -> dict[str, Any]:
        await self._settle_push_back(turn.session)
        params = self._turn_params(turn, send=Send(_transfer_id(turn, "p2d")))
        return {KEY: params.to_wire()}

    def decode_transfer_params(self, turn: Turn, placement: Placement,
                               prefill: PrefillResult | None) -> dict[str, Any] | None:
        receive = Receive(_transfer_id(turn, "p2d"), self.ctx.side_channels[placement.prefill.name])
        keep_going = turn.session is not None and not _hints(turn).final
        send = Send(_transfer_id(turn, "d2p")) if keep_going else None
        return {KEY: self._turn_params(turn, receive=receive, send=send).to_wire()}

    def prompt_tokens(self, turn: Turn, prefill: PrefillResult) -> PromptTokens:
        # The prefill engine's cached_tokens are its own prefix hits: the lease kept the
        # session's last turn there and the push back added its reply.
        return PromptTokens(
            total=prefill.prompt_tokens,
            prefill_cached=prefill.cached_tokens,
            prefill_received=0,
            prefill_reused=prefill.cached_tokens,
            prefill_computed=prefill.prompt_tokens - prefill.cached_tokens,
        )

    def after_turn(self, turn: Turn, placement: Placement,
                   decode_params: dict[str, Any] | None) -> None:
        session = turn.session
        if session is None or _hints(turn).final or turn.prompt_token_ids is None \
                or not turn.output_token_ids:
            return
        history = [*turn.prompt_token_ids, *turn.output_token_ids]
        body: dict[str, Any] = {
            "model": turn.body.get("model"),
            "prompt": history,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {KEY: self._turn_params(turn, receive=Receive(
                _transfer_id(turn, "d2p"), self.ctx.side_channels[placement.decode.name],
                # The decode engine never computed its last token's KV.
                peer_tokens=len(history) - 1, timeout_s=PUSH_BACK_RECEIVE_S)).to_wire()},
        }
        if "cache_salt" in turn.body:
            # Block hashes include the salt: without it the history lands in another cache.
            body["cache_salt"] = turn.body["cache_salt"]
        session.mode_state[PUSH_BACK] = asyncio.create_task(
            self._push_back(placement.prefill, body))

    def drop_session(self, session: Session) -> None:
        task = session.mode_state.pop(PUSH_BACK, None)
        if isinstance(task, asyncio.Task):
            task.cancel()
        model = session.mode_state.get(MODEL)
        pool = self.ctx.pool
        if pool is None or model is None:
            return
        engines = [e for e in pool.engines()
                   if e.name in (session.prefill, session.decode) and e.healthy]
        params = TurnParams(session=lease_key(session), release=True)
        self._releases.add(asyncio.create_task(self._release(engines, model, params)))

    # -- internals ---------------------------------------------------------------------------

    def _turn_params(self, turn: Turn, receive: Receive | None = None,
                     send: Send | None = None) -> TurnParams:
        session = turn.session
        if session is None:
            return TurnParams(receive=receive, send=send)
        session.mode_state[MODEL] = turn.body.get("model")
        hints = _hints(turn)
        return TurnParams(session=lease_key(session), ttl_s=hints.ttl,
                          priority=hints.priority or 0, release=hints.final,
                          receive=receive, send=send)

    async def _push_back(self, prefill: Engine, body: dict[str, Any]) -> None:
        try:
            reply = await self.ctx.upstream.post(f"{prefill.url}/v1/completions", body,
                                                 timeout=PUSH_BACK_TIMEOUT_S)
            if not reply.ok:
                log.warning("push back to %s answered %s", prefill.name, reply.status)
        except EngineConnectionError as exc:
            # The decode engine gives up on its own; the next turn recomputes what is missing.
            log.warning("push back to %s failed: %s", prefill.name, exc)

    async def _settle_push_back(self, session: Session | None) -> None:
        task = session.mode_state.pop(PUSH_BACK, None) if session is not None else None
        if isinstance(task, asyncio.Task) and not task.done():
            # A turn that comes before the push back has landed computes what it lacks.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), PUSH_BACK_WAIT_S)

    async def _release(self, engines: list[Engine], model: str, params: TurnParams) -> None:
        """End the session's leases now rather than at their TTL: a one-token request whose
        params say so (the engines take instructions only through their HTTP API)."""
        body = {"model": model, "prompt": [0], "max_tokens": 1,
                "kv_transfer_params": {KEY: params.to_wire()}}
        try:
            for engine in engines:
                with contextlib.suppress(EngineConnectionError):
                    await self.ctx.upstream.post(f"{engine.url}/v1/completions", body,
                                                 timeout=30.0)
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._releases.discard(task)


def _transfer_id(turn: Turn, direction: str) -> str:
    return f"{turn.request_id}-{direction}"


def _hints(turn: Turn) -> CacheHints:
    return turn.tag.hints if turn.tag is not None else CacheHints()
