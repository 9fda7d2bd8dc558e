"""The `turnkv` mode as the planner places each turn (no `--fixed-pools`): each session homed
on either engine of its pair, each turn whole, split or moved, the decision in its stats."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from turnkv.protocol import CacheHints, KvMoved, PromptTokens, RouterTurnStats, TurnTimes
from turnkv.stats import TurnStats as SdkTurnStats
from turnkv_server.engine.protocol import parse
from turnkv_server.router import stats
from turnkv_server.router.config import RouterConfig, from_args
from turnkv_server.router.decisions import SessionPlace, Where
from turnkv_server.router.engines import Engine, EnginePool, Placement, Upstream
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import ModeContext, Turn, TurnEnd, TurnPlan
from turnkv_server.router.modes.planned import Turnkv
from turnkv_server.router.sessions import SessionKey

from .test_router_turnkv_mode import DECODE, PREFILL, Tokenizer, turn
from .test_tool_calling import up_config

CHANNELS = {"prefill-0": "127.0.0.1:5601", "decode-0": "127.0.0.1:5602"}


class NoTokenizer(Upstream):
    """An upstream that fails a test asking it to tokenize."""

    async def tokenize(self, engine: Engine, body: dict[str, object]) -> list[int]:
        raise AssertionError("the planner tokenized a turn it did not need to")


def planned(upstream: Upstream | None = None, pins: tuple[Where, ...] = ()) -> Turnkv:
    pool = EnginePool.from_urls([PREFILL], [DECODE])
    ctx = ModeContext(upstream=upstream or NoTokenizer(), prefill_peers={},
                      decoder_kv_ttl=120.0, side_channels=CHANNELS, pool=pool, pins=pins)
    mode = make_mode("turnkv", ctx)
    assert isinstance(mode, Turnkv)
    return mode


def engine(mode: Turnkv, name: str) -> Engine:
    found = mode.ctx.pool.by_name(name)  # type: ignore[union-attr]
    assert found is not None
    return found


def place(mode: Turnkv, t: Turn) -> Placement:
    session = t.session
    return mode.ctx.pool.place(  # type: ignore[union-attr]
        prefill=session.prefill if session else None,
        decode=session.decode if session else None, prefix_id=None)


def served(mode: Turnkv, t: Turn, plan: TurnPlan, *, total: int, computed: int,
           engine_ms: float | None = None, completion: int = 10) -> None:
    """The turn ended whole: the mode hears of it and the session remembers its placement."""
    tokens = (PromptTokens(total=total, decode_computed=computed) if plan.alone is not None
              else PromptTokens(total=total, prefill_computed=computed))
    end = TurnEnd("complete", stats=RouterTurnStats(
        mode="turnkv", prompt_tokens=tokens, completion_tokens=completion,
        times=TurnTimes(engine_prefill_ms=engine_ms, first_token_ms=10.0, total_ms=100.0)))
    mode.finish(t, plan, end)
    assert t.session is not None
    t.session.prefill, t.session.decode = plan.placement.prefill.name, plan.placement.decode.name
    t.session.turns += 1


def test_an_idle_homes_turn_is_served_whole_there_without_tokenizing() -> None:
    mode = planned()
    t = turn()
    plan = asyncio.run(mode.plan(t, place(mode, t)))
    assert plan.prefill_params is None and plan.alone is not None
    assert plan.placement.prefill is plan.placement.decode
    assert plan.decision is not None and plan.decision.where == "whole"
    decode = parse(plan.decode_params)
    assert decode is not None and decode.send is None and decode.receive is None


def test_sessions_are_homed_on_either_engine_and_stay_there() -> None:
    mode = planned()
    homes = []
    for name in ("a", "b"):
        t = turn()
        assert t.session is not None
        t.session.key = SessionKey("tenant-a", name)
        plan = asyncio.run(mode.plan(t, place(mode, t)))
        served(mode, t, plan, total=3, computed=3)
        homes.append(plan.placement.decode.name)
        # Its next turn stays home, whichever role the launcher gave that engine.
        again = asyncio.run(mode.plan(t, place(mode, t)))
        assert again.placement.decode.name == homes[-1]
        assert again.decision is not None and again.decision.where == "whole"
    assert sorted(homes) == ["decode-0", "prefill-0"]


def test_new_sessions_alternate_even_where_their_prefix_is_warm_on_one_engine() -> None:
    """The pool places a new session where its prefix ID last ran: for a whole turn, one
    engine as both prefill and decode. The planned mode still homes new sessions on the
    engine of the pair home to fewer, so that a shared system prompt does not crowd one."""
    mode = planned()
    homes = []
    for name in "abcd":
        t = turn()
        assert t.session is not None
        t.session.key = SessionKey("tenant-a", name)
        warm = engine(mode, "prefill-0")
        plan = asyncio.run(mode.plan(t, Placement(warm, warm, "prefix_warm")))
        homes.append(plan.placement.decode.name)
    assert sorted(homes) == ["decode-0", "decode-0", "prefill-0", "prefill-0"]


def test_a_move_to_the_copy_waits_for_the_push_back_that_writes_it() -> None:
    """The other engine's copy may still be arriving (the last turn's push back): a turn
    moved there waits for it, as a split does, rather than recomputing the history."""
    async def main() -> None:
        mode = planned(Tokenizer([5] * 400))
        t = turn()
        assert t.session is not None and mode.ctx.pool is not None
        home, other = engine(mode, "decode-0"), engine(mode, "prefill-0")
        t.session.prefill, t.session.decode = other.name, home.name
        t.session.tokens = [5] * 380
        mode._places[t.session.key] = SessionPlace(copy_on=other.name, copy_tokens=380,
                                                   history_len=380, tokens_current=True)
        home.in_flight = mode.ctx.pool.max_in_flight  # overloaded: the session moves
        landed = asyncio.Event()

        async def push_back() -> None:
            await landed.wait()

        t.session.mode_state.push_back = asyncio.create_task(push_back())
        planning = asyncio.create_task(mode.plan(t, place(mode, t)))
        await asyncio.sleep(0.05)
        assert not planning.done()  # waiting for the copy
        landed.set()
        plan = await planning
        assert plan.decision is not None
        assert (plan.decision.where, plan.decision.pull) == ("move", False)
        assert plan.placement.decode is other and plan.prefill_params is None

    asyncio.run(main())


def test_a_long_delta_on_a_busy_home_is_split_to_the_other_engine() -> None:
    history, delta = [1] * 3000, [2] * 3000
    mode = planned(Tokenizer(history + delta))
    t = turn()
    assert t.session is not None
    t.session.prefill = t.session.decode = "decode-0"
    t.session.tokens = history
    mode._places[t.session.key] = SessionPlace(history_len=len(history), tokens_current=True)
    engine(mode, "decode-0").in_flight = 3  # other sessions decoding there
    plan = asyncio.run(mode.plan(t, place(mode, t)))
    assert plan.decision is not None and plan.decision.where == "split", plan.decision
    assert (plan.placement.prefill.name, plan.placement.decode.name) == ("prefill-0",
                                                                         "decode-0")
    prefill, decode = parse(plan.prefill_params), parse(plan.decode_params)
    assert prefill is not None and prefill.send is not None
    assert decode is not None and decode.receive is not None
    assert decode.receive.transfer_id == prefill.send.transfer_id
    assert decode.receive.peer == CHANNELS["prefill-0"]
    # A session that splits keeps a copy on the other engine for its next split.
    assert plan.decision.push_back and decode.send is not None


def test_a_split_stays_whole_where_the_other_engines_leases_fill_its_cache() -> None:
    """The router counts what the sessions homed on each engine hold there: where the other
    engine's cache is full of them, a split would end their leases, so the turn stays home."""
    history, delta = [1] * 3000, [2] * 3000
    mode = planned(Tokenizer(history + delta))
    for name in ("decode-0", "prefill-0"):
        engine(mode, name).block_size, engine(mode, name).kv_tokens = 16, 20_000
    # Three sessions homed on the other engine, 5,000 tokens of history each.
    for i in range(3):
        other = turn()
        assert other.session is not None
        other.session.key = SessionKey("tenant-a", f"other-{i}")
        other.session.prefill = other.session.decode = "prefill-0"
        plan = asyncio.run(mode.plan(other, place(mode, other)))
        served(mode, other, plan, total=4990, computed=4990)
    assert mode._holdings.held("prefill-0") == 3 * 5000
    t = turn()
    assert t.session is not None
    t.session.prefill = t.session.decode = "decode-0"
    t.session.tokens = history
    mode._places[t.session.key] = SessionPlace(history_len=len(history), tokens_current=True)
    engine(mode, "decode-0").in_flight = 3
    plan = asyncio.run(mode.plan(t, place(mode, t)))
    assert plan.decision is not None and plan.decision.where == "whole", plan.decision
    assert "would end leases" in plan.decision.why
    # The other sessions end: their leases go, and the same turn splits.
    for i in range(3):
        gone = turn()
        assert gone.session is not None
        gone.session.key = SessionKey("tenant-a", f"other-{i}")
        mode.forget_session(gone.session)
    assert mode._holdings.held("prefill-0") == 0
    plan = asyncio.run(mode.plan(t, place(mode, t)))
    assert plan.decision is not None and plan.decision.where == "split", plan.decision


def test_a_prefetch_only_where_the_home_lost_histories_and_its_sessions_fit() -> None:
    """A hinted pause is prefetched only where the home lost a held history lately (its
    histories are being evicted) and holds every history it is home to. Without such a loss
    the history is resident and the prefetch only costs the engine a request, which the turn
    waits for; where the homes' histories do not fit, it would evict another's to load this
    one's."""
    async def main(kv_tokens: int, lost: bool) -> bool:
        mode = planned()
        for name in ("decode-0", "prefill-0"):
            engine(mode, name).block_size, engine(mode, name).kv_tokens = 16, kv_tokens
            mode._pressure.record(name, lost)
        t = turn(CacheHints(next_turn_in=30))
        plan = await mode.plan(t, place(mode, t))
        t.prompt_token_ids, t.output_token_ids = [5] * 3000, [6] * 10
        served(mode, t, plan, total=3000, computed=3000)
        assert t.session is not None
        scheduled = t.session.key in mode._prefetches.pending
        mode.forget_session(t.session)
        return scheduled

    assert asyncio.run(main(kv_tokens=20_000, lost=True))
    assert not asyncio.run(main(kv_tokens=20_000, lost=False))
    assert not asyncio.run(main(kv_tokens=3_000, lost=True))


@pytest.mark.parametrize("pins", [("whole", "split", "move"), ("split", "move", "whole")])
def test_pinned_placements_are_carried_out_turn_by_turn(pins: tuple[Where, ...]) -> None:
    async def main() -> None:
        mode = planned(Tokenizer([5] * 40), pins=pins)
        t = turn()
        for where in pins:
            home = t.session.decode if t.session else None
            plan = await mode.plan(t, place(mode, t))
            decision = plan.decision
            assert decision is not None and decision.where == where and decision.pinned
            if where == "whole":
                assert plan.alone is not None and plan.prefill_params is None
            else:
                assert plan.alone is None and plan.prefill_params is not None
                assert plan.placement.prefill is not plan.placement.decode
            if where == "move" and home is not None:
                # Pulled from the old home, which computes, to the new one.
                assert plan.placement.prefill.name == home != plan.placement.decode.name
            served(mode, t, plan, total=40, computed=40)
        # The push backs and give-ups it spawned (nobody listens: they fail).
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


def test_push_back_only_where_the_planner_decided_it() -> None:
    """A copy goes to the other engine only where it has room for it (and only from a turn
    whose prompt the router read: an idle home's turn is not tokenized)."""
    async def main() -> None:
        mode = planned(Tokenizer([5] * 40), pins=("whole", "split"))
        for name in ("decode-0", "prefill-0"):
            engine(mode, name).block_size, engine(mode, name).kv_tokens = 16, 40
        t = turn()
        plan = await mode.plan(t, place(mode, t))
        assert plan.decision is not None and not plan.decision.push_back
        assert plan.decode_send is None
        t.prompt_token_ids, t.output_token_ids = [5] * 40, [6] * 10
        served(mode, t, plan, total=40, computed=40)
        assert t.session is not None and t.session.mode_state.push_back is None
        for name in ("decode-0", "prefill-0"):
            engine(mode, name).kv_tokens = 10_000
        plan = await mode.plan(t, place(mode, t))
        assert plan.decision is not None and plan.decision.push_back
        served(mode, t, plan, total=40, computed=40)
        task = t.session.mode_state.push_back
        assert isinstance(task, asyncio.Task)  # sent to the other engine (nobody listens)
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_planned_prompt_is_counted_ahead_on_its_engine_until_its_turn_ends() -> None:
    """The split's prompt, estimated when planned, is what the next prompt placed on the
    helper queues behind while the helper has not answered it (the mode's clock stands
    still: none of it is done yet)."""
    async def main() -> None:
        history, delta = [1] * 3000, [2] * 3000
        mode = planned(Tokenizer(history + delta))
        mode.ctx.clock = lambda: 100.0
        t = turn()
        assert t.session is not None
        t.session.prefill = t.session.decode = "decode-0"
        t.session.tokens = history
        mode._places[t.session.key] = SessionPlace(history_len=len(history),
                                                   tokens_current=True)
        engine(mode, "decode-0").in_flight = 3
        plan = await mode.plan(t, place(mode, t))
        assert plan.decision is not None and plan.decision.where == "split"
        compute = plan.decision.estimates["compute_ms"]
        helper = engine(mode, "prefill-0")
        helper.in_flight = helper.prefilling = 1  # the split's prefill request, unanswered
        assert compute > 0 and mode._load(helper).prefill_wait_ms == pytest.approx(compute)
        assert mode._load(engine(mode, "decode-0")).prefill_wait_ms == 0
        served(mode, t, plan, total=6000, computed=3000)
        assert mode._load(helper).prefill_wait_ms == 0
        # The copy it sent meanwhile (nobody listens: it fails).
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


class GatedTokenizer(Tokenizer):
    """Engines that render every prompt as `tokens`, each render answered when the test lets
    it (`gates`, one per render asked, in order)."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.gates: list[asyncio.Event] = []

    async def tokenize(self, engine: Engine, body: dict[str, object]) -> list[int]:
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return self.tokens


def test_a_turn_planned_while_its_prompt_was_rendered_counts_in_the_decision() -> None:
    """Two sessions' long deltas on one busy home, planned at once: each waits for its render
    (/tokenize), and the one decided second weighs the first's prompt ahead on the helper,
    as if they had come one after the other (in a benchmark both were decided onto one engine
    at the same moment, neither counting the other)."""
    history, delta = [1] * 3000, [2] * 3000

    def session_turn(mode: Turnkv, name: str) -> Turn:
        t = turn()
        assert t.session is not None
        t.session.key = SessionKey("tenant-a", name)
        t.session.prefill = t.session.decode = "decode-0"
        t.session.tokens = history
        mode._places[t.session.key] = SessionPlace(history_len=len(history),
                                                   tokens_current=True, turns_since_split=0)
        return t

    def busy(tokens: Upstream) -> Turnkv:
        mode = planned(tokens)
        mode.ctx.clock = lambda: 100.0
        engine(mode, "decode-0").in_flight = 3  # other sessions decoding on the home
        return mode

    async def one_after_the_other() -> TurnPlan:
        mode = busy(Tokenizer(history + delta))
        first, second = session_turn(mode, "a"), session_turn(mode, "b")
        assert (await mode.plan(first, place(mode, first))).decision.where == "split"
        helper = engine(mode, "prefill-0")
        helper.in_flight = helper.prefilling = 1  # the split's prefill request
        return await mode.plan(second, place(mode, second))

    async def at_once() -> TurnPlan:
        tokens = GatedTokenizer(history + delta)
        mode = busy(tokens)
        first, second = session_turn(mode, "a"), session_turn(mode, "b")
        planning = [asyncio.ensure_future(mode.plan(t, place(mode, t)))
                    for t in (first, second)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(tokens.gates) == 2  # both read the engines' load, both wait for a render
        tokens.gates[0].set()
        assert (await planning[0]).decision.where == "split"
        helper = engine(mode, "prefill-0")
        helper.in_flight = helper.prefilling = 1
        tokens.gates[1].set()
        return await planning[1]

    sequential, concurrent = asyncio.run(one_after_the_other()), asyncio.run(at_once())
    assert sequential.decision is not None and concurrent.decision is not None
    assert sequential.decision.where == "whole"  # the first's prompt ahead on the helper
    assert concurrent.decision.where == sequential.decision.where
    assert concurrent.decision.why == sequential.decision.why  # every option weighed alike


def test_a_prompt_not_read_is_counted_ahead_at_its_estimated_delta() -> None:
    """An idle home's turn is not tokenized; its prompt's length is estimated at the session's
    last tokens per byte of request, and what it adds to the history is what a prompt placed
    after it on that engine is counted to wait for (not a typical prompt's time)."""
    async def main() -> None:
        mode = planned()
        mode.ctx.clock = lambda: 100.0
        first = turn()
        first.body["messages"] = [{"role": "user", "content": "x" * 4000}]
        plan = await mode.plan(first, place(mode, first))
        assert plan.decision is not None and plan.decision.where == "whole"
        home = plan.placement.decode
        served(mode, first, plan, total=1000, computed=1000, engine_ms=1000.0, completion=10)
        later = turn()
        later.session = first.session
        later.body["messages"] = [{"role": "user", "content": "x" * 16_000}]
        plan = await mode.plan(later, place(mode, later))
        assert plan.decision is not None and plan.decision.where == "whole"
        assert plan.placement.decode is home
        # About four times the bytes: about 4,000 tokens, some 3,000 of them new; at the 1 ms
        # a token the first measured (a typical prompt: 1,000 ms).
        compute = plan.decision.estimates["compute_ms"]
        assert 2_500 < compute < 3_500
        home.in_flight = home.prefilling = 1
        assert mode._load(home).prefill_wait_ms == pytest.approx(compute)

    asyncio.run(main())


class CountingTokenizer(Tokenizer):
    """`Tokenizer`, counting the turns it rendered."""

    calls = 0

    async def tokenize(self, engine: Engine, body: dict[str, object]) -> list[int]:
        self.calls += 1
        return await super().tokenize(engine, body)


def test_a_busy_homes_short_delta_is_whole_unread_where_no_copy_could_follow() -> None:
    """A busy home's turn is read for a split, a move or a push back. Where its delta, as the
    request's size estimates it, is short enough that whole is still the least waiting taken
    twice as long, and no copy could be pushed back after it (the engines share a
    tier), no /tokenize round trip is spent: the turn is whole, unread. A long delta is read,
    and so is a short one where a copy could follow (no shared tier)."""
    async def second_turn(new_bytes: int, shared_tier: bool) -> tuple[int, str, str]:
        upstream = CountingTokenizer([1] * (1000 + new_bytes // 4))
        mode = planned(upstream)
        mode.ctx.shared_tier = shared_tier
        for name in CHANNELS:  # both alike: 1 ms a token computed, 2 ms a token read
            mode.planner.costs.observe_prefill(name, 1000, 1000, 1000.0)
            mode.planner.costs.observe_prefill(name, 2000, 1000, 3000.0, restored=1000)
        first = turn()
        first.body["messages"] = [{"role": "user", "content": "x" * 4000}]
        plan = await mode.plan(first, place(mode, first))
        served(mode, first, plan, total=1000, computed=1000, engine_ms=1000.0)
        plan.placement.decode.in_flight = 3  # other sessions decoding on the home
        later = turn()
        later.session = first.session
        later.body["messages"] = [{"role": "user", "content": "x" * (4000 + new_bytes)}]
        plan = await mode.plan(later, place(mode, later))
        assert plan.decision is not None
        return upstream.calls, plan.decision.where, plan.decision.why

    calls, where, why = asyncio.run(second_turn(400, shared_tier=True))
    assert (calls, where) == (0, "whole") and "not read" in why, why
    calls, where, why = asyncio.run(second_turn(12_000, shared_tier=True))
    assert calls == 1 and where != "whole", why
    calls, where, why = asyncio.run(second_turn(400, shared_tier=False))
    assert calls == 1 and where == "whole" and "not read" not in why, why


def test_what_a_turn_measured_feeds_the_cost_model() -> None:
    mode = planned()
    t = turn()
    plan = asyncio.run(mode.plan(t, place(mode, t)))
    home = plan.placement.decode.name
    assert not mode.planner.costs.measured(home)
    served(mode, t, plan, total=1000, computed=1000, engine_ms=500.0)
    assert mode.planner.costs.prefill_ms_per_token(home, 1000) == (0.5, True)


def test_a_prompt_sent_beside_another_on_its_engine_cannot_raise_its_cost() -> None:
    """Two sessions' first turns reach one engine at once: the second is planned while the
    first is unanswered there, and the engine's timing of it may hold the first's compute.
    It teaches the cost model nothing upward; the first, alone, does."""
    async def main() -> None:
        mode = planned()
        first, second = turn(), turn()
        plan_1 = await mode.plan(first, place(mode, first))
        home = plan_1.placement.decode
        home.in_flight = home.prefilling = 1  # the first turn's request, unanswered
        other = engine(mode, "prefill-0" if home.name == "decode-0" else "decode-0")
        other.in_flight = other.prefilling = 1  # as busy: the turn goes whole, unread
        assert second.session is not None
        second.session.prefill = second.session.decode = home.name
        plan_2 = await mode.plan(second, place(mode, second))
        assert plan_2.placement.decode is home
        served(mode, first, plan_1, total=1000, computed=1000, engine_ms=500.0)
        served(mode, second, plan_2, total=1000, computed=100, engine_ms=600.0)
        assert mode.planner.costs.prefill_ms_per_token(home.name, 1000) == (0.5, True)

    asyncio.run(main())


def test_a_splits_stats_teach_the_helpers_tier_read_and_the_homes_tail() -> None:
    """The helper computed 200 tokens and read 2,000 from its tier in 500 ms: at the 0.5 ms a
    token its prompts measured, 400 ms of reading. The home's first token came 100 ms after
    the helper answered (the turn's first 405 ms less its 5 ms of planning and 300 ms of
    prefill request), 500 tokens of KV written into it."""
    async def main() -> None:
        mode = planned(Tokenizer([5] * 2200), pins=("split",))
        t = turn()
        plan = await mode.plan(t, place(mode, t))
        assert plan.decision is not None and plan.decision.where == "split"
        helper, home = plan.placement.prefill.name, plan.placement.decode.name
        costs = mode.planner.costs
        costs.observe_prefill(helper, 2200, computed=1000, engine_ms=500.0)
        mode.finish(t, plan, TurnEnd("complete", stats=RouterTurnStats(
            mode="turnkv", completion_tokens=10, kv=KvMoved(to_decode_tokens=500),
            prompt_tokens=PromptTokens(total=2200, prefill_computed=200,
                                       prefill_restored=2000),
            times=TurnTimes(engine_prefill_ms=500.0, plan_ms=5.0, prefill_ms=300.0,
                            first_token_ms=405.0, total_ms=600.0))))
        assert costs.tier_read_ms(helper, 1000) == pytest.approx(200.0)
        assert costs.prefill_ms_per_token(helper, 2200) == (0.5, True)
        assert costs.split_overhead_ms(home) == pytest.approx(100.0 - costs.transfer_ms(500))
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


def test_a_home_that_lost_the_history_is_under_pressure_and_gets_no_copy() -> None:
    async def main() -> None:
        mode = planned(Tokenizer([5] * 2000), pins=("whole", "split", "whole"))
        t = turn()
        plan = await mode.plan(t, place(mode, t))
        served(mode, t, plan, total=1000, computed=1000)
        assert t.session is not None
        home = t.session.decode
        assert home is not None
        assert not mode._load(engine(mode, home)).pressure
        # Untokenized (an idle home): it computed the whole history again, not its delta.
        mode.ctx.pins = ()
        t.prompt_token_ids = None
        plan = await mode.plan(t, place(mode, t))
        assert plan.alone is not None and plan.alone.prompt_token_ids is None
        served(mode, t, plan, total=1100, computed=1100)
        assert mode._load(engine(mode, home)).pressure
        # Now even a split keeps no copy on the other engine.
        mode.ctx.pins = ("split",)
        plan = await mode.plan(t, place(mode, t))
        assert plan.decision is not None and plan.decision.where == "split"
        assert not plan.decision.push_back and plan.decode_send is None
        # The copies it sent meanwhile (nobody listens: they fail).
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


def test_the_turns_stats_carry_the_decision_and_parse_in_the_sdk() -> None:
    mode = planned(Tokenizer([5] * 40), pins=("split",))
    t = turn(CacheHints())
    plan = asyncio.run(mode.plan(t, place(mode, t)))
    t.prompt_token_ids = [5] * 40
    turn_stats = stats.begin(t, plan, None, "turnkv", None, None)
    assert turn_stats.placement is not None and turn_stats.placement.where == "split"
    assert turn_stats.placement.pinned and "pinned" in turn_stats.placement.why
    again = RouterTurnStats.model_validate_json(turn_stats.model_dump_json())
    assert again.placement == turn_stats.placement
    # The SDK's stats of a turn read it too.
    client_side = SdkTurnStats.from_wire(orjson.loads(turn_stats.model_dump_json()))
    assert client_side.placement is not None and client_side.placement.where == "split"
    assert client_side.wire().placement == turn_stats.placement


def test_fixed_pools_and_pins_are_router_options() -> None:
    import argparse

    from turnkv_server.router.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engines: dict[str, Any] = dict(prefill=[PREFILL], decode=[DECODE],
                                   prefill_nixl=["p@h:1"], decode_nixl=["d@h:2"])
    args = ["--prefill", PREFILL, "--decode", DECODE, "--prefill-nixl", "p@h:1",
            "--decode-nixl", "d@h:2"]
    config = from_args(parser.parse_args([*args, "--fixed-pools"]))
    assert config.fixed_pools and config.pins() == ()
    config = from_args(parser.parse_args([*args, "--pin-placement", "whole, split,move"]))
    assert config.pins() == ("whole", "split", "move") and not config.fixed_pools
    with pytest.raises(ValueError, match="choose among"):
        RouterConfig(**engines, pin_placement="whole,sideways")
    with pytest.raises(ValueError, match="planner"):
        RouterConfig(**engines, pin_placement="whole", fixed_pools=True)
    with pytest.raises(ValueError, match="fixed-pools"):
        RouterConfig(engine=[DECODE], mode="affinity", fixed_pools=True)


def test_turnkv_up_passes_fixed_pools_to_its_router(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    assert "--fixed-pools" not in up_config(monkeypatch, tmp_path).router_args
    assert "--fixed-pools" in up_config(monkeypatch, tmp_path, "--fixed-pools").router_args


def test_a_turn_without_a_session_goes_whole_to_the_less_busy_engine() -> None:
    mode = planned()
    engine(mode, "prefill-0").in_flight = 2
    t = turn(session=False)
    plan = asyncio.run(mode.plan(t, mode.ctx.pool.round_robin()))  # type: ignore[union-attr]
    assert plan.decision is not None and plan.decision.where == "whole"
    assert plan.placement.decode.name == "decode-0" and plan.decode_send is None
