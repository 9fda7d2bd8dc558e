"""The ITL target (`--itl-target-ms`): whether a short delta stays on the decode engine, which
is computing it for its other requests' tokens to wait on, or goes to the prefill engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from turnkv.protocol import CacheHints, PromptTokens, RouterTurnStats, TurnTimes
from turnkv_server.bench.plan import BenchSettings, cluster_config
from turnkv_server.router.__main__ import parse_args
from turnkv_server.router.config import RouterConfig, from_args, itl_target_args
from turnkv_server.router.engines import Placement
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import DecodeAlone, Mode, Turn, TurnEnd, TurnPlan
from turnkv_server.router.modes.itl import WINDOW, ItlTarget
from turnkv_server.router.planner import tokens_to_compute

from .test_router_turnkv_mode import Tokenizer, context, turn

HISTORY = list(range(1000, 1200))  # the session's last prompt and reply: 200 tokens


def test_an_engine_holding_a_history_computes_its_last_blocks_tail_too() -> None:
    # 200 tokens held in blocks of 128: the first block is reused, 72 + 20 are computed.
    assert tokens_to_compute(220, 200, 128) == 92
    assert tokens_to_compute(220, 200, None) == 20  # block size unknown: the delta alone
    assert tokens_to_compute(256, 256, 128) == 128  # the last token is always computed
    assert tokens_to_compute(300, 0, 128) == 300
    assert tokens_to_compute(1, 5, 16) == 1


def test_without_a_target_or_with_nobody_waiting_a_delta_stays() -> None:
    off = ItlTarget(None)
    assert off.divert("decode-0", 500, others=8) is None
    target = ItlTarget(100.0)
    # Nothing measured yet, but nobody's tokens wait on it.
    assert target.divert("decode-0", 500, others=0) is None


def test_before_any_measurement_a_delta_that_others_would_wait_on_goes_to_prefill() -> None:
    note = ItlTarget(100.0).divert("decode-0", 5, others=1)
    assert note is not None and "no measured prefill cost" in note and "100 ms" in note
    assert "1 other request in flight" in note


def test_the_estimate_is_the_tokens_times_the_engines_measured_cost() -> None:
    target = ItlTarget(100.0)
    target.observe("decode-0", 30.0, 20)
    target.observe("decode-0", 90.0, 100)  # together: 120 ms for 120 tokens
    assert target.cost_per_token_ms("decode-0") == pytest.approx(1.0)
    assert target.divert("decode-0", 100, others=3) is None  # 100 ms: within the target
    note = target.divert("decode-0", 101, others=3)
    assert note is not None and "101 tokens" in note and "3 other requests" in note
    # Per decode engine: another one has measured nothing.
    assert target.cost_per_token_ms("decode-1") is None
    assert target.divert("decode-1", 1, others=1) is not None


def test_the_cost_follows_the_last_window_of_deltas() -> None:
    target = ItlTarget(100.0)
    target.observe("decode-0", 500.0, 100)
    for _ in range(WINDOW):
        target.observe("decode-0", 10.0, 10)
    assert target.cost_per_token_ms("decode-0") == pytest.approx(1.0)
    # What the engine did not report teaches nothing.
    target.observe("decode-0", None, 10)
    target.observe("decode-0", 10.0, None)
    target.observe("decode-0", 10.0, 0)
    assert target.cost_per_token_ms("decode-0") == pytest.approx(1.0)


def test_a_zero_target_keeps_deltas_to_an_idle_decode_engine() -> None:
    target = ItlTarget(0.0)
    target.observe("decode-0", 1.0, 100)
    assert target.divert("decode-0", 1, others=1) is not None
    assert target.divert("decode-0", 500, others=0) is None


def served_alone(mode: Mode, placement: Placement, delta: int, engine_ms: float | None,
                 computed: int) -> None:
    """The decode engine served a short delta of `delta` tokens, computing `computed` in
    `engine_ms`. (Final: no push back to arrange.)"""
    plan = TurnPlan(placement, prefill_params=None, alone=DecodeAlone([0] * 1000, delta))
    stats = RouterTurnStats(mode="turnkv", times=TurnTimes(engine_prefill_ms=engine_ms),
                      prompt_tokens=PromptTokens(total=1000, decode_computed=computed))
    mode.finish(turn(CacheHints(final=True)), plan, TurnEnd("complete", None, stats))


def held_turn(placement: Placement, new: int) -> Turn:
    t = turn()
    assert t.session is not None
    t.session.tokens, t.session.decode = HISTORY, placement.decode.name
    return t


def test_the_mode_sends_a_delta_over_the_target_to_the_prefill_engine() -> None:
    ctx = context(short_delta_tokens=512)
    ctx.itl_target_ms = 50.0
    assert ctx.pool is not None
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)
    placement.decode.block_size = 128

    def plan(new: int) -> TurnPlan:
        ctx.upstream = Tokenizer([*HISTORY, *range(new)])
        return asyncio.run(mode.plan(held_turn(placement, new), placement))

    # Idle: the delta stays, whatever its size.
    assert plan(300).alone == DecodeAlone([*HISTORY, *range(300)], 300)
    placement.decode.in_flight = 2  # two other sessions decoding there
    # Busy, nothing measured yet: to the prefill engine, and the stats will say why.
    busy = plan(10)
    assert busy.alone is None and busy.prefill_params is not None
    assert busy.note is not None and "no measured prefill cost" in busy.note
    served_alone(mode, placement, delta=40, engine_ms=60.0, computed=120)  # 0.5 ms a token
    # 20 new tokens after 200 held: 72 + 20 to compute, 46 ms.
    assert plan(20).alone is not None
    # 40: 112 tokens, 56 ms, over the target.
    over = plan(40)
    assert over.alone is None and over.prefill_params is not None and over.prefill_send
    assert over.note is not None and "112 tokens" in over.note and "2 other requests" in over.note
    # Past the short-delta limit a turn goes to the prefill engine without a note: as always.
    assert plan(600).note is None
    # Only a prefill engine that is up can take it: the decode engine computes it anyway.
    ctx.pool.prefill[0].healthy = False
    down = plan(40)
    assert down.alone is not None and down.note is None and down.prefill_params is None


def test_only_short_deltas_that_found_their_history_teach_the_cost() -> None:
    ctx = context(short_delta_tokens=64)
    ctx.itl_target_ms = 50.0
    assert ctx.pool is not None
    mode = make_mode("turnkv", ctx)
    placement = ctx.pool.place(prefill=None, decode=None, prefix_id=None)
    target: ItlTarget = mode._itl  # type: ignore[attr-defined]
    served_alone(mode, placement, delta=40, engine_ms=900.0, computed=900)  # history lost
    served_alone(mode, placement, delta=300, engine_ms=300.0, computed=300)  # not short
    served_alone(mode, placement, delta=40, engine_ms=None, computed=40)  # not timed
    assert target.cost_per_token_ms(placement.decode.name) is None
    served_alone(mode, placement, delta=40, engine_ms=20.0, computed=40)
    assert target.cost_per_token_ms(placement.decode.name) == pytest.approx(0.5)


def test_the_target_is_a_router_setting_that_up_and_bench_pass_on(tmp_path: Path) -> None:
    engines = {"prefill": ["http://p"], "decode": ["http://d"], "mode": "standard"}
    assert RouterConfig(**engines).itl_target_ms is None
    for wrong in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="itl_target_ms"):
            RouterConfig(**engines, itl_target_ms=wrong)
    args = ["--prefill", "http://p", "--decode", "http://d", "--mode", "standard"]
    assert from_args(parse_args(args)).itl_target_ms is None
    given = [*args, *itl_target_args(250)]
    assert from_args(parse_args(given)).itl_target_ms == 250.0
    assert itl_target_args(None) == ()
    settings = BenchSettings(itl_target_ms=200.0)
    config = cluster_config("turnkv", settings, tmp_path)
    assert config.router_args == ("--itl-target-ms", "200.0")
    assert cluster_config("turnkv", BenchSettings(), tmp_path).router_args == ()
