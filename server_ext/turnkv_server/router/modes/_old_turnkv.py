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

The decode engine keeps a finished turn's blocks for the push back until the prefill engine
registers for them or its send times out. Whenever the router knows the push back will not
come (the turn's stream was cut, its output was empty, the prefill engine refused or failed the
push back, or it was cancelled), it tells the decode engine to give the send up at once
(`TurnParams.abandon`), so that those blocks do not stay allocated for the whole timeout.

A short delta skips step 1: when a turn adds at most `short_delta_tokens` tokens to the
session's history (counted with the decode engine's /tokenize), the decode engine, which holds
that history, computes them itself and no prefill request is sent. Step 2 brings the prefill
engine up to date as usual, so a later long turn still prefills only its new tokens.

Everything reaches the engines as `kv_transfer_params["turnkv"]` (`connector.params`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from turnkv.protocol import CacheHints, PromptTokens
from turnkv_server.connector.params import KEY, Receive, Send, TurnParams, parse
from turnkv_server.router.history import common_prefix_len
from turnkv_server.router.modes import Mode, ModeContext, PrefillResult, tokenize
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
SHORT_DELTA = "turnkv_short_delta"
# A held history leaves at most the tail of its last block to recompute (127 tokens with the
# CPU backend's 128-token blocks, 15 on GPUs). A decode engine that computed more than this
# beyond the delta had lost the session's KV: its leases are going to memory pressure.
HELD_TAIL_TOKENS = 256
# After such a miss, that decode engine's turns go through the prefill engine for this long
# (which moves them the history back), doubling while misses go on.
PRESSURE_BACKOFF_S = 30.0
PRESSURE_BACKOFF_MAX_S = 600.0


def lease_key(session: Session) -> str:
    """The engines' name for a session: tenant-scoped, and no IDs or tenant names in their logs."""
    raw = f"{session.key.tenant}\0{session.key.session_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def new_tokens(prompt_ids: list[int], history: list[int]) -> int:
    """Tokens of the prompt past its first difference from the session's history (the last
    turn's prompt and output): an edited history counts from the edit."""
    return len(prompt_ids) - common_prefix_len(prompt_ids, history)


def lost_history(computed: int | None, delta: int) -> bool:
    """Whether a decode engine that computed `computed` prompt tokens for a short delta of
    `delta` tokens had lost the session's KV (None: its usage did not say)."""
    return computed is not None and computed > delta + HELD_TAIL_TOKENS


class Turnkv(Mode):
    name = "turnkv"
    affinity = True
    concurrent = True

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        # Push backs and releases run on after their turn; a task nobody references may be
        # collected before it ends.
        self._background: set[asyncio.Task[None]] = set()
        # Decode engine name -> (until when its turns skip short deltas, the current backoff).
        self._pressure: dict[str, tuple[float, float]] = {}
        names = [e.name for e in ctx.pool.engines()] if ctx.pool is not None else []
        missing = [name for name in names if name not in ctx.side_channels]
        if missing:
            raise ValueError(f"turnkv mode needs the side channel (HOST:PORT) of every engine; "
                             f"missing: {', '.join(missing)}")

    async def decode_alone(self, turn: Turn, placement: Placement) -> list[int] | None:
        session = turn.session
        decode = placement.decode.name
        if (self.ctx.short_delta_tokens <= 0 or session is None or not session.tokens
                or session.decode != decode or self._under_pressure(decode)):
            return None
        prompt_ids = await tokenize(self.ctx.upstream, placement.decode, turn)
        delta = new_tokens(prompt_ids, session.tokens)
        if delta > self.ctx.short_delta_tokens:
            return None
        session.mode_state[SHORT_DELTA] = delta
        return prompt_ids

    async def prefill_transfer_params(self, turn: Turn, placement: Placement) -> dict[str, Any]:
        await self._settle_push_back(turn.session)
        # Streamed: the decode engine registers within milliseconds, so the prefill's KV can be
        # written layer by layer while it computes.
        params = self._turn_params(turn, send=Send(_transfer_id(turn, "p2d"), stream=True))
        return {KEY: params.to_wire()}

    def decode_transfer_params(self, turn: Turn, placement: Placement,
                               prefill: PrefillResult | None) -> dict[str, Any] | None:
        receive = None if turn.decode_alone else Receive(
            _transfer_id(turn, "p2d"), self.ctx.side_channels[placement.prefill.name])
        keep_going = turn.session is not None and not _hints(turn).final
        send = Send(_transfer_id(turn, "d2p")) if keep_going else None
        return {KEY: self._turn_params(turn, receive=receive, send=send).to_wire()}

    def prompt_tokens(self, turn: Turn, prefill: PrefillResult) -> PromptTokens:
        if turn.decode_alone:
            # No prefill engine took part; the decode engine's split arrives with its usage
            # (`finish_stats`).
            return PromptTokens(total=prefill.prompt_tokens)
        # The prefill engine's cached_tokens are its own prefix hits: the lease kept the
        # session's last turn there and the push back added its reply.
        return super().prompt_tokens(turn, prefill)

    def after_turn(self, turn: Turn, placement: Placement,
                   decode_params: dict[str, Any] | None) -> None:
        _read_decode_figures(turn, decode_params)
        if turn.decode_alone:
            self._judge_short_delta(turn, placement.decode.name)
        session = turn.session
        if session is None or _hints(turn).final:
            return  # the decode request had nothing to send
        if turn.prompt_token_ids is None or not turn.output_token_ids:
            # No history to push back: the decode engine's send would wait for nothing.
            self._abandon(placement.decode, turn.body.get("model"), _transfer_id(turn, "d2p"))
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
        session.mode_state[PUSH_BACK] = self._spawn(self._push_back(
            placement.prefill, placement.decode, body, _transfer_id(turn, "d2p")))

    def decode_cut(self, turn: Turn, placement: Placement,
                   decode_params: dict[str, Any] | None) -> None:
        # The push back comes only after a whole reply. (A request the engine aborted sends
        # nothing anyway; one that finished just before the cut would wait for the timeout.)
        sent = parse(decode_params)
        if sent is None:
            return
        model = turn.body.get("model")
        if sent.send is not None:
            self._abandon(placement.decode, model, sent.send.transfer_id)
        if sent.receive is not None and not turn.output_token_ids:
            # Cut before any token: the decode engine may never have registered for the
            # prefill engine's send (a request dropped before it reached the engine).
            self._abandon(placement.prefill, model, sent.receive.transfer_id)

    def decode_refused(self, turn: Turn, placement: Placement,
                       decode_params: dict[str, Any] | None) -> None:
        # The decode engine will never register for the prefill engine's send (it refused a
        # body the prefill engine accepted, say a `max_tokens` over the model's length): give
        # the send up there, rather than keep the prompt's blocks for the send timeout.
        sent = parse(decode_params)
        if sent is not None and sent.receive is not None:
            self._abandon(placement.prefill, turn.body.get("model"), sent.receive.transfer_id)

    def drop_session(self, session: Session) -> None:
        task = session.mode_state.pop(PUSH_BACK, None)
        if isinstance(task, asyncio.Task) and not task.done():
            # Its own ending gives the decode engine's send up (`_push_back`).
            task.cancel()
        model = session.mode_state.get(MODEL)
        pool = self.ctx.pool
        if pool is None or model is None:
            return
        release = TurnParams(session=lease_key(session), release=True)
        orders = [(engine, release) for engine in pool.engines()
                  if engine.name in (session.prefill, session.decode) and engine.healthy]
        self._spawn(self._tell(model, orders))

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

    def _under_pressure(self, decode: str) -> bool:
        until, _ = self._pressure.get(decode, (0.0, 0.0))
        return self.ctx.clock() < until

    def _judge_short_delta(self, turn: Turn, decode: str) -> None:
        """A short delta that found its history gone backs that decode engine off short
        deltas; one that found it held ends the backoff."""
        delta = turn.session.mode_state.pop(SHORT_DELTA, None) if turn.session else None
        computed = turn.stats.prompt_tokens.decode_computed if turn.stats else None
        if not isinstance(delta, int) or computed is None:
            return
        if not lost_history(computed, delta):
            self._pressure.pop(decode, None)
            return
        _, backoff = self._pressure.get(decode, (0.0, PRESSURE_BACKOFF_S / 2))
        backoff = min(backoff * 2, PRESSURE_BACKOFF_MAX_S)
        self._pressure[decode] = (self.ctx.clock() + backoff, backoff)
        log.info("%s recomputed %d tokens for a delta of %d: its turns skip short deltas "
                 "for %.0f s", decode, computed, delta, backoff)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _push_back(self, prefill: Engine, decode: Engine, body: dict[str, Any],
                         transfer_id: str) -> None:
        """Send the history to the prefill engine, which registers for the decode engine's
        blocks; if it does not (refused, e.g. a history at the model's max length, failed,
        unreachable, or cancelled), the decode engine's send is given up. The next turn
        recomputes what is missing."""
        landed = False
        try:
            reply = await self.ctx.upstream.post(prefill, "/v1/completions", body,
                                                 timeout=PUSH_BACK_TIMEOUT_S)
            landed = reply.ok
            if not reply.ok:
                log.warning("push back to %s answered %s: %s", prefill.name, reply.status,
                            reply.content[:200])
        except EngineConnectionError as exc:
            log.warning("push back to %s failed: %s", prefill.name, exc)
        finally:
            if not landed:
                self._abandon(decode, body.get("model"), transfer_id)

    async def _settle_push_back(self, session: Session | None) -> None:
        task = session.mode_state.pop(PUSH_BACK, None) if session is not None else None
        if isinstance(task, asyncio.Task) and not task.done():
            # A turn that comes before the push back has landed computes what it lacks.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), PUSH_BACK_WAIT_S)

    def _abandon(self, engine: Engine, model: str | None, transfer_id: str) -> None:
        """Tell `engine` to give up its send under `transfer_id` now: nobody will register for
        it, and until it times out its blocks stay allocated."""
        if engine.healthy:  # (a lost engine's request was aborted: it sends nothing)
            self._spawn(self._tell(model, [(engine, TurnParams(abandon=(transfer_id,)))]))

    async def _tell(self, model: str | None, orders: list[tuple[Engine, TurnParams]]) -> None:
        """Instructions that are not part of a turn (end the session's leases now rather than
        at their TTL, give a send up): a one-token request whose params say so (the engines
        take instructions only through their HTTP API)."""
        for engine, params in orders:
            body: dict[str, Any] = {"prompt": [0], "max_tokens": 1,
                                    "kv_transfer_params": {KEY: params.to_wire()}}
            if model is not None:
                body["model"] = model
            with contextlib.suppress(EngineConnectionError):
                await self.ctx.upstream.post(engine, "/v1/completions", body, timeout=30.0)


def _read_decode_figures(turn: Turn, decode_params: dict[str, Any] | None) -> None:
    """The decode engine's split of the prompt, from its connector's reply.

    vLLM returns `kv_transfer_params` only in non-streamed responses; a streamed turn keeps
    None there (the engines' `turnkv:*` counters have the totals).
    """
    figures = (decode_params or {}).get(KEY)
    stats = turn.stats
    if not isinstance(figures, dict) or stats is None or turn.decode_alone:
        return
    local, received = int(figures.get("local_tokens", 0)), int(figures.get("received_tokens", 0))
    tokens = stats.prompt_tokens
    tokens.decode_cached, tokens.decode_received = local, received
    tokens.decode_computed = max(0, tokens.total - local - received)
    stats.kv.to_decode_tokens = received
    if figures.get("receive_failed") and stats.fallback is None:
        stats.fallback = "transfer_failed"
        stats.fallback_detail = "the prefill engine's KV did not arrive; the decode engine " \
                                "recomputed it"


def _transfer_id(turn: Turn, direction: str) -> str:
    return f"{turn.request_id}-{direction}"


def _hints(turn: Turn) -> CacheHints:
    return turn.tag.hints if turn.tag is not None else CacheHints()
