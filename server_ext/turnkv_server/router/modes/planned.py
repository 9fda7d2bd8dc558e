"""The `turnkv` mode: each turn placed by the planner (`router.planner`), from measured costs.

Each session has a home, either engine of its pair (the launcher starts both with the turnkv
connector as `kv_both`, so a "prefill" engine serves whole turns as well as a "decode" one): a
new session's is the engine of its pair home to fewer sessions, as in `--pair-pool`. Per turn:

1. `plan` reads the engines' load (requests in flight; whether each lost a held history or
   failed a push back lately; the room its cache has left beside what the sessions' leases
   hold there, as the planner's `Holdings` counts them), asks the planner whether it needs
   the prompt (only where a split could pay, `Planner.needs_prompt`: an idle home gets no
   /tokenize round trip) and for its decision, and carries it out with the P/D form's machinery
   (`modes.turnkv`): `whole` is a turn the home serves alone, as the pool serves it; `split`
   is the P/D plan with the other engine as prefill engine and the home as decode engine; a
   `move` that pulls is the P/D plan from the old home to the new one, one that recomputes is
   a whole turn on the new home. The turn's stats carry the decision (`placement`).
2. `finish` feeds the cost model what the turn measured (prefill cost per token on the engine
   that computed, decode step time at the home's batch), keeps the session's record (what each
   engine holds of its history, when it last split) and pushes the history back to the other
   engine only where the planner said so.

`--fixed-pools` keeps the P/D form, `--pair-pool` the pool: both skip the planner.

The pair as one pool (`--pair-pool`, `PairPool`): each session lives on its home, which serves
its turns whole, as an aggregated engine would. Why: a P/D turn keeps the session's history on
both engines (the decode engine holds the turn, the push back gives the prefill engine its
copy), so under memory pressure the pair holds half the sessions it could, and every turn that
finds its history gone on either side pays for it again. With the pool each engine holds only
its own sessions (its lease, hint-ordered eviction, its tier and the prefetch work as before,
on that one engine), no KV crosses the link and the pair holds twice as many histories. What
it gives up is what P/D is for: a long delta is computed on an engine that is decoding other
sessions meanwhile, so their inter-token latency suffers. docs/benchmarks.md measures the trade
under pressure. The router's placement keeps a session on its home by naming that engine as
both the session's prefill and decode engine, as it keeps an aggregated engine's sessions; a
home that goes down or is overloaded moves the session to its pair's engines, and a home is
chosen again. Sessionless turns are served by the pair as ever.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnkv_server.engine.protocol import Receive, Send
from turnkv_server.router.engines import Engine, Placement
from turnkv_server.router.modes.base import (
    DecodeAlone,
    ModeContext,
    Turn,
    TurnEnd,
    TurnPlan,
    gives_token_ids,
    tokenize,
)
from turnkv_server.router.modes.leases import send_or_none, turn_hints
from turnkv_server.router.modes.turnkv import HELD_TAIL_TOKENS, PdTurnkv, transfer_id
from turnkv_server.router.planner import (
    Choice,
    CostModel,
    Decision,
    EngineLoad,
    Holdings,
    Priors,
    TurnFacts,
)
from turnkv_server.router.sessions import Session, SessionKey
from turnkv_server.router.token_history import common_prefix_len
from turnkv_server.router.weighing import WeighingPlanner

# Weight of a turn's output length in the session's expected output.
OUTPUT_WEIGHT = 0.5


# The homes remembered, at most: a backstop (the router's table tells the mode of every session
# that leaves it, `Mode.forget_session`; a turn replayed after its session ended is placed once
# more).
MAX_HOMES = 100_000


class PairPool:
    """The sessions' homes, each an engine of the session's pair, counted per engine: the
    planner's homes, and with `--pair-pool` the pool's, whose home serves each turn whole."""

    def __init__(self, max_homes: int = MAX_HOMES) -> None:
        self._homes: OrderedDict[SessionKey, str] = OrderedDict()
        # Engine name -> sessions home there, kept with `_homes`: placing a session is O(1).
        self._homed: Counter[str] = Counter()
        self._max_homes = max_homes

    def __len__(self) -> int:
        return len(self._homes)

    def homed(self, engine: str) -> int:
        """How many sessions `engine` is home to."""
        return self._homed[engine]

    def plan(self, session: Session, placement: Placement, params: dict[str, Any],
             others: Sequence[Engine] = ()) -> TurnPlan:
        """The session's home serves the turn alone, under the session's lease (`params`),
        computing what its cache and tier do not hold; nothing is sent for a push back.

        The router does not tokenize the prompt, as in `affinity`: the engine's prefix cache
        finds the history by itself, and a `/tokenize` round trip per turn waits behind the
        engine's own work (with it the pool measured 10% slower than `affinity-tier` under
        pressure, without it 5%: docs/benchmarks.md). (The
        stats read as an aggregated engine's: the total from the engine's usage, no
        `prefix_break_at`; a prefetch tokenizes when it runs.) `held` False: what the engine
        computed says nothing about a short delta's backoff."""
        home = self.home(session, placement, others)
        return TurnPlan(Placement(home, home, placement.reason), prefill_params=None,
                        decode_params=params, alone=DecodeAlone(None, new_tokens=0, held=False))

    def home(self, session: Session, placement: Placement, others: Sequence[Engine] = ()
             ) -> Engine:
        """The engine that serves `session`: its home, where the placement kept it there (both
        places name it), else the one of the pair (the placement's engines and `others`) home
        to fewer sessions, now its home. (A new session's placement where its prefix is warm
        names one engine too, but keeps nothing.)"""
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
        self._homed[engine] -= 1
        if not self._homed[engine]:
            del self._homed[engine]


@dataclass
class SessionPlace:
    """What the planner keeps of a session between its turns."""

    # The engine other than the home holding a copy of the history, and how many of its
    # leading tokens (a copy of an older history is still its prefix, edits aside).
    copy_on: str | None = None
    copy_tokens: int = 0
    history_len: int = 0  # prompt and output tokens of the last turn
    # Whether `Session.tokens` is that history (a turn served untokenized leaves it older).
    tokens_current: bool = False
    turns_since_split: int | None = None
    expected_output: float = 0.0


class Turnkv(PdTurnkv):
    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        priors = Priors(transfer_tokens_per_ms=ctx.transfer_tokens_per_ms)
        self.planner = WeighingPlanner(CostModel(priors), ctx.itl_target_ms)
        self._homes = PairPool()
        self._places: OrderedDict[SessionKey, SessionPlace] = OrderedDict()
        self._holdings = Holdings()

    @property
    def planned(self) -> bool:
        return not (self.ctx.fixed_pools or self.ctx.pair_pool)

    # -- before the turn ---------------------------------------------------------------------

    async def begin(self, turn: Turn) -> None:
        # Named here, as every hook the turn pipeline calls, so that a turn reads this class
        # and what it calls, not its bases too: the wait for a prefetch is the leases'.
        await super().begin(turn)

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        session = turn.session
        if self.ctx.pair_pool and session is not None:
            # Releasing the session's leases when it ends takes a request of its model.
            session.mode_state.model = turn.body.get("model")
            other = self._other(placement.decode)
            return self._homes.plan(session, placement, self._params(turn),
                                    others=[other] if other is not None else [])
        if not self.planned:
            return await super().plan(turn, placement)
        if session is not None:
            session.mode_state.model = turn.body.get("model")
        home = self._home(session, placement)
        other = self._other(home)
        home_load = self._load(home)
        other_load = self._load(other) if other is not None else None
        place = self._places.get(session.key) if session is not None else None
        facts = TurnFacts(turns_since_split=place.turns_since_split if place else None,
                          history_tokens=place.history_len if place else 0)
        pin = self._pin(session)
        prompt_ids: list[int] | None = None
        if self.planner.needs_prompt(home_load, other_load, facts, pin):
            # Rendered where it waits least: the engine that is not the home.
            prompt_ids = await tokenize(self.ctx.upstream, other or home, turn)
        if prompt_ids is not None:
            facts = self._facts(turn, prompt_ids, home, other, place)
        decision = self.planner.decide(home_load, other_load, facts, pin)
        if session is not None:
            decided = self._engine(decision.home)
            self._homes.home(session, Placement(decided, decided, "affinity"))
        return await self._carry_out(turn, decision, prompt_ids, facts, placement)

    def _home(self, session: Session | None, placement: Placement) -> Engine:
        """The session's home (even down: the planner moves it), else the engine of the pair
        (the placement's and its other: a warm prefix's placement names one) home to fewer
        sessions, then with fewer requests in flight."""
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
        engine = self.ctx.pool.named.get(name) if self.ctx.pool else None
        assert engine is not None, name
        return engine

    def _load(self, engine: Engine) -> EngineLoad:
        overloaded = self.ctx.pool is not None and engine.in_flight >= self.ctx.pool.max_in_flight
        pressure = (self._pressure.active(engine.name)
                    or self._no_push_back.active(engine.name))
        return EngineLoad(engine.name, engine.healthy, engine.in_flight, overloaded, pressure,
                          self._holdings.room(engine.name, engine.kv_tokens),
                          homed=self._homes.homed(engine.name), prefilling=engine.prefilling)

    def _pin(self, session: Session | None) -> Choice | None:
        pins = self.ctx.pins
        if not pins:
            return None
        return pins[(session.turns if session is not None else 0) % len(pins)]

    def _facts(self, turn: Turn, prompt_ids: list[int], home: Engine, other: Engine | None,
               place: SessionPlace | None) -> TurnFacts:
        """What each engine holds of the prompt: the history's prefix the prompt keeps, on
        the home where it served the last turn, on the other engine as far as its copy goes."""
        session, prompt = turn.session, len(prompt_ids)
        shared = 0
        if session is not None and place is not None:
            shared = (common_prefix_len(prompt_ids, session.tokens) if place.tokens_current
                      else min(prompt, place.history_len))
        home_holds = shared if session is not None and session.decode == home.name else 0
        copy = place is not None and other is not None and place.copy_on == other.name
        return TurnFacts(
            prompt_tokens=prompt, home_holds=home_holds,
            helper_holds=min(shared, place.copy_tokens) if copy and place else 0,
            block_size=home.block_size,
            expected_output=round(place.expected_output) if place else 0,
            turns_since_split=place.turns_since_split if place else None,
            history_tokens=place.history_len if place else 0,
            can_push_back=self._can_push_back(turn))

    @staticmethod
    def _can_push_back(turn: Turn) -> bool:
        """The turn's history will be known (the engines give its token IDs) and another turn
        may follow."""
        return (turn.session is not None and not turn_hints(turn).final
                and gives_token_ids(turn))

    async def _carry_out(self, turn: Turn, decision: Decision, prompt_ids: list[int] | None,
                         facts: TurnFacts, placement: Placement) -> TurnPlan:
        home, prefill = self._engine(decision.home), self._engine(decision.prefill)
        # A push back names its receiver as the placement's prefill engine (`PdTurnkv.finish`
        # sends it there): the engine that computed a split, else the home's other engine.
        receiver = (prefill if prefill is not home else self._other(home)) \
            if decision.push_back else None
        keep = transfer_id(turn, "d2p") if receiver is not None else None
        decode_params = self._params(turn, send=send_or_none(keep))
        old = self.ctx.pool.named.get(turn.session.decode or "") \
            if self.ctx.pool and turn.session else None
        if decision.where == "split" or (decision.where == "move" and not decision.pull
                                         and old is not None and old.healthy):
            # From the other engine's copy, which the last push back may still be writing.
            await self._settle_push_back(turn.session)
        if prefill is not home:  # a split, or a move that pulls
            p2d = transfer_id(turn, "p2d")
            decode_params = self._params(turn, send=send_or_none(keep), receive=Receive(
                p2d, self.ctx.side_channels[prefill.name]))
            return TurnPlan(Placement(prefill, home, placement.reason),
                            prefill_params=self._params(turn, send=Send(p2d, stream=True)),
                            concurrent=True, decode_params=decode_params, prefill_send=p2d,
                            decode_send=keep, decision=decision)
        # Whole (or a move that recomputes): the home alone.
        held = prompt_ids is not None and facts.home_holds > 0 and decision.where == "whole"
        alone = DecodeAlone(prompt_ids, len(prompt_ids) - facts.home_holds if prompt_ids
                            else 0, held=held)
        return TurnPlan(Placement(receiver or home, home, placement.reason),
                        prefill_params=None, alone=alone, decode_params=decode_params,
                        decode_send=keep, decision=decision)

    # -- after it ----------------------------------------------------------------------------

    def finish(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        decision = plan.decision
        if decision is not None and end.how == "complete" and end.stats is not None:
            self._observe(turn, plan, decision, end)
        if plan.prefill_send or plan.decode_send or (plan.alone is not None and plan.alone.held):
            super().finish(turn, plan, end)  # the P/D form: sends, push back, a held delta
        elif end.how == "complete":  # the home alone, nothing sent: only the lease's prefetch
            self._schedule_prefetch(turn, plan)

    def _observe(self, turn: Turn, plan: TurnPlan, decision: Decision, end: TurnEnd) -> None:
        stats = end.stats
        assert stats is not None
        tokens, times = stats.prompt_tokens, stats.times
        decode = plan.placement.decode
        alone = plan.alone is not None
        computed = tokens.decode_computed if alone else tokens.prefill_computed
        computing = decode if alone else plan.placement.prefill
        self.planner.costs.observe_prefill(computing.name, tokens.total, computed,
                                           times.engine_prefill_ms)
        self.planner.costs.observe_decode(decode.name, decode.in_flight, times.first_token_ms,
                                          times.total_ms, stats.completion_tokens)
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
            # An untokenized turn that computed more than its delta: the home lost the
            # history (memory pressure), as a held short delta tells (`_judge_short_delta`).
            # (Its delta is counted as if the history was not edited: an edit reads as
            # pressure, and only holds push backs off for a while.)
            self._pressure.record(decode.name, True)
        history_len = tokens.total + stats.completion_tokens
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
        elif decision.where == "move":
            # Moved to its copy: the old home keeps the history as it was.
            old_home = self._other(decode)
            place.copy_on = old_home.name if old_home is not None else None
            place.copy_tokens = place.history_len
        place.history_len = history_len
        held = {decode.name: history_len}
        if place.copy_on is not None and place.copy_on != decode.name:
            held[place.copy_on] = place.copy_tokens
        self._holdings.hold(session.key, held)

    def _prefetch_pays(self, engine: Engine) -> bool:
        """Where the sessions the engine is home to fit its cache and, under the planner,
        only where it lost a held history lately (a turn there computed more than its delta).
        Elsewhere the history is still resident, so the prefetch is only a request on the
        engine (a `/tokenize` too, for an untokenized turn), which the turn then waits for
        when it comes back while the engine is busy; and where the homes' histories do not
        fit, it makes one resident by evicting another's, which that session's turn then
        restores."""
        if self.planned and not self._pressure.active(engine.name):
            return False
        room = self._holdings.room(engine.name, engine.kv_tokens)
        return room is None or room > 0

    def forget_session(self, session: Session) -> None:
        super().forget_session(session)
        self._homes.forget(session.key)
        self._places.pop(session.key, None)
        self._holdings.drop(session.key)

    def drop_session(self, session: Session) -> None:
        place = self._places.get(session.key)
        copy_on = place.copy_on if place is not None else None
        if copy_on is not None and copy_on not in (session.prefill, session.decode):
            # The copy an earlier turn left on an engine the last turn did not name: the
            # session is ending, so naming it lets `PdTurnkv` release its lease with the rest.
            session.prefill = copy_on
        super().drop_session(session)
