"""Admission (`router/admission.py`): a new session's first turn waits while the live
sessions' histories fill the engines.

The rule and the queue run without HTTP, on a real session table and service (whose wake-ups
they rely on). Then turns through the router, under uvicorn in front of the stand-in engine of
`test_router_affinity`, with admission on.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_router_affinity import StandIn, affinity_router, stats_of, turn
from turnkv.protocol import PromptTokens, RouterTurnStats, TurnTag, TurnTimes
from turnkv_server.router.admission import Admission, ClientGone, ClientLeft, fits, is_cold
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.engines import EnginePool
from turnkv_server.router.sessions import (
    Session,
    SessionKey,
    SessionService,
    SessionTable,
    held_tokens,
)
from turnkv_server.router.stats import RouterMetrics
from turnkv_server.router.tenants import DEFAULT_TENANT

# -- the rule --------------------------------------------------------------------------------------


def test_a_newcomer_fits_while_the_live_histories_and_its_estimate_do() -> None:
    # (held tokens, sessions holding any, newcomers admitted, budget)
    # Nothing held: nothing to estimate from, nor to protect.
    assert fits(0, 0, 0, 1) and fits(0, 0, 3, 1)
    # Two live sessions of 300: a newcomer is expected to grow to 300 too. (Sessions that
    # hold nothing are not counted as holding: they leave the mean alone.)
    assert fits(600, 2, 0, 900) and not fits(600, 2, 0, 899)
    # A newcomer already admitted, its first turn under way, will hold its share as well.
    assert not fits(600, 2, 1, 1199) and fits(600, 2, 1, 1200)


def test_what_a_session_holds_and_when_it_is_cold() -> None:
    session = Session(SessionKey("t", "s"), 0.0, 0.0, 0.0)
    assert is_cold(session) and held_tokens(session) == 0
    # Served once (its index 0, as a client may count): warm. Affinity keeps no token history,
    # so the last turn's prompt and output say what the engine holds.
    session.last_stats = RouterTurnStats(mode="affinity", turn=0, completion_tokens=2,
                                   prompt_tokens=PromptTokens(total=300)).model_dump()
    assert session.turns == 0 and not is_cold(session) and held_tokens(session) == 302
    session.tokens = list(range(500))  # where the mode keeps the history, it counts
    assert held_tokens(session) == 500


def test_admission_is_off_until_the_operator_sets_what_the_engines_hold() -> None:
    from turnkv_server.router.__main__ import parse_args
    from turnkv_server.router.config import from_args

    engines = ["--mode", "standard", "--prefill", "http://p", "--decode", "http://d"]
    config = from_args(parse_args(engines))
    assert (config.admission_tokens, config.admission_max_wait_s) == (None, 120.0)
    config = from_args(parse_args([*engines, "--admission-tokens", "4096",
                                   "--admission-max-wait-s", "30"]))
    assert (config.admission_tokens, config.admission_max_wait_s) == (4096, 30.0)
    with pytest.raises(ValueError, match="admission_tokens must be positive"):
        RouterConfig(mode="standard", prefill=["p"], decode=["d"], admission_tokens=0)
    with pytest.raises(ValueError, match="admission_max_wait_s must be positive"):
        RouterConfig(mode="standard", prefill=["p"], decode=["d"], admission_max_wait_s=0.0)


def test_a_turns_stats_say_how_long_it_was_queued_and_how_long_the_engine_queued_it() -> None:
    assert TurnTimes().queue_ms == 0.0 and TurnTimes().engine_queue_ms is None
    # A router from before admission sent the engine's queue time as `queue_ms`, null where
    # the engine did not measure it: its stats still parse.
    assert TurnTimes.model_validate({"queue_ms": None}).queue_ms == 0.0


# -- the queue -------------------------------------------------------------------------------------


def queue(budget: int | None = 700, max_wait_s: float = 30.0
          ) -> tuple[Admission, SessionService, RouterMetrics]:
    """Admission over a fresh table, woken by the session service as the router wires it."""
    table, metrics = SessionTable(), RouterMetrics()
    admission = Admission(table, budget, max_wait_s, metrics)
    service = SessionService(table, on_end=lambda _: None, on_change=admission.recheck)
    return admission, service, metrics


def live(service: SessionService, name: str, tokens: int) -> Session:
    """A session that has served a turn and holds `tokens` of history."""
    session = service.table.open(SessionKey("t", name))
    session.tokens, session.turns = list(range(tokens)), 1
    session.last_stats = RouterTurnStats(mode="standard", turn=1).model_dump()
    return session


async def arrive(service: SessionService, admission: Admission, name: str,
                 gone: ClientGone | None = None) -> tuple[Session, asyncio.Task[float]]:
    """A new session's first turn, opened as the pipeline opens it, asking to be admitted."""
    session, _ = await service.begin_turn(SessionKey("t", name))
    task = asyncio.create_task(admission.admit(session, gone))
    await settled()
    return session, task


async def settled() -> None:
    """Let every task run until it waits."""
    for _ in range(5):
        await asyncio.sleep(0)


def count(metrics: RouterMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_only_a_cold_sessions_turn_waits_and_only_with_a_budget() -> None:
    async def main() -> None:
        admission, service, metrics = queue(budget=100)
        # The first newcomer: no live history to protect, so it goes however small the budget.
        _, task = await arrive(service, admission, "first")
        assert await task == 0.0
        live(service, "big", 300)  # alone over the budget
        assert await admission.admit(live(service, "warm", 50)) == 0.0
        assert await admission.admit(None) == 0.0  # sessionless
        off = Admission(service.table, None, 30.0, metrics)
        newcomer, _ = await service.begin_turn(SessionKey("t", "new"))
        assert await off.admit(newcomer) == 0.0
        assert count(metrics, "turnkv_admission_queued_total") == 0
        assert admission.waiting == 0

    asyncio.run(main())


def test_cold_turns_queue_in_order_and_go_as_sessions_end() -> None:
    async def main() -> None:
        admission, service, metrics = queue(budget=700)
        a, d = live(service, "a", 300), live(service, "d", 300)
        _, b = await arrive(service, admission, "b")
        _, c = await arrive(service, admission, "c")
        assert admission.waiting == 2 and not b.done() and not c.done()
        assert count(metrics, "turnkv_admission_waiting") == 2
        # a ends: room for one newcomer (300 held, 300 expected), and b came first; c would
        # make 900 beside b's first turn.
        await service.release(a)
        await settled()
        assert b.done() and b.result() > 0 and not c.done()
        # d ends: nothing held, nothing to protect.
        await service.release(d)
        assert await c > 0
        assert admission.waiting == 0 and count(metrics, "turnkv_admission_waiting") == 0
        assert count(metrics, "turnkv_admission_queued_total") == 2
        assert count(metrics, "turnkv_admission_timeouts_total") == 0

    asyncio.run(main())


def test_a_cold_turn_never_overtakes_an_earlier_one() -> None:
    async def main() -> None:
        admission, service, _ = queue(budget=700)
        a, _ = live(service, "a", 300), live(service, "d", 300)
        _, b = await arrive(service, admission, "b")
        service.table.release(a.key)  # room for one, but nothing said so
        _, e = await arrive(service, admission, "e")
        # e's arrival re-checked the queue from its head: b went, e waits behind it.
        assert b.done() and not e.done() and admission.waiting == 1
        e.cancel()

    asyncio.run(main())


def test_a_history_that_shrinks_lets_the_queue_on() -> None:
    async def main() -> None:
        admission, service, _ = queue(budget=700)
        a = live(service, "a", 600)
        _, b = await arrive(service, admission, "b")
        assert not b.done()
        # a's next turn edits its history down to 300 tokens.
        placement = EnginePool.from_urls(["http://p"], ["http://d"]).round_robin()
        await service.remember(a, TurnTag(session_id="a", turn=2), placement,
                               RouterTurnStats(mode="standard", turn=2), list(range(300)))
        assert await b > 0

    asyncio.run(main())


def test_a_turn_waits_at_most_the_longest_wait_then_goes() -> None:
    async def main() -> None:
        admission, service, metrics = queue(budget=100, max_wait_s=0.05)
        live(service, "a", 300)
        _, b = await arrive(service, admission, "b")
        assert await b > 0 and admission.waiting == 0
        assert count(metrics, "turnkv_admission_timeouts_total") == 1
        assert count(metrics, "turnkv_admission_queued_total") == 1

    asyncio.run(main())


def test_a_cancelled_turn_or_one_whose_client_left_leaves_nothing_behind() -> None:
    async def main() -> None:
        admission, service, metrics = queue(budget=700)
        a, _ = live(service, "a", 300), live(service, "d", 300)
        b_session, b = await arrive(service, admission, "b")
        left = asyncio.Event()
        c_session, c = await arrive(service, admission, "c", gone=left.wait)
        assert admission.waiting == 2
        b.cancel()
        await settled()
        assert b.cancelled() and admission.waiting == 1 and not c.done()
        left.set()
        with pytest.raises(ClientLeft):
            await c
        assert admission.waiting == 0 and count(metrics, "turnkv_admission_waiting") == 0
        # The pipeline ends both turns (their sessions had served nothing: gone from the table).
        for session in (b_session, c_session):
            await service.end_turn(session, opened=True, failed=True)
        # No ghost in the queue: when a ends, the next newcomer goes at once.
        await service.release(a)
        _, e = await arrive(service, admission, "e")
        assert await e == 0.0

    asyncio.run(main())


# -- through the router ----------------------------------------------------------------------------

# The router's budget: room for one of the stand-in engine's sessions (302 tokens: 300 of
# prompt, 2 of output), not for two.
ADMISSION_TOKENS = 500


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 10 s: {what}")


@pytest.mark.parametrize(("ending", "stream"), [("final", False), ("delete", True)])
def test_a_new_session_waits_for_a_live_one_to_end(ending: str, stream: bool) -> None:
    """Session a's first turn is served; b's (cold) waits while a's history fills the budget,
    a's own turns (warm) go straight through meanwhile, and b is served once a ends, by a turn
    tagged `final` or a DELETE; b's stats say it waited, a's that it did not."""

    async def main() -> None:
        engine = StandIn()
        started = affinity_router([engine], admission_tokens=ADMISSION_TOKENS)
        async with started as (router, url), httpx.AsyncClient(timeout=30) as client:
            assert (await stats_of(client, url, "a", False))["times"]["queue_ms"] == 0.0
            b = asyncio.create_task(stats_of(client, url, "b", stream))
            await until(lambda: router.admission.waiting == 1, "b's turn queued")
            assert (await stats_of(client, url, "a", True))["times"]["queue_ms"] == 0.0
            assert not b.done() and len(engine.seen) == 2  # a's turns only
            if ending == "final":
                body = {**turn("a", False), "turnkv": {"session_id": "a",
                                                       "hints": {"final": True}}}
                reply = await client.post(f"{url}/v1/chat/completions", json=body)
                assert reply.json()["turnkv"]["times"]["queue_ms"] == 0.0
            else:
                reply = await client.delete(f"{url}/v1/turnkv/sessions/a")
            assert reply.status_code == 200, reply.text
            waited = await b
            assert waited["times"]["queue_ms"] > 0 and waited["session_id"] == "b"
            assert router.admission.waiting == 0
            metrics = router.metrics.registry
            assert metrics.get_sample_value("turnkv_admission_queued_total") == 1
            assert metrics.get_sample_value("turnkv_admission_waiting") == 0

    asyncio.run(main())


def test_a_client_that_leaves_while_queued_leaves_no_turn_behind() -> None:
    """uvicorn does not cancel a handler whose client has gone: the router listens for the
    disconnect while the turn waits, and drops the turn and its new session."""

    async def main() -> None:
        engine = StandIn()
        started = affinity_router([engine], admission_tokens=ADMISSION_TOKENS)
        async with started as (router, url), httpx.AsyncClient(timeout=30) as client:
            await stats_of(client, url, "a", False)
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{url}/v1/chat/completions", json=turn("b", False),
                                  timeout=httpx.Timeout(30, read=0.5))
            await until(lambda: router.admission.waiting == 0, "b's turn out of the queue")
            assert router.metrics.registry.get_sample_value(
                "turnkv_admission_queued_total") == 1  # it had queued
            assert router.sessions.table.get(SessionKey(DEFAULT_TENANT, "b")) is None
            await client.delete(f"{url}/v1/turnkv/sessions/a")
            await asyncio.sleep(0.1)
            assert len(engine.seen) == 1  # never served, even once there was room

    asyncio.run(main())


# -- the running totals ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def recount(table: SessionTable) -> tuple[int, int, int, dict[str, int]]:
    """The totals, summed afresh over the table."""
    sessions = list(table)
    held = [held_tokens(s) for s in sessions]
    homes = Counter(h for s in sessions if (h := s.decode or s.placed))
    return (sum(held), sum(1 for t in held if t), sum(
        1 for s, t in zip(sessions, held, strict=True) if not t and s.in_flight and not s.queued),
        dict(homes))


def totals(table: SessionTable) -> tuple[int, int, int, dict[str, int]]:
    counts = table.counts
    return counts.tokens, counts.holding, counts.starting, dict(counts.homes)


OPERATIONS = st.lists(st.tuples(
    st.sampled_from(["begin", "remember", "final", "end", "fail", "release", "expire", "look",
                     "affinity", "queue", "admit", "place", "record", "sync_gone"]),
    st.integers(0, 6),  # which session
    st.integers(0, 700)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_the_running_totals_equal_a_recount_after_any_operations(
        operations: list[tuple[str, int, int]]) -> None:
    """Sessions opened, served (a token history, or affinity's stats only), ended, failed,
    released, expired (in the sweep or on the way), evicted from the full table, queued and
    admitted, placed, and rewritten from another router's record: after each, the totals
    admission and placement read equal the table summed afresh."""
    from turnkv_server.router.session_store import apply_record

    clock = Clock()
    table = SessionTable(max_sessions=4, clock=clock)
    service = SessionService(table, on_end=lambda _: None)
    placement = EnginePool.from_urls(["http://p"], ["http://d0", "http://d1"]).round_robin()

    async def run() -> None:
        opened: dict[int, bool] = {}
        for op, n, value in operations:
            key = SessionKey("t", f"s{n}")
            session = table.get(key)
            if op == "begin":
                _, opened[n] = await service.begin_turn(key)
            elif session is None or op == "look":
                pass  # (`get` above may have dropped it, expired)
            elif op in ("remember", "final"):
                tag = TurnTag(session_id=key.session_id, turn=session.turns + 1,
                              hints={"final": op == "final", "ttl": 1 + value % 60})
                await service.remember(session, tag, placement,
                                       RouterTurnStats(mode="standard", turn=session.turns + 1),
                                       list(range(value)))
            elif op in ("end", "fail"):
                await service.end_turn(session, opened.get(n, False), failed=op == "fail")
            elif op == "release":
                await service.release(session)
            elif op == "expire":
                clock.now += value / 10
                await service.expire()
            elif op == "affinity":  # no token history: the last turn's stats say what it holds
                session.tokens = []
                session.last_stats = RouterTurnStats(mode="affinity", turn=1, completion_tokens=2,
                                               prompt_tokens=PromptTokens(total=value)
                                               ).model_dump()
            elif op == "queue":
                session.queued += 1
            elif op == "admit" and session.queued:
                session.queued -= 1
            elif op == "place":
                session.placed = f"decode-{value % 2}"
            elif op == "record":
                apply_record(session, {"decode": f"decode-{value % 3}",
                                       "tokens": list(range(value)), "last_stats": None})
            elif op == "sync_gone":
                table.release(key)
            assert totals(table) == recount(table)

    asyncio.run(run())


def test_rechecking_the_queue_costs_the_same_however_many_sessions_live() -> None:
    """Admission reads running totals: a re-check visits no session, with ten live or a
    thousand (it summed the whole table on every change)."""

    async def visits(live_sessions: int) -> int:
        admission, service, _ = queue(budget=1)
        for i in range(live_sessions):
            live(service, f"live-{i}", 300)
        _, waiting = await arrive(service, admission, "new")  # over budget: it waits
        visited = 0
        iterate = SessionTable.__iter__

        def counting(table: SessionTable) -> Iterator[Session]:
            nonlocal visited
            for session in iterate(table):
                visited += 1
                yield session

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SessionTable, "__iter__", counting)
            for _ in range(10):
                admission.recheck()
        assert not waiting.done()
        waiting.cancel()
        return visited

    async def main() -> None:
        assert [await visits(10), await visits(1000)] == [0, 0]

    asyncio.run(main())
