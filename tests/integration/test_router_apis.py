"""The Responses and Messages APIs through the router, on real engines (turnkv mode, one prefill
and one decode engine, tiny model, float32), through the client libraries a user runs:
openai-python's `responses.create` (chained by `previous_response_id`, streamed and not,
function tools in and out), the anthropic SDK's `messages.create` (streamed, tools), and the
OpenAI Agents SDK's default Runner (the Responses API).

Each conversation is played first, with the same client code, on a single plain engine (tool
calling on, as on the pair); through the router every turn must equal it (greedy, float32) and,
from the second on, report KV reused. The routers keep the Responses state in a real
redis-server: it survives a router killed between turns.
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

from examples import agents_sdk, anthropic_messages
from tests.support.api_conversations import (
    INSTRUCTIONS,
    MAX_TOKENS,
    QUESTIONS,
    SCRIPTS,
    STOPS,
    Turn,
    agents_runs,
    create,
    messages_turns,
    responses_chain,
    responses_tools,
    responses_turn,
)
from tests.support.clusters import (
    IDLE_ROUTER,
    RECEIVE_TIMEOUT_S,
    TINY_CACHE_BYTES,
    TINY_ENGINES,
    ClusterPool,
    ClusterSpec,
    EngineSet,
    RouterProcess,
    RouterView,
    redis_store,
)
from tests.support.oracle import compare
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState
from turnkv_server.models import build_tiny


def _tool_calling() -> tuple[str, ...]:
    """vLLM's tool calling on the engines (`tools` with `tool_choice` "required" or a named
    tool need it): what `turnkv up` turns on by itself where the launcher knows how."""
    if "tool_call_parser" in ClusterConfig.__dataclass_fields__:
        return ()
    return ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def _tiny(mode: Any, run_dir: Path, **settings: Any) -> ClusterConfig:
    return ClusterConfig(mode=mode, model=str(build_tiny()), dtype="float32", run_dir=run_dir,
                         engine_extra_args=_tool_calling(), **settings)


SINGLE = ClusterSpec("single-tiny-tools", EngineSet(
    "single-tiny-tools", lambda run_dir: _tiny("single", run_dir)))
CLUSTER = ClusterSpec("api-routes", EngineSet("tiny-turnkv-1p1d-tools", lambda run_dir: _tiny(
    "turnkv", run_dir, kv_cache_bytes=TINY_CACHE_BYTES, router_args=IDLE_ROUTER,
    connector_settings={"receive_timeout_s": RECEIVE_TIMEOUT_S})),
    RouterView(service=redis_store))
pytestmark = pytest.mark.cluster(CLUSTER)


# -- the references --------------------------------------------------------------------------



class References:
    """Every script on the single plain engine, played before the pair starts; a script that
    failed there fails the tests that compare with it, not the others."""

    def __init__(self, state: ClusterState) -> None:
        self._played: dict[str, list[Turn] | Exception] = {}
        for name, script in SCRIPTS.items():
            try:
                self._played[name] = script(state.router, state.served_model_name, False)
            except Exception as exc:  # noqa: BLE001  (raised again by the test that needs it)
                self._played[name] = exc

    def __getitem__(self, name: str) -> list[Turn]:
        played = self._played[name]
        if isinstance(played, Exception):
            raise AssertionError(f"{name} failed on the single engine") from played
        return played


@pytest.fixture(scope="module")
def references(clusters: ClusterPool) -> References:
    return References(clusters.get(SINGLE)[1])


@pytest.fixture
def cluster(clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
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
        references: References, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    turns = responses_chain(state.router, state.served_model_name, True)
    root = turns[0]["id"]
    for n, (expected, got) in enumerate(zip(references["responses_chain"], turns, strict=True),
                                              start=1):
        check_equal(expected, got, n)
        check_reused(got, n, got["usage"]["input_tokens_details"]["cached_tokens"])
        # The chain is one session, named by its root; the answer echoes the client's request.
        assert got["stats"]["session_id"] == (None if n == 1 else root)
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
        references: References, cluster: tuple[Cluster, ClusterState]) -> None:
    """Codex's way: nothing stored, the whole input every turn, a prompt cache key."""
    _, state = cluster
    client = openai.OpenAI(base_url=f"{state.router}/v1", api_key="test", max_retries=0)
    history: list[Any] = []
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


def test_function_tools_out_and_in_on_the_responses_api(
        references: References, cluster: tuple[Cluster, ClusterState]) -> None:
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
        references: References, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    turns = messages_turns(state.router, state.served_model_name, True)
    for n, (expected, got) in enumerate(zip(references["messages"], turns, strict=True),
                                              start=1):
        assert got["content"] == expected["content"], f"turn {n}"
        check_reused(got, n, got["usage"].get("cache_read_input_tokens"))
        assert got["stats"]["session_id"] == "claude-1"
        assert got["stats"]["turn"] == n
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
        references: References, cluster: tuple[Cluster, ClusterState]) -> None:
    _, state = cluster
    calls = agents_runs(state.router, state.served_model_name, True)
    expected = references["agents"]
    assert len(calls) == len(expected) == 2
    for n, (want, got) in enumerate(zip(expected, calls, strict=True), start=1):
        assert _texts(got["output"]) == _texts(want["output"]), f"call {n}"
        if n >= 2:
            assert got["cached"] > 0, f"call {n}: nothing reused"


def test_the_examples_run_against_the_router(cluster: tuple[Cluster, ClusterState]) -> None:
    """examples/agents_sdk.py (the follow-up continues the first run by
    `previous_response_id`: a session named by its root) and examples/anthropic_messages.py
    (one session by its header, each turn's stats on the stream)."""
    _, state = cluster
    model = state.served_model_name
    runs = asyncio.run(agents_sdk.converse(f"{state.router}/v1", model, max_tokens=64,
                                           stop=STOPS))
    assert [len(calls) for calls in runs][1] >= 1
    root = runs[0][0].response_id
    assert root is not None
    record = httpx.get(f"{state.router}/v1/turnkv/sessions/{root}", timeout=30).json()
    assert record["turns"] == len(runs[1])

    replies = anthropic_messages.converse(state.router, model, max_tokens=16,
                                          session="example-messages")
    for n, reply in enumerate(replies, start=1):
        assert reply.stats is not None
        assert (reply.stats["session_id"], reply.stats["turn"]) == ("example-messages", n)
        assert reply.usage["cache_read_input_tokens"] == \
            reply.stats["prompt_tokens"]["prefill_reused"]


# After the tests on this module's router: it kills that router.
def test_the_responses_state_survives_a_router_killed_between_turns(
        references: References, cluster: tuple[Cluster, ClusterState]) -> None:
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
        assert two["turnkv"]["session_id"] == one["id"]
        assert two["turnkv"]["prompt_tokens"]["prefill_reused"] > 0
        assert second.responses.retrieve(one["id"]).id == one["id"]
    finally:
        heir.stop()


# The other serving modes, on the suite's tiny engines of each (no tool calling there before
# `turnkv up` turns it on: Messages without tools), and `affinity` in front of this module's
# decode engine, which serves whole turns under the session's lease.
MODES = {"affinity": ClusterSpec("api-routes-affinity", CLUSTER.engines, RouterView(
    prefill=0, decode=1, mode="affinity", args=("--engine-leases",)))}
MODES.update({mode: ClusterSpec(f"api-routes-{mode}", TINY_ENGINES[mode], RouterView())
              for mode in ("standard", "bidirectional", "push")})


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_serves_both_apis_as_a_single_engine(
        references: References, clusters: ClusterPool, mode: str) -> None:
    _, state = clusters.get(MODES[mode])
    model = state.served_model_name
    chain = responses_chain(state.router, model, True)
    messages = messages_turns(state.router, model, True, tools=False)
    for n, (expected, got) in enumerate(zip(references["responses_chain"], chain,
                                            strict=True), start=1):
        check_equal(expected, got, n)
        check_reused(got, n, got["usage"]["input_tokens_details"]["cached_tokens"])
    for n, (expected, got) in enumerate(zip(references["messages_without_tools"], messages,
                                            strict=True), start=1):
        assert got["content"] == expected["content"], f"turn {n}"
        check_reused(got, n, got["usage"].get("cache_read_input_tokens"))


def _texts(items: list[dict[str, Any]]) -> list[Any]:
    return [(item.get("type"), item.get("name"), item.get("arguments"),
             [part.get("text") for part in item.get("content") or []]) for item in items]
