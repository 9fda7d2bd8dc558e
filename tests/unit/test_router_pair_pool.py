"""The pair as one pool (`turnkv` mode with `--pair-pool`): each session served whole by one
engine of its pair, chosen by how many sessions each is home to, kept by the placement."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.protocol import CacheHints, TurnTag
from turnkv_server.bench.plan import BenchSettings, cluster_config
from turnkv_server.engine.protocol import parse
from turnkv_server.router.app import Router
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.engines import Engine, EnginePool, Placement, Upstream
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import DecodeAlone, ModeContext, Turn, TurnEnd
from turnkv_server.router.modes.planned import PairPool
from turnkv_server.router.sessions import Session, SessionKey
from turnkv_server.router.tenants import DEFAULT_TENANT


class Tokenizer(Upstream):
    """Engines that render every prompt as `tokens`, and record whom they were asked."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__()
        self.tokens = tokens
        self.asked: list[str] = []

    async def tokenize(self, engine: Engine, body: dict[str, object]) -> list[int]:
        self.asked.append(engine.name)
        return self.tokens


def context(upstream: Upstream) -> ModeContext:
    pool = EnginePool.from_urls(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    channels = {pool.prefill[0].name: "127.0.0.1:5601", pool.decode[0].name: "127.0.0.1:5602"}
    return ModeContext(upstream=upstream, prefill_peers={}, decoder_kv_ttl=120.0,
                       side_channels=channels, pool=pool, short_delta_tokens=64,
                       pair_pool=True)


def turn(name: str, hints: CacheHints | None = None) -> Turn:
    return Turn(path="/v1/chat/completions", body={"model": "m", "messages": []},
                tag=TurnTag(session_id=name, hints=hints or CacheHints(ttl=60)),
                session=Session(key=SessionKey("t", name), created_at=0.0, last_used=0.0,
                                expires_at=1e9),
                want_token_ids=False, stream=False)


def test_new_sessions_alternate_where_their_prefix_is_warm_on_one_engine() -> None:
    """A new session's placement where its prefix ID last ran names one engine (a whole
    turn's), which keeps nothing: the pool still homes it on the engine home to fewer."""
    ctx = context(Tokenizer([1, 2, 3]))
    pool = ctx.pool
    assert pool is not None
    mode = make_mode("turnkv", ctx)
    warm = pool.prefill[0]
    homes = [asyncio.run(mode.plan(turn(name), Placement(warm, warm, "prefix_warm")))
             .placement.decode.name for name in "abcd"]
    assert sorted(homes) == ["decode-0", "decode-0", "prefill-0", "prefill-0"]


def test_new_sessions_get_one_engine_each_and_keep_it() -> None:
    upstream = Tokenizer([1, 2, 3, 4, 5])
    ctx = context(upstream)
    pool = ctx.pool
    assert pool is not None
    mode = make_mode("turnkv", ctx)
    first, second = turn("a"), turn("b")
    plans = []
    for t in (first, second):
        placement = pool.place(prefill=None, decode=None, prefix_id=None)
        plans.append(asyncio.run(mode.plan(t, placement)))
    homes = [plan.placement.decode.name for plan in plans]
    assert sorted(homes) == ["decode-0", "prefill-0"]
    for plan in plans:
        # Served whole where it lives: no prefill request, nothing sent or received, the
        # session's lease on that engine.
        assert plan.placement.prefill is plan.placement.decode
        assert plan.prefill_params is None and plan.prefill_send is plan.decode_send is None
        # Not tokenized (the engine's prefix cache finds the history by itself).
        assert plan.alone == DecodeAlone(None, new_tokens=0, held=False)
        params = parse(plan.decode_params)
        assert params is not None and params.session is not None and params.ttl_s == 60
        assert params.send is None and params.receive is None
    assert upstream.asked == []
    # Its next turn: the placement names the home in both places, the plan keeps it there.
    session = first.session
    assert session is not None
    session.prefill = session.decode = homes[0]
    placement = pool.place(prefill=session.prefill, decode=session.decode, prefix_id=None)
    again = asyncio.run(mode.plan(first, placement))
    assert again.placement.decode.name == homes[0] and again.placement.reason == "affinity"


def test_a_session_whose_home_is_down_moves_to_the_other_engine_and_an_ended_one_frees_it(
) -> None:
    ctx = context(Tokenizer([1]))
    pool = ctx.pool
    assert pool is not None
    mode = make_mode("turnkv", ctx)
    a, b, c = turn("a"), turn("b"), turn("c")
    assert a.session is not None

    async def scenario() -> None:
        home = (await mode.plan(a, pool.place(prefill=None, decode=None,
                                              prefix_id=None))).placement.decode
        assert a.session is not None
        a.session.prefill = a.session.decode = home.name
        home.healthy = False
        moved = (await mode.plan(a, pool.place(prefill=home.name, decode=home.name,
                                               prefix_id=None))).placement.decode
        assert moved is not home and moved.healthy
        home.healthy = True
        # a now lives on the other engine: b goes to the first; once a ends, c may go where
        # a lived.
        plan_b = await mode.plan(b, pool.place(prefill=None, decode=None, prefix_id=None))
        assert plan_b.placement.decode is home
        mode.drop_session(a.session)
        plan_c = await mode.plan(c, pool.place(prefill=None, decode=None, prefix_id=None))
        assert plan_c.placement.decode is moved

    asyncio.run(scenario())


def test_a_hinted_pause_prefetches_on_the_home_engine_only() -> None:
    ctx = context(Tokenizer([1, 2, 3]))
    pool = ctx.pool
    assert pool is not None
    mode = make_mode("turnkv", ctx)
    t = turn("a", CacheHints(next_turn_in=30.0))
    plan = asyncio.run(mode.plan(t, pool.place(prefill=None, decode=None, prefix_id=None)))
    t.prompt_token_ids, t.output_token_ids = [1, 2, 3], [4]

    async def finish() -> list[str]:
        mode.finish(t, plan, TurnEnd("complete", None))
        prefetches = mode._prefetches  # type: ignore[attr-defined]
        assert t.session is not None
        scheduled = prefetches.pending[t.session.key]
        names = [e.name for e in scheduled.engines]
        prefetches.cancel(t.session.key)
        return names

    assert asyncio.run(finish()) == [plan.placement.decode.name]


def test_the_pool_is_a_turnkv_router_option_and_a_benchmark_mode(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="pair-pool"):
        RouterConfig(mode="standard", prefill=["http://p"], decode=["http://d"],
                     pair_pool=True)
    config = cluster_config("turnkv-pool", BenchSettings(tier_host_blocks=64),
                            tmp_path)  # type: ignore[arg-type]
    assert config.mode == "turnkv" and "--pair-pool" in config.router_args
    assert config.tier_host_blocks == 64
    assert "--pair-pool" not in cluster_config("turnkv-tier", BenchSettings(),
                                               tmp_path).router_args  # type: ignore[arg-type]


# -- homes, counted --------------------------------------------------------------------------


class CountingHomes(OrderedDict[SessionKey, str]):
    """The pool's homes, counting how many of them anything walks."""

    walked = 0

    def values(self) -> Any:
        self.walked += len(self)
        return super().values()

    def items(self) -> Any:
        self.walked += len(self)
        return super().items()

    def __iter__(self) -> Iterator[SessionKey]:
        self.walked += len(self)
        return super().__iter__()


def pair_pool(ctx: ModeContext) -> PairPool:
    pool = make_mode("turnkv", ctx)._homes  # type: ignore[attr-defined]
    assert isinstance(pool, PairPool)
    return pool


def test_placing_a_new_session_reads_no_other_sessions_home() -> None:
    """Each engine's count of homes is kept as sessions are placed, move and end: a new
    session's placement costs the same with ten homes as with a thousand."""
    ctx = context(Tokenizer([1]))
    engines = ctx.pool
    assert engines is not None
    walked = []
    for count in (10, 1000):
        pool = pair_pool(ctx)
        pool._homes = CountingHomes()  # type: ignore[assignment]
        for i in range(count):
            pool.home(turn(f"s{i}").session,  # type: ignore[arg-type]
                      engines.place(prefill=None, decode=None, prefix_id=None))
        pool._homes.walked = 0  # type: ignore[attr-defined]
        pool.home(turn("new").session,  # type: ignore[arg-type]
                  engines.place(prefill=None, decode=None, prefix_id=None))
        walked.append(pool._homes.walked)  # type: ignore[attr-defined]
    assert walked == [0, 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "kept", "down", "end"]),
                          st.integers(0, 5)), max_size=60))
def test_each_engines_count_of_homes_equals_a_recount(ops: list[tuple[str, int]]) -> None:
    ctx = context(Tokenizer([1]))
    engines = ctx.pool
    assert engines is not None
    pool = pair_pool(ctx)
    prefill, decode = engines.prefill[0], engines.decode[0]
    pair = Placement(prefill, decode, "least_loaded")
    for op, n in ops:
        session = Session(SessionKey("t", f"s{n}"), 0.0, 0.0, 1e9)
        prefill.healthy = decode.healthy = True
        if op == "new":
            pool.home(session, pair)
        elif op == "kept":  # the placement names a home in both places
            home = decode if n % 2 else prefill
            pool.home(session, Placement(home, home, "affinity"))
        elif op == "down":  # one engine down: the session moves to the other
            (prefill if n % 2 else decode).healthy = False
            pool.home(session, pair)
        else:
            pool.forget(session.key)
        recount = Counter(pool._homes.values())
        assert {e.name: pool.homed(e.name) for e in (prefill, decode)} == {
            e.name: recount[e.name] for e in (prefill, decode)}


def test_a_session_evicted_from_the_routers_table_is_nobodys_home() -> None:
    """The router's session table is bounded: a session it evicts (or that expires on the way)
    leaves no home behind in the pool, nor does one that ends."""
    config = RouterConfig(mode="turnkv", prefill=["http://127.0.0.1:1"],
                          decode=["http://127.0.0.1:2"], pair_pool=True, max_sessions=2,
                          prefill_nixl=["p@127.0.0.1:5601"], decode_nixl=["d@127.0.0.1:5602"])
    router = Router(config)
    pool = router.mode._homes  # type: ignore[attr-defined]
    assert isinstance(pool, PairPool)

    async def serve(name: str) -> Session:
        """A turn of session `name`, planned and ended as the pipeline does."""
        session, opened = await router.sessions.begin_turn(SessionKey(DEFAULT_TENANT, name))
        t = turn(name)
        t.session = session
        await router.mode.plan(t, router.turns._place(t))
        await router.sessions.end_turn(session, opened, failed=False)
        session.turns = 1  # served: a table entry worth keeping
        return session

    async def scenario() -> None:
        a = await serve("a")
        await serve("b")
        assert len(pool._homes) == 2
        await serve("c")  # the table is full: a, the least recently used, is evicted
        assert router.sessions.table.get(a.key) is None and router.sessions.table.evicted_total
        assert a.key not in pool._homes and len(pool._homes) == 2
        assert sum(pool.homed(e.name) for e in router.pool.engines()) == 2
        c = router.sessions.table.get(SessionKey(DEFAULT_TENANT, "c"))
        assert c is not None
        c.expires_at = 0.0  # expired: the next look drops it on the way
        assert router.sessions.table.get(c.key) is None
        assert c.key not in pool._homes and len(pool._homes) == 1
        b = router.sessions.table.get(SessionKey(DEFAULT_TENANT, "b"))
        assert b is not None
        await router.sessions.release(b)
        assert len(pool._homes) == 0 and not any(pool.homed(e.name) for e in router.pool.engines())

    asyncio.run(scenario())
