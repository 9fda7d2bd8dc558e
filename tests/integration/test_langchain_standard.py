"""LangChain's standard integration tests for chat models (`langchain-tests`) against
`ChatTurnKV`, through the router of the shared `router_cluster` (tiny random-weight model,
bidirectional mode, the launcher's defaults: tool calling on).

The capability flags are what this server and model honestly hold: tool calling and tool
choice (vLLM's tool-call parser; "any" is sent as "required", which vLLM constrains to a call
of one of the tools), usage with `cache_read` (turnkv's count of the prompt tokens the prefill
engine did not compute); text only (no images, audio, PDFs), and no structured output (the
model cannot, see below). Every standard test that fails on this model is marked as an
expected failure below, with the reason.

The tiny model writes random tokens, so no test may depend on what it says: it never sees
the tools (its chat template, like SmolLM2-135M's, does not render them), so "auto" answers
with text, and a call forced by "required" has arguments the model made up (vLLM holds them
to the tool's schema only for `strict` tools, which the standard tests do not send).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from tests.support.conversation import SYSTEM, USER_TURNS
from turnkv.integrations.langchain import ChatTurnKV
from turnkv_server.launcher import ClusterState

# A reply as long as the tests need to see some text, short enough to keep them quick.
MAX_TOKENS = 24

# What the tiny model cannot do, as these tests showed on it.
FORCED_CALL = ("the model never sees the tools (its chat template does not render them) and "
               "writes a forced call's arguments at random: vLLM holds them to the tool's "
               "schema only for strict tools, which these tests do not send, so the call is not "
               "the one asked for (a JSON number where the arguments object belongs, or a call "
               "cut by max_tokens)")
AUTO_NO_CALL = ("with tool_choice left to the model (\"auto\") it never calls a tool: it never "
                "sees them")
XFAILS: dict[str, str] = {
    "test_tool_calling": FORCED_CALL,
    "test_tool_calling_async": FORCED_CALL,
    "test_tool_calling_with_no_arguments": FORCED_CALL,
    "test_tool_choice": FORCED_CALL,
    "test_bind_runnables_as_tools": FORCED_CALL,
    "test_unicode_tool_call_integration": FORCED_CALL,
    "test_agent_loop": AUTO_NO_CALL,
}
# Structured output and JSON mode are flagged off rather than expected to fail, the model
# being unable to hold them: vLLM's structured outputs keep the reply valid JSON so far, but
# the model fills its strings at random and closes none within max_tokens (each of the nine
# tests failed with openai.LengthFinishReasonError).


class TestChatTurnKVStandard(ChatModelIntegrationTests):
    # The suite runs pytest-asyncio in strict mode, which runs only marked coroutines: the
    # standard tests' async ones get the mark here, and its sync ones ignore it.
    pytestmark = [
        pytest.mark.asyncio,
        pytest.mark.filterwarnings(
            "ignore:The test <Function .*> is marked with '@pytest.mark.asyncio' but it is "
            "not an async function"),
    ]
    state: ClusterState

    @pytest.fixture(autouse=True)
    def _cluster(self, router_cluster: ClusterState, request: pytest.FixtureRequest) -> None:
        type(self).state = router_cluster
        name = request.node.originalname
        if name in XFAILS:
            request.applymarker(pytest.mark.xfail(reason=XFAILS[name], strict=True))

    @property
    def chat_model_class(self) -> type[ChatTurnKV]:
        return ChatTurnKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": self.state.served_model_name, "base_url": f"{self.state.router}/v1",
                "api_key": "unused", "max_tokens": MAX_TOKENS, "ttl": 60}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return False  # the model cannot: see above XFAILS

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[Any, Any]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The second turn of a session: its prompt starts with the first turn's, whose KV
        the router keeps, so part of it is read rather than computed."""
        with ChatTurnKV(**{**self.standard_chat_model_params, **self.chat_model_params}) as llm:
            messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(USER_TURNS[0])]
            first = llm.invoke(messages)
            messages += [first, HumanMessage(USER_TURNS[1])]
            if stream:
                merged: AIMessageChunk | None = None
                for chunk in llm.stream(messages):
                    merged = chunk if merged is None else merged + chunk
                assert merged is not None
                second: AIMessage = merged
            else:
                second = llm.invoke(messages)
        assert second.usage_metadata is not None
        assert second.usage_metadata["input_token_details"].get("cache_read", 0) > 0
        return second

    # Not run (LangChain's own check wants an override marked xfail, with its reason).
    @pytest.mark.xfail(reason="a timing benchmark over responses recorded with VCR: this suite "
                              "records nothing and asserts no timing (docs/benchmarks.md "
                              "measures)", run=False)
    def test_stream_time(self, *args: Any, **kwargs: Any) -> None:
        """LangChain's stream-overhead benchmark. Its VCR cassette would also refuse the live
        requests (a health probe) that set up this suite's cluster."""
