"""A LlamaIndex chat on a turnkv session, with each turn's stats.

`TurnKVLLM` is LlamaIndex's `OpenAILike` bound to a turnkv session: every `chat` /
`stream_chat` / `achat` call is a turn of that session, so the router keeps the conversation's
KV on the engines that hold it, and each response carries the turn's stats in
`additional_kwargs["turnkv"]` and the prompt tokens not recomputed in
`additional_kwargs["cache_read"]`. Here the session is opened with `turnkv.session()` and
given to the LLM; leaving the `with` block releases it on the router.

    turnkv up
    python examples/llamaindex_chat.py               # the cluster `turnkv up` started
    python examples/llamaindex_chat.py --base-url http://HOST:PORT/v1 --model NAME
    turnkv down
"""

from __future__ import annotations

import argparse

from _endpoint import endpoint, endpoint_parser
from llama_index.core.base.llms.types import ChatMessage, ChatResponse
from rich.console import Console

import turnkv
from turnkv.integrations.llamaindex import CACHE_READ_KEY, TurnKVLLM

SYSTEM = "You are a concise travel assistant. Answer in two or three sentences."
QUESTIONS = [
    "I am planning a three-day trip to Lisbon in spring. Which neighbourhoods should I stay in?",
    "What are two day trips from there that are easy by train?",
    "Which local dishes should I try, and where?",
    "Summarise the whole plan in a short list.",
]


def main() -> None:
    args = _parser().parse_args()
    console = Console()
    base_url, model_name = endpoint(args)
    with turnkv.session(ttl=args.ttl) as session:
        llm = TurnKVLLM(model=model_name, api_base=base_url, api_key=args.api_key,
                        temperature=0, max_tokens=args.max_tokens, session=session)
        console.rule(f"LlamaIndex + turnkv: {model_name} at {base_url}, session {session.id}")
        messages = [ChatMessage(role="system", content=SYSTEM)]
        for question in QUESTIONS[: args.turns]:
            messages.append(ChatMessage(role="user", content=question))
            console.print(f"[bold cyan]user[/] {question}")
            console.print("[bold green]assistant[/] ", end="")
            last: ChatResponse | None = None
            for last in llm.stream_chat(messages):
                console.print(last.delta or "", end="", highlight=False, markup=False)
            console.print()
            assert last is not None
            messages.append(last.message)
            _print_turn(console, last)
        console.print(turnkv.stats_table(session.turns, title="per turn"))
        console.print(turnkv.session_stats_table(session.stats))


def _print_turn(console: Console, last: ChatResponse) -> None:
    """What the adapter put on the stream's last response."""
    stats = turnkv.TurnStats.model_validate(last.additional_kwargs["turnkv"])
    ttft = "-" if stats.client_ttft_ms is None else f"{stats.client_ttft_ms:.0f}"
    console.print(f"[dim]turn {stats.turn}: {stats.prompt_tokens.total} prompt tokens, "
                  f"cache_read {last.additional_kwargs.get(CACHE_READ_KEY)}, "
                  f"computed {stats.computed_tokens}, client TTFT {ttft} ms[/]\n")


def _parser() -> argparse.ArgumentParser:
    parser = endpoint_parser(__doc__)
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    return parser


if __name__ == "__main__":
    main()
