"""What belongs to a turn, not to one attempt of it, survives the turn's replay.

A turn whose first attempt fails on an engine is replayed on another (`Turns._attempts`), and
the mode plans each attempt afresh; what happened before the turn (whether a prefetch of the
session's history was in time, `modes.prefetch`) happened once, and the turn's stats say it
whatever attempt served it. Through the router, under uvicorn, in front of the stand-in
engines of `test_router_affinity`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.unit.test_router_admission import until
from tests.unit.test_router_affinity import StandIn, affinity_router
from turnkv_server.router.engines import Placement
from turnkv_server.router.modes.base import Mode, Turn, TurnEnd, TurnPlan


def chat(session: str, next_turn_in: float | None = None) -> dict[str, Any]:
    hints = {} if next_turn_in is None else {"next_turn_in": next_turn_in}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "turnkv": {"session_id": session, "hints": hints}}


def record_hooks(mode: Mode) -> list[str]:
    """Wrap the mode's per-turn hooks: the list says which ran, in order."""
    calls: list[str] = []
    begin, plan, finish = mode.begin, mode.plan, mode.finish

    async def begin_(turn: Turn) -> None:
        calls.append("begin")
        await begin(turn)

    async def plan_(turn: Turn, placement: Placement) -> TurnPlan:
        calls.append("plan")
        return await plan(turn, placement)

    def finish_(turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        calls.append(f"finish {end.how}")
        finish(turn, plan, end)

    mode.begin, mode.plan, mode.finish = begin_, plan_, finish_  # type: ignore[method-assign]
    return calls


def test_a_replayed_turn_still_says_its_prefetch_was_in_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's engine made its history resident before the hinted return, then went
    down: the next turn's first attempt fails there, the replay is served by the other
    engine, and the stats still say the prefetch was in time."""
    from turnkv_server.router.modes import prefetch

    monkeypatch.setattr(prefetch, "LEAD_S", 0.3)
    monkeypatch.setattr(prefetch, "MIN_PAUSE_S", 0.5)

    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with affinity_router(engines, engine_leases=True) as (router, url), \
                httpx.AsyncClient(timeout=30) as client:
            first = await client.post(f"{url}/v1/chat/completions", json=chat("s", 0.8))
            assert first.status_code == 200, first.text
            home = router.pool.by_name(first.json()["turnkv"]["decode_node"])
            assert home is not None
            engine = engines[router.pool.decode.index(home)]
            prefetches = router.mode._prefetches.pending  # type: ignore[attr-defined]
            await until(lambda: "/v1/completions" in engine.paths, "the prefetch sent")
            await until(lambda: all(p.task.done() for p in prefetches.values()),
                        "the prefetch done")
            await engine.stop()  # the router has not noticed: its health probe is far off
            calls = record_hooks(router.mode)
            reply = await client.post(f"{url}/v1/chat/completions", json=chat("s"))
            assert reply.status_code == 200, reply.text
            stats = reply.json()["turnkv"]
            assert stats["decode_node"] != home.name and stats["moved"], stats
            assert stats["fallback"] == "engine_unavailable", stats
            assert stats["prefetch"] == "in_time", stats
            # The hooks' contract (`Mode`): `begin` once per turn, `plan` once per attempt,
            # `finish` once per attempt that tried its decode request.
            assert calls == ["begin", "plan", "finish refused", "plan", "finish complete"]

    asyncio.run(main())


def test_turnkv_takes_the_prefetch_outcome_once_per_turn_not_per_attempt() -> None:
    """In turnkv mode (here the pair as one pool) the outcome is the turn's from `begin`; each
    attempt's `plan` leaves it as it is."""
    from tests.unit.test_router_pair_pool import Tokenizer, context, turn
    from turnkv_server.router.modes import make_mode

    ctx = context(Tokenizer([1]))
    engines = ctx.pool
    assert engines is not None
    mode = make_mode("turnkv", ctx)
    first = turn("s")
    session = first.session
    assert session is not None

    async def main() -> None:
        placement = engines.place(prefill=None, decode=None, prefix_id=None)
        first.prompt_token_ids, first.output_token_ids = [1], [2]
        # After the last turn, a prefetch is scheduled for a return in a minute...
        mode._prefetches.schedule(  # type: ignore[attr-defined]
            session.key, [placement.decode], first, {}, 60.0)
        again = turn("s")
        again.session = session
        # ...and the turn comes first: the prefetch is called off, once.
        await mode.begin(again)
        assert again.prefetch == "early"
        for _ in range(2):  # the attempt and its replay
            await mode.plan(again, engines.place(prefill=None, decode=None, prefix_id=None))
            assert again.prefetch == "early"
        assert not mode._prefetches.pending  # type: ignore[attr-defined]

    asyncio.run(main())


def test_a_turns_stats_say_how_long_its_serving_attempt_was_planned() -> None:
    """`times.plan_ms` is the planning of the attempt that served the turn (a replay's, not
    the failed attempt's and the replay's together), and it is part of the first token."""

    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with affinity_router(engines) as (router, url), \
                httpx.AsyncClient(timeout=30) as client:
            plan = router.mode.plan

            async def slow_plan(turn: Turn, placement: Placement) -> TurnPlan:
                await asyncio.sleep(0.2)
                return await plan(turn, placement)

            router.mode.plan = slow_plan  # type: ignore[method-assign]
            reply = await client.post(f"{url}/v1/chat/completions", json=chat("s"))
            assert reply.status_code == 200, reply.text
            times = reply.json()["turnkv"]["times"]
            assert 200 <= times["plan_ms"] < 2000, times
            assert times["total_ms"] >= times["plan_ms"], times

    asyncio.run(main())
