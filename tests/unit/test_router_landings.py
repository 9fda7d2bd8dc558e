"""Turns that move KV, and the prompts held back from their engines until they land
(`router.landings.Landings`), alone and as the `turnkv` mode plans a split and a turn after it.
The clock is a number the test moves; the waits are asyncio's, a few ms each."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from turnkv_server.router.config import RouterConfig, add_arguments, from_args
from turnkv_server.router.decisions import Decision, SessionPlace
from turnkv_server.router.engines import EnginePool, Upstream
from turnkv_server.router.landings import OVERDUE_S, Landings
from turnkv_server.router.modes.base import ModeContext, Turn
from turnkv_server.router.sessions import Session, SessionKey

from .test_router_turnkv_mode import DECODE, PREFILL, Tokenizer, turn
from .test_router_turnkv_planned import engine, place, planned


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def split(prefill_done_ms: float = 400.0, ttft_ms: float = 500.0) -> Decision:
    return Decision("split", "home", "helper", estimates={
        "compute_ms": 300.0, "prefill_done_ms": prefill_done_ms, "ttft_ms": ttft_ms})


def whole(engine: str, compute_ms: float) -> Decision:
    return Decision("whole", engine, engine, why="the least waiting",
                    estimates={"compute_ms": compute_ms})


async def pending(landings: Landings, decision: Decision) -> asyncio.Task[Decision]:
    """The turn's hold, started and left waiting (a few loop turns in)."""
    task = asyncio.ensure_future(landings.hold(decision))
    for _ in range(5):
        await asyncio.sleep(0)
    return task


def test_a_prompt_that_would_hold_a_landing_longer_than_it_waits_is_held_until_it_lands() -> None:
    async def main() -> None:
        landings = Landings(Clock())
        landings.begin("split", split(ttft_ms=500.0))
        held = await pending(landings, whole("home", compute_ms=5000.0))
        assert not held.done()
        landings.end("split")  # its first token
        decision = await asyncio.wait_for(held, 1.0)
        assert "held" in decision.why and "landing on home" in decision.why
        assert decision.estimates["held_ms"] == 0.0  # the test's clock stood still
        assert decision.estimates["compute_ms"] == 5000.0
        assert not landings.parts

    asyncio.run(main())


def test_a_prompt_shorter_than_the_landings_time_left_goes_at_once() -> None:
    async def main() -> None:
        landings = Landings(Clock())
        landings.begin("split", split(ttft_ms=500.0))
        short = whole("home", compute_ms=100.0)
        assert await asyncio.wait_for(landings.hold(short), 1.0) is short
        # On an engine the split does not use, even a long one goes.
        other = whole("third", compute_ms=9000.0)
        assert await asyncio.wait_for(landings.hold(other), 1.0) is other

    asyncio.run(main())


def test_the_helpers_part_ends_when_its_prompt_is_answered() -> None:
    async def main() -> None:
        landings = Landings(Clock())
        landings.begin("split", split(prefill_done_ms=400.0, ttft_ms=500.0))
        on_helper = await pending(landings, whole("helper", compute_ms=5000.0))
        on_home = await pending(landings, whole("home", compute_ms=5000.0))
        landings.prefilled("split")
        await asyncio.wait_for(on_helper, 1.0)
        assert not on_home.done()  # the home's part lasts to the first token
        landings.end("split")
        await asyncio.wait_for(on_home, 1.0)

    asyncio.run(main())


def test_a_one_engine_move_has_one_part_until_its_first_token() -> None:
    async def main() -> None:
        landings = Landings(Clock())
        move = Decision("move", "helper", "helper", estimates={"compute_ms": 200.0,
                                                               "ttft_ms": 250.0})
        landings.begin("move", move)
        held = await pending(landings, whole("helper", compute_ms=1000.0))
        landings.prefilled("move")  # no prefill request of its own: nothing ends
        await asyncio.sleep(0.01)
        assert not held.done()
        landings.end("move")
        await asyncio.wait_for(held, 1.0)

    asyncio.run(main())


def test_the_planner_is_told_the_time_each_part_not_done_has_left() -> None:
    clock = Clock()
    landings = Landings(clock)
    landings.begin("split", split(prefill_done_ms=400.0, ttft_ms=900.0))
    assert landings.left_ms("helper") == pytest.approx((400.0,))
    assert landings.left_ms("home") == pytest.approx((900.0,))
    clock.now += 0.5
    landings.prefilled("split")
    assert landings.left_ms("helper") == ()
    assert landings.left_ms("home") == pytest.approx((400.0,))
    clock.now += 1.0  # past its due time, not forgotten yet: due now
    assert landings.left_ms("home") == (0.0,)
    assert landings.left_ms("elsewhere") == ()
    landings.end("split")
    assert landings.left_ms("home") == ()


def test_a_prompt_is_held_no_longer_than_its_own_compute() -> None:
    async def main() -> None:
        landings = Landings(asyncio.get_running_loop().time)
        landings.begin("split", split(ttft_ms=0.0))  # overdue: its time left is past
        decision = await asyncio.wait_for(landings.hold(whole("home", compute_ms=50.0)), 1.0)
        assert decision.estimates["held_ms"] == pytest.approx(50.0, abs=40.0)
        assert "split" in landings.parts  # still landing: only the prompt stopped waiting

    asyncio.run(main())


def test_long_overdue_parts_are_forgotten_and_the_table_is_bounded() -> None:
    async def main() -> None:
        clock = Clock()
        landings = Landings(clock, max_parts=3)
        landings.begin("old", split())
        clock.now += OVERDUE_S + 1.0
        landings.begin("new", split())
        assert list(landings.parts) == ["new"]
        for name in ("a", "b", "c"):
            landings.begin(name, split())
        assert list(landings.parts) == ["a", "b", "c"]  # the oldest went first

    asyncio.run(main())


def test_a_replanned_attempt_ends_the_last_ones_parts_and_stale_parts_hold_nothing() -> None:
    async def main() -> None:
        clock = Clock()
        landings = Landings(clock)
        landings.begin("split", split(ttft_ms=500.0))
        held = await pending(landings, whole("home", compute_ms=5000.0))
        landings.begin("split", split(ttft_ms=500.0))  # the turn's next attempt
        await asyncio.wait_for(held, 1.0)
        assert "held_ms" in held.result().estimates
        # An attempt whose end never comes: long past its due time, it holds no prompt.
        clock.now += OVERDUE_S + 1.0
        prompt = whole("home", compute_ms=60_000.0)
        assert await asyncio.wait_for(landings.hold(prompt), 1.0) is prompt
        assert not landings.parts

    asyncio.run(main())


def long_split_turn(mode: object, history: list[int]) -> Turn:
    t = turn()
    assert t.session is not None
    t.session.prefill = t.session.decode = "decode-0"
    t.session.tokens = history
    mode._places[t.session.key] = SessionPlace(  # type: ignore[attr-defined]
        history_len=len(history), tokens_current=True)
    return t


def other_session_turn(home: str) -> Turn:
    """Another session's first turn, at home on `home`."""
    t = turn()
    key = SessionKey("tenant-a", "chat-2")
    t.session = Session(key=key, created_at=0.0, last_used=0.0, expires_at=1e9,
                        prefill=home, decode=home)
    return t


def test_the_mode_holds_a_long_prompt_for_its_engines_split_until_that_lands() -> None:
    """A split planned on a busy home; then another session's long prompt, whole on that
    home (the helper is busier): held until the split's first token reaches the router."""
    async def main() -> None:
        history, delta = [1] * 3000, [2] * 3000
        mode = planned(Tokenizer(history + delta))
        first = long_split_turn(mode, history)
        engine(mode, "decode-0").in_flight = 3  # other sessions decoding there
        plan = await mode.plan(first, place(mode, first))
        assert plan.decision is not None and plan.decision.where == "split"
        assert set(mode._landings.parts) == {id(first)}
        # The next prompt: unread (no estimate), whole on the same home; prompts there
        # measured at seconds each.
        mode.planner.costs.observe_prefill("decode-0", 2000, 2000, 9000.0)
        second = other_session_turn("decode-0")
        helper = engine(mode, "prefill-0")
        helper.in_flight = helper.prefilling = 5  # busier than the home: no split for it
        task = asyncio.ensure_future(mode.plan(second, place(mode, second)))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done()
        mode.first_token(first)
        later = await asyncio.wait_for(task, 1.0)
        assert later.decision is not None and later.decision.where == "whole"
        assert "held" in later.decision.why and "held_ms" in later.decision.estimates
        assert not mode._landings.parts
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


def test_a_prompt_held_back_counts_ahead_on_its_engine_until_sent_or_dropped() -> None:
    """A long prompt held for a landing is sent when that lands or when it has waited its own
    compute: meanwhile its engine is not idle for the planner (in a benchmark, a short prompt
    split onto that engine as if it were, estimated at ~0.5 s, waited 19 s behind it)."""
    async def main() -> None:
        history, delta = [1] * 3000, [2] * 3000
        mode = planned(Tokenizer(history + delta))
        load = mode._load  # type: ignore[attr-defined]
        first = long_split_turn(mode, history)
        home = engine(mode, "decode-0")
        home.in_flight = 3
        plan = await mode.plan(first, place(mode, first))
        assert plan.decision is not None and plan.decision.where == "split"
        mode.planner.costs.observe_prefill("decode-0", 2000, 2000, 9000.0)
        helper = engine(mode, "prefill-0")
        helper.in_flight = helper.prefilling = 5
        second = other_session_turn("decode-0")
        task = asyncio.ensure_future(mode.plan(second, place(mode, second)))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done()
        # Held, not sent: no request of its own on the home, and not one it answers.
        assert (home.in_flight, home.prefilling) == (3, 0)
        assert load(home).prefill_wait_ms == pytest.approx(9000.0)
        home.in_flight = 0  # the home idles meanwhile: the held prompt is still to come
        assert load(home).prefill_wait_ms == pytest.approx(9000.0)
        mode.first_token(first)
        later = await asyncio.wait_for(task, 1.0)
        assert later.decision is not None and later.decision.prefill == "decode-0"
        # Sent: one of the home's prompts not answered, as its requests count them.
        home.in_flight = home.prefilling = 1  # its compute counted since sent (a real clock)
        assert load(home).prefill_wait_ms == pytest.approx(9000.0, abs=500)
        home.prefilling = 0
        assert load(home).prefill_wait_ms == 0
        # A prompt held and then cancelled (its client left) is never sent: it counts no more.
        home.in_flight, helper.in_flight, helper.prefilling = 3, 0, 0
        again = long_split_turn(mode, history)
        plan = await mode.plan(again, place(mode, again))
        assert plan.decision is not None and plan.decision.where == "split"
        helper.in_flight = helper.prefilling = 5
        third = other_session_turn("decode-0")
        task = asyncio.ensure_future(mode.plan(third, place(mode, third)))
        for _ in range(10):
            await asyncio.sleep(0)
        assert load(home).prefill_wait_ms == pytest.approx(9000.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert load(home).prefill_wait_ms == 0
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


def test_without_landing_holds_the_mode_registers_nothing_and_holds_nothing() -> None:
    """`--no-landing-holds` (the ablation): the split goes out as before, the next prompt at
    once."""
    async def main() -> None:
        history, delta = [1] * 3000, [2] * 3000
        mode = planned(Tokenizer(history + delta))
        mode.ctx.landing_holds = False
        first = long_split_turn(mode, history)
        engine(mode, "decode-0").in_flight = 3
        plan = await mode.plan(first, place(mode, first))
        assert plan.decision is not None and plan.decision.where == "split"
        assert not mode._landings.parts
        mode.planner.costs.observe_prefill("decode-0", 2000, 2000, 9000.0)
        second = other_session_turn("decode-0")
        helper = engine(mode, "prefill-0")
        helper.in_flight = helper.prefilling = 5
        later = await asyncio.wait_for(mode.plan(second, place(mode, second)), 1.0)
        assert later.decision is not None and "held" not in later.decision.why
        await asyncio.gather(*mode._orders._background, return_exceptions=True)

    asyncio.run(main())


def test_landing_holds_are_a_turnkv_router_option() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--prefill", PREFILL, "--decode", DECODE, "--prefill-nixl", "p@h:1",
            "--decode-nixl", "d@h:2"]
    pool = EnginePool.from_urls([PREFILL], [DECODE])
    for flags, holds in (([], True), (["--no-landing-holds"], False)):
        config = from_args(parser.parse_args([*args, *flags]))
        assert ModeContext.of(config, Upstream(), pool, clock=Clock()).landing_holds is holds
    with pytest.raises(ValueError, match="--no-landing-holds is for turnkv mode"):
        RouterConfig(mode="standard", prefill=[PREFILL], decode=[DECODE],
                     no_landing_holds=True)
