"""The single-engine reference: what one plain vLLM engine answers, greedily, to the
conversations the integration tests then play through turnkv (`tests.support.oracle`
compares the two).

One engine per model serves every test module's reference (`References`, the
`tiny_references` fixture): the suite's tiny-model conversations are played on it in one go,
while it runs, and remembered. Each conversation is played under a cache salt of its own, so
that no conversation hits another's prefixes: each one is computed as on an engine of its own.

A conversation is a `Script` (the suite's own, `conversation`), or anything else `Playable`:
a test module's conversation played the way its clients play it (a stock client's, an API
client's), given to the same engine in the same go.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httpx

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import ClusterSpec
from tests.support.conversation import conversation
from tests.support.oracle import Completion, greedy_chat


@dataclass(frozen=True)
class Script:
    """A conversation of `turns` turns, each answered with at most `max_tokens` tokens; with
    `edited_at`, one more request: that turn's history with the reply of turn
    `edited_reply` replaced by `edit`."""

    turns: int
    max_tokens: int
    edited_at: int | None = None
    edit: str = ""
    edited_reply: int = 1

    @property
    def salt(self) -> str:
        edited = f"-edited-at-{self.edited_at}" if self.edited_at is not None else ""
        if self.edited_reply != 1:
            edited += f"-reply-{self.edited_reply}"
        return f"reference-{self.turns}x{self.max_tokens}{edited}"

    def play(self, base_url: str, model: str, client: httpx.Client) -> Reference:
        return play(base_url, model, self, client)


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Playable(Protocol[T_co]):
    """A conversation the reference engine plays (hashable: `References` plays each once)."""

    def __hash__(self) -> int: ...

    def play(self, base_url: str, model: str, client: httpx.Client) -> T_co:
        """What the engine at `base_url` answers to it, turn by turn."""


@dataclass
class Reference:
    turns: list[Completion]
    messages: list[list[dict[str, Any]]]  # the exact messages of each turn
    edited_messages: list[dict[str, Any]] | None = None
    edited_turn: Completion | None = None


def play(base_url: str, model: str, script: Script, client: httpx.Client) -> Reference:
    """The script on a single engine: each turn's messages hold the engine's earlier replies."""
    extra = {"cache_salt": script.salt}
    replies: list[str] = []
    outputs = []
    for turn in range(script.turns):
        out = greedy_chat(base_url, model, conversation(replies, script.turns)[turn],
                          script.max_tokens, client=client, extra=extra)
        outputs.append(out)
        replies.append(out.text)
    reference = Reference(outputs, conversation(replies, script.turns))
    if script.edited_at is not None:
        edited = conversation(replies, script.turns)[script.edited_at - 1]
        edited[2 * script.edited_reply] = {"role": "assistant", "content": script.edit}
        reference.edited_messages = edited
        reference.edited_turn = greedy_chat(base_url, model, edited, script.max_tokens,
                                            client=client, extra=extra)
    return reference


class References:
    """The references of one model's single engine (`engine`, from the pool), each played
    once. `prefetch` plays several while the engine runs: asking for one later brings the
    engine back, in place of whatever cluster runs then."""

    def __init__(self, clusters: ClusterPool, engine: ClusterSpec) -> None:
        self._clusters = clusters
        self._engine = engine
        # What each conversation gave, or the error it raised (a client's conversation may
        # fail on the engine: it fails the tests that compare with it, not the others).
        self._played: dict[Playable[Any], Any] = {}

    def prefetch(self, scripts: Iterable[Playable[Any]]) -> None:
        missing = [s for s in scripts if s not in self._played]
        if not missing:
            return
        _, state = self._clusters.get(self._engine)
        started = time.monotonic()
        with httpx.Client(timeout=600) as client:
            for script in missing:
                try:
                    self._played[script] = script.play(state.router, state.served_model_name,
                                                       client)
                except Exception as exc:  # noqa: BLE001  (raised again by `__getitem__`)
                    self._played[script] = exc
        self._clusters.starts.append(
            (f"references on {self._engine.name}: {len(missing)} conversation(s) played",
             time.monotonic() - started))

    def __getitem__(self, script: Playable[T]) -> T:
        self.prefetch([script])
        played = self._played[script]
        if isinstance(played, Exception):
            raise AssertionError(f"{script} failed on {self._engine.name}") from played
        return played


# The tiny-model conversations of the suite, played together before the first cluster that
# needs them starts.
ROUTER_SCRIPT = Script(turns=5, max_tokens=24, edited_at=3, edit=(
    "Let me restate my first answer more briefly: crashes can lose buffered writes."))
# Shared sessions play all five turns; test_faults.py plays the first four.
SHORT_SCRIPT = Script(turns=5, max_tokens=16)
# test_tier.py's: four turns, and the fourth again with turn 3's reply rewritten, so that the
# edited history still shares whole blocks with what the tier holds.
TIER_SCRIPT = Script(turns=4, max_tokens=16, edited_at=4, edited_reply=3, edit=(
    "Only the HTTP handler can see a key twice; the backup job cannot."))
TINY_SCRIPTS = (ROUTER_SCRIPT, SHORT_SCRIPT, TIER_SCRIPT)

# test_turnkv_connector.py's SmolLM2 conversation: eight turns, and the fourth again with turn
# 1's reply rewritten. Played before the SmolLM2 pair starts (`smollm2_references`).
SMOLLM2_SCRIPT = Script(turns=8, max_tokens=16, edited_at=4, edit=(
    "In short: a crash can lose the writes that were not yet synced."))
SMOLLM2_SCRIPTS = (SMOLLM2_SCRIPT,)
