"""turnkv's router in the fleet: engines in pairs, each session homed on one engine of a pair,
and every turn placed by turnkv's own planner (`router.weighing.WeighingPlanner`, imported),
which learns each engine's costs from the simulated turns through `router.planner.CostModel`, as
the router learns them from real ones.

The planner's decisions are carried out as the `turnkv` mode carries them out
(`router/modes/planned.py`): `whole` on the home; `split` computes on the other engine, which
writes the KV the home lacks into it; `move` makes the other engine the home, pulling the
history from the old one (which computes the delta) or recomputing it where the old one is
lost; `push_back` copies the history to the other engine after the turn. Where the pair
shares a tier (`FleetSpec.shared_tier`) the planner is told so, and that the tier holds the
session's history, as the router tells it; a move to the other engine then reads the history
there (`move-tier`). The planner sees each engine's room as the router shows it (`Holdings`:
what the sessions' histories and their copies hold there, counted from the placements, as
`planned.py` counts them; `TurnsInFlight`: what the turns in flight hold, and the compute of
the prompts each engine has ahead, counted from the planner's estimates as the router counts
them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import simpy

from turnkv_server.router.decisions import Decision, TurnFacts
from turnkv_server.router.planner import CostModel, EngineLoad, Holdings, Planner, TurnsInFlight
from turnkv_server.router.weighing import WeighingPlanner
from turnkv_server.sim.baseline_routing import RoundRobin, TurnProcess
from turnkv_server.sim.engine import SimEngine
from turnkv_server.sim.outcomes import FleetTraffic, SimTurnOutcome
from turnkv_server.sim.sessions import SimSession
from turnkv_server.sim.turn_steps import (
    PrefillDone,
    compute_prompt,
    held_prefix,
    keep_history,
    reserve,
    routing_work,
)

# An engine that lost a held history for room this recently is under memory pressure (the
# planner then keeps no copies on both engines): a lease ended for room (the connector's own
# signal), or under LRU, where nothing is leased, any history evicted.
PRESSURE_WINDOW_S = 30.0


@dataclass
class _SessionPlace:
    home: SimEngine
    last_split: int | None = None  # the turn that last split
    history: int = 0  # tokens of history after its last turn
    copy_on: SimEngine | None = None  # the other engine's copy, as the router counts it
    copy_tokens: int = 0


class TurnkvRouting:
    name = "turnkv"

    def __init__(self, env: simpy.Environment, engines: Sequence[SimEngine],
                 traffic: FleetTraffic, itl_target_ms: float | None = None) -> None:
        if len(engines) < 2 or len(engines) % 2:
            raise ValueError("turnkv serves engines in pairs: an even number, at least 2")
        self.env = env
        self.traffic = traffic
        self.planner = WeighingPlanner(CostModel(engines[0].costs.planner_priors()), itl_target_ms)
        self.partner = {a.name: b for a, b in zip(engines[::2], engines[1::2], strict=True)}
        self.partner.update({b.name: a for a, b in zip(engines[::2], engines[1::2],
                                                       strict=True)})
        self.pairs = RoundRobin(engines[::2])
        self.places: dict[str, _SessionPlace] = {}
        self.decisions: dict[str, int] = {}
        self.holdings = Holdings()
        self.in_flight = TurnsInFlight()
        self._pressure: dict[str, tuple[int, float]] = {}

    # -- where --------------------------------------------------------------------------------

    def _place(self, sid: str) -> _SessionPlace:
        place = self.places.get(sid)
        if place is not None and not place.home.healthy \
                and not self.partner[place.home.name].healthy:
            place.home.homed -= 1  # its pair is lost: a new one, recomputing the history
            place = None
        if place is None:
            first = self.pairs.pick()
            pair = (first, self.partner[first.name])
            home = min((e for e in pair if e.healthy), key=lambda e: (e.homed, e.in_flight))
            home.homed += 1
            place = self.places[sid] = _SessionPlace(home)
        return place

    def load(self, engine: SimEngine) -> EngineLoad:
        """The engine as the router shows it to the planner."""
        if not engine.in_flight:
            self.in_flight.idle(engine.name)
        return EngineLoad(engine.name, engine.healthy, engine.in_flight,
                          pressure=self._under_pressure(engine),
                          room_tokens=self.holdings.room(engine.name, engine.cache.capacity),
                          homed=engine.homed, prefilling=engine.prompts,
                          capacity_tokens=engine.cache.capacity,
                          kv_in_flight=self.in_flight.kv_tokens(engine.name),
                          prefill_wait_ms=self.in_flight.prefill_wait_ms(
                              engine.name, engine.prompts, self.env.now,
                              self.env.now - engine.answered_s))

    def _under_pressure(self, engine: SimEngine) -> bool:
        cache = engine.cache
        count = cache.lease_evictions if cache.order == "lease" else cache.evicted_tokens
        seen, since = self._pressure.get(engine.name, (0, -PRESSURE_WINDOW_S))
        if count != seen:
            self._pressure[engine.name] = (count, self.env.now)
            return True
        return self.env.now - since < PRESSURE_WINDOW_S

    def _decide(self, session: SimSession, turn: int, place: _SessionPlace) -> Decision:
        home, helper = place.home, self.partner[place.home.name]
        home_load, helper_load = self.load(home), self.load(helper)
        # The router counts the shared tier as holding all of the history the prompt keeps.
        shared_tier = home.shared is not None
        facts = TurnFacts(
            prompt_tokens=session.prompts[turn],
            home_holds=held_prefix(home, session) if home.healthy else 0,
            helper_holds=held_prefix(helper, session) if helper.healthy else 0,
            block_size=home.costs.block_size,
            expected_output=session.turns[turn].tokens_out,
            turns_since_split=None if place.last_split is None else turn - place.last_split,
            can_push_back=session.next_gap(turn) is not None, shared_tier=shared_tier,
            tier_holds=min(session.prompts[turn], place.history) if shared_tier else 0,
            history_tokens=place.history)
        # Not read, the router estimates its length from the request's size (here exact).
        prompt = session.prompts[turn]
        unread = replace(facts, prompt_tokens=None, prompt_estimate=prompt
                         if place.history and prompt > place.history else None)
        if not Planner.needs_prompt(home_load, helper_load, facts):
            return self.planner.decide(home_load, helper_load, unread)
        # Read, unless reading it could not change its decision.
        return (self.planner.decide_unread(home_load, helper_load, unread)
                or self.planner.decide(home_load, helper_load, facts))

    # -- the turn -----------------------------------------------------------------------------

    def serve(self, session: SimSession, turn: int) -> TurnProcess:
        env, sid = self.env, session.session_id
        place = self._place(sid)
        decision = self._decide(session, turn, place)
        self.decisions[decision.where] = self.decisions.get(decision.where, 0) + 1
        self.in_flight.begin(
            (sid, turn), decision.home, session.prompts[turn] + session.turns[turn].tokens_out,
            decision.prefill, decision.estimates["compute_ms"], env.now)
        old = place.home
        home = self._engine(old, decision.home)
        prefill = self._engine(old, decision.prefill)
        if home is not old:
            old.homed -= 1
            home.homed += 1
            place.home = home
        prompt, out = session.prompts[turn], session.turns[turn].tokens_out
        keep = prompt + out
        start = env.now
        received, tail_ms, ahead_ms = 0, None, 0.0
        home.in_flight += 1
        yield from routing_work(home, self.name)
        if prefill is home:  # whole, or a move that recomputes
            done = yield from compute_prompt(home, session, turn, keep, self.traffic)
        else:  # split, or a move that pulls: the KV the home lacks is written into it
            prefill.in_flight += 1
            held = home.cache.begin(sid)
            done = yield from compute_prompt(prefill, session, turn, prompt, self.traffic)
            # The helper's blocks are not the session's lease: only a push back keeps a copy.
            keep_history(prefill, session, turn, prompt, self.traffic, lease=False,
                         stored=done.stored_blocks)
            prefill.turn_ended()
            reserve(home, sid, keep, self.traffic)
            received = max(0, prompt - held)
            answered = env.now
            yield env.timeout(home.costs.transfer_ms(received) / 1000)
            # The home's first token is a step of its own, after the prompts it has ahead.
            with home.lane() as lane:
                yield lane
            yield env.timeout(home.costs.split_overhead_ms / 1000)
            tail_ms = (env.now - answered) * 1000
            ahead_ms = decision.estimates.get("home_wait_ms", 0.0) - (answered - start) * 1000
            self.traffic.kv_moved_tokens += received
        ttft_ms = (env.now - start) * 1000
        batch = home.batch + 1
        yield home.decode(out - 1)
        decode_ms = (env.now - start) * 1000 - ttft_ms
        keep_history(home, session, turn, keep, self.traffic,
                     stored=done.stored_blocks if prefill is home else 0)
        home.turn_ended()
        self.in_flight.end((sid, turn))
        self._observe(prefill, home, prompt, done, batch, ttft_ms, decode_ms, out,
                      None if tail_ms is None else (tail_ms, received, ahead_ms))
        if decision.where == "split":
            place.last_split = turn
        helper = self.partner[home.name]
        pushed = decision.push_back and helper.healthy
        if pushed:
            self.traffic.kv_moved_tokens += helper.cache.put(sid, keep, session.next_gap(turn))
        self._hold(place, sid, old, prefill, decision, prompt, keep, pushed)
        if session.next_gap(turn) is None:
            self._forget(sid)
        return SimTurnOutcome(sid, turn, home.name, prefill.name, decision.where, prompt,
                              done.computed, done.cached, done.from_tier, received,
                              ttft_ms - done.ms, ttft_ms, decode_ms, out, start)

    def _hold(self, place: _SessionPlace, sid: str, old: SimEngine, prefill: SimEngine,
              decision: Decision, prompt: int, keep: int, pushed: bool) -> None:
        """Count where the session's history and its copy now lie, as the router's
        `finish` does: a push back's copy on the other engine; else the prompt on the engine
        that computed it for the home (a split, a move that pulled); else, after a move that
        recomputed, the old home's history as it was."""
        home = place.home
        if pushed:
            place.copy_on, place.copy_tokens = self.partner[home.name], keep
        elif prefill is not home:
            place.copy_on, place.copy_tokens = prefill, prompt
        elif decision.where == "move":
            place.copy_on, place.copy_tokens = old, place.history
        place.history = keep
        held = {home.name: keep}
        if place.copy_on is not None and place.copy_on is not home:
            held[place.copy_on.name] = place.copy_tokens
        self.holdings.hold(sid, held)

    def _engine(self, home: SimEngine, name: str) -> SimEngine:
        return home if name == home.name else self.partner[home.name]

    def _observe(self, prefill: SimEngine, home: SimEngine, prompt: int, done: PrefillDone,
                 batch: int, ttft_ms: float, decode_ms: float, out: int,
                 tail: tuple[float, int, float] | None) -> None:
        """What the turn measured, fed to the planner's cost model as the router's `finish`
        feeds it (`tail`: a split's or a pull's time after the helper's prefill, the tokens it
        wrote into the home, and the estimated prompts the home still had ahead then)."""
        costs = self.planner.costs
        costs.observe_prefill(prefill.name, prompt, done.computed, done.ms, done.from_tier)
        costs.observe_decode(home.name, batch, ttft_ms, ttft_ms + decode_ms, out)
        if tail is not None:
            costs.observe_split_tail(home.name, *tail)

    def _forget(self, sid: str) -> None:
        place = self.places.pop(sid)
        place.home.homed -= 1
        self.holdings.drop(sid)
