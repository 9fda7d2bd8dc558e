"""The OpenAI Agents SDK on its defaults against a turnkv router: an agent with a function tool,
run by the default `Runner` over the Responses API, then asked a follow-up that continues the
first run by `previous_response_id`.

Nothing here is turnkv's: the SDK only needs the router's URL for its OpenAI client (the same as
`OPENAI_BASE_URL=http://HOST:PORT/v1`). The router keeps the Responses state itself (stored
responses resolve on any router that shares its Redis), serves a chain of responses as one
session, and says per model call what the engines did not compute again, in the usage the SDK
already reads (`input_tokens_details.cached_tokens`).

    turnkv up
    python examples/agents_sdk.py               # the cluster `turnkv up` started
    python examples/agents_sdk.py --base-url http://HOST:PORT/v1 --model NAME
    turnkv down
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI

INSTRUCTIONS = ("You are the operations assistant of a small storage team. Use the tools to "
                "read the team's notes before you answer, and answer in two sentences.")
NOTES = {"oncall.md": "The on-call engineer changes every Monday at nine.",
         "backups.md": "Backups run every six hours and are kept for two weeks."}
QUESTION = "How long are backups kept? The notes are in backups.md."
FOLLOW_UP = "And who is on call on Monday morning? See oncall.md."


@function_tool
def read_notes(name: str) -> str:
    """Read one of the team's notes by its file name."""
    return NOTES.get(name, f"no notes called {name}; there are {', '.join(NOTES)}")


@dataclass
class Call:
    """One model call of a run, as the SDK reports it."""

    response_id: str | None
    output: list[Any]
    input_tokens: int
    cached_tokens: int


def agent(model: str, max_tokens: int | None = None, stop: list[str] | None = None) -> Agent:
    # (vLLM's `stop` strings, for a model that never ends its replies by itself, such as the
    # tests' random one: the SDK refuses a reply cut short by max_tokens.)
    settings = ModelSettings(max_tokens=max_tokens,
                             extra_body={"stop": stop} if stop else None)
    return Agent(name="ops", instructions=INSTRUCTIONS, tools=[read_notes], model=model,
                 model_settings=settings)


async def converse(base_url: str, model: str, api_key: str = "unused",
                   max_tokens: int | None = None, stop: list[str] | None = None
                   ) -> list[list[Call]]:
    """The question, then the follow-up on the first run's last response: each run's model
    calls."""
    config = RunConfig(model_provider=OpenAIProvider(
        openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key)),
        # The SDK's traces go to OpenAI's platform: nowhere to send them from here.
        tracing_disabled=True)
    ops = agent(model, max_tokens, stop)
    first = await Runner.run(ops, QUESTION, run_config=config)
    second = await Runner.run(ops, FOLLOW_UP, run_config=config,
                              previous_response_id=first.last_response_id)
    return [[Call(r.response_id, r.output, r.usage.input_tokens,
                  r.usage.input_tokens_details.cached_tokens) for r in run.raw_responses]
            for run in (first, second)]


def main() -> None:
    # Here, not at the top: the tests import this module as `examples.agents_sdk`.
    from _endpoint import endpoint, endpoint_parser

    args = endpoint_parser(__doc__, max_tokens=None, ttl=False).parse_args()
    base_url, model = endpoint(args)
    runs = asyncio.run(converse(base_url, model, args.api_key, args.max_tokens))
    for question, calls in zip((QUESTION, FOLLOW_UP), runs, strict=True):
        print(f"user: {question}")
        for call in calls:
            for item in call.output:
                text = "".join(getattr(part, "text", "") for part in
                               getattr(item, "content", None) or [])
                if getattr(item, "type", None) == "function_call":
                    text = f"[calls {item.name}({item.arguments})]"
                print(f"  model: {text}")
            print(f"  ({call.input_tokens} prompt tokens, {call.cached_tokens} not computed "
                  "again)")


if __name__ == "__main__":
    main()
