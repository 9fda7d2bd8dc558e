"""A LangChain chain on a turnkv session: a docs assistant that reads files between turns.

The chain is plain LangChain (`ChatPromptTemplate | model`); the only turnkv part is the model,
`ChatTurnKV` instead of `ChatOpenAI`. Every turn is then a turn of one router session, so the
router keeps the conversation's KV on the engines that hold it, and every reply carries its
stats in `response_metadata["turnkv"]` and `usage_metadata["input_token_details"]["cache_read"]`.

Between turns the script runs LangChain tools (`list_files`, `read_file`) over the repository's
docs and hands their output to the model with the next question, the way a tool-calling agent
would; the turn before a tool run tells the router when the next turn comes (`next_turn_in`),
and the last turn says it is the last (`final`).

    turnkv up
    python examples/langchain_agent.py               # the cluster `turnkv up` started
    python examples/langchain_agent.py --base-url http://HOST:PORT/v1 --model NAME
    turnkv down
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _endpoint import endpoint, endpoint_parser
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.tools import tool
from rich.console import Console

import turnkv
from turnkv.integrations.langchain import ChatTurnKV

DOCS = Path(__file__).resolve().parent.parent / "docs"
TOOL_OUTPUT_CHARS = 900  # SmolLM2's context is 8k tokens: keep each tool result short
SYSTEM = ("You are a concise assistant for the turnkv project. Tool results are given to you "
          "in the user's messages. Answer in two or three sentences.")


@tool
def list_files(folder: str) -> str:
    """List the files of a folder of the project's docs."""
    base = (DOCS / folder).resolve()
    if not base.is_relative_to(DOCS):
        return f"error: {folder} is outside the docs"
    return "\n".join(sorted(p.name for p in base.iterdir() if p.is_file()))


@tool
def read_file(path: str) -> str:
    """Read the beginning of a file of the project's docs."""
    target = (DOCS / path).resolve()
    if not target.is_relative_to(DOCS) or not target.is_file():
        return f"error: no such file {path}"
    return target.read_text(encoding="utf-8")[:TOOL_OUTPUT_CHARS]


# (tool, its argument, the question about its output); None: a question without a tool.
PLAN: list[tuple[Any, str, str] | tuple[None, None, str]] = [
    (list_files, ".", "Which documents does the project have, judging by their names?"),
    (read_file, "protocol.md", "What does the router add to OpenAI's HTTP API?"),
    (read_file, "architecture.md", "Which parts make up the system, in one sentence each?"),
    (None, None, "In one sentence: why does keeping a session's KV cache make turns faster?"),
]
TOOL_SECONDS = 2.0  # how long the next tool run is announced to take


def main() -> None:
    args = endpoint_parser(__doc__).parse_args()
    console = Console()
    base_url, model_name = endpoint(args)
    model = ChatTurnKV(model=model_name, base_url=base_url, api_key=args.api_key,
                       temperature=0, max_tokens=args.max_tokens, ttl=args.ttl)
    chain = ChatPromptTemplate.from_messages([
        ("system", SYSTEM), MessagesPlaceholder("history"), ("human", "{input}"),
    ]) | model
    console.rule(f"LangChain + turnkv: {model_name} at {base_url}, session {model.session.id}")
    history: list[BaseMessage] = []
    try:
        for index, (tool_fn, argument, question) in enumerate(PLAN, start=1):
            user = question
            if tool_fn is not None:
                output = tool_fn.invoke(argument)
                console.print(f"[dim]tool {tool_fn.name}({argument!r}): "
                              f"{len(output)} characters[/]")
                user = f"Tool {tool_fn.name}({argument!r}) returned:\n{output}\n\n{question}"
            if index == len(PLAN):
                model.session.hint(final=True)
            elif PLAN[index][0] is not None:
                model.session.hint(next_turn_in=TOOL_SECONDS)
            console.print(f"[bold cyan]user[/] {question}")
            reply = _stream_turn(console, chain, history, user)
            history += [HumanMessage(user), AIMessage(content=reply.content)]
            _print_turn(console, reply)
        console.print(turnkv.stats_table(model.session.turns, title="per turn"))
        console.print(turnkv.session_stats_table(model.session.stats))
    finally:
        model.close()


def _stream_turn(console: Console, chain: Any, history: list[BaseMessage], user: str
                 ) -> AIMessageChunk:
    console.print("[bold green]assistant[/] ", end="")
    merged: AIMessageChunk | None = None
    for chunk in chain.stream({"history": history, "input": user}):
        console.print(chunk.content, end="", highlight=False, markup=False)
        merged = chunk if merged is None else merged + chunk
    console.print()
    assert merged is not None
    return merged


def _print_turn(console: Console, reply: AIMessageChunk) -> None:
    """What the adapter put on the reply: the turn's stats and LangChain's cache_read."""
    stats = turnkv.TurnStats.model_validate(reply.response_metadata["turnkv"])
    usage = reply.usage_metadata
    cache_read = usage.get("input_token_details", {}).get("cache_read") if usage else None
    ttft = "-" if stats.client_ttft_ms is None else f"{stats.client_ttft_ms:.0f}"
    console.print(f"[dim]turn {stats.turn}: {stats.prompt_tokens.total} prompt tokens, "
                  f"cache_read {cache_read}, computed {stats.computed_tokens}, "
                  f"client TTFT {ttft} ms[/]\n")


if __name__ == "__main__":
    main()
