"""Serving modes: what each engine is told for a turn, and what that says about the prompt.

A mode is the policy between the router's turn pipeline and vLLM's `kv_transfer_params`:

- `standard`: vLLM's pull-based P/D (NixlConnector), round robin, no session reuse: what
  deployments run today. `standard-nocache` is the same with the prefill engines' prefix cache
  off (a launcher setting): the baseline of vLLM's multi-turn blog.
- `bidirectional`: vLLM's `bidirectional_kv_xfer`. The decode engine keeps a finished turn's
  blocks for `decoder_kv_blocks_ttl` seconds and returns their IDs; the next turn's prefill READs
  them back. The router keeps those params per session, trims them to what the new prompt
  really shares (upstream pairs blocks from the end without checking tokens, vLLM #43094), and
  uses each set once, before it expires by the router's own clock.
- `push`: vLLM's `NixlPushConnector`. Prefill and decode are dispatched at the same time; the
  decode engine registers its blocks and the prefill engine WRITEs into them.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turnkv.protocol import PromptTokens
from turnkv_server.router.history import common_prefix_len
from turnkv_server.router.placement import Engine, EnginePool, Placement
from turnkv_server.router.sessions import Session
from turnkv_server.router.upstream import EngineConnectionError, EngineRejected, Upstream

if TYPE_CHECKING:
    from turnkv_server.router.turn import Turn

# The prefill engine computes the prompt and keeps its blocks for a remote decode.
PREFILL_FOR_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Held params are not offered this close to their expiry: a read of expired blocks fails the
# prefill request with a 500 (measured), and the clocks of router and engine differ.
EXPIRY_MARGIN_S = 10.0


@dataclass
class PrefillResult:
    transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int
    elapsed_ms: float

    @classmethod
    def skipped(cls, prompt_token_ids: list[int]) -> PrefillResult:
        """No prefill engine served the turn: the decode engine computes its prompt alone."""
        return cls(None, prompt_token_ids, len(prompt_token_ids), 0, 0.0)


@dataclass(frozen=True)
class NixlPeer:
    """Where a prefill engine's NIXL side channel listens (push mode needs it up front)."""

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


class Mode:
    """The `standard` mode; other modes override what differs."""

    name = "standard"
    # Whether a session's turns stick to the pair that served it.
    affinity = False
    # Whether the decode request goes out together with the prefill request.
    concurrent = False

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx

    async def decode_alone(self, turn: Turn, placement: Placement) -> list[int] | None:
        """The prompt's token IDs when the decode engine should serve the turn by itself,
        with no prefill request; None for the usual prefill, then decode."""
        return None

    async def prefill_transfer_params(self, turn: Turn, placement: Placement) -> dict[str, Any]:
        return dict(PREFILL_FOR_REMOTE_DECODE)

    def decode_transfer_params(
        self, turn: Turn, placement: Placement, prefill: PrefillResult | None
    ) -> dict[str, Any] | None:
        assert prefill is not None
        return prefill.transfer_params

    def prompt_tokens(self, turn: Turn, prefill: PrefillResult) -> PromptTokens:
        # On the prefill engine vLLM's cached_tokens is its own prefix-cache hit count. The
        # decode engine's split is not reported per request by the upstream connectors.
        return PromptTokens(
            total=prefill.prompt_tokens,
            prefill_cached=prefill.cached_tokens,
            prefill_received=0,
            prefill_reused=prefill.cached_tokens,
            prefill_computed=prefill.prompt_tokens - prefill.cached_tokens,
        )

    def after_turn(self, turn: Turn, placement: Placement,
                   decode_params: dict[str, Any] | None) -> None:
        """Called when the decode engine has finished the turn."""

    def decode_cut(self, turn: Turn, placement: Placement,
                   decode_params: dict[str, Any] | None) -> None:
        """The decode request that carried `decode_params` ended without `after_turn` (its
        stream broke or was closed early, or the turn failed elsewhere): give up whatever
        the mode arranged for after the turn."""

    def decode_refused(self, turn: Turn, placement: Placement,
                       decode_params: dict[str, Any] | None) -> None:
        """The decode request that would have carried `decode_params` never started (the
        engine refused it, failed it or could not be reached): give up what the prefill
        engine keeps for it."""

    def drop_session(self, session: Session) -> None:
        """The session ended; release whatever the mode holds for it."""


class StandardNoCache(Mode):
    name = "standard-nocache"


@dataclass
class HeldKv:
    """A decode engine's offer to have the session's blocks read back, from its last turn."""

    params: dict[str, Any]
    token_ids: list[int]
    decode: str
    expires_at: float


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
    name = "bidirectional"
    affinity = True
    KEY = "bidirectional_held"

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._block_sizes: dict[str, int] = {}

    async def prefill_transfer_params(self, turn: Turn, placement: Placement) -> dict[str, Any]:
        session = turn.session
        held = await self._take_held(session)
        if held is None or session is None:
            return dict(PREFILL_FOR_REMOTE_DECODE)
        if held.expires_at <= self.ctx.clock():
            turn.reuse_note = ("lease_expired", "the decode engine's hold expired")
            return dict(PREFILL_FOR_REMOTE_DECODE)
        if held.decode != placement.decode.name:
            # The session moved (its decode engine is down or overloaded): recompute rather
            # than read from an engine the router is steering away from.
            turn.reuse_note = ("session_moved", f"KV held on {held.decode}, not read back")
            return dict(PREFILL_FOR_REMOTE_DECODE)
        prompt_ids = await tokenize(self.ctx.upstream, placement.prefill, turn)
        params, _ = trim_offer(held.params, held.token_ids, prompt_ids,
                               await self._block_size(placement.prefill))
        turn.reuse_params = True
        return params

    def prompt_tokens(self, turn: Turn, prefill: PrefillResult) -> PromptTokens:
        # cached_tokens on the prefill engine is its own cache hits plus what it read back;
        # vLLM does not report the split per request.
        return PromptTokens(
            total=prefill.prompt_tokens,
            prefill_reused=prefill.cached_tokens,
            prefill_computed=prefill.prompt_tokens - prefill.cached_tokens,
        )

    def after_turn(self, turn: Turn, placement: Placement,
                   decode_params: dict[str, Any] | None) -> None:
        session = turn.session
        if session is None or turn.prompt_token_ids is None:
            return
        token_ids = [*turn.prompt_token_ids, *turn.output_token_ids]
        now = self.ctx.clock()
        expires_at = now + self.ctx.decoder_kv_ttl - EXPIRY_MARGIN_S
        if decode_params and decode_params.get("remote_block_ids"):
            session.mode_state[self.KEY] = HeldKv(decode_params, token_ids,
                                                  placement.decode.name, expires_at)
            return
        # A streamed response carries no params: ask the decode engine for them with a
        # one-token request over the same tokens, which hits the blocks the turn left there.
        task = asyncio.create_task(
            self._capture(placement.decode, turn, token_ids, expires_at))
        session.mode_state[self.KEY] = task

    def drop_session(self, session: Session) -> None:
        held = session.mode_state.pop(self.KEY, None)
        if isinstance(held, asyncio.Task):
            held.cancel()

    async def _capture(self, decode: Engine, turn: Turn, token_ids: list[int],
                       expires_at: float) -> HeldKv | None:
        body: dict[str, Any] = {
            "model": turn.body.get("model"),
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False},
        }
        if "cache_salt" in turn.body:
            body["cache_salt"] = turn.body["cache_salt"]
        try:
            response = await self.ctx.upstream.post(decode, "/v1/completions", body,
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
        # Each offer is used once: after a read the decode engine frees those blocks.
        held = session.mode_state.pop(self.KEY, None)
        if isinstance(held, asyncio.Task):
            try:
                held = await asyncio.wait_for(held, timeout=10.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                held.cancel()
                return None
        return held if isinstance(held, HeldKv) else None

    async def _block_size(self, engine: Engine) -> int:
        if engine.name not in self._block_sizes:
            reply = await self.ctx.upstream.get(f"{engine.url}/metrics", timeout=10.0)
            text = reply.content.decode()
            match = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', text)
            if not match:
                raise RuntimeError(f"{engine.name} does not report its block size")
            self._block_sizes[engine.name] = int(match.group(1))
        return self._block_sizes[engine.name]


async def tokenize(upstream: Upstream, engine: Engine, turn: Turn) -> list[int]:
    """The turn's prompt as the engine will see it (chat template applied), from its /tokenize."""
    body: dict[str, Any] = {"model": turn.body.get("model")}
    if "messages" in turn.body:
        for key in ("messages", "tools", "chat_template", "chat_template_kwargs",
                    "add_generation_prompt", "continue_final_message"):
            if key in turn.body:
                body[key] = turn.body[key]
        body.setdefault("add_generation_prompt", True)
    else:
        body["prompt"] = turn.body.get("prompt")
    response = await upstream.post(engine, "/tokenize", body, timeout=30.0)
    if 400 <= response.status < 500:
        # A prompt the engine cannot render (an empty one, say) is the client's to fix: the
        # same 4xx a whole turn would get, never an engine taken for unavailable.
        raise EngineRejected(response.status, response.content)
    if not response.ok:
        raise EngineConnectionError(f"{engine.name} /tokenize answered {response.status}")
    return list(response.json()["tokens"])


class Push(Mode):
    name = "push"
    affinity = True
    concurrent = True

    def decode_transfer_params(
        self, turn: Turn, placement: Placement, prefill: PrefillResult | None
    ) -> dict[str, Any] | None:
        peer = self.ctx.prefill_peers.get(placement.prefill.name)
        if peer is None:
            raise RuntimeError(f"push mode needs the NIXL side channel of {placement.prefill.name}"
                               " (--prefill-nixl ENGINE_ID@HOST:PORT)")
        prefix = "chatcmpl" if turn.path.endswith("/chat/completions") else "cmpl"
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": peer.engine_id,
            "remote_host": peer.host,
            "remote_port": peer.port,
            "tp_size": 1,
            "pp_size": 1,
            # Upstream requires it; registrations are matched by the shared X-Request-Id.
            "remote_request_id": f"{prefix}-{turn.request_id}",
            "remote_block_ids": [],
        }


UPSTREAM_MODES: dict[str, type[Mode]] = {
    "standard": Mode,
    "standard-nocache": StandardNoCache,
    "bidirectional": Bidirectional,
    "push": Push,
}

