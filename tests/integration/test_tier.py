"""The host tier on a real turnkv pair (tiny model, float32, 32-block caches): a session whose
blocks were evicted from both engines' caches finds its history again in the tier below them
and loads it instead of computing it, and its output still equals a single engine's.

Each engine runs the turnkv connector and, after it under vLLM's `MultiConnector`, vLLM's
offloading connector with this project's host-memory spec (`turnkv_server.tier`): every block
an engine computes is copied to host memory; a request whose prefix is neither in the engine's
cache nor pushed by the peer is served from there. A session plays three turns; two long
prompts of other sessions then take every block of both caches (the session's leases end for
room); its fourth turn loads its history from the prefill engine's tier. Then, evicted again,
the fourth turn is asked once more with turn 3's reply rewritten: the tier serves the blocks
before the edit only, and the output equals the single engine's for the edited history.

The turn stats split the prefill engine's reused tokens into its own cache hits
(`prefill_cached`) and the tier's (`prefill_restored`), which vLLM's offloading metrics confirm
byte for byte.

Then the aggregated flavour on the same engines: an `affinity` router with `--engine-leases`
in front of the decode engine alone, which serves whole turns. It holds the session's lease
between turns (its connector's counters), loads the session's evicted history from its own
tier, and releases the lease when the session is deleted. Nothing here is timed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import (
    TIER,
    TIER_ADMISSION,
    TIER_AFFINITY,
    TIER_DISK_BLOCKS,
    TIER_PLANNER,
    TIER_POOL,
    TINY_BLOCK_BYTES,
)
from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import Completion, RoutedCompletion, compare, routed_chat
from tests.support.reference import TIER_SCRIPT, Reference, References
from tests.support.waiting import wait_for
from turnkv.protocol import CacheHints, TurnTag
from turnkv.tagging import tag_headers
from turnkv_server.engine.metrics import families, fetch, fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterState

BLOCK = 128
SESSION = "tier-session"
# The eviction prompts' text: about 3,800 tokens with the system prompt, of the 4,096 a cache
# holds (the model takes 4,096).
WORDS = " ".join(USER_TURNS * 6).split()
CLUSTER = TIER
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture(scope="module")
def reference(tiny_references: References) -> Reference:
    return tiny_references[TIER_SCRIPT]


def engine_urls(state: ClusterState) -> dict[str, str]:
    endpoints = state.endpoints()
    return {"prefill": endpoints["prefill"][0],  # type: ignore[index]
            "decode": endpoints["decode"][0]}  # type: ignore[index]


def restored_bytes(url: str) -> float:
    """Bytes vLLM's offloading connector has loaded from the tier into the engine's cache."""
    for family in families(fetch(url)):
        if family.name == "vllm:kv_offload_total_bytes":
            return sum(s.value for s in family.samples if s.name.endswith("_total")
                       and s.labels.get("transfer_type") == "CPU_to_GPU")
    return 0.0


def tier_in_use(url: str) -> float | None:
    """The share of the tier's chunks that loads or stores in flight hold (vLLM's manager
    gauge; evictable and free chunks aside): 0 once every transfer is over, or space leaks."""
    for family in families(fetch(url)):
        if family.name == "vllm:kv_offload_cpu_cache_usage_perc":
            return sum(s.value for s in family.samples)
    return None


def disk_read_bytes(url: str) -> float:
    """Bytes vLLM's tiering manager has read back from the disk tier into host memory."""
    for family in families(fetch(url)):
        if family.name == "vllm:kv_offload_tiering_read_bytes":
            return sum(s.value for s in family.samples if s.name.endswith("_total")
                       and s.labels.get("tier", "").endswith(":CheckedDiskTier"))
    return 0.0


def disk_counters(url: str) -> dict[str, float]:
    """The disk tier's own figures (`turnkv:disk_tier_*`), by name less that prefix."""
    out = {}
    for family in families(fetch(url)):
        if family.name.startswith("turnkv:disk_tier_"):
            out[family.name.removeprefix("turnkv:disk_tier_")] = sum(
                s.value for s in family.samples if not s.name.endswith("_created"))
    return out


def disk_folder(launched: Cluster, role: str) -> Path:
    """Where the `role` engine's disk tier keeps its files (one folder per engine, in the
    engine set's run folder)."""
    engine = next(e for e in launched.engines if e.spec.role == role)
    [folder] = (engine.workdir.parent / "tier-disk").glob(f"turnkv-disk-turnkv-{role}-0-*")
    return folder


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def no_leases(urls: dict[str, str]) -> bool:
    return all(fetch_connector_counters(url).get("leases", 0.0) == 0 for url in urls.values())


def turn(state: ClusterState, client: httpx.Client, number: int,
         messages: list[dict[str, Any]], expected: Completion, session: str = SESSION,
         side: str = "prefill", hints: CacheHints | None = None) -> RoutedCompletion:
    """One turn of `session`, its output equal to a single engine's; the `side` engine's
    parts of the prompt (its own hits, the tier's, computed) sum to the prompt."""
    tag = TurnTag(session_id=session, turn=number, hints=hints or CacheHints())
    out = routed_chat(state.router, state.served_model_name, messages, TIER_SCRIPT.max_tokens,
                      session=None, stream=False, client=client, headers=tag_headers(tag),
                      extra={"cache_salt": session})
    verdict = compare(expected, out.completion)
    print(f"turn {number}: {verdict.describe()}; {out.stats['prompt_tokens']}")
    assert verdict.acceptable, f"turn {number}: {verdict.describe()}"
    tokens = out.stats["prompt_tokens"]
    assert (tokens[f"{side}_cached"] + tokens[f"{side}_restored"] + tokens[f"{side}_computed"]
            == tokens["total"]), tokens
    return out


def evict(state: ClusterState, client: httpx.Client, urls: dict[str, str], tag: str) -> None:
    """Two long prompts of sessions that end with their turn take every block of both caches:
    the first ends the session's leases for room and takes most of its blocks, the second
    the rest (vLLM reuses freed blocks oldest first)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(WORDS)}]
    for k in range(2):
        session = f"tier-evict-{tag}-{k}"
        out = routed_chat(state.router, state.served_model_name, messages, 4, session=None,
                          stream=False, client=client,
                          headers=tag_headers(TurnTag(session_id=session, turn=1,
                                                      hints=CacheHints(final=True))),
                          extra={"cache_salt": session})
        assert out.stats["prompt_tokens"]["total"] > 28 * BLOCK, out.stats
    wait_for(lambda: no_leases(urls), "no lease left on either engine")


def test_an_evicted_session_is_restored_from_the_tier_with_a_single_engines_output(
    reference: Reference, clusters: ClusterPool
) -> None:
    _, state = clusters.clean(CLUSTER)
    urls = engine_urls(state)
    # (No gauge yet on engines that never reported tier stats.)
    assert all(tier_in_use(url) in (None, 0.0) for url in urls.values())
    # This test's own transfers (an earlier test on the same engines may have lost a push
    # back to a send given up for room: its own business).
    transfers_before = {url: fetch_connector_counters(url) for url in urls.values()}
    with httpx.Client(timeout=600) as client:
        for number in (1, 2, 3):
            turn(state, client, number, reference.messages[number - 1],
                 reference.turns[number - 1])
        evict(state, client, urls, "a")

        # Turn 4: the history comes back from the prefill engine's tier, not computed again.
        before = restored_bytes(urls["prefill"])
        from_disk = disk_read_bytes(urls["prefill"])
        out = turn(state, client, 4, reference.messages[3], reference.turns[3])
        tokens = out.stats["prompt_tokens"]
        assert tokens["prefill_restored"] >= BLOCK, tokens
        assert tokens["prefill_computed"] < tokens["total"] - BLOCK, tokens
        # The load ran in the step that computed the rest: the turn waited no step for it.
        assert out.stats["times"]["restore_ms"] == 0.0, out.stats
        wait_for(lambda: restored_bytes(urls["prefill"]) > before, "the tier's load counted")
        loaded = restored_bytes(urls["prefill"]) - before
        assert loaded == tokens["prefill_restored"] // BLOCK * TINY_BLOCK_BYTES, (loaded, tokens)
        # The long prompts pushed the session out of host memory too: it came from disk.
        assert disk_read_bytes(urls["prefill"]) - from_disk == loaded

        # Turn 4 again with turn 3's reply rewritten, evicted again first: the tier serves the
        # blocks before the edit, never KV of the old reply.
        assert reference.edited_messages is not None and reference.edited_turn is not None
        evict(state, client, urls, "b")
        edited = turn(state, client, 4, reference.edited_messages, reference.edited_turn)
        tokens = edited.stats["prompt_tokens"]
        shared = edited.stats["prefix_break_at"]
        assert shared is not None, edited.stats
        assert tokens["prefill_restored"] >= BLOCK, tokens
        assert tokens["prefill_cached"] + tokens["prefill_restored"] <= shared, edited.stats

        for url in urls.values():
            counters, start = fetch_connector_counters(url), transfers_before[url]
            for name in ("receives_failed", "sends_failed"):
                assert counters.get(name, 0.0) == start.get(name, 0.0), (name, counters)
        assert client.delete(f"{state.router}/v1/turnkv/sessions/{SESSION}").status_code == 200
        wait_for(lambda: no_leases(urls), "the session's leases released")
    # Every tier chunk a load or store held is given back.
    wait_for(lambda: [tier_in_use(url) for url in urls.values()] == [0.0, 0.0],
             "no tier chunk held on either engine")


@pytest.mark.parametrize("damage", ["corrupted", "deleted"])
def test_a_corrupted_or_deleted_tier_file_is_computed_again_never_served(
    damage: str, reference: Reference, clusters: ClusterPool
) -> None:
    """Every file of the prefill engine's disk tier damaged while the session lives only
    there: its next turn computes the whole prompt, equal to a single engine's, and the tier
    counts what it refused to serve."""
    launched, state = clusters.clean(CLUSTER)
    urls = engine_urls(state)
    folder = disk_folder(launched, "prefill")
    session = f"tier-disk-{damage}"
    with httpx.Client(timeout=600) as client:
        for number in (1, 2, 3):
            turn(state, client, number, reference.messages[number - 1],
                 reference.turns[number - 1], session)
        evict(state, client, urls, damage)
        files = sorted(folder.rglob("*.bin"))
        assert files, f"nothing on disk in {folder}"
        before = disk_counters(urls["prefill"])
        for path in files:
            flip_a_byte(path) if damage == "corrupted" else path.unlink()
        out = turn(state, client, 4, reference.messages[3], reference.turns[3], session)
        tokens = out.stats["prompt_tokens"]
        assert (tokens["prefill_cached"], tokens["prefill_restored"]) == (0, 0), tokens
        assert tokens["prefill_computed"] == tokens["total"], tokens
        after = disk_counters(urls["prefill"])
        refused = "checksum_failures" if damage == "corrupted" else "missing_files"
        assert after.get(refused, 0.0) > before.get(refused, 0.0), (before, after)
        assert after["bytes_used"] <= TIER_DISK_BLOCKS * TINY_BLOCK_BYTES, after
        assert client.delete(f"{state.router}/v1/turnkv/sessions/{session}").status_code == 200
        wait_for(lambda: no_leases(urls), "the session's leases released")
    wait_for(lambda: [tier_in_use(url) for url in urls.values()] == [0.0, 0.0],
             "no tier chunk held on either engine")


@pytest.mark.cluster(TIER_AFFINITY)
def test_an_aggregated_engine_holds_the_sessions_lease_and_restores_it_from_its_tier(
    reference: Reference, clusters: ClusterPool
) -> None:
    _, state = clusters.clean(TIER_AFFINITY)
    engine = state.endpoints()["decode"][0]  # type: ignore[index]
    urls = {"engine": engine}
    session = "tier-aggregated"
    with httpx.Client(timeout=600) as client:
        before = fetch_connector_counters(engine)
        for number in (1, 2, 3):
            out = turn(state, client, number, reference.messages[number - 1],
                       reference.turns[number - 1], session, side="decode")
            assert out.stats["prefill_node"] is None, out.stats  # the engine served it whole
        # The engine holds the session's lease between turns, and turns 2 and 3 found it.
        counters = fetch_connector_counters(engine)
        assert counters.get("leases") == 1, counters
        assert counters.get("lease_hits", 0.0) - before.get("lease_hits", 0.0) == 2, counters

        evict(state, client, urls, "aggregated")
        restored = restored_bytes(engine)
        out = turn(state, client, 4, reference.messages[3], reference.turns[3], session,
                   side="decode")
        tokens = out.stats["prompt_tokens"]
        assert tokens["decode_restored"] >= BLOCK, tokens
        assert out.stats["times"]["restore_ms"] == 0.0, out.stats  # loaded in its step
        wait_for(lambda: restored_bytes(engine) > restored, "the tier's load counted")
        assert restored_bytes(engine) - restored == (
            tokens["decode_restored"] // BLOCK * TINY_BLOCK_BYTES), tokens

        # Deleting the session ends its lease on the engine now, not at its TTL.
        assert client.delete(f"{state.router}/v1/turnkv/sessions/{session}").status_code == 200
        wait_for(lambda: no_leases(urls), "the session's lease released")
    wait_for(lambda: tier_in_use(engine) == 0.0, "no tier chunk held")


# The pause the prefetch test's session announces before its fourth turn: long enough for the
# two eviction prompts to run first (the router prefetches one second before it is over).
PREFETCH_PAUSE_S = 8.0


@pytest.mark.cluster(TIER_AFFINITY)
def test_a_session_back_after_a_hinted_pause_finds_its_history_prefetched(
    reference: Reference, clusters: ClusterPool
) -> None:
    """The aggregated engine with its tier: turn 3 says the session is back in
    PREFETCH_PAUSE_S; two long prompts then evict its history to the tier; shortly before the
    pause is over the router has the engine load it back, so that turn 4 finds it in the
    engine's cache (cached, none restored on arrival) with a single engine's output."""
    _, state = clusters.clean(TIER_AFFINITY)
    engine = state.endpoints()["decode"][0]  # type: ignore[index]
    urls = {"engine": engine}
    session = "tier-prefetch"
    with httpx.Client(timeout=600) as client:
        for number in (1, 2):
            turn(state, client, number, reference.messages[number - 1],
                 reference.turns[number - 1], session, side="decode")
        turn(state, client, 3, reference.messages[2], reference.turns[2], session,
             side="decode", hints=CacheHints(next_turn_in=PREFETCH_PAUSE_S))
        hinted_at = time.monotonic()
        restored = restored_bytes(engine)
        evict(state, client, urls, "prefetch")
        # The test means something only if the eviction ended before the prefetch began.
        assert time.monotonic() - hinted_at < PREFETCH_PAUSE_S - 2.0
        wait_for(lambda: restored_bytes(engine) > restored, "the prefetch's load from the tier",
                 timeout=PREFETCH_PAUSE_S + 10)
        time.sleep(max(0.0, hinted_at + PREFETCH_PAUSE_S - time.monotonic()))
        out = turn(state, client, 4, reference.messages[3], reference.turns[3], session,
                   side="decode")
        tokens = out.stats["prompt_tokens"]
        assert out.stats["prefetch"] == "in_time", out.stats
        assert tokens["decode_restored"] == 0 and tokens["decode_cached"] >= 3 * BLOCK, tokens
        assert out.stats["times"]["restore_ms"] is None, out.stats  # nothing left to load
        assert client.delete(f"{state.router}/v1/turnkv/sessions/{session}").status_code == 200
        wait_for(lambda: no_leases(urls), "the session's lease released")
    wait_for(lambda: tier_in_use(engine) == 0.0, "no tier chunk held")


@pytest.mark.cluster(TIER_POOL)
def test_the_pair_as_one_pool_serves_each_session_whole_on_one_engine(
    reference: Reference, clusters: ClusterPool
) -> None:
    """A turnkv router with `--pair-pool` in front of the pair: two sessions, each served whole
    by an engine of its own (no prefill request, no KV moved), whose cache holds its history
    from one turn to the next; outputs equal a single engine's, and each engine holds the lease
    of its own session only."""
    _, state = clusters.clean(TIER_POOL)
    urls = engine_urls(state)
    sessions = ("pool-a", "pool-b")
    homes: dict[str, set[str]] = {session: set() for session in sessions}
    with httpx.Client(timeout=600) as client:
        before = {url: fetch_connector_counters(url) for url in urls.values()}
        for number in (1, 2, 3):
            for session in sessions:
                out = turn(state, client, number, reference.messages[number - 1],
                           reference.turns[number - 1], session, side="decode")
                assert out.stats["prefill_node"] is None, out.stats
                assert out.stats["kv"]["to_decode_tokens"] in (None, 0), out.stats
                homes[session].add(out.stats["decode_node"])
                if number > 1:  # the history its engine kept, found again
                    assert out.stats["prompt_tokens"]["decode_cached"] >= BLOCK, out.stats
        assert all(len(found) == 1 for found in homes.values()), homes
        assert homes["pool-a"] != homes["pool-b"], homes  # one session on each engine
        for url in urls.values():
            counters = fetch_connector_counters(url)
            assert counters.get("leases") == 1, counters
            for name in ("transfers_declined", "tokens_requested"):
                assert counters.get(name, 0.0) == before[url].get(name, 0.0), (name, counters)
        for session in sessions:
            assert client.delete(f"{state.router}/v1/turnkv/sessions/{session}"
                                 ).status_code == 200
        wait_for(lambda: no_leases(urls), "both sessions' leases released")


@pytest.mark.cluster(TIER_PLANNER)
def test_the_planner_restores_an_evicted_history_from_the_homes_tier(
    reference: Reference, clusters: ClusterPool
) -> None:
    """The default router (the planner) serves an idle home's turns whole there. When the home
    ends the session's lease for room (a long prompt sent to it directly takes every block),
    the next turn is still whole on that home, which restores the history from its tier:
    the planner's `tier restore`, its output equal to a single engine's."""
    _, state = clusters.clean(TIER_PLANNER)
    urls = engine_urls(state)
    session = "planner-tier"
    with httpx.Client(timeout=600) as client:
        homes = set()
        for number in (1, 2, 3):
            out = turn(state, client, number, reference.messages[number - 1],
                       reference.turns[number - 1], session, side="decode")
            assert out.stats["placement"]["where"] == "whole", out.stats
            homes.add(out.stats["decode_node"])
        [home] = homes
        home_url = urls[home.split("-")[0]]
        text = " ".join(WORDS)
        for k in range(2):
            reply = client.post(f"{home_url}/v1/chat/completions", json={
                "model": state.served_model_name, "max_tokens": 4, "cache_salt": f"fill-{k}",
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": text}]})
            assert reply.status_code == 200, reply.text
        wait_for(lambda: fetch_connector_counters(home_url).get("leases", 0.0) == 0,
                 "the session's lease ended for room")
        before = restored_bytes(home_url)
        out = turn(state, client, 4, reference.messages[3], reference.turns[3], session,
                   side="decode")
        placement, tokens = out.stats["placement"], out.stats["prompt_tokens"]
        assert placement["where"] == "whole" and placement["home"] == home, out.stats
        assert tokens["decode_restored"] >= BLOCK, tokens
        assert tokens["decode_computed"] < tokens["total"] - BLOCK, tokens
        wait_for(lambda: restored_bytes(home_url) > before, "the tier's load counted")
        assert client.delete(f"{state.router}/v1/turnkv/sessions/{session}").status_code == 200
        wait_for(lambda: no_leases(urls), "the session's leases released")


def own_client_turn(state: ClusterState, *args: Any) -> RoutedCompletion:
    """`turn` on a client of its own (another thread's)."""
    with httpx.Client(timeout=600) as client:
        return turn(state, client, *args)


def admission_waiting(router: str, client: httpx.Client) -> float:
    for family in families(client.get(f"{router}/metrics").text):
        if family.name == "turnkv_admission_waiting":
            return sum(s.value for s in family.samples)
    return 0.0


@pytest.mark.cluster(TIER_ADMISSION)
def test_a_new_session_waits_for_room_and_is_then_served_exactly(
    reference: Reference, clusters: ClusterPool
) -> None:
    """A router whose admission budget holds one session: b's first turn waits while a lives
    (a's own turns go on meanwhile), and is served once a ends, with a single engine's output
    and its wait in its stats."""
    _, state = clusters.clean(TIER_ADMISSION)
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(1) as pool:
        first = turn(state, client, 1, reference.messages[0], reference.turns[0], "admit-a")
        assert first.stats["times"]["queue_ms"] == 0.0, first.stats
        waiting = pool.submit(own_client_turn, state, 1, reference.messages[0],
                              reference.turns[0], "admit-b")
        wait_for(lambda: admission_waiting(state.router, client) == 1, "b's turn queued")
        second = turn(state, client, 2, reference.messages[1], reference.turns[1], "admit-a")
        assert second.stats["times"]["queue_ms"] == 0.0, second.stats
        assert not waiting.done()
        turn(state, client, 3, reference.messages[2], reference.turns[2], "admit-a",
             hints=CacheHints(final=True))
        admitted = waiting.result(timeout=300)
        assert admitted.stats["times"]["queue_ms"] > 0, admitted.stats
        assert admission_waiting(state.router, client) == 0
        assert client.delete(f"{state.router}/v1/turnkv/sessions/admit-b").status_code == 200
        wait_for(lambda: no_leases(engine_urls(state)), "both sessions' leases released")
