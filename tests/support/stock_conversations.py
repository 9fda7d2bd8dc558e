"""The conversations tests/integration/test_stock_clients.py plays as stock clients play them:
no tags, a system prompt, one question a turn, and each turn's history holding the replies the
client got. The single tiny engine plays each first (`tests.support.reference`, with the
suite's other conversations), under a cache salt of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import Completion, greedy_chat

MAX_TOKENS = 16
# Longer than a KV block (128 tokens): the conversations that share it share whole blocks.
LONG_SYSTEM = " ".join([SYSTEM] * 3)


@dataclass(frozen=True)
class Edit:
    """From turn `at` on, the question of turn `question` reads `prefix` + itself: the user
    edited it after its reply came."""

    at: int
    question: int
    prefix: str


@dataclass(frozen=True)
class StockConversation:
    name: str  # also its cache salt on the reference engine
    system: str
    questions: tuple[str, ...]
    edit: Edit | None = None

    @property
    def turns(self) -> int:
        return len(self.questions)

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, Any]]:
        """Turn `turn`'s request (from 1), given the replies of the turns before it."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for earlier in range(1, turn + 1):
            question = self.questions[earlier - 1]
            if self.edit is not None and turn >= self.edit.at and earlier == self.edit.question:
                question = self.edit.prefix + question
            messages.append({"role": "user", "content": question})
            if earlier < turn:
                messages.append({"role": "assistant", "content": replies[earlier - 1]})
        return messages

    def play(self, base_url: str, model: str, client: httpx.Client) -> list[Completion]:
        """Greedy, each turn on the replies the engine gave before."""
        replies: list[str] = []
        outputs = []
        for turn in range(1, self.turns + 1):
            out = greedy_chat(base_url, model, self.messages(turn, replies), MAX_TOKENS,
                              client=client, extra={"cache_salt": self.name})
            outputs.append(out)
            replies.append(out.text)
        return outputs


def _rotated(start: int, turns: int) -> tuple[str, ...]:
    return tuple((USER_TURNS[start:] + USER_TURNS[:start])[:turns])


# Played at once by a stock openai client: two share a long system prompt with the edited one,
# whose second question is rewritten at its third turn.
EDITED_AT = 3
AT_ONCE = (
    StockConversation("shared-a", LONG_SYSTEM, _rotated(0, 4)),
    StockConversation("shared-b", LONG_SYSTEM, _rotated(1, 4)),
    StockConversation("edited", LONG_SYSTEM, _rotated(2, 4),
                      Edit(EDITED_AT, 2, "In one sentence: ")),
    StockConversation("own", SYSTEM, _rotated(3, 4)),
)


def benchmark_conversation(conversation_id: str | None) -> StockConversation:
    """What vLLM's multi-turn benchmark client plays, untagged or with `conversation_id`."""
    name = f"benchmark-client-{conversation_id}"
    return StockConversation(name, f"{name}. {SYSTEM}", tuple(USER_TURNS[:3]))


BENCHMARK_IDS = (None, "CONV_ID_7")
STOCK_CONVERSATIONS = (*AT_ONCE, *(benchmark_conversation(i) for i in BENCHMARK_IDS))
