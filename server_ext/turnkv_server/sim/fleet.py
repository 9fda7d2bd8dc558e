"""A simulated fleet: its engines, their caches and tiers, one router, and the sessions it
serves; `run` plays them and returns what happened to every turn."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import simpy

from turnkv_server.connector.leases import LeaseLimits
from turnkv_server.router.admission import fits
from turnkv_server.sim.baseline_routing import AffinityRouting, StandardRouting, TurnProcess
from turnkv_server.sim.engine import SimEngine
from turnkv_server.sim.kv_cache import EvictionOrder, SessionKvCache
from turnkv_server.sim.outcomes import FleetTraffic, SimTurnOutcome
from turnkv_server.sim.service_costs import ServiceCosts
from turnkv_server.sim.sessions import SimSession
from turnkv_server.sim.turnkv_routing import TurnkvRouting

RoutingName = Literal["affinity", "standard", "turnkv"]
ROUTINGS: tuple[RoutingName, ...] = ("affinity", "standard", "turnkv")
# A shared tier's size: files on a disk, of no bound the simulation meets.
SHARED_TIER_TOKENS = 1 << 50


@dataclass(frozen=True)
class FleetSpec:
    """What runs: `engines` engines (for `standard`, `prefill_engines` of them prefill), each
    with the costs' KV cache, a host tier of `tier_tokens` (0: none), idle histories evicted in
    `eviction` order (default: `lease` under turnkv, `lru` otherwise); with `shared_tier`, a
    tier below those that each pair of engines (0 and 1, 2 and 3, ...) shares, of no bound
    (the launcher's file tier: a folder on the pair's machine, where nothing is evicted)."""

    routing: RoutingName
    engines: int
    costs: ServiceCosts
    eviction: EvictionOrder | None = None
    tier_tokens: int = 0
    shared_tier: bool = False
    prefill_engines: int = 1
    itl_target_ms: float | None = None
    admission_tokens: int | None = None  # the router's `--admission-tokens`
    concurrency: int | None = None  # closed loop: this many sessions at once
    lose: tuple[tuple[int, float], ...] = ()  # (engine index, at second)
    lease_limits: LeaseLimits = field(default_factory=LeaseLimits)

    @property
    def order(self) -> EvictionOrder:
        return self.eviction or ("lease" if self.routing == "turnkv" else "lru")

    def label(self) -> str:
        parts: list[str] = [self.routing, self.order]
        if self.tier_tokens:
            parts.append("tier")
        if self.shared_tier:
            parts.append("shared")
        if self.routing == "standard":
            parts.append(f"{self.prefill_engines}P:{self.engines - self.prefill_engines}D")
        return "/".join(parts)


@dataclass
class FleetRun:
    spec: FleetSpec
    outcomes: list[SimTurnOutcome]
    traffic: FleetTraffic
    engines: list[SimEngine]
    duration_s: float
    decisions: dict[str, int]


Progress = Callable[[int], None]  # turns ended so far


class Fleet:
    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.env = env = simpy.Environment()
        self.traffic = FleetTraffic()
        costs = spec.costs
        self.engines = [
            SimEngine(env, f"engine-{i}", costs,
                      SessionKvCache(costs.kv_capacity_tokens, costs.block_size, spec.order,
                                     lambda: env.now, spec.lease_limits),
                      SessionKvCache(spec.tier_tokens, costs.block_size, spec.order,
                                     lambda: env.now, spec.lease_limits)
                      if spec.tier_tokens else None)
            for i in range(spec.engines)]
        if spec.shared_tier:
            for first, second in zip(self.engines[::2], self.engines[1::2], strict=False):
                first.shared = second.shared = SessionKvCache(
                    SHARED_TIER_TOKENS, costs.block_size, "lru", lambda: env.now)
        self.routing: AffinityRouting | StandardRouting | TurnkvRouting
        if spec.routing == "affinity":
            self.routing = AffinityRouting(env, self.engines, self.traffic)
        elif spec.routing == "standard":
            if not 0 < spec.prefill_engines < spec.engines:
                raise ValueError("standard needs prefill and decode engines")
            self.routing = StandardRouting(env, self.engines[:spec.prefill_engines],
                                           self.engines[spec.prefill_engines:], self.traffic)
        else:
            self.routing = TurnkvRouting(env, self.engines, self.traffic, spec.itl_target_ms)
        self.outcomes: list[SimTurnOutcome] = []
        self._slots = simpy.Resource(env, spec.concurrency) if spec.concurrency else None
        # Admission's running totals (`router.sessions`): histories held, by how many.
        self._held: dict[str, int] = {}
        self._held_total = 0
        self._starting = 0
        self._admission: simpy.Event = env.event()

    def run(self, sessions: Sequence[SimSession], progress: Progress | None = None,
            every: int = 1000) -> FleetRun:
        env = self.env
        for session in sessions:
            env.process(self._session(session))
        for index, at in self.spec.lose:
            env.process(self._lose(self.engines[index], at))
        if progress is None:
            env.run()
        else:
            while env.peek() != float("inf"):
                target = len(self.outcomes) + every
                while env.peek() != float("inf") and len(self.outcomes) < target:
                    env.step()
                progress(len(self.outcomes))
        decisions = dict(getattr(self.routing, "decisions", {}))
        return FleetRun(self.spec, self.outcomes, self.traffic, self.engines, env.now,
                        decisions)

    # -- a session ------------------------------------------------------------------------

    def _session(self, session: SimSession) -> Generator[simpy.Event, Any, None]:
        env = self.env
        if session.start_s:
            yield env.timeout(session.start_s)
        slot = self._slots.request() if self._slots is not None else None
        if slot is not None:
            yield slot
        yield from self._admit()
        for turn, spec in enumerate(session.turns):
            if turn and spec.gap_s:
                yield env.timeout(spec.gap_s)
            outcome = yield from self._turn(session, turn)
            self.outcomes.append(outcome)
            if turn == 0:
                self._starting -= 1
            self._remember(session.session_id, outcome.prompt + outcome.output)
        self._remember(session.session_id, 0)
        if slot is not None and self._slots is not None:
            self._slots.release(slot)

    def _turn(self, session: SimSession, turn: int) -> TurnProcess:
        return (yield from self.routing.serve(session, turn))

    # -- admission (`router.admission`) ---------------------------------------------------------

    def _admit(self) -> Generator[simpy.Event, Any, None]:
        budget = self.spec.admission_tokens
        if budget is not None:
            waited = False
            while not fits(self._held_total, len(self._held), self._starting, budget):
                waited = True
                yield self._admission
            self.traffic.admission_waits += waited
        self._starting += 1

    def _remember(self, session: str, tokens: int) -> None:
        self._held_total += tokens - self._held.pop(session, 0)
        if tokens:
            self._held[session] = tokens
        if self.spec.admission_tokens is not None:
            changed, self._admission = self._admission, self.env.event()
            changed.succeed()

    def _lose(self, engine: SimEngine, at: float) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(at)
        engine.lose()
