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

import argparse
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
    args = _parser().parse_args()
    base_url, model = _endpoint(args)
    converse(base_url, model, args.api_key, args.max_tokens)


def _endpoint(args: argparse.Namespace) -> tuple[str, str]:
    """The router's URL and model: given, or those of the cluster `turnkv up` started."""
    if args.base_url and args.model:
        return args.base_url, args.model
    from turnkv_server.launcher import current_state

    state = current_state()
    if args.base_url is None and (state is None or not state.router):
        raise SystemExit("no cluster is running: start one with `turnkv up`, or pass "
                         "--base-url and --model")
    assert state is not None
    return args.base_url or state.router, args.model or state.served_model_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a turnkv router's URL (http://HOST:PORT)")
    parser.add_argument("--model", help="the model to use (default: the cluster's)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-tokens", type=int, default=96)
    return parser


if __name__ == "__main__":
    main()
