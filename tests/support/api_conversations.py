"""The client conversations of tests/integration/test_router_apis.py, each played through the
client library a user runs, against a base URL: a single plain engine (the reference) or a
turnkv router. Each returns what its turns answered (`Turn`): the output, and the router's
stats where they came back. The single tiny engine plays each (`ApiConversation`) with the
suite's other conversations, before any pair starts (`tests.support.reference`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from tests.support.oracle import Completion

# Over one KV block (128 tokens) of the tiny model's tokenizer: what a second turn reuses.
INSTRUCTIONS = (
    "You are the operations assistant of a small storage team. You answer questions about "
    "the write-ahead log, the compaction schedule, the backup jobs and the on-call rota. "
    "Keep every answer short and concrete, name the file or the job you mean, and say when "
    "you do not know. The write-ahead log is synced every two hundred milliseconds; the "
    "compaction runs at night; backups are taken every six hours and kept for two weeks; "
    "the on-call engineer changes every Monday at nine in the morning.")
QUESTIONS = ("What happens to writes when the process crashes?",
             "And how long are backups kept?",
             "Who should I call about a failed compaction?",
             "Thanks. Anything else I should know?")
MAX_TOKENS = 16
# The tiny model's random weights never finish a tool call's arguments (vLLM's JSON grammar
# for them lets it write whitespace for ever), but vLLM's streaming parser makes a call of
# what it writes after a required call's envelope: a function call out, whole or not.
READ_FILE = {"type": "function", "name": "read_file", "description": "Read a file.",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                            "required": ["path"]}}
# Nor does it ever end a reply by itself: the Agents SDK refuses a response cut short
# (`status: incomplete`), so its calls end at a stop string, on both sides alike.
STOPS = ["a", "e", "o", "."]  # (vLLM takes four at most)
NOTES = "The router keeps a lease per session."


# -- the scripts: each plays one client's conversation against a base URL --------------------

Turn = dict[str, Any]  # what a turn answered: its output, and the router's stats where given


def responses_chain(base: str, model: str, routed: bool) -> list[Turn]:
    """openai-python's `responses.create`, chained by `previous_response_id` through the router
    (turns 2 and 4 streamed); on a single engine, which keeps no state, the same conversation
    with its whole input each time."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="test", max_retries=0)
    turns: list[Turn] = []
    history: list[Any] = []
    previous: str | None = None
    for n, question in enumerate(QUESTIONS, start=1):
        args: dict[str, Any] = dict(
            model=model, instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS, temperature=0,
            include=["message.output_text.logprobs"], top_logprobs=2,
            extra_body={"enable_response_messages": True})
        if routed:
            args.update(input=question, previous_response_id=previous)
        else:
            args.update(input=[*history, {"role": "user", "content": question}], store=False)
        response = create(client, args, stream=n % 2 == 0)
        turns.append(responses_turn(response))
        history += [{"role": "user", "content": question}, *response["output"]]
        previous = response["id"]
    return turns


def responses_tools(base: str, model: str, routed: bool) -> list[Turn]:
    """A function call out (`tool_choice: required`, streamed) and its output back in, the
    second turn by `previous_response_id`."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="test", max_retries=0)
    args: dict[str, Any] = dict(
        model=model, instructions=INSTRUCTIONS, tools=[READ_FILE], max_output_tokens=24,
        temperature=0, extra_body={"enable_response_messages": True})
    ask = [{"role": "user", "content": "Read notes.md and tell me what it says."}]
    first = create(client, {**args, "input": ask, "tool_choice": "required",
                             **({} if routed else {"store": False})}, stream=True)
    call = next(item for item in first["output"] if item["type"] == "function_call")
    result = [{"type": "function_call_output", "call_id": call["call_id"], "output": NOTES}]
    if routed:
        more: dict[str, Any] = {"input": result, "previous_response_id": first["id"]}
    else:
        more = {"input": [*ask, *first["output"], *result], "store": False}
    second = create(client, {**args, **more}, stream=False)
    return [responses_turn(first), responses_turn(second)]


def messages_turns(base: str, model: str, routed: bool) -> list[Turn]:
    """The anthropic SDK's `messages.create` (streamed, but the last turn), the session named
    by turnkv's own header, tools declared throughout: a question, then a tool's result in
    (after a tool use as a client sends it back), then a question after."""
    # Imported here, as the Agents SDK below: tests/integration/conftest.py imports this
    # module, and either takes seconds of a core to import.
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="test", max_retries=0,
                                 default_headers={"X-TurnKV-Session": "claude-1"})
    tools = [{"name": "read_file", "description": "Read a file.",
              "input_schema": READ_FILE["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTIONS[0]}]
    turns = []
    for n in range(1, 4):
        # (The SDK has no `temperature` any more; vLLM's route takes it.)
        args: dict[str, Any] = dict(model=model, system=INSTRUCTIONS, messages=messages,
                                    max_tokens=MAX_TOKENS, tools=tools,
                                    extra_body={"temperature": 0})
        if n == 3:
            message = client.messages.create(**args).to_dict()
            turn = {"content": message["content"], "usage": message["usage"],
                    "stats": message.get("turnkv")}
        else:
            turn = streamed_message(client.messages.create(**args, stream=True))
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn["content"]})
        if n == 1:
            messages += [
                {"role": "user", "content": "Read notes.md, please."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                   "name": "read_file",
                                                   "input": {"path": "notes.md"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": NOTES}]}]
        else:
            messages.append({"role": "user", "content": QUESTIONS[n]})
    return turns


def agents_runs(base: str, model: str, routed: bool) -> list[Turn]:
    """The Agents SDK's default Runner (Responses API; nothing stored or chained by the SDK:
    the whole history each call) on an agent with a function tool, run twice: the second run
    on the first's history and a new question."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="test", max_retries=0)

    @function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        return NOTES

    agent = Agent(name="ops", instructions=INSTRUCTIONS, tools=[read_file], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=64,
                                               extra_body={"stop": STOPS}))
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client),
                       tracing_disabled=True)

    async def play() -> list[Turn]:
        first = await Runner.run(agent, QUESTIONS[0], run_config=config, max_turns=2)
        second = await Runner.run(agent, [*first.to_input_list(), {
            "role": "user", "content": QUESTIONS[1]}], run_config=config, max_turns=2)
        return [{"output": [item.model_dump(mode="json") for item in call.output],
                 "cached": call.usage.input_tokens_details.cached_tokens}
                for call in [*first.raw_responses, *second.raw_responses]]

    return asyncio.run(play())


def create(client: openai.OpenAI, args: dict[str, Any], stream: bool) -> dict[str, Any]:
    """A response object as the client library parsed it (JSON), streamed or not."""
    if not stream:
        return client.responses.create(**args).model_dump(mode="json")
    completed = None
    with client.responses.create(**args, stream=True) as events:
        for event in events:
            if event.type == "response.completed":
                completed = event.response.model_dump(mode="json")
    assert completed is not None, "the stream had no response.completed"
    return completed


def responses_turn(response: dict[str, Any]) -> Turn:
    tokens = [t for m in response.get("output_messages") or [] for t in m["tokens"]]
    gaps = []
    for item in response["output"]:
        for part in item.get("content") or []:
            for entry in part.get("logprobs") or []:
                top = sorted((t["logprob"] for t in entry.get("top_logprobs") or []),
                             reverse=True)
                gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return {"id": response["id"], "completion": Completion(tokens, "", gaps),
            "output": [{k: v for k, v in item.items() if k in ("type", "name", "arguments")}
                       for item in response["output"]],
            "usage": response["usage"], "stats": response.get("turnkv"),
            "previous": response.get("previous_response_id")}


def streamed_message(events: Any) -> Turn:
    """A streamed message's content blocks, usage and the router's stats (on message_delta)."""
    blocks: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    stats = None
    for event in events:
        if event.type == "content_block_start":
            blocks.append(event.content_block.to_dict())
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            blocks[-1]["text"] += event.delta.text
        elif event.type == "message_delta":
            usage = event.usage.to_dict()
            stats = (event.model_extra or {}).get("turnkv")
    return {"content": blocks, "usage": usage, "stats": stats}


SCRIPTS: dict[str, Callable[[str, str, bool], list[Turn]]] = {
    "responses_chain": responses_chain, "responses_tools": responses_tools,
    "messages": messages_turns, "agents": agents_runs}


@dataclass(frozen=True)
class ApiConversation:
    """A script (`SCRIPTS`, by name) as the reference engine plays it."""

    name: str

    def play(self, base_url: str, model: str, client: httpx.Client) -> list[Turn]:
        return SCRIPTS[self.name](base_url, model, False)


API_CONVERSATIONS = tuple(ApiConversation(name) for name in SCRIPTS)
