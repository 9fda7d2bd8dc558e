"""The `turnkv` mode as every turn of it runs: placed by the planner (`router.planner`), from
measured costs, and served under the session's lease on its engines.

Each session has a home, either engine of its pair (both run the turnkv connector as `kv_both`):
a new session's is the engine of its pair home to fewer sessions (`PairPool`). Per turn, `begin`
waits for the session's prefetch where one is pending (`modes.prefetch`); `plan` reads the
engines' load (requests in flight, recent misses, `Backoff`; the room each cache has beside
what the sessions' leases hold there, `planner.Holdings`), asks the planner whether it needs
the prompt (an idle home gets no /tokenize round trip) and for its decision, holds it back
while a turn that moves KV lands where it would compute (`router.landings`), and carries it
out: `whole`, the home alone, here; a `split` or a `move`, with the P/D machinery (`PdTurnkv`
in `modes.turnkv`, the class the registry makes); `finish` feeds the cost model what the turn
measured and keeps the session's place. Every request carries the session's lease
(`lease_params`). `--fixed-pools` keeps the P/D form, `--pair-pool` the pair as one pool:
both skip the planner (`PdTurnkv._plan_unplanned`).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from turnkv.protocol import CacheHints, RouterTurnStats
from turnkv_server.engine.protocol import KEY, Receive, Send, TurnParams
from turnkv_server.router.decisions import Decision, Priors, SessionPlace, TurnFacts
from turnkv_server.router.engines import Engine, Placement
from turnkv_server.router.landings import Landings
from turnkv_server.router.modes import prefetch
from turnkv_server.router.modes.base import (
    DecodeAlone,
    Mode,
    ModeContext,
    Turn,
    TurnEnd,
    TurnPlan,
    tokenize,
)
from turnkv_server.router.modes.engine_orders import EngineOrders
from turnkv_server.router.planner import CostModel, EngineLoad, Holdings, TurnsInFlight
from turnkv_server.router.sessions import LeasePolicy, Session, SessionKey
from turnkv_server.router.weighing import WeighingPlanner, guessed_facts, read_facts

# Weight of a turn's output length in the session's expected output.
OUTPUT_WEIGHT = 0.5
# A held history leaves at most its last block's tail to compute (under 128 tokens on CPUs):
# an engine that computed more beyond the delta had lost the session's KV to memory pressure.
HELD_TAIL_TOKENS = 256
# After such a miss, or a push back whose receive failed, the engine is under pressure for this
# long, doubling while misses go on (`Backoff`), up to the max.
BACKOFF_S, BACKOFF_MAX_S = 30.0, 600.0


# -- the session's lease, as its engines' connector is told it ---------------------------------

def lease_key(session: Session) -> str:
    """The engines' name for a session: tenant-scoped, and no IDs or tenant names in their logs."""
    raw = f"{session.key.tenant}\0{session.key.session_id}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def engine_ttl(policy: LeasePolicy, hints: CacheHints) -> float | None:
    """The engines' leases' TTL: the session's (`LeasePolicy.ttl`, each engine caps it) where a
    hint shapes it, kept as long as the router keeps the session; None (theirs) where none does."""
    return None if hints.ttl is None and hints.next_turn_in is None else policy.ttl(hints)


def turn_hints(turn: Turn) -> CacheHints:
    return turn.tag.hints if turn.tag is not None else CacheHints()


def lease_params(turn: Turn, policy: LeasePolicy, send: Send | None = None,
                 receive: Receive | None = None) -> dict[str, Any]:
    """A request's `kv_transfer_params`: its transfers, and a session's lease that its blocks
    leave behind, with the hint by which each engine orders its evictions (on every request)."""
    session, hints = turn.session, turn_hints(turn)
    if session is None:
        return {KEY: TurnParams(receive=receive, send=send).to_wire()}
    params = TurnParams(session=lease_key(session), ttl_s=engine_ttl(policy, hints),
                        priority=hints.priority or 0, release=hints.final, receive=receive,
                        send=send, next_turn_in_s=None if hints.final else hints.next_turn_in,
                        epoch=session.epoch)
    return {KEY: params.to_wire()}


def prefetch_lease(session: Session, hints: CacheHints, policy: LeasePolicy) -> dict[str, Any]:
    """A prefetch's `kv_transfer_params`: the session's lease, with the session expected back
    `LEAD_S` after the prefetch (when it is sent)."""
    params = TurnParams(session=lease_key(session), ttl_s=engine_ttl(policy, hints),
                        priority=session.priority, next_turn_in_s=prefetch.LEAD_S,
                        epoch=session.epoch)
    return {KEY: params.to_wire()}


class Backoff:
    """Per-engine backoffs: after a miss (a decode engine whose leases lost a held history, a
    push back whose receive failed), an engine is avoided for a while, twice as long after
    each further miss (up to a cap), and no longer once a try succeeds."""

    def __init__(self, clock: Callable[[], float], first_s: float = BACKOFF_S,
                 max_s: float = BACKOFF_MAX_S) -> None:
        self.first_s, self.max_s, self._clock = first_s, max_s, clock
        self._until: dict[str, tuple[float, float]] = {}  # engine: (avoided until, backoff)

    def active(self, engine: str) -> bool:
        return self._clock() < self._until.get(engine, (0.0, 0.0))[0]  # (until, backoff)

    def record(self, engine: str, missed: bool) -> float | None:
        """A try on `engine` missed (start or double its backoff: its length, s) or not (None)."""
        if not missed:
            self._until.pop(engine, None)
            return None
        _, backoff = self._until.get(engine, (0.0, self.first_s / 2))
        backoff = min(backoff * 2, self.max_s)
        self._until[engine] = (self._clock() + backoff, backoff)
        return backoff


# -- the homes, and the mode ---------------------------------------------------------------

# The homes remembered, at most: a backstop (a session that leaves the router's table is gone).
MAX_HOMES = 100_000


class PairPool:
    """The sessions' homes, each an engine of the session's pair, counted per engine: the
    planner's homes, and with `--pair-pool` the pool's, whose home serves each turn whole."""

    def __init__(self, max_homes: int = MAX_HOMES) -> None:
        self._homes: OrderedDict[SessionKey, str] = OrderedDict()
        self._homed: Counter[str] = Counter()  # sessions per engine, kept with `_homes`
        self._max_homes = max_homes

    def homed(self, engine: str) -> int:
        return self._homed[engine]

    def home(self, session: Session, placement: Placement, others: Sequence[Engine] = ()
             ) -> Engine:
        """The engine that serves `session`: its home, where the placement kept it there (both
        places name it), else the one of the pair (the placement's engines and `others`) home to
        fewer sessions, now its home (a warm prefix's placement names one engine, keeping none)."""
        kept = self._homes.get(session.key) == placement.decode.name
        if placement.prefill is placement.decode and (kept or not others):
            engine = placement.decode
        else:
            pair = [e for e in (placement.prefill, placement.decode, *others) if e.healthy]
            engine = min(pair or [placement.decode],
                         key=lambda e: (self._homed[e.name], e.in_flight))
        self.forget(session.key)
        self._homes[session.key] = engine.name
        self._homed[engine.name] += 1
        while len(self._homes) > self._max_homes:
            self._uncount(self._homes.popitem(last=False)[1])
        return engine

    def forget(self, key: SessionKey) -> None:
        """The session ended, or left the router's table: it is nobody's any more."""
        home = self._homes.pop(key, None)
        if home is not None:
            self._uncount(home)

    def _uncount(self, engine: str) -> None:
        self._homed -= Counter((engine,))  # and an engine home to none leaves the count


class Turnkv(Mode):
    """What every `turnkv` turn runs; `PdTurnkv` adds what moves KV (declared at the end)."""

    affinity = True
    serves_without_prefill = True

    def __init__(self, ctx: ModeContext, orders: EngineOrders) -> None:
        super().__init__(ctx)
        priors = Priors(transfer_tokens_per_ms=ctx.transfer_tokens_per_ms)
        self.planner = WeighingPlanner(CostModel(priors), ctx.itl_target_ms)
        self._homes = PairPool()
        self._places: OrderedDict[SessionKey, SessionPlace] = OrderedDict()
        self._holdings = Holdings()
        self._in_flight = TurnsInFlight()
        self._landings = Landings(ctx.clock)  # turns that move KV, until they land
        # Push backs, releases, give-ups, renewals and prefetches run on after their turn.
        self._orders = orders
        self._prefetches = prefetch.Prefetches(ctx.upstream, orders)
        # Engines that lost a held history lately; engines a push back to failed lately.
        self._pressure, self._no_push_back = Backoff(ctx.clock), Backoff(ctx.clock)

    @property
    def planned(self) -> bool:
        return not (self.ctx.fixed_pools or self.ctx.pair_pool)

    # -- before the turn ---------------------------------------------------------------------

    async def begin(self, turn: Turn) -> None:
        """A turn is never raced with its session's prefetch (`Prefetches.before_turn`)."""
        session = turn.session
        if session is not None and session.key in self._prefetches.pending:
            turn.prefetch = await self._prefetches.before_turn(session.key)

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        if not self.planned:
            return await self._plan_unplanned(turn, placement)
        session = turn.session
        if session is not None:
            session.mode_state.model = turn.body.get("model")
        home = self._home(session, placement)
        other, home_load = self._other(home), self._load(home)
        other_load = self._load(other) if other is not None else None
        place = self._places.get(session.key) if session is not None else None
        size = turn.request_bytes = len(orjson.dumps(turn.body))  # a prompt grows with it
        guess = (place.prompt_tokens * size // place.request_bytes  # its last tokens per byte
                 if place and place.request_bytes else 0)
        facts = TurnFacts(turns_since_split=place.turns_since_split if place else None,
                          history_tokens=place.history_len if place else 0,
                          prompt_estimate=guess if place and guess > place.history_len else None)
        pins, tier = self.ctx.pins, self.ctx.shared_tier
        pin = pins[(session.turns if session is not None else 0) % len(pins)] if pins else None
        prompt_ids: list[int] | None = None
        decision: Decision | None = None
        if self.planner.needs_prompt(home_load, other_load, facts, pin):
            push_back = self._can_push_back(turn)
            if facts.prompt_estimate:  # whole unread, where reading it could not change that
                decision = self.planner.decide_unread(home_load, other_load, guessed_facts(
                    facts.prompt_estimate, session, place, home, other, push_back, tier), pin)
            if decision is None:  # rendered where it waits least: not on the home
                prompt_ids = await tokenize(self.ctx.upstream, other or home, turn)
                # Turns planned meanwhile count: the engines' load is read again.
                home_load = self._load(home)
                other_load = self._load(other) if other is not None else None
            if prompt_ids is not None:
                facts = read_facts(prompt_ids, session, place, home, other, push_back, tier)
        decision = decision or self.planner.decide(home_load, other_load, facts, pin)
        kv = (facts.prompt_tokens or facts.prompt_estimate or facts.history_tokens) + round(
            place.expected_output if place else 0)
        self._in_flight.begin(id(turn), decision.home, kv, decision.prefill,
                              decision.estimates["compute_ms"], held=True)  # counted from now
        try:
            if self._landings.parts:  # a turn moving KV lands where this one would compute
                decision = await self._landings.hold(decision)
        except BaseException:  # cancelled while held back: never sent
            self._in_flight.end(id(turn))
            raise
        self._in_flight.sent(id(turn), self.ctx.clock(),
                             shared=self._engine(decision.prefill).prefilling > 0)
        if session is not None:
            decided = self._engine(decision.home)
            self._homes.home(session, Placement(decided, decided, "affinity"))
        return await self._carry_out(turn, decision, prompt_ids, facts, placement)

    def _home(self, session: Session | None, placement: Placement) -> Engine:
        """The session's home (even down: the planner moves it), else the pair's engine (a warm
        prefix's placement names one) home to fewer sessions, then with fewer requests in flight."""
        if session is not None and session.decode is not None:
            home = self.ctx.pool.named.get(session.decode) if self.ctx.pool else None
            if home is not None:
                return home
        pair = [e for e in (placement.prefill, placement.decode) if e.healthy]
        other = self._other(placement.decode)
        if other is not None and other not in pair:
            pair.append(other)
        return min(pair or [placement.decode],
                   key=lambda e: (self._homes.homed(e.name), e.in_flight))

    def _other(self, home: Engine) -> Engine | None:
        """The pair's other engine: the least busy healthy engine that is not the home."""
        others = [e for e in (self.ctx.pool.named.values() if self.ctx.pool else [])
                  if e is not home and e.healthy]
        return min(others, key=lambda e: e.in_flight) if others else None

    def _engine(self, name: str) -> Engine:
        assert self.ctx.pool is not None and name in self.ctx.pool.named, name
        return self.ctx.pool.named[name]

    def _load(self, engine: Engine) -> EngineLoad:
        if not engine.in_flight:
            self._in_flight.idle(engine.name)
        overloaded = self.ctx.pool is not None and engine.in_flight >= self.ctx.pool.max_in_flight
        pressure = self._pressure.active(engine.name) or self._no_push_back.active(engine.name)
        return EngineLoad(engine.name, engine.healthy, engine.in_flight, overloaded, pressure,
                          self._holdings.room(engine.name, engine.kv_tokens),
                          homed=self._homes.homed(engine.name), prefilling=engine.prefilling,
                          capacity_tokens=engine.kv_tokens,
                          kv_in_flight=self._in_flight.kv_tokens(engine.name),
                          prefill_wait_ms=self._in_flight.prefill_wait_ms(
                              engine.name, engine.prefilling, self.ctx.clock(),
                              time.monotonic() - engine.answered_at),
                          landing_ms=self._landings.left_ms(engine.name) if self._landings.parts
                          else ())

    def _params(self, turn: Turn, send: Send | None = None,
                receive: Receive | None = None) -> dict[str, Any]:
        return lease_params(turn, self.ctx.session_policy, send, receive)

    def _can_push_back(self, turn: Turn) -> bool:
        """Its history will be known (the engines give its token IDs); another turn may follow."""
        return (turn.session is not None and not turn_hints(turn).final
                and (turn.api is None or turn.api.gives_token_ids))

    async def _carry_out(self, turn: Turn, decision: Decision, prompt_ids: list[int] | None,
                         facts: TurnFacts, placement: Placement) -> TurnPlan:
        if decision.where != "whole" or decision.push_back:
            return await self._move_kv(turn, decision, prompt_ids, facts, placement)
        home = self._engine(decision.home)  # alone, and keeps nothing to send
        alone = DecodeAlone(prompt_ids, len(prompt_ids) - facts.home_holds if prompt_ids else 0,
                            held=prompt_ids is not None and facts.home_holds > 0)
        return TurnPlan(Placement(home, home, placement.reason), prefill_params=None,
                        alone=alone, decode_params=self._params(turn), decision=decision)

    # -- after it ----------------------------------------------------------------------------

    def first_token(self, turn: Turn) -> None:
        if self._landings.parts:  # if it moved KV, it has landed
            self._landings.end(id(turn))

    def finish(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        self.first_token(turn)  # whatever came, it has landed or never will
        shared = self._in_flight.end(id(turn))
        decision = plan.decision
        if decision is not None and end.how == "complete" and end.stats is not None:
            self._observe(turn, plan, decision, end.stats, shared)
        if plan.prefill_send or plan.decode_send or (plan.alone is not None and plan.alone.held):
            self._finish_pd(turn, plan, end)  # sends, a push back, a held delta judged
        elif end.how == "complete" and turn_hints(turn).next_turn_in is not None:
            self._schedule_prefetch(turn, plan)  # the home alone, a pause ahead

    def _observe(self, turn: Turn, plan: TurnPlan, decision: Decision,
                 stats: RouterTurnStats, shared: bool = False) -> None:
        tokens, times = stats.prompt_tokens, stats.times
        decode = plan.placement.decode
        alone = plan.alone is not None
        computed, restored, computing = (
            (tokens.decode_computed, tokens.decode_restored, decode) if alone
            else (tokens.prefill_computed, tokens.prefill_restored, plan.placement.prefill))
        costs = self.planner.costs
        costs.observe_prefill(computing.name, tokens.total, computed, times.engine_prefill_ms,
                              restored or 0, shared)
        costs.observe_decode(decode.name, decode.in_flight, times.first_token_ms,
                             times.total_ms, stats.completion_tokens)
        if computing is not decode and times.first_token_ms is not None:  # a split, a pull
            tail = times.first_token_ms - times.queue_ms - times.plan_ms - times.prefill_ms
            ahead = decision.estimates.get("home_wait_ms", 0.0) - times.prefill_ms
            costs.observe_split_tail(decode.name, tail, stats.kv.to_decode_tokens or 0, ahead)
        session = turn.session
        if session is None:
            return
        place = self._places.pop(session.key, None) or SessionPlace()
        self._places[session.key] = place  # the most recent last
        while len(self._places) > MAX_HOMES:
            self._holdings.drop(self._places.popitem(last=False)[0])
        if (plan.alone is not None and not plan.alone.held and decision.where == "whole"
                and place.history_len and session.decode == decode.name and computed is not None
                and computed > tokens.total - place.history_len + HELD_TAIL_TOKENS):
            # Unread, it computed more than its delta (the history unedited): the home lost it.
            self._pressure.record(decode.name, True)
        history_len = tokens.total + stats.completion_tokens
        place.prompt_tokens, place.request_bytes = tokens.total, turn.request_bytes
        place.tokens_current = turn.prompt_token_ids is not None
        place.turns_since_split = 0 if decision.where == "split" else (
            None if place.turns_since_split is None else place.turns_since_split + 1)
        place.expected_output += OUTPUT_WEIGHT * (stats.completion_tokens
                                                  - place.expected_output)
        if plan.decode_send is not None and plan.placement.prefill is not decode:
            place.copy_on, place.copy_tokens = plan.placement.prefill.name, history_len
        elif plan.alone is None:  # the prefill engine computed the prompt
            place.copy_on, place.copy_tokens = plan.placement.prefill.name, tokens.total
        elif decision.where == "move" and decision.pull:
            place.copy_on, place.copy_tokens = None, 0
        elif decision.where == "move":  # to its copy: the old home keeps the history as it was
            old_home = self._other(decode)
            place.copy_on = old_home.name if old_home is not None else None
            place.copy_tokens = place.history_len
        place.history_len = history_len
        held = {decode.name: history_len}
        if place.copy_on is not None and place.copy_on != decode.name:
            held[place.copy_on] = place.copy_tokens
        self._holdings.hold(session.key, held)

    def forget_session(self, session: Session) -> None:
        self._prefetches.cancel(session.key)
        self._homes.forget(session.key)
        self._places.pop(session.key, None)
        self._holdings.drop(session.key)

    # -- what a pause ahead and a turn that moves KV add: `PdTurnkv`'s ------------------------
    async def _plan_unplanned(self, turn: Turn, placement: Placement) -> TurnPlan:
        raise NotImplementedError  # `--fixed-pools` (the P/D form), `--pair-pool`

    async def _move_kv(self, turn: Turn, decision: Decision, prompt_ids: list[int] | None,
                       facts: TurnFacts, placement: Placement) -> TurnPlan:
        raise NotImplementedError  # a split, a move, or a whole turn pushed back after

    def _finish_pd(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        raise NotImplementedError  # an attempt that sent or kept KV, or held a short delta

    def _schedule_prefetch(self, turn: Turn, plan: TurnPlan) -> None:
        raise NotImplementedError  # the prefetch before the session's hinted return
