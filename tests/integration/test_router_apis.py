"""The Responses and Messages APIs through the router, on real engines (the suite's tiny turnkv
engines, float32, behind a turnkv router of this module's own in front of one prefill and one
decode engine), through the client libraries a user runs: openai-python's `responses.create`
(chained by `previous_response_id`, streamed and not, function tools in and out), the
anthropic SDK's `messages.create` (streamed, tools), and the OpenAI Agents SDK's default
Runner (the Responses API). Then both APIs through a router of every other mode, on the
suite's engines of that mode.

Each conversation is played first, with the same client code, on the single tiny engine (tool
calling on, as on every engine the launcher starts), with the suite's other conversations
(`tiny_references`); through the router every turn must equal it (greedy, float32) and, from
the second on, report KV reused. This module's turnkv router keeps the Responses state in a
real redis-server: it survives a router killed between turns.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from examples import agents_sdk, anthropic_messages, langchain_responses
from tests.support.api_conversations import (
    INSTRUCTIONS,
    MAX_TOKENS,
    QUESTIONS,
    STOPS,
    ApiConversation,
    Turn,
    agents_runs,
    create,
    messages_turns,
    responses_chain,
    responses_tools,
    responses_turn,
)
from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import (
    FIXED_POOLS,
    TINY_ENGINES,
    ClusterSpec,
    RouterProcess,
    RouterView,
    redis_store,
)
from tests.support.oracle import compare
from tests.support.reference import References
from turnkv_server.launcher import Cluster, ClusterState

# turnkv in fixed pools: the stats read here are the P/D form's.
CLUSTER = ClusterSpec("api-routes", TINY_ENGINES["turnkv"], RouterView(
    args=FIXED_POOLS, service=redis_store))
pytestmark = pytest.mark.cluster(CLUSTER)


class ApiReferences:
    """The single tiny engine's turns of each conversation (`api_conversations.SCRIPTS`), by
    its name; a conversation that failed there fails the tests that compare with it."""

    def __init__(self, references: References) -> None:
        self._references = references

    def __getitem__(self, name: str) -> list[Turn]:
        return self._references[ApiConversation(name)]


@pytest.fixture
def references(tiny_references: References) -> ApiReferences:
    return ApiReferences(tiny_references)


@pytest.fixture
def cluster(clusters: ClusterPool, references: ApiReferences) -> tuple[Cluster, ClusterState]:
    """This module's turnkv router, once the references are played (the pool runs one engine
    set at a time)."""
    return clusters.get(CLUSTER)


def check_equal(expected: Turn, got: Turn, n: int) -> None:
    verdict = compare(expected["completion"], got["completion"])
    assert verdict.acceptable, f"turn {n}: {verdict.describe()}"
    if verdict.equal:
        assert got["output"] == expected["output"], f"turn {n}"


def check_reused(turn: Turn, n: int, cached: int | None) -> None:
    """From the second turn on: KV reused, said in the stats and the API's own usage (a P/D
    turn's prefill engine's reuse, or in `affinity` the engine's own prefix hits)."""
    stats = turn["stats"]
    assert stats is not None, f"turn {n}: no stats"
    tokens = stats["prompt_tokens"]
    alone = stats["mode"] == "affinity"
    assert (stats["prefill_node"] is None) == alone, f"turn {n}: {stats}"
    reused = tokens["decode_cached"] if alone else tokens["prefill_reused"]
    if n >= 2:
        assert reused > 0, f"turn {n}: {tokens}"
    assert cached == reused, f"turn {n}: usage says {cached}, stats {tokens}"


# -- the tests -------------------------------------------------------------------------------

def test_a_response_chain_through_openai_python_equals_a_single_engine(
        references: ApiReferences, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    turns = responses_chain(state.router, state.served_model_name, True)
    root = turns[0]["id"]
    session = turns[0]["stats"]["session_id"]
    for n, (expected, got) in enumerate(zip(references["responses_chain"], turns, strict=True),
                                              start=1):
        check_equal(expected, got, n)
        check_reused(got, n, got["usage"]["input_tokens_details"]["cached_tokens"])
        # The chain is one session: the root's, which no key named (inferred), continued by
        # its lineage; the answer echoes the client's request.
        assert (got["stats"]["session_id"], got["stats"]["session_source"]) == (
            session, "inferred" if n == 1 else "lineage")
        assert got["previous"] == (None if n == 1 else turns[n - 2]["id"])
    client = openai.OpenAI(base_url=f"{state.router}/v1", api_key="test", max_retries=0)
    stored = client.responses.retrieve(turns[1]["id"])
    assert stored.previous_response_id == root
    assert (stored.model_extra or {})["turnkv"] == turns[1]["stats"]
    client.responses.delete(turns[1]["id"])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(turns[1]["id"])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=state.served_model_name, input="Go on.",
                                previous_response_id=turns[1]["id"], max_output_tokens=4)
    # Each record stands alone: deleting one breaks no later response of the chain.
    assert client.responses.retrieve(turns[2]["id"]).id == turns[2]["id"]


def test_store_false_with_the_whole_history_each_turn(
        references: ApiReferences, cluster: tuple[Cluster, ClusterState]) -> None:
    """Codex's way, without Codex's headers: nothing stored, the whole input every turn, a
    prompt cache key (which names a prefix, not a session, from any client but Codex). No key
    names a session: the router infers one from the conversation."""
    _, state = cluster
    client = openai.OpenAI(base_url=f"{state.router}/v1", api_key="test", max_retries=0)
    history: list[Any] = []
    sessions = []
    for n, question in enumerate(QUESTIONS[:2], start=1):
        history.append({"role": "user", "content": question})
        response = create(client, dict(
            model=state.served_model_name, instructions=INSTRUCTIONS, input=history,
            store=False, prompt_cache_key="codex-conversation-1", max_output_tokens=MAX_TOKENS,
            temperature=0, extra_body={"enable_response_messages": True}), stream=n == 2)
        got = responses_turn(response)
        check_equal(references["responses_chain"][n - 1], got, n)
        check_reused(got, n, got["usage"]["input_tokens_details"]["cached_tokens"])
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response["id"])
        history += response["output"]
        assert got["stats"] is not None and got["stats"]["session_source"] == "inferred"
        sessions.append(got["stats"]["session_id"])
    assert len(set(sessions)) == 1, sessions


def test_function_tools_out_and_in_on_the_responses_api(
        references: ApiReferences, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    turns = responses_tools(state.router, state.served_model_name, True)
    assert turns[0]["output"][0]["type"] == "function_call"
    assert turns[0]["output"][0]["name"] == "read_file"
    assert references["responses_tools"][0]["output"][0]["type"] == "function_call"
    for n, (expected, got) in enumerate(zip(references["responses_tools"], turns, strict=True),
                                              start=1):
        check_equal(expected, got, n)
        check_reused(got, n, got["usage"]["input_tokens_details"]["cached_tokens"])


def test_messages_through_the_anthropic_sdk_equal_a_single_engine(
        references: ApiReferences, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    turns = messages_turns(state.router, state.served_model_name, True)
    for n, (expected, got) in enumerate(zip(references["messages"], turns, strict=True),
                                              start=1):
        assert got["content"] == expected["content"], f"turn {n}"
        check_reused(got, n, got["usage"].get("cache_read_input_tokens"))
        assert got["stats"]["session_id"] == "claude-1"
        assert got["stats"]["turn"] == n
    # Without a session header: the second turn continues the first's conversation, one
    # session inferred from it.
    plain = anthropic.Anthropic(base_url=state.router, api_key="test", max_retries=0)
    history: list[Any] = []
    untagged = []
    for question in QUESTIONS[:2]:
        history.append({"role": "user", "content": question})
        reply = plain.messages.create(model=state.served_model_name, max_tokens=8,
                                      messages=history).model_dump(mode="json")
        stats = reply["turnkv"]
        assert stats["session_source"] == "inferred", stats
        untagged.append(stats["session_id"])
        history.append({"role": "assistant", "content": [
            {"type": "text", "text": block["text"]} for block in reply["content"]
            if block["type"] == "text"]})
    assert len(set(untagged)) == 1, untagged
    # Errors on this route are Anthropic's shape.
    client = anthropic.Anthropic(base_url=state.router, api_key="test", max_retries=0,
                                 default_headers={"X-TurnKV-Session": "claude-2",
                                                  "X-TurnKV-TTL": "-1"})
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=state.served_model_name, max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "invalid turnkv.hints.ttl: Input should be greater than 0"}}


def test_the_agents_sdk_default_runner_equals_a_single_engine(
        references: ApiReferences, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    calls = agents_runs(state.router, state.served_model_name, True)
    expected = references["agents"]
    assert len(calls) == len(expected) == 2
    for n, (want, got) in enumerate(zip(expected, calls, strict=True), start=1):
        assert _texts(got["output"]) == _texts(want["output"]), f"call {n}"
        if n >= 2:
            assert got["cached"] > 0, f"call {n}: nothing reused"


def test_the_examples_run_against_the_router(cluster: tuple[Cluster, ClusterState]) -> None:
    """examples/agents_sdk.py (the first run's model calls send its whole history, untagged:
    one inferred session; the follow-up continues it by `previous_response_id`),
    examples/anthropic_messages.py (one session by its header, each turn's stats on the
    stream) and examples/langchain_responses.py (LangChain's ChatOpenAI on the Responses API,
    untagged: one inferred session)."""
    _, state = cluster
    model = state.served_model_name
    runs = asyncio.run(agents_sdk.converse(f"{state.router}/v1", model, max_tokens=64,
                                           stop=STOPS))
    assert [len(calls) for calls in runs][1] >= 1
    root = runs[0][0].response_id
    assert root is not None
    stored = httpx.get(f"{state.router}/v1/responses/{root}", timeout=30).json()
    session = stored["turnkv"]["session_id"]
    record = httpx.get(f"{state.router}/v1/turnkv/sessions/{session}", timeout=30).json()
    assert record["turns"] == len(runs[0]) + len(runs[1]), (record, [len(r) for r in runs])

    replies = anthropic_messages.converse(state.router, model, max_tokens=16,
                                          session="example-messages")
    for n, reply in enumerate(replies, start=1):
        assert reply.stats is not None
        assert (reply.stats["session_id"], reply.stats["turn"]) == ("example-messages", n)
        assert reply.usage["cache_read_input_tokens"] == \
            reply.stats["prompt_tokens"]["prefill_reused"]

    said = langchain_responses.converse(f"{state.router}/v1", model, max_tokens=8)
    stats = [httpx.get(f"{state.router}/v1/responses/{reply.response_id}", timeout=30
                       ).json()["turnkv"] for reply in said]
    assert [s["session_source"] for s in stats] == ["inferred"] * len(said), stats
    assert len({s["session_id"] for s in stats}) == 1, stats
    for n, reply in enumerate(said[1:], start=2):
        assert reply.cached_tokens > 0, f"turn {n}: nothing reused"


# After the tests on this module's router: it kills that router.
def test_the_responses_state_survives_a_router_killed_between_turns(
        references: ApiReferences, cluster: tuple[Cluster, ClusterState]) -> None:
    launched, state = cluster
    expected = references["responses_chain"]
    heir = RouterProcess(launched, Path(state.run_dir) / "logs" / "router-heir.log")
    try:
        model = state.served_model_name
        first = openai.OpenAI(base_url=f"{state.router}/v1", api_key="test", max_retries=0)
        args: dict[str, Any] = dict(
            model=model, instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS,
            temperature=0, extra_body={"enable_response_messages": True})
        one = first.responses.create(input=QUESTIONS[0], **args).model_dump(mode="json")
        assert state.router_process is not None
        os.kill(state.router_process.pid, signal.SIGKILL)
        second = openai.OpenAI(base_url=f"{heir.url}/v1", api_key="test", max_retries=0)
        two = second.responses.create(input=QUESTIONS[1], previous_response_id=one["id"],
                                      **args).model_dump(mode="json")
        for n, got in enumerate((one, two), start=1):
            verdict = compare(expected[n - 1]["completion"], responses_turn(got)["completion"])
            assert verdict.acceptable, f"turn {n}: {verdict.describe()}"
        assert two["turnkv"]["session_id"] == one["turnkv"]["session_id"]
        assert two["turnkv"]["prompt_tokens"]["prefill_reused"] > 0
        assert second.responses.retrieve(one["id"]).id == one["id"]
    finally:
        heir.stop()


# The other serving modes, each on the suite's tiny engines of its mode, and `affinity` in
# front of this module's decode engine, which serves whole turns under the session's lease.
MODES = {"affinity": ClusterSpec("api-routes-affinity", CLUSTER.engines, RouterView(
    prefill=0, decode=1, mode="affinity", args=("--engine-leases",)))}
MODES.update({mode: ClusterSpec(f"api-routes-{mode}", TINY_ENGINES[mode], RouterView())
              for mode in ("standard", "bidirectional", "push")})


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=pytest.mark.cluster(spec))
                                  for mode, spec in MODES.items()])
def test_every_mode_serves_both_apis_as_a_single_engine(
        references: ApiReferences, clusters: ClusterPool, mode: str) -> None:
    _, state = clusters.get(MODES[mode])
    model = state.served_model_name
    chain = responses_chain(state.router, model, True)
    messages = messages_turns(state.router, model, True)
    for n, (expected, got) in enumerate(zip(references["responses_chain"], chain,
                                            strict=True), start=1):
        check_equal(expected, got, n)
        check_reused(got, n, got["usage"]["input_tokens_details"]["cached_tokens"])
    for n, (expected, got) in enumerate(zip(references["messages"], messages,
                                            strict=True), start=1):
        assert got["content"] == expected["content"], f"turn {n}"
        check_reused(got, n, got["usage"].get("cache_read_input_tokens"))


def _texts(items: list[dict[str, Any]]) -> list[Any]:
    return [(item.get("type"), item.get("name"), item.get("arguments"),
             [part.get("text") for part in item.get("content") or []]) for item in items]
