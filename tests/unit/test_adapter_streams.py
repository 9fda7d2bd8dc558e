"""The adapters' pure logic: finding a call's recorded turn, and putting the stats of a
streamed turn on its last chunk (LangChain) or response (LlamaIndex)."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessageChunk
from langchain_core.outputs import ChatGenerationChunk
from llama_index.core.base.llms.types import ChatMessage, ChatResponse

import turnkv
from turnkv.integrations import langchain as lc
from turnkv.integrations import llamaindex as li
from turnkv.integrations.turns import stats_for


def wire(session_id: str, turn: int, reused: int = 40, total: int = 50) -> dict[str, Any]:
    return {"session_id": session_id, "turn": turn, "mode": "bidirectional",
            "prompt_tokens": {"total": total, "prefill_reused": reused,
                              "prefill_computed": total - reused},
            "completion_tokens": 3, "times": {"prefill_ms": 5.0, "total_ms": 9.0}}


def test_stats_for_finds_the_recorded_turn_by_index_then_response_then_count() -> None:
    session = turnkv.session("unit-find")
    first = session.record(wire("unit-find", 1), 11.0, client_total_ms=20.0, turn=1)
    second = session.record(wire("unit-find", 2), 12.0, client_total_ms=21.0, turn=2)
    assert stats_for(session, wire("unit-find", 1)) is first.stats
    assert stats_for(session, wire("unit-find", 2)) is second.stats

    class Response:
        id = "chatcmpl-1"

    second.response = Response()
    assert stats_for(session, None, response_id="chatcmpl-1") is second.stats
    assert stats_for(session, None, since=1) is second.stats
    assert stats_for(session, None, since=0) is None  # two turns since: ambiguous
    # Not recorded (e.g. another session's turn 9): the router's part alone.
    unrecorded = stats_for(session, wire("unit-find", 9))
    assert unrecorded is not None and unrecorded.turn == 9
    assert unrecorded.client_total_ms is None


def lc_chunk(content: str = "", **metadata: Any) -> ChatGenerationChunk:
    return ChatGenerationChunk(message=AIMessageChunk(content=content, **metadata))


def test_langchain_stream_tail_puts_the_stats_on_the_last_chunk() -> None:
    session = turnkv.session("unit-lc")
    tail = lc.ChunkTail(session)
    usage = {"input_tokens": 50, "output_tokens": 3, "total_tokens": 53,
             "input_token_details": {"cache_read": 7}}  # vLLM's own (wrong under P/D) count
    out = [*tail.take(lc_chunk()), *tail.take(lc_chunk("Hel")), *tail.take(lc_chunk("lo"))]
    assert [c.message.content for c in out] == ["", "Hel", "lo"]  # content is not delayed
    assert tail.take(lc_chunk(usage_metadata=usage)) == []
    assert tail.take(lc_chunk(response_metadata={"turnkv": wire("unit-lc", 1)})) == []
    # The transport records the turn when the response ends, before the tail is flushed.
    recorded = session.record(wire("unit-lc", 1), 15.0, client_total_ms=30.0, turn=1)
    rest = tail.finish()
    assert len(rest) == 2 and rest[-1].message.chunk_position == "last"
    assert rest[-1].message.response_metadata["turnkv"] == recorded.stats.model_dump()
    merged = out[0].message
    for chunk in [*out[1:], *rest]:
        merged = merged + chunk.message
    assert isinstance(merged, AIMessageChunk) and merged.content == "Hello"
    assert merged.usage_metadata is not None
    assert merged.usage_metadata["input_token_details"].get("cache_read") == 40
    assert merged.usage_metadata["input_tokens"] == 50


def test_langchain_stream_tail_without_stats_changes_nothing() -> None:
    tail = lc.ChunkTail(turnkv.session("unit-lc-none"))
    assert tail.take(lc_chunk("a")) and tail.take(lc_chunk()) == []
    rest = tail.finish()
    assert len(rest) == 1 and "turnkv" not in rest[0].message.response_metadata


def li_response(delta: str, text: str, raw: Any = None) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role="assistant", content=text), delta=delta,
                        raw=raw)


def test_llamaindex_stream_tail_puts_the_stats_on_the_last_response() -> None:
    session = turnkv.session("unit-li")
    tail = li.ResponseTail(session, since=0)
    out = [*tail.take(li_response("", "")), *tail.take(li_response("Hi", "Hi"))]
    assert [r.delta for r in out] == ["", "Hi"]
    assert tail.take(li_response("", "Hi", raw={"choices": [], "usage": {}})) == []
    assert tail.take(li_response("", "Hi", raw={"choices": [],
                                                "turnkv": wire("unit-li", 1)})) == []
    recorded = session.record(wire("unit-li", 1), 9.0, client_total_ms=10.0, turn=1)
    rest = tail.finish()
    assert len(rest) == 2 and "turnkv" not in rest[0].additional_kwargs
    assert rest[-1].additional_kwargs["turnkv"] == recorded.stats.model_dump()
    assert rest[-1].additional_kwargs[li.CACHE_READ_KEY] == 40
    assert rest[-1].message.content == "Hi"
