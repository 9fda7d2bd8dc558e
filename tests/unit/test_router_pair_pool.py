"""The pair as one pool (`turnkv` mode with `--pair-pool`): each session served whole by one
engine of its pair, chosen by how many sessions each is home to, kept by the placement."""

from __future__ import annotations

import asyncio

import pytest

from turnkv.protocol import CacheHints, TurnTag
from turnkv_server.bench.plan import BenchSettings, cluster_config
from turnkv_server.engine.protocol import parse
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import DecodeAlone, ModeContext, Turn, TurnEnd
from turnkv_server.router.placement import Engine, EnginePool
from turnkv_server.router.sessions import Session, SessionKey
from turnkv_server.router.upstream import Upstream


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
        scheduled = prefetches._pending[t.session.key]
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
