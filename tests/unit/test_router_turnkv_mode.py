"""The router's `turnkv` mode in fixed pools (the P/D form, whose machinery the planner's form
reuses): what each engine is told, per turn and per session."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from turnkv.protocol import CacheHints, PromptTokens, RouterTurnStats, TurnTag
from turnkv_server.engine.protocol import parse
from turnkv_server.launcher.cluster import kv_transfer_config
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.engines import Engine, EnginePool, Reply, Upstream
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import (
    DecodeAlone,
    ModeContext,
    Turn,
    TurnEnd,
    TurnPlan,
)
from turnkv_server.router.modes.planned import BACKOFF_S, lease_key, prefetch_lease
from turnkv_server.router.modes.turnkv import lost_history, new_tokens
from turnkv_server.router.sessions import LeasePolicy, Session, SessionKey

PREFILL, DECODE = "http://127.0.0.1:1", "http://127.0.0.1:2"


def context(short_delta_tokens: int = 0) -> ModeContext:
    pool = EnginePool.from_urls([PREFILL], [DECODE])
    channels = {pool.prefill[0].name: "127.0.0.1:5601", pool.decode[0].name: "127.0.0.1:5602"}
    return ModeContext(upstream=Upstream(), prefill_peers={}, decoder_kv_ttl=120.0,
                       side_channels=channels, pool=pool, short_delta_tokens=short_delta_tokens,
                       fixed_pools=True)


def turn(hints: CacheHints | None = None, session: bool = True) -> Turn:
    key = SessionKey("tenant-a", "chat-1")
    return Turn(path="/v1/chat/completions", body={"model": "m", "messages": []},
                tag=TurnTag(session_id="chat-1", hints=hints or CacheHints()) if session else None,
                session=Session(key=key, created_at=0.0, last_used=0.0, expires_at=1e9)
                if session else None,
                want_token_ids=False, stream=False)


class Tokenizer(Upstream):
    """An upstream whose engines render every prompt as `tokens`."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__()
        self.tokens = tokens

    async def tokenize(self, engine: Engine, body: dict[str, object]) -> list[int]:
        return self.tokens


def test_prefill_sends_and_decode_receives_under_one_transfer_id() -> None:
    ctx = context()
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn(CacheHints(ttl=60, priority=2))
    plan = asyncio.run(mode.plan(t, placement))
    prefill, decode = parse(plan.prefill_params), parse(plan.decode_params)
    assert prefill is not None and decode is not None
    assert prefill.send is not None and decode.receive is not None
    assert prefill.send.transfer_id == decode.receive.transfer_id
    assert decode.receive.peer == "127.0.0.1:5601"
    # The decode engine keeps the turn for the push back to the prefill engine.
    assert decode.send is not None and decode.send.transfer_id != prefill.send.transfer_id
    # Layer by layer to a decode engine registered before the prefill ends; nobody registers
    # for the push back before the decode request ends, so that send is not streamed.
    assert prefill.send.stream and not decode.send.stream
    assert t.session is not None
    assert prefill.session == decode.session == lease_key(t.session)
    assert (decode.ttl_s, decode.priority, decode.release) == (60, 2, False)


def test_a_final_turn_releases_and_pushes_nothing_back() -> None:
    ctx = context()
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    decode = parse(asyncio.run(mode.plan(turn(CacheHints(final=True)), placement)).decode_params)
    assert decode is not None and decode.release and decode.send is None
    anonymous = parse(asyncio.run(mode.plan(turn(session=False), placement)).decode_params)
    assert anonymous is not None and anonymous.session is None and anonymous.send is None


def test_lease_keys_are_tenant_scoped_and_opaque() -> None:
    a = Session(key=SessionKey("tenant-a", "chat-1"), created_at=0, last_used=0, expires_at=1)
    b = Session(key=SessionKey("tenant-b", "chat-1"), created_at=0, last_used=0, expires_at=1)
    assert lease_key(a) != lease_key(b)
    assert "chat-1" not in lease_key(a) and len(lease_key(a)) == 32


def test_turnkv_mode_needs_every_engines_side_channel() -> None:
    with pytest.raises(ValueError, match="--decode-nixl"):
        RouterConfig(prefill=[PREFILL], decode=[DECODE], mode="turnkv",
                     prefill_nixl=["p@127.0.0.1:5601"])
    ctx = context()
    ctx.side_channels.popitem()
    with pytest.raises(ValueError, match="side channel"):
        make_mode("turnkv", ctx)


def test_engines_load_the_turnkv_connector_on_both_roles() -> None:
    for role in ("prefill", "decode"):
        config = kv_transfer_config("turnkv", role, "e0",  # type: ignore[arg-type]
                                    connector_settings={"lease_ttl_s": 5})
        assert config is not None
        assert config["kv_connector"] == "TurnkvConnector"
        assert config["kv_role"] == "kv_both"
        assert config["kv_load_failure_policy"] == "recompute"
        assert config["kv_connector_extra_config"] == {"lease_ttl_s": 5}
    assert kv_transfer_config("turnkv", "single", "e0") is None


def test_a_short_delta_is_counted_from_the_first_difference() -> None:
    history = list(range(100))
    assert new_tokens([*history, 1, 2, 3], history) == 3
    # An edited history counts every token past the edit as new.
    edited = [*history[:50], -1, *history[51:], 1]
    assert new_tokens(edited, history) == 51
    assert new_tokens([1, 2], []) == 2


def test_decode_alone_needs_a_limit_a_history_and_the_sessions_decode_engine() -> None:
    ctx = context(short_delta_tokens=64)
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn()
    assert t.session is not None
    # A first turn: nothing held anywhere. (No engine is asked: these return before /tokenize.)
    assert asyncio.run(mode.plan(t, placement)).alone is None
    t.session.tokens = [1, 2, 3]
    t.session.decode = "elsewhere"
    assert asyncio.run(mode.plan(t, placement)).alone is None
    assert asyncio.run(make_mode("turnkv", context()).plan(t, placement)).alone is None
    assert asyncio.run(mode.plan(turn(session=False), placement)).alone is None


def test_a_turn_served_by_decode_alone_receives_nothing_and_still_pushes_back() -> None:
    ctx = context(short_delta_tokens=64)
    ctx.upstream = Tokenizer([1, 2, 3, 4, 5])  # the history and two new tokens
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn(CacheHints(ttl=60))
    assert t.session is not None
    t.session.tokens, t.session.decode = [1, 2, 3], placement.decode.name
    plan = asyncio.run(mode.plan(t, placement))
    assert plan.alone == DecodeAlone([1, 2, 3, 4, 5], new_tokens=2)
    assert plan.prefill_params is None and plan.prefill_send is None
    decode = parse(plan.decode_params)
    assert decode is not None and decode.receive is None
    assert decode.send is not None and decode.ttl_s == 60


def test_a_short_delta_that_found_its_history_gone_backs_the_decode_engine_off() -> None:
    now = [0.0]
    ctx = context(short_delta_tokens=64)
    ctx.clock = lambda: now[0]
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    decode = placement.decode.name

    def served_alone(delta: int, computed: int) -> None:
        # (Final: no push back or abandoned send to arrange, only the verdict on the delta.)
        t = turn(CacheHints(final=True))
        plan = TurnPlan(placement, prefill_params=None, alone=DecodeAlone([0] * 1000, delta))
        stats = RouterTurnStats(mode="turnkv",
                          prompt_tokens=PromptTokens(total=1000, decode_computed=computed))
        mode.finish(t, plan, TurnEnd("complete", None, stats))

    served_alone(delta=40, computed=40 + 127)  # the history was held: a block's tail at most
    assert not mode._pressure.active(decode)  # type: ignore[attr-defined]
    served_alone(delta=40, computed=900)  # the lease was gone: everything recomputed
    assert mode._pressure.active(decode)  # type: ignore[attr-defined]
    now[0] = BACKOFF_S + 1
    assert not mode._pressure.active(decode)  # type: ignore[attr-defined]
    served_alone(delta=40, computed=900)  # again: twice as long
    now[0] += 2 * BACKOFF_S - 1
    assert mode._pressure.active(decode)  # type: ignore[attr-defined]
    now[0] += 2
    served_alone(delta=40, computed=60)  # held again: the backoff ends
    assert not mode._pressure.active(decode)  # type: ignore[attr-defined]
    assert lost_history(900, 40) and not lost_history(None, 40)


def test_while_no_prefill_engine_is_up_the_decode_engine_serves_every_turn_alone() -> None:
    # The soak killed the prefill engine: within seconds every session was at a turn that is
    # not a short delta (a first turn) and got 503 until the engine was back, while the decode
    # engine sat idle. It computes such a turn itself, as a single engine would.
    ctx = context(short_delta_tokens=64)
    ctx.upstream = Tokenizer(list(range(300)))
    mode = make_mode("turnkv", ctx)
    assert ctx.pool is not None
    ctx.pool.prefill[0].healthy = False
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)
    assert not placement.prefill.healthy  # the only prefill engine, down
    first = turn(CacheHints(ttl=60))
    plan = asyncio.run(mode.plan(first, placement))
    assert plan.alone == DecodeAlone(list(range(300)), new_tokens=300, held=False)
    assert plan.prefill_params is None and plan.prefill_send is None
    assert plan.reuse_note is not None and plan.reuse_note[0] == "engine_unavailable"
    decode = parse(plan.decode_params)
    assert decode is not None and decode.receive is None and decode.ttl_s == 60
    # Nothing is kept for a push back the prefill engine cannot take.
    assert decode.send is None and plan.decode_send is None
    # A long delta of a session the decode engine holds: only the new tokens are computed.
    later = turn()
    assert later.session is not None
    later.session.tokens, later.session.decode = list(range(100)), placement.decode.name
    plan = asyncio.run(mode.plan(later, placement))
    assert plan.alone == DecodeAlone(list(range(300)), new_tokens=200, held=True)
    # An anonymous turn too.
    assert asyncio.run(mode.plan(turn(session=False), placement)).alone is not None
    # Back up: a turn that is not a short delta goes through the prefill engine again.
    ctx.pool.prefill[0].healthy = True
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)
    plan = asyncio.run(mode.plan(turn(), placement))
    assert plan.alone is None and plan.prefill_params is not None


def test_a_turn_that_held_nothing_says_nothing_about_the_decode_engines_leases() -> None:
    ctx = context(short_delta_tokens=64)
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    decode = placement.decode.name
    mode._pressure.record(decode, missed=True)  # type: ignore[attr-defined]
    # A first turn computed on the decode engine (its prefill engine down) computed its whole
    # prompt, as expected: that does not show the engine's leases are held again.
    plan = TurnPlan(placement, prefill_params=None,
                    alone=DecodeAlone([0] * 1000, 1000, held=False))
    stats = RouterTurnStats(mode="turnkv",
                            prompt_tokens=PromptTokens(total=1000, decode_computed=1000))
    mode.finish(turn(CacheHints(final=True)), plan, TurnEnd("complete", None, stats))
    assert mode._pressure.active(decode)  # type: ignore[attr-defined]


class Recorder(Upstream):
    """An upstream that answers every POST with 200 and keeps the bodies, by engine."""

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[tuple[str, str, dict[str, Any]]] = []

    async def post(self, engine: Engine, path: str, body: dict[str, Any], *,
                   headers: dict[str, str] | None = None, timeout: float | None = None) -> Reply:
        self.posted.append((engine.name, path, body))
        return Reply(200, b"{}")


def test_the_next_turn_hint_goes_to_every_engine_that_keeps_the_session() -> None:
    ctx = context()
    recorder = Recorder()
    ctx.upstream = recorder
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]

    async def one_turn(t: Turn) -> TurnPlan:
        plan = await mode.plan(t, placement)
        t.prompt_token_ids, t.output_token_ids = [7, 8, 9], [1, 2]
        mode.finish(t, plan, TurnEnd("complete", None, None))
        assert t.session is not None
        await t.session.mode_state.push_back  # spawned by finish: it posts its request
        return plan

    plan = asyncio.run(one_turn(turn(CacheHints(ttl=60, next_turn_in=8.5))))
    prefill, decode = parse(plan.prefill_params), parse(plan.decode_params)
    assert prefill is not None and decode is not None
    assert prefill.next_turn_in_s == decode.next_turn_in_s == 8.5
    # The push back leaves the session's lease on the prefill engine: the hint rides with it.
    [(engine, path, body)] = recorder.posted
    assert (engine, path) == (placement.prefill.name, "/v1/completions")
    push = parse(body["kv_transfer_params"])
    assert push is not None and push.receive is not None and push.next_turn_in_s == 8.5
    # No hint, no expectation: the engines keep their LRU order for this session.
    recorder.posted.clear()
    plan = asyncio.run(one_turn(turn(CacheHints(ttl=60))))
    for params in (plan.prefill_params, plan.decode_params,
                   recorder.posted[0][2]["kv_transfer_params"]):
        assert "next_turn_in_s" not in params["turnkv"]
    # A final turn holds nothing, so a hint would mean nothing.
    decode = parse(asyncio.run(mode.plan(turn(CacheHints(final=True, next_turn_in=5)),
                                         placement)).decode_params)
    assert decode is not None and decode.release and decode.next_turn_in_s is None


def test_a_turn_served_by_decode_alone_carries_the_hint_too() -> None:
    ctx = context(short_delta_tokens=64)
    ctx.upstream = Tokenizer([1, 2, 3, 4, 5])
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn(CacheHints(next_turn_in=0))
    assert t.session is not None
    t.session.tokens, t.session.decode = [1, 2, 3], placement.decode.name
    plan = asyncio.run(mode.plan(t, placement))
    assert plan.alone is not None
    decode = parse(plan.decode_params)
    assert decode is not None and decode.next_turn_in_s == 0.0


class PushBackReplies(Upstream):
    """An upstream whose engines answer every POST with 200 and the turnkv reply given."""

    def __init__(self) -> None:
        super().__init__()
        self.receive_failed = False

    async def post(self, engine: Engine, path: str, body: dict[str, Any], *,
                   headers: dict[str, str] | None = None, timeout: float | None = None) -> Reply:
        reply = {"kv_transfer_params": {"turnkv": {"receive_failed": self.receive_failed}}}
        return Reply(200, json.dumps(reply).encode())


def test_a_push_back_that_recomputed_the_history_stops_push_backs_for_a_while() -> None:
    now = [0.0]
    ctx = context()
    ctx.clock = lambda: now[0]
    engines = PushBackReplies()
    ctx.upstream = engines
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]

    async def one_turn() -> TurnPlan:
        t = turn(CacheHints(ttl=60))
        plan = await mode.plan(t, placement)
        t.prompt_token_ids, t.output_token_ids = [7, 8, 9], [1, 2]
        mode.finish(t, plan, TurnEnd("complete", None, None))
        assert t.session is not None
        push_back = t.session.mode_state.push_back
        if push_back is not None:
            await push_back
        return plan

    def keeps_a_send() -> bool:
        decode = parse(asyncio.run(one_turn()).decode_params)
        assert decode is not None
        return decode.send is not None

    assert keeps_a_send()  # the push back landed: the next turn keeps one too
    engines.receive_failed = True
    assert keeps_a_send()  # this push back's receive failed: the prefill engine recomputed
    assert not keeps_a_send()  # nothing kept, nothing pushed back
    now[0] = BACKOFF_S + 1
    assert keeps_a_send()  # failed again: twice as long
    now[0] += 2 * BACKOFF_S - 1
    assert not keeps_a_send()
    now[0] += 2
    engines.receive_failed = False
    assert keeps_a_send()  # this one landed: the backoff ends
    assert keeps_a_send()


def test_every_request_of_a_session_carries_its_epoch_and_its_next_life_a_later_one() -> None:
    """Engines ignore a hold or renewal older than the session's release: each request says
    which life of the session it belongs to (its epoch), the release too, and a session
    opened again after its release is a later life."""
    ctx = context()
    recorder = Recorder()
    ctx.upstream = recorder
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn(CacheHints(ttl=60, next_turn_in=8.5))
    session = t.session
    assert session is not None

    async def scenario() -> TurnPlan:
        plan = await mode.plan(t, placement)
        t.prompt_token_ids, t.output_token_ids = [7, 8, 9], [1, 2]
        mode.finish(t, plan, TurnEnd("complete", None, None))
        await session.mode_state.push_back
        session.prefill, session.decode = placement.prefill.name, placement.decode.name
        mode.hinted(session, CacheHints(next_turn_in=30))
        mode.drop_session(session)
        for _ in range(20):  # the renewals and releases, spawned
            await asyncio.sleep(0)
        return plan

    plan = asyncio.run(scenario())
    sent = [parse(plan.prefill_params), parse(plan.decode_params),
            *(parse(body["kv_transfer_params"]) for _, _, body in recorder.posted)]
    kinds = {(p.renew_only, p.release, p.receive is not None) for p in sent if p is not None}
    assert kinds == {(False, False, False), (False, False, True), (True, False, False),
                     (False, True, False)}  # turn, push back, renewals, releases
    assert {p.epoch for p in sent if p is not None} == {session.epoch}
    prefetch = parse(prefetch_lease(session, CacheHints(next_turn_in=8), LeasePolicy()))
    assert prefetch is not None and prefetch.epoch == session.epoch
    again = turn().session
    assert again is not None and again.epoch > session.epoch
