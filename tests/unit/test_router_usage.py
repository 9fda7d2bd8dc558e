"""What the router tells the client about a turn's prompt tokens, beyond its `turnkv` stats:
`usage.prompt_tokens_details.cached_tokens` corrected to what the turn did not compute, the
engine's own prefill timing, and why a short history reused nothing (whole KV blocks)."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv import protocol as p
from turnkv_server.router import stats
from turnkv_server.router.apis.chat import correct_usage
from turnkv_server.router.engines import Engine, Placement
from turnkv_server.router.modes.base import DecodeAlone, Turn, TurnPlan
from turnkv_server.router.sessions import Session, SessionKey

BLOCK = 128


def placement() -> Placement:
    return Placement(Engine("prefill-0", "http://p", "prefill", block_size=BLOCK),
                     Engine("decode-0", "http://d", "decode", block_size=BLOCK), "affinity")


def turn(history: list[int], prompt: list[int]) -> Turn:
    session = Session(SessionKey("t", "s"), 0.0, 0.0, 0.0, tokens=history)
    return Turn(path="/v1/chat/completions", body={}, tag=None, session=session,
                want_token_ids=False, stream=False, prompt_token_ids=prompt)


def pd_plan() -> TurnPlan:
    return TurnPlan(placement(), prefill_params={}, concurrent=True)


def alone_plan(prompt: list[int], new: int) -> TurnPlan:
    return TurnPlan(placement(), prefill_params=None, alone=DecodeAlone(prompt, new))


def usage(cached: int | None, total: int = 300) -> dict[str, Any]:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": total, "completion_tokens": 8, "prompt_tokens_details": details}


def pd_stats(total: int, reused: int) -> p.RouterTurnStats:
    return p.RouterTurnStats(mode="turnkv", prompt_tokens=p.PromptTokens(
        total=total, prefill_cached=reused, prefill_received=0, prefill_reused=reused,
        prefill_computed=total - reused))


def test_a_first_pd_turn_reports_nothing_cached() -> None:
    """vLLM counts what the decode engine received from the prefill engine as cached: on a
    first turn that reused nothing, nearly the whole prompt."""
    body = usage(cached=299)
    correct_usage(body, pd_plan(), pd_stats(300, 0))
    assert body["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_later_pd_turn_reports_the_prefill_sides_reuse() -> None:
    body = usage(cached=299, total=300)
    correct_usage(body, pd_plan(), pd_stats(300, 256))
    assert body["prompt_tokens_details"]["cached_tokens"] == 256


def test_a_short_delta_keeps_the_decode_engines_own_hits() -> None:
    body = usage(cached=256)
    tokens = p.RouterTurnStats(mode="turnkv", prompt_tokens=p.PromptTokens(total=300))
    correct_usage(body, alone_plan(list(range(300)), 20), tokens)
    assert body["prompt_tokens_details"]["cached_tokens"] == 256


@pytest.mark.parametrize("details", [None, {}, {"cached_tokens": None}])
def test_no_figure_is_invented_where_the_engine_reported_none(details: Any) -> None:
    body = {"prompt_tokens": 300, "prompt_tokens_details": details}
    correct_usage(body, pd_plan(), pd_stats(300, 256))
    assert body["prompt_tokens_details"] == details


def test_engine_times_read_vllms_per_request_metrics() -> None:
    assert stats.engine_times({"time_to_first_token_ms": 41.5, "queue_time_ms": 2}) == (
        41.5, 2.0)
    assert stats.engine_times({"time_to_first_token_ms": None}) == (None, None)
    assert stats.engine_times(None) == (None, None)
    read = stats.PrefillResult.read({"usage": {"prompt_tokens": 3}, "metrics": {
        "time_to_first_token_ms": 12.0, "queue_time_ms": 0.5}}, elapsed_ms=30.0)
    assert (read.engine_ms, read.engine_queue_ms, read.elapsed_ms) == (12.0, 0.5, 30.0)


def test_a_short_delta_is_timed_by_the_decode_engine() -> None:
    prompt = list(range(300))
    plan = alone_plan(prompt, 20)
    record = p.RouterTurnStats(mode="turnkv", prompt_tokens=p.PromptTokens(total=300))
    stats.finish(turn(prompt[:280], prompt), plan, record, 8, None, usage(256), None,
                 {"time_to_first_token_ms": 15.0, "queue_time_ms": 1.0})
    assert (record.times.engine_prefill_ms, record.times.engine_queue_ms) == (15.0, 1.0)
    assert record.prompt_tokens.decode_computed == 44


def test_a_pd_turn_keeps_the_prefill_engines_timing() -> None:
    """The decode engine's time to its first token in P/D is mostly the wait for the KV."""
    prompt = list(range(300))
    record = pd_stats(300, 256)
    record.times.engine_prefill_ms = 20.0
    stats.finish(turn(prompt[:280], prompt), pd_plan(), record, 8, None, usage(299), None,
                 {"time_to_first_token_ms": 400.0})
    assert record.times.engine_prefill_ms == 20.0


@pytest.mark.parametrize(("history", "reused", "noted"), [
    (100, 0, True),      # a history under one block: nothing reused, and the stats say why
    (300, 256, False),   # reused the whole blocks: nothing to explain
    (0, 0, False),       # a first turn: no history to reuse
    (300, 0, False),     # more than a block missed: not the block size (a fallback's case)
])
def test_a_turn_that_reused_nothing_says_when_the_block_size_is_why(
        history: int, reused: int, noted: bool) -> None:
    prompt = list(range(320))
    record = pd_stats(320, reused)
    stats.finish(turn(prompt[:history], prompt), pd_plan(), record, 8, None, usage(319), None)
    assert (record.note is not None) == noted
    if noted:
        assert record.note is not None
        assert f"whole KV blocks of {BLOCK} tokens" in record.note and "100 tokens" in record.note


def test_a_short_delta_under_a_block_says_so_too() -> None:
    prompt = list(range(90))
    record = p.RouterTurnStats(mode="turnkv", prompt_tokens=p.PromptTokens(total=90))
    stats.finish(turn(prompt[:70], prompt), alone_plan(prompt, 20), record, 8, None,
                 usage(0, total=90), None)
    assert record.prompt_tokens.decode_cached == 0
    assert record.note is not None and "70 tokens" in record.note


def test_no_note_without_the_block_size() -> None:
    prompt = list(range(120))
    plan = TurnPlan(Placement(Engine("p", "http://p", "prefill"),
                              Engine("d", "http://d", "decode"), "affinity"),
                    prefill_params={})
    record = pd_stats(120, 0)
    stats.finish(turn(prompt[:100], prompt), plan, record, 8, None, usage(119), None)
    assert record.note is None


def test_the_prefill_engines_reply_splits_its_own_hits_from_the_tiers() -> None:
    """vLLM's cached tokens count what a lower tier loaded too: the turnkv engine's reply says
    how many its own prefix cache held, and the rest were restored from the tier. Without a
    reply (an upstream connector) nothing is split, and nothing is guessed."""
    def tokens(params: dict[str, Any] | None) -> p.PromptTokens:
        prefill = stats.PrefillResult(transfer_params=params, prompt_token_ids=None,
                                      prompt_tokens=600, cached_tokens=512, elapsed_ms=1.0)
        return stats.begin(turn([], list(range(600))), pd_plan(), prefill, "turnkv", None,
                           None).prompt_tokens

    split = tokens({"turnkv": {"local_tokens": 128}})
    assert (split.prefill_cached, split.prefill_restored, split.prefill_computed,
            split.prefill_reused) == (128, 384, 88, 512)
    unsplit = tokens(None)
    assert (unsplit.prefill_cached, unsplit.prefill_restored) == (512, None)


def test_a_short_delta_s_reply_splits_the_decode_engines_hits_from_the_tiers() -> None:
    plan = alone_plan(list(range(300)), 20)
    found = p.RouterTurnStats(mode="turnkv", prompt_tokens=p.PromptTokens(total=300))
    stats.finish(turn([], list(range(300))), plan, found, 8, None, usage(cached=256),
                 {"turnkv": {"local_tokens": 128}})
    tokens = found.prompt_tokens
    assert (tokens.decode_cached, tokens.decode_restored, tokens.decode_computed) == (
        128, 128, 44)
