"""The router's `turnkv` mode: what each engine is told, per turn and per session."""

from __future__ import annotations

import asyncio

import pytest

from turnkv.protocol import CacheHints, PromptTokens, TurnStats, TurnTag
from turnkv_server.connector.params import parse
from turnkv_server.launcher.cluster import kv_transfer_config
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.modes import ModeContext
from turnkv_server.router.placement import EnginePool
from turnkv_server.router.registry import make_mode
from turnkv_server.router.sessions import Session, SessionKey
from turnkv_server.router.turn import Turn
from turnkv_server.router.turnkv_mode import (
    PRESSURE_BACKOFF_S,
    SHORT_DELTA,
    lease_key,
    lost_history,
    new_tokens,
)
from turnkv_server.router.upstream import Upstream

PREFILL, DECODE = "http://127.0.0.1:1", "http://127.0.0.1:2"


def context(short_delta_tokens: int = 0) -> ModeContext:
    pool = EnginePool.from_urls([PREFILL], [DECODE])
    channels = {pool.prefill[0].name: "127.0.0.1:5601", pool.decode[0].name: "127.0.0.1:5602"}
    return ModeContext(upstream=Upstream(), prefill_peers={}, decoder_kv_ttl=120.0,
                       side_channels=channels, pool=pool, short_delta_tokens=short_delta_tokens)


def turn(mode: object, hints: CacheHints | None = None, session: bool = True) -> Turn:
    key = SessionKey("tenant-a", "chat-1")
    return Turn(path="/v1/chat/completions", body={"model": "m", "messages": []},
                tag=TurnTag(session_id="chat-1", hints=hints or CacheHints()) if session else None,
                session=Session(key=key, created_at=0.0, last_used=0.0, expires_at=1e9)
                if session else None,
                mode=mode, want_token_ids=False)  # type: ignore[arg-type]


def test_prefill_sends_and_decode_receives_under_one_transfer_id() -> None:
    ctx = context()
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn(mode, CacheHints(ttl=60, priority=2))
    prefill = parse(asyncio.run(mode.prefill_transfer_params(t, placement)))
    decode = parse(mode.decode_transfer_params(t, placement, None))
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
    decode = parse(mode.decode_transfer_params(turn(mode, CacheHints(final=True)), placement,
                                               None))
    assert decode is not None and decode.release and decode.send is None
    anonymous = parse(mode.decode_transfer_params(turn(mode, session=False), placement, None))
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
    t = turn(mode)
    assert t.session is not None
    # A first turn: nothing held anywhere. (No engine is asked: these return before /tokenize.)
    assert asyncio.run(mode.decode_alone(t, placement)) is None
    t.session.tokens = [1, 2, 3]
    t.session.decode = "elsewhere"
    assert asyncio.run(mode.decode_alone(t, placement)) is None
    assert asyncio.run(make_mode("turnkv", context()).decode_alone(t, placement)) is None
    assert asyncio.run(mode.decode_alone(turn(mode, session=False), placement)) is None


def test_a_turn_served_by_decode_alone_receives_nothing_and_still_pushes_back() -> None:
    ctx = context(short_delta_tokens=64)
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)  # type: ignore[union-attr]
    t = turn(mode, CacheHints(ttl=60))
    t.decode_alone = True
    decode = parse(mode.decode_transfer_params(t, placement, None))
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
        t = turn(mode, CacheHints(final=True))
        assert t.session is not None
        t.decode_alone = True
        t.session.mode_state[SHORT_DELTA] = delta
        t.stats = TurnStats(mode="turnkv",
                            prompt_tokens=PromptTokens(total=1000, decode_computed=computed))
        mode.after_turn(t, placement, None)

    served_alone(delta=40, computed=40 + 127)  # the history was held: a block's tail at most
    assert not mode._under_pressure(decode)  # type: ignore[attr-defined]
    served_alone(delta=40, computed=900)  # the lease was gone: everything recomputed
    assert mode._under_pressure(decode)  # type: ignore[attr-defined]
    now[0] = PRESSURE_BACKOFF_S + 1
    assert not mode._under_pressure(decode)  # type: ignore[attr-defined]
    served_alone(delta=40, computed=900)  # again: twice as long
    now[0] += 2 * PRESSURE_BACKOFF_S - 1
    assert mode._under_pressure(decode)  # type: ignore[attr-defined]
    now[0] += 2
    served_alone(delta=40, computed=60)  # held again: the backoff ends
    assert not mode._under_pressure(decode)  # type: ignore[attr-defined]
    assert lost_history(900, 40) and not lost_history(None, 40)
