"""The `bidirectional` mode: vLLM's `bidirectional_kv_xfer`.

The decode engine keeps a finished turn's blocks for `decoder_kv_blocks_ttl` seconds and returns
their IDs; the next turn's prefill READs them back. The router keeps those params per session,
trims them to what the new prompt really shares (upstream pairs blocks from the end without
checking tokens, vLLM #43094), and uses each set once, before it expires by the router's own
clock.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

from turnkv_server.engine.requests import PREFILL_FOR_REMOTE_DECODE, one_token_request
from turnkv_server.router.engine_queries import block_size
from turnkv_server.router.engines import Engine, EngineConnectionError, Placement
from turnkv_server.router.mode_state import HeldKv
from turnkv_server.router.modes.base import (
    Mode,
    ModeContext,
    Turn,
    TurnEnd,
    TurnPlan,
    tokenize,
    tokenize_body,
)
from turnkv_server.router.sessions import Session
from turnkv_server.router.token_history import common_prefix_len

# Held params are not offered this close to their expiry: a read of expired blocks fails the
# prefill request with a 500 (measured), and the clocks of router and engine differ.
EXPIRY_MARGIN_S = 10.0


def trim_offer(
    params: dict[str, Any], held_ids: list[int], prompt_ids: list[int], block_size: int
) -> tuple[dict[str, Any], int]:
    """A decode engine's offer cut down to the prefix the new prompt really shares.

    Returns the params to send and the number of tokens they offer. The offer is sent even
    when nothing is usable: reading it (or not) is what lets the decode engine free the blocks.
    """
    offered = int(params.get("remote_num_tokens") or 0)
    shared = common_prefix_len(prompt_ids, held_ids[:offered])
    # One prompt token is always computed; the rest may be read where the history matches.
    usable = max(0, min(shared, offered, len(prompt_ids) - 1))
    blocks = math.ceil(usable / block_size)
    trimmed = dict(params)
    trimmed["remote_num_tokens"] = usable
    # Upstream pairs the remote blocks with the prompt from the end: trim the lists, not only
    # the count, or it reads blocks of other positions.
    trimmed["remote_block_ids"] = [list(group)[:blocks] for group in params["remote_block_ids"]]
    return trimmed, usable


class Bidirectional(Mode):
    affinity = True

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._block_sizes: dict[str, int] = {}

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        # cached_tokens on the prefill engine is its own cache hits plus what it read back;
        # vLLM does not report the split per request.
        plain = TurnPlan(placement, prefill_params=dict(PREFILL_FOR_REMOTE_DECODE),
                         cached_is_local=False)
        session = turn.session
        # Each offer is used once (after a read the decode engine frees those blocks): a
        # replay after a failed read-back finds none and recomputes.
        held = await self._take_held(session)
        if held is None or session is None:
            return plain
        if held.expires_at <= self.ctx.clock():
            return replace(plain, reuse_note=("lease_expired", "the decode engine's hold expired"))
        if held.decode != placement.decode.name:
            # The session moved (its decode engine is down or overloaded): recompute rather
            # than read from an engine the router is steering away from.
            return replace(plain, reuse_note=("session_moved",
                                              f"KV held on {held.decode}, not read back"))
        prompt_ids = await tokenize(self.ctx.upstream, placement.prefill, turn)
        if prompt_ids is None:
            return plain  # (`finish` offers nothing for such a turn's API)
        params, _ = trim_offer(held.params, held.token_ids, prompt_ids,
                               await self._block_size(placement.prefill))
        return replace(plain, prefill_params=params, reuse=True)

    def finish(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        session = turn.session
        if end.how != "complete" or session is None or turn.prompt_token_ids is None \
                or tokenize_body(turn) is None:
            # (An offer is trimmed to the next prompt, which such an API cannot render alone.)
            return
        token_ids = [*turn.prompt_token_ids, *turn.output_token_ids]
        decode = plan.placement.decode
        expires_at = self.ctx.clock() + self.ctx.decoder_kv_ttl - EXPIRY_MARGIN_S
        if end.reply and end.reply.get("remote_block_ids"):
            session.mode_state.held_kv = HeldKv(end.reply, token_ids, decode.name, expires_at)
            return
        # A streamed response carries no params: ask the decode engine for them with a
        # one-token request over the same tokens, which hits the blocks the turn left there.
        session.mode_state.held_kv = asyncio.create_task(
            self._capture(decode, turn, token_ids, expires_at))

    def drop_session(self, session: Session) -> None:
        held, session.mode_state.held_kv = session.mode_state.held_kv, None
        if isinstance(held, asyncio.Task):
            held.cancel()

    async def _capture(self, decode: Engine, turn: Turn, token_ids: list[int],
                       expires_at: float) -> HeldKv | None:
        request = one_token_request(
            turn.body.get("model"), token_ids,
            {"do_remote_decode": False, "do_remote_prefill": False},
            cache_salt=turn.body.get("cache_salt"))
        try:
            response = await self.ctx.upstream.post(decode, "/v1/completions", request,
                                                    timeout=60.0)
            params = response.json().get("kv_transfer_params") if response.ok else None
        except (EngineConnectionError, ValueError):
            return None
        if not params or not params.get("remote_block_ids"):
            return None
        return HeldKv(params, token_ids, decode.name, expires_at)

    async def _take_held(self, session: Session | None) -> HeldKv | None:
        if session is None:
            return None
        held, session.mode_state.held_kv = session.mode_state.held_kv, None
        if not isinstance(held, asyncio.Task):
            return held
        try:
            return await asyncio.wait_for(held, timeout=10.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            held.cancel()
            return None

    async def _block_size(self, engine: Engine) -> int:
        if engine.name not in self._block_sizes:
            self._block_sizes[engine.name] = await block_size(self.ctx.upstream, engine)
        return self._block_sizes[engine.name]
