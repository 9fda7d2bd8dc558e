"""The anthropic SDK against a turnkv router: a streamed conversation over the Messages API
(`/v1/messages`), the way Claude Code talks to its model.

The client is Anthropic's own, pointed at the router (`base_url`, the same as
`ANTHROPIC_BASE_URL=http://HOST:PORT`); the engines behind it serve vLLM's Messages route. The
conversation is one session, named by a header the router reads like any turnkv tag: keep it
for every turn (Claude Code sends its own session header). Each reply says what the engines did
not compute again in the usage Anthropic's clients read (`cache_read_input_tokens`), and the
router's stats of the turn ride on the stream's `message_delta` event as `turnkv`.

    turnkv up
    python examples/anthropic_messages.py           # the cluster `turnkv up` started
    python examples/anthropic_messages.py --base-url http://HOST:PORT --model NAME
    turnkv down
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import anthropic
from anthropic.types import MessageParam

SYSTEM = ("You are a careful reviewer of a small storage service. The write-ahead log is "
          "synced every two hundred milliseconds; backups run every six hours and are kept "
          "for two weeks. Answer in two sentences.")
QUESTIONS = ("What can a crash lose?",
             "How would you make that window smaller?",
             "And what does that cost?")


@dataclass
class Reply:
    text: str
    usage: dict[str, Any]
    stats: dict[str, Any] | None  # the router's, for the turn


def converse(base_url: str, model: str, api_key: str = "unused", max_tokens: int = 96,
             session: str | None = None) -> list[Reply]:
    """The questions in one session, each reply streamed (and printed as it comes)."""
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, default_headers={
        "X-TurnKV-Session": session or f"messages-{uuid.uuid4().hex[:12]}"})
    messages: list[MessageParam] = []
    replies = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        print(f"user: {question}\nassistant: ", end="", flush=True)
        reply = _streamed(client.messages.create(model=model, system=SYSTEM, messages=messages,
                                                 max_tokens=max_tokens, stream=True))
        messages.append({"role": "assistant", "content": reply.text})
        replies.append(reply)
        print(f"\n  ({reply.usage.get('cache_read_input_tokens')} prompt tokens read from "
              f"the cache, {reply.usage.get('input_tokens')} computed)")
    return replies


def _streamed(events: Any) -> Reply:
    text, usage, stats = [], {}, None
    for event in events:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text.append(event.delta.text)
            print(event.delta.text, end="", flush=True)
        elif event.type == "message_delta":
            usage = event.usage.to_dict()
            stats = (event.model_extra or {}).get("turnkv")
    return Reply("".join(text), usage, stats)


def main() -> None:
    # Here, not at the top: the tests import this module as `examples.anthropic_messages`.
    from _endpoint import endpoint, endpoint_parser

    args = endpoint_parser(__doc__, ttl=False, path="").parse_args()
    base_url, model = endpoint(args, path="")
    converse(base_url, model, args.api_key, args.max_tokens)


if __name__ == "__main__":
    main()
