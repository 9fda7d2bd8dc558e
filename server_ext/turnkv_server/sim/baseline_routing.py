"""The routers a platform runs without turnkv, as `turnkv bench` names them:

- `affinity`: pooled (aggregated) engines, each session kept on one (its home), which computes
  what its cache lacks and decodes;
- `standard`: vLLM's P/D. A session's prompts go to one prefill engine (prefix-aware routing
  keeps it there; its cache holds the prompts, never the outputs, which were decoded
  elsewhere); the prompt's KV goes to a decode engine, round robin, which holds it for the
  turn only.

New sessions are spread round robin over the healthy engines; a session whose engine is lost
starts over on another one, recomputing its history.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from typing import Any

import simpy

from turnkv_server.sim.engine import SimEngine
from turnkv_server.sim.outcomes import FleetTraffic, SimTurnOutcome
from turnkv_server.sim.sessions import SimSession
from turnkv_server.sim.turn_steps import compute_prompt, keep_history, reserve, routing_work

TurnProcess = Generator[simpy.Event, Any, SimTurnOutcome]


class RoundRobin:
    """The next healthy engine of a list, in turn."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        if not engines:
            raise ValueError("no engines")
        self.engines = engines
        self._next = itertools.cycle(range(len(engines)))

    def pick(self) -> SimEngine:
        for _ in range(len(self.engines)):
            engine = self.engines[next(self._next)]
            if engine.healthy:
                return engine
        raise RuntimeError("every engine is down")


class SessionHomes:
    """Each session's engine, kept while it is healthy."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self.spread = RoundRobin(engines)
        self.homes: dict[str, SimEngine] = {}

    def home(self, session: str, wanted: int | None = None) -> SimEngine:
        """The session's engine: where it is homed, else engine `wanted` (a replay's), else
        the next of the spread."""
        engine = self.homes.get(session)
        if engine is None or not engine.healthy:
            if engine is not None:
                engine.homed -= 1
            engines = self.spread.engines
            # A replayed session goes where it was served, unless that engine was lost.
            if engine is None and wanted is not None and wanted < len(engines) \
                    and engines[wanted].healthy:
                engine = self.homes[session] = engines[wanted]
            else:
                engine = self.homes[session] = self.spread.pick()
            engine.homed += 1
        return engine

    def forget(self, session: str) -> None:
        engine = self.homes.pop(session, None)
        if engine is not None:
            engine.homed -= 1


class AffinityRouting:
    name = "affinity"

    def __init__(self, env: simpy.Environment, engines: Sequence[SimEngine],
                 traffic: FleetTraffic) -> None:
        self.env = env
        self.homes = SessionHomes(engines)
        self.traffic = traffic

    def serve(self, session: SimSession, turn: int) -> TurnProcess:
        env, sid = self.env, session.session_id
        engine = self.homes.home(sid, session.home)
        prompt, out = session.prompts[turn], session.turns[turn].tokens_out
        start = env.now
        engine.in_flight += 1
        yield from routing_work(engine, self.name)
        done = yield from compute_prompt(engine, session, turn, prompt + out, self.traffic)
        ttft_ms = (env.now - start) * 1000
        yield engine.decode(out - 1)
        decode_ms = (env.now - start) * 1000 - ttft_ms
        keep_history(engine, session, turn, prompt + out, self.traffic,
                     stored=done.stored_blocks)
        engine.turn_ended()
        if session.next_gap(turn) is None:
            self.homes.forget(sid)
        return SimTurnOutcome(sid, turn, engine.name, engine.name, "whole", prompt,
                              done.computed, done.cached, done.from_tier, 0,
                              ttft_ms - done.ms, ttft_ms, decode_ms, out, start)


class StandardRouting:
    name = "standard"

    def __init__(self, env: simpy.Environment, prefill: Sequence[SimEngine],
                 decode: Sequence[SimEngine], traffic: FleetTraffic) -> None:
        self.env = env
        self.homes = SessionHomes(prefill)
        self.decoders = RoundRobin(decode)
        self.traffic = traffic

    def serve(self, session: SimSession, turn: int) -> TurnProcess:
        env, sid = self.env, session.session_id
        p = self.homes.home(sid)
        prompt, out = session.prompts[turn], session.turns[turn].tokens_out
        start = env.now
        p.in_flight += 1
        yield from routing_work(p, self.name)
        done = yield from compute_prompt(p, session, turn, prompt, self.traffic)
        keep_history(p, session, turn, prompt, self.traffic, stored=done.stored_blocks)
        p.turn_ended()
        d = self.decoders.pick()
        d.in_flight += 1
        d.cache.begin(sid)
        reserve(d, sid, prompt + out, self.traffic)
        yield env.timeout(d.costs.transfer_ms(prompt) / 1000)
        self.traffic.kv_moved_tokens += prompt
        yield d.decode(1)  # the decode engine's first step samples the first token
        ttft_ms = (env.now - start) * 1000
        yield d.decode(out - 1)
        decode_ms = (env.now - start) * 1000 - ttft_ms
        d.cache.drop(sid)
        d.turn_ended()
        if session.next_gap(turn) is None:
            self.homes.forget(sid)
        return SimTurnOutcome(sid, turn, d.name, p.name, "p/d", prompt, done.computed,
                              done.cached, done.from_tier, prompt, 0.0, ttft_ms, decode_ms,
                              out, start)
