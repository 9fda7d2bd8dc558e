"""The LangChain and LlamaIndex adapters, with the real packages, against a real router
(bidirectional mode, tiny model: the shared `router_cluster`).

Each adapter plays three turns of one conversation through its framework's own calls. The
stats it puts into the framework's response must equal the router's record of that turn
(`GET /v1/turnkv/sessions/{id}` -> `last_turn`), `cache_read` must be the prompt tokens the
prefill engine did not compute, and from turn 2 the session reuses its KV.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import httpx
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from llama_index.core.base.llms.types import ChatMessage

import turnkv
from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.waiting import wait_for
from turnkv.integrations.langchain import ChatTurnKV
from turnkv.integrations.llamaindex import CACHE_READ_KEY, TurnKVLLM
from turnkv.integrations.turns import wire_of
from turnkv_server.launcher import ClusterState

MAX_TOKENS = 6
TTL = 120.0
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]},
    },
}


def router_session(state: ClusterState, session_id: str) -> httpx.Response:
    return httpx.get(f"{state.router}/v1/turnkv/sessions/{session_id}", timeout=30)


def check_turn(state: ClusterState, session: turnkv.Session, stats: dict[str, Any],
               cache_read: int | None, index: int) -> None:
    """What the adapter reported for turn `index` is the router's record of it."""
    record = router_session(state, session.id).json()
    assert record["turns"] == index
    reported = turnkv.TurnStats.model_validate(stats)
    assert reported.served_by_turnkv and reported.mode == "bidirectional"
    assert (reported.session_id, reported.turn) == (session.id, index)
    assert record["last_turn"] == reported.wire().model_dump()
    # The session's own record (client-measured time included), not a copy of the wire.
    assert session.turns[-1].stats == reported and reported.client_total_ms is not None
    assert record["prefix_id"] == session.prefix_id is not None
    assert 0 < record["expires_in_s"] <= TTL  # the ttl hint reached the router
    tokens = reported.prompt_tokens
    print(f"turn {index}: prompt {tokens.total}, cache_read {cache_read}, "
          f"computed {tokens.prefill_computed}")
    assert tokens.total > 0 and reported.completion_tokens > 0
    assert cache_read == tokens.prefill_reused
    if index >= 2:
        assert cache_read is not None and cache_read > 0, tokens


def test_langchain_invoke_stream_ainvoke_with_tools(router_cluster: ClusterState) -> None:
    state = router_cluster
    llm = ChatTurnKV(model=state.served_model_name, base_url=f"{state.router}/v1",
                     api_key="unused", temperature=0, max_tokens=MAX_TOKENS, ttl=TTL)
    session = llm.session
    assert isinstance(session, turnkv.Session)
    # Every turn carries the same tool schema. "none": the cluster's engines run without a
    # tool-call parser, which vLLM needs for "auto".
    model = llm.bind_tools([READ_FILE], tool_choice="none")
    messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(USER_TURNS[0])]

    first = model.invoke(messages)
    assert isinstance(first, AIMessage) and first.usage_metadata is not None
    check_turn(state, session, first.response_metadata["turnkv"],
               first.usage_metadata["input_token_details"].get("cache_read"), 1)
    assert first.usage_metadata["input_tokens"] == session.turns[-1].stats.prompt_tokens.total

    messages += [first, HumanMessage(USER_TURNS[1])]
    chunks = list(model.stream(messages))
    assert "turnkv" in chunks[-1].response_metadata
    assert all("turnkv" not in c.response_metadata for c in chunks[:-1])
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert isinstance(merged, AIMessageChunk) and merged.usage_metadata is not None
    check_turn(state, session, merged.response_metadata["turnkv"],
               merged.usage_metadata["input_token_details"].get("cache_read"), 2)
    assert merged.content == session.turns[-1].text

    messages += [AIMessage(content=merged.content), HumanMessage(USER_TURNS[2])]
    third = asyncio.run(model.ainvoke(messages))
    assert isinstance(third, AIMessage) and third.usage_metadata is not None
    check_turn(state, session, third.response_metadata["turnkv"],
               third.usage_metadata["input_token_details"].get("cache_read"), 3)

    assert session.stats.turns == 3 and session.stats.prompt_tokens_reused > 0
    llm.close()  # the model opened the session: closing it releases it on the router
    assert router_session(state, session.id).status_code == 404


def test_llamaindex_chat_stream_achat_in_a_given_session(router_cluster: ClusterState) -> None:
    state = router_cluster
    with turnkv.session(ttl=TTL) as session:
        llm = TurnKVLLM(model=state.served_model_name, api_base=f"{state.router}/v1",
                        api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                        session=session)
        messages = [ChatMessage(role="system", content=SYSTEM),
                    ChatMessage(role="user", content=USER_TURNS[0])]

        first = llm.chat(messages)
        check_turn(state, session, first.additional_kwargs["turnkv"],
                   first.additional_kwargs.get(CACHE_READ_KEY), 1)
        # `raw` is the openai response, with the router's own stats field.
        assert wire_of(first.raw) == router_session(state, session.id).json()["last_turn"]

        messages += [first.message, ChatMessage(role="user", content=USER_TURNS[1])]
        responses = list(llm.stream_chat(messages))
        last = responses[-1]
        assert all("turnkv" not in r.additional_kwargs for r in responses[:-1])
        check_turn(state, session, last.additional_kwargs["turnkv"],
                   last.additional_kwargs.get(CACHE_READ_KEY), 2)
        assert last.message.content == session.turns[-1].text

        messages += [last.message, ChatMessage(role="user", content=USER_TURNS[2])]
        third = asyncio.run(llm.achat(messages))
        check_turn(state, session, third.additional_kwargs["turnkv"],
                   third.additional_kwargs.get(CACHE_READ_KEY), 3)

        llm.close()  # the session was given: the LLM leaves it to its owner
        assert router_session(state, session.id).status_code == 200
    assert router_session(state, session.id).status_code == 404


def test_models_collected_unclosed_release_their_sessions(router_cluster: ClusterState) -> None:
    """A model never closed (as LangChain's standard tests leave theirs) releases the session
    it opened once it is garbage-collected: the router holds it no longer."""
    state = router_cluster
    chat = ChatTurnKV(model=state.served_model_name, base_url=f"{state.router}/v1",
                      api_key="unused", temperature=0, max_tokens=MAX_TOKENS, ttl=TTL)
    chat.invoke([SystemMessage(SYSTEM), HumanMessage(USER_TURNS[0])])
    llm = TurnKVLLM(model=state.served_model_name, api_base=f"{state.router}/v1",
                    api_key="unused", temperature=0, max_tokens=MAX_TOKENS, ttl=TTL)
    llm.chat([ChatMessage(role="user", content=USER_TURNS[0])])
    sessions = [chat.session.id, llm.session.id]
    assert [router_session(state, s).status_code for s in sessions] == [200, 200]
    del chat, llm
    gc.collect()
    for session_id in sessions:
        wait_for(lambda s=session_id: router_session(state, s).status_code == 404,  # type: ignore[misc]
                 f"the router releasing session {session_id}")
