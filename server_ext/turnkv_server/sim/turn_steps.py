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


@dataclass
class PrefillDone:
    cached: int
    from_tier: int
    computed: int
    ms: float  # the compute and tier read, not the queueing
    stored_blocks: int = 0  # the prompt's blocks new to the engine's tier, to be copied there


def routing_work(engine: SimEngine, routing: str) -> Generator[simpy.Event, Any, None]:
    """The routing's own work for a turn before its prompt reaches an engine
    (`ServiceCosts.turn_overhead_ms`): time in the turn's TTFT that no engine spends."""
    ms = engine.costs.turn_overhead_ms(routing)
    if ms > 0:
        yield engine.env.timeout(ms / 1000)


def held_prefix(engine: SimEngine, session: SimSession) -> int:
    """Leading tokens of the session's prompts the engine holds (cache, host tier or shared
    prefix; not what it could read of a tier it shares), without starting anything."""
    held = engine.cache.held(session.session_id)
    if engine.tier is not None:
        held = max(held, engine.tier.held(session.session_id))
    if session.prefix is not None and session.prefix in engine.prefixes:
        held = max(held, session.prefix_tokens)
    return held


def reserve(engine: SimEngine, session: str, tokens: int, traffic: FleetTraffic) -> None:
    """Room for the session's `tokens` in the engine's cache, now: where the turns running
    there hold it all, the turn goes in anyway, counted (`overcommits`)."""
    tokens = min(tokens, engine.cache.capacity)
    if not engine.cache.reserve(session, tokens):
        traffic.overcommits += 1
        engine.cache.reserve(session, tokens, force=True)


def wait_for_room(engine: SimEngine, session: str, tokens: int, traffic: FleetTraffic
                  ) -> Generator[simpy.Event, Any, int]:
    """Room for the session's `tokens`, waiting (at the head of the engine's queue, as
    vLLM's scheduler waits) for decoding turns there to end; returns the tokens recomputed
    for want of room: where nothing decodes there and the room is still short, vLLM would
    preempt, and what it lacks is computed again."""
    tokens = min(tokens, engine.cache.capacity)
    while not engine.cache.reserve(session, tokens):
        if not engine.batch:
            before = engine.cache.held(session)
            reserve(engine, session, tokens, traffic)
            short = min(tokens - before, max(0, -engine.cache.free))
            traffic.preempted_tokens += short
            return short
        yield engine.room_changed()
    return 0


def compute_prompt(engine: SimEngine, session: SimSession, turn: int, keep_tokens: int,
                   traffic: FleetTraffic, reuse: bool = True
                   ) -> Generator[simpy.Event, Any, PrefillDone]:
    """The engine computes the turn's prompt after the prefills queued before it, reusing
    what it holds (unless `reuse` is False), with room reserved for `keep_tokens` of the
    session."""
    sid, prompt = session.session_id, session.prompts[turn]
    # What the engine holds is read as the prefill starts (it may be evicted while the turn
    # queues), and room is taken then: a queued request holds no blocks in vLLM.
    with engine.lane() as lane:
        yield lane
        if session.prefix is not None:
            engine.cache.share(sid, session.prefix, session.prefix_tokens)
        cached = engine.cache.begin(sid)
        if not reuse:
            cached = 0
        tier = tier_held(engine, sid) if reuse else 0
        if reuse and session.prefix is not None and session.prefix in engine.prefixes:
            cached = max(cached, session.prefix_tokens)
        computed = tokens_to_compute(prompt, max(cached, tier), engine.costs.block_size)
        from_tier = max(0, prompt - computed - cached)
        ms = engine.costs.tier_read_ms(from_tier)
        computed += yield from wait_for_room(engine, sid, keep_tokens, traffic)
        compute_ms = engine.costs.prefill_ms(computed, prompt)
        if ms:
            yield engine.env.timeout(ms / 1000)
        traffic.tier_read_tokens += from_tier
        compute_ms += yield from engine.compute(compute_ms, computed)
        # vLLM's offloading stores the prompt's blocks its tier lacks from the next step on.
        block = engine.costs.block_size
        stored = 0
        if engine.tier is not None:
            stored = max(0, prompt // block - engine.tier.held(sid) // block)
            engine.store(stored)
    if session.prefix is not None:
        engine.prefixes.add(session.prefix)
    return PrefillDone(max(0, min(cached, prompt - computed)), from_tier, computed,
                       ms + compute_ms, stored)


def tier_held(engine: SimEngine, session: str) -> int:
    """Leading tokens of the session's history the engine can read back from its tiers: its
    host tier's and the one it shares with its pair's other engine."""
    held = engine.tier.held(session) if engine.tier is not None else 0
    if engine.shared is not None:
        held = max(held, engine.shared.held(session))
    return held


def keep_history(engine: SimEngine, session: SimSession, turn: int, tokens: int,
                 traffic: FleetTraffic, lease: bool = True, stored: int = 0) -> None:
    """The turn on `engine` ended: the session's first `tokens` stay in its cache (under a
    lease unless `lease` is False: see `SessionKvCache.end`), and go to its tier (written as
    the turn's blocks complete, as vLLM's offloading does); the blocks written beyond the
    `stored` its prompt's prefill queued there (`PrefillDone.stored_blocks`) are copied on
    the engine's steps (`SimEngine.store`); and to the tier it shares with its pair's other
    engine, on that tier's own threads."""
    sid, hint = session.session_id, session.next_gap(turn)
    final = hint is None
    engine.cache.end(sid, tokens, hint, final, lease)
    if engine.tier is not None:
        written = engine.tier.put(sid, tokens, hint, final)
        traffic.tier_written_tokens += written
        engine.store(written // engine.costs.block_size - stored)
    if engine.shared is not None:
        traffic.tier_written_tokens += engine.shared.put(sid, tokens, hint, final)
