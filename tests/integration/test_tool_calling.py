"""Requests with `tools` through the router of a cluster started with the launcher's defaults
(the shared `router_cluster`: tiny model, bidirectional mode), with a stock openai client.

Every engine runs vLLM's tool-call parser for the model (`--enable-auto-tool-choice
--tool-call-parser hermes`, the ChatML one); without it vLLM answers `tool_choice: "auto"`
with a 400. The tiny model's chat template, like SmolLM2's, does not render tools: the model
never sees them, so "auto" answers with text; "required" and a named tool are constrained by
vLLM to a `<tool_call>` of one of the tools, whose arguments follow the tool's schema where the
tool is `strict`.
"""

from __future__ import annotations

from typing import Any

import openai

from turnkv_server.launcher import ClusterState

PATHS = ["README.md", "setup.py"]
# strict: vLLM holds the arguments to the schema, not only the call's name.
READ_FILE: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the project.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"path": {"type": "string", "enum": PATHS}},
                       "required": ["path"]},
        "strict": True,
    },
}
MESSAGES = [{"role": "system", "content": "You can read the project's files."},
            {"role": "user", "content": "What does the README say?"}]


def client(state: ClusterState) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{state.router}/v1", api_key="unused", max_retries=0)


def test_tools_with_auto_tool_choice_reach_the_model(router_cluster: ClusterState) -> None:
    openai_client = client(router_cluster)
    reply = openai_client.chat.completions.create(
        model=router_cluster.served_model_name, messages=MESSAGES,  # type: ignore[arg-type]
        tools=[READ_FILE], tool_choice="auto", max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    # Streamed too, as agent frameworks send it.
    chunks = list(openai_client.chat.completions.create(
        model=router_cluster.served_model_name, messages=MESSAGES,  # type: ignore[arg-type]
        tools=[READ_FILE], max_tokens=8, temperature=0, stream=True))
    finished = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finished[-1] in ("stop", "length", "tool_calls")


def test_required_and_named_tool_choice_call_the_tool(router_cluster: ClusterState) -> None:
    """Streamed, as agent frameworks send it: the call's name comes as soon as vLLM has
    constrained the output to it. (The model then fills the arguments' JSON with whitespace,
    which JSON allows, until max_tokens: a non-streamed reply cut there parses no call.)"""
    openai_client = client(router_cluster)
    named = {"type": "function", "function": {"name": "read_file"}}
    for tool_choice in ("required", named):
        chunks = list(openai_client.chat.completions.create(
            model=router_cluster.served_model_name, messages=MESSAGES,  # type: ignore[arg-type]
            tools=[READ_FILE], tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=False, max_tokens=32, temperature=0, stream=True))
        calls = [call for chunk in chunks if chunk.choices
                 for call in chunk.choices[0].delta.tool_calls or ()]
        assert calls, (tool_choice, chunks)
        first = calls[0]
        assert first.index == 0 and first.type == "function" and first.id
        assert first.function is not None and first.function.name == "read_file"
        assert {call.index for call in calls} == {0}  # one call (parallel_tool_calls=False)
