"""The steps every router's turn is made of: computing a prompt on an engine (what its cache,
its tier and a shared prefix save), decoding, and keeping the history afterwards."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from turnkv_server.router.planner import tokens_to_compute
from turnkv_server.sim.engine import SimEngine
from turnkv_server.sim.outcomes import FleetTraffic
from turnkv_server.sim.sessions import SimSession

# A turn that finds no room waits for a turn on the engine to end, this long at most per try;
# after `_ROOM_TRIES` tries it goes in anyway (vLLM would preempt a running request).
_ROOM_WAIT_S = 1.0
_ROOM_TRIES = 3


@dataclass
class PrefillDone:
    cached: int
    from_tier: int
    computed: int
    ms: float  # the compute and tier read, not the queueing


def held_prefix(engine: SimEngine, session: SimSession) -> int:
    """Leading tokens of the session's prompts the engine holds (cache, tier or shared
    prefix), without starting anything."""
    held = engine.cache.held(session.session_id)
    if engine.tier is not None:
        held = max(held, engine.tier.held(session.session_id))
    if session.prefix is not None and session.prefix in engine.prefixes:
        held = max(held, session.prefix_tokens)
    return held


def reserve(engine: SimEngine, session: str, tokens: int,
            traffic: FleetTraffic) -> Generator[simpy.Event, Any, None]:
    """Room for the session's `tokens` in the engine's cache, waiting for turns to end."""
    env = engine.env
    tokens = min(tokens, engine.cache.capacity)
    for _ in range(_ROOM_TRIES):
        if engine.cache.reserve(session, tokens):
            return
        yield env.any_of([engine.room_changed(), env.timeout(_ROOM_WAIT_S)])
    if not engine.cache.reserve(session, tokens):
        traffic.overcommits += 1


def compute_prompt(engine: SimEngine, session: SimSession, turn: int, keep_tokens: int,
                   traffic: FleetTraffic, reuse: bool = True
                   ) -> Generator[simpy.Event, Any, PrefillDone]:
    """The engine computes the turn's prompt, reusing what it holds (unless `reuse` is
    False), with room reserved for `keep_tokens` of the session."""
    sid, prompt = session.session_id, session.prompts[turn]
    cached = engine.cache.begin(sid) if reuse else 0
    if not reuse:
        engine.cache.begin(sid)
    tier = engine.tier.held(sid) if engine.tier is not None and reuse else 0
    if reuse and session.prefix is not None and session.prefix in engine.prefixes:
        cached = max(cached, session.prefix_tokens)
    computed = tokens_to_compute(prompt, max(cached, tier), engine.costs.block_size)
    from_tier = max(0, prompt - computed - cached)
    yield from reserve(engine, sid, keep_tokens, traffic)
    ms = engine.costs.tier_read_ms(from_tier)
    if ms:
        yield engine.env.timeout(ms / 1000)
    traffic.tier_read_tokens += from_tier
    compute_ms = engine.costs.prefill_ms(computed, prompt)
    yield from engine.prefill(compute_ms)
    if session.prefix is not None:
        engine.prefixes.add(session.prefix)
    return PrefillDone(min(cached, prompt - computed), from_tier, computed, ms + compute_ms)


def keep_history(engine: SimEngine, session: SimSession, turn: int, tokens: int,
                 traffic: FleetTraffic) -> None:
    """The turn on `engine` ended: the session's first `tokens` stay in its cache, and go to
    its tier (written as the turn's blocks complete, as vLLM's offloading does)."""
    sid, hint = session.session_id, session.next_gap(turn)
    final = hint is None
    engine.cache.end(sid, tokens, hint, final)
    if engine.tier is not None:
        traffic.tier_written_tokens += engine.tier.put(sid, tokens, hint, final)
