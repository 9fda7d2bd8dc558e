"""The turnkv connector on a real prefill/decode pair (SmolLM2-135M-Instruct, float32).

Every turn is checked against a single engine's greedy output for the same conversation; the
connector's own counters (each engine's `/metrics`) show what moved: turn N+1 sends the decode
engine only the blocks it lacks (or, for a short delta, no prefill at all: the decode engine
computes it), the decode engine pushes each reply back to the prefill engine, leases stay
under their cap and end with the session, and a failed or missing peer means recompute, never
wrong KV. The tests share one cluster: each test that plays turns gets it clean (no lease, no
block in use, nothing cached; a router of its own holding no session). The launcher's own
tests come last in the suite's order (the last one stops the cluster through `turnkv down`),
but pass in any.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import (
    SMOLLM2_LAUNCHER,
    SMOLLM2_LEASE_S,
    SMOLLM2_SHORT_DELTA_TOKENS,
    SMOLLM2_TURNKV,
)
from tests.support.oracle import Completion, RoutedCompletion, compare, routed_chat
from tests.support.reference import SMOLLM2_SCRIPT, Reference, References
from tests.support.waiting import wait_for
from turnkv_server.engine.metrics import fetch_connector_counters, fetch_prompt_token_sources
from turnkv_server.launcher import Cluster, ClusterState, ProcessRef
from turnkv_server.launcher.processes import group_members, unpinned_threads

SCRIPT = SMOLLM2_SCRIPT
TURNS = SCRIPT.turns
MAX_TOKENS = SCRIPT.max_tokens
EDITED_AT = 4  # this turn's history rewrites turn 1's reply
assert SCRIPT.edited_at == EDITED_AT
# Engine leases last this long unless a client asks for less; the router keeps sessions longer.
ENGINE_LEASE_S = SMOLLM2_LEASE_S
# Turns adding at most this many tokens are served by the decode engine alone: some of the
# conversation's user messages are below it, some above.
SHORT_DELTA_TOKENS = SMOLLM2_SHORT_DELTA_TOKENS
TURNKV = [sys.executable, "-m", "turnkv_server.cli"]
# The pair, started after the reference engine stopped: its turns through a router of their
# own, the launcher's tests through the launcher's.
CLUSTER = SMOLLM2_TURNKV
pytestmark = pytest.mark.cluster(CLUSTER)
launcher_test = pytest.mark.cluster(SMOLLM2_LAUNCHER)


@pytest.fixture(scope="module")
def reference(smollm2_references: References) -> Reference:
    return smollm2_references[SCRIPT]


@pytest.fixture
def cluster(reference: Reference, clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    """The pair, clean: every test here counts blocks and leases from none."""
    return clusters.clean(CLUSTER)


@pytest.fixture
def launcher(reference: Reference, clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    """The pair as the launcher started it: its state file, its router."""
    return clusters.get(SMOLLM2_LAUNCHER)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=600) as c:
        yield c


class Engines:
    """The pair's connector counters, read from their `/metrics`."""

    def __init__(self, state: ClusterState) -> None:
        endpoints = state.endpoints()
        self.prefill: str = endpoints["prefill"][0]  # type: ignore[index]
        self.decode: str = endpoints["decode"][0]  # type: ignore[index]

    def read(self) -> tuple[dict[str, float], dict[str, float]]:
        return fetch_connector_counters(self.prefill), fetch_connector_counters(self.decode)


def _turn(state: ClusterState, client: httpx.Client, messages: list[dict[str, Any]],
          session: dict[str, Any], stream: bool) -> RoutedCompletion:
    return routed_chat(state.router, state.served_model_name, messages, MAX_TOKENS,
                       session=session, stream=stream, client=client,
                       extra={"cache_salt": session["session_id"]})


def _play(state: ClusterState, client: httpx.Client, reference: Reference,
          session: dict[str, Any], turns: range) -> None:
    """Play the reference conversation's `turns` (1-based) in `session`, checking each."""
    for turn in turns:
        out = _turn(state, client, reference.messages[turn - 1], session, stream=False)
        _assert_same(reference.turns[turn - 1], out, turn)


def _assert_same(ref: Completion, out: RoutedCompletion, turn: int) -> None:
    verdict = compare(ref, out.completion)
    print(f"turn {turn}: {verdict.describe()}; {out.stats['prompt_tokens']}")
    assert verdict.acceptable, f"turn {turn}: {verdict.describe()}"


def _end_session(state: ClusterState, client: httpx.Client, engines: Engines,
                 session_id: str) -> None:
    """DELETE the session; both engines' leases and blocks must come back."""
    reply = client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}")
    assert reply.status_code == 200
    _assert_all_blocks_back(engines)


def _assert_all_blocks_back(engines: Engines) -> None:
    def empty() -> bool:
        return all(c.get("pinned_blocks") == 0 and c.get("leases") == 0
                   and c.get("kv_cache_usage") == 0 for c in engines.read())
    wait_for(empty, "every lease released and every block free on both engines")


@launcher_test
def test_status_json_lists_the_endpoints(launcher: tuple[Cluster, ClusterState]) -> None:
    _, state = launcher
    status = subprocess.run([*TURNKV, "status", "--json", "--run-dir", state.run_dir],
                            capture_output=True, text=True, check=True)
    endpoints = json.loads(status.stdout)
    assert endpoints["running"] is True and endpoints["mode"] == "turnkv"
    assert endpoints["router"] == state.router
    assert httpx.get(f"{endpoints['router']}/health").status_code == 200
    assert len(endpoints["prefill"]) == 1 and len(endpoints["decode"]) == 1


@launcher_test
def test_every_engine_thread_stays_on_its_own_core(launcher: tuple[Cluster, ClusterState]
                                                   ) -> None:
    _, state = launcher
    prefill, decode = state.engines
    assert set(prefill.cores).isdisjoint(decode.cores)
    for engine in state.engines:
        # The connector's transfer thread and NIXL's progress thread included.
        assert unpinned_threads(engine.pid, engine.cores) == []


def test_eight_turns_equal_a_single_engine_and_move_only_what_is_missing(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    _, state = cluster
    engines = Engines(state)
    sources = fetch_prompt_token_sources(engines.decode)
    prefill, decode = engines.read()
    at_start = (prefill, decode)
    block = int(decode["block_size"])
    caps = [int((c["num_gpu_blocks"] - 1) * 0.5) for c in (prefill, decode)]
    assert prefill["kv_cache_usage"] == decode["kv_cache_usage"] == 0
    held = 0  # tokens the decode engine computed for the session so far
    alone_turns = []
    streamed_total = 0.0
    for turn in range(1, TURNS + 1):
        final = turn == TURNS
        session = {"session_id": "eight", "turn": turn, "hints": {"final": final}}
        out = _turn(state, client, reference.messages[turn - 1], session, stream=turn % 2 == 0)
        _assert_same(reference.turns[turn - 1], out, turn)
        after_prefill, after_decode = engines.read()
        tokens = out.stats["prompt_tokens"]
        total = tokens["total"]
        shared = min(out.stats["prefix_break_at"] or held, held)
        hit_blocks = min(shared, total - 1) // block  # the decode engine's own prefix hit
        received = after_decode["blocks_received"] - decode["blocks_received"]
        alone = out.stats["prefill_node"] is None
        if alone:
            # A short delta: the decode engine computed it, nothing came from the prefill engine.
            alone_turns.append(turn)
            assert turn > 1 and total - shared <= SHORT_DELTA_TOKENS
            assert received == 0 and tokens["prefill_computed"] is None
            expected = total - hit_blocks * block
            assert tokens["decode_computed"] == expected, (turn, tokens)
            # (After `final` the router also releases each engine's lease with a one-token
            # request: it counts one more.)
            counted = expected + int(final)
            wait_for(lambda before=sources, counted=counted:  # type: ignore[misc]
                     (fetch_prompt_token_sources(engines.decode) - before).local_compute
                     == counted, f"turn {turn}: {expected} tokens computed on decode")
        else:
            # Prefill to decode: only the blocks past the decode engine's own full-block hit.
            assert received == math.ceil(total / block) - hit_blocks, (turn, received)
            # Written layer by layer during the prefill, what the decode engine had registered
            # for by then; the rest in the last write.
            streamed = after_prefill["bytes_streamed"] - prefill["bytes_streamed"]
            sent = after_prefill["bytes_sent"] - prefill["bytes_sent"]
            assert 0 <= streamed <= sent, (turn, streamed, sent)
            streamed_total += streamed
            print(f"turn {turn}: {streamed / max(sent, 1):.0%} of {sent} bytes written "
                  f"layer by layer")
            if turn % 2:
                # A non-streamed turn also carries the decode engine's own figures: vLLM
                # computes again the last token of a prompt received whole (to sample the
                # next), so that one counts as computed, not received.
                assert (tokens["decode_cached"], tokens["decode_received"],
                        tokens["decode_computed"]) == (
                    hit_blocks * block, total - hit_blocks * block - 1, 1), (turn, tokens)
            # The prefill engine computed the new tokens, from the last full block it held.
            if turn > 1:
                assert tokens["prefill_computed"] < total - shared + block, (turn, tokens)
            # vLLM's own account agrees: the decode engine got the prompt by transfer and
            # computed at most the one token it always recomputes.
            wait_for(lambda before=sources:  # type: ignore[misc]
                     (fetch_prompt_token_sources(engines.decode) - before).external_kv_transfer
                     > 0, f"turn {turn}'s prompt counted as received on decode")
            assert (fetch_prompt_token_sources(engines.decode) - sources).local_compute \
                <= 1 + int(final)
        for counters, first, cap in zip((after_prefill, after_decode), at_start, caps,
                                        strict=True):
            assert counters["pinned_blocks"] <= cap
            for name in ("receives_failed", "sends_failed"):
                assert counters.get(name, 0.0) == first.get(name, 0.0), (turn, name, counters)

        # What the prefill engine holds of the new history: the prompt it computed, or (after
        # a short delta) the last history, pushed back, as far as it is still shared.
        prefill_holds = min(shared, held) if alone else total
        output = len(out.completion.token_ids)
        held = total + output - 1  # the last generated token's KV is never computed
        if not final:
            # Decode to prefill: the blocks it lacks, during the pause before the next turn.
            expected = math.ceil(held / block) - prefill_holds // block
            # (The push back may land before the counters above were read: count from
            # before the turn, when the prefill engine receives nothing else.)
            start = prefill["blocks_received"]
            wait_for(lambda start=start, expected=expected:  # type: ignore[misc]
                     engines.read()[0]["blocks_received"] - start == expected,
                     f"turn {turn}'s {expected} block(s) pushed back to prefill")
        prefill, decode = engines.read()
        sources = fetch_prompt_token_sources(engines.decode)
    print(f"turns served by the decode engine alone: {alone_turns}")
    # Both paths ran: the conversation's short and long user messages straddle the limit.
    assert 0 < len(alone_turns) < TURNS - 1
    # The decode engine registers within milliseconds of the dispatch, while a prefill takes
    # tenths of a second: layer-by-layer writes carried KV on these turns (97-100% of it when
    # measured), and the outputs above stayed exact.
    assert streamed_total > 0
    # `final` released both leases: every block is free again.
    _assert_all_blocks_back(engines)


def test_edited_history_stays_exact(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    _, state = cluster
    session = {"session_id": "edited"}
    _play(state, client, reference, session, range(1, EDITED_AT))
    out = _turn(state, client, reference.edited_messages, session, stream=True)
    _assert_same(reference.edited_turn, out, EDITED_AT)
    assert out.stats["prefix_break_at"] is not None
    _end_session(state, client, Engines(state), "edited")


def test_a_lease_that_expired_between_turns(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    _, state = cluster
    engines = Engines(state)
    session = {"session_id": "expiry"}
    _play(state, client, reference, session, range(1, 3))
    before = engines.read()
    time.sleep(ENGINE_LEASE_S + 2)  # both engines' leases run out; the router's session not
    out = _turn(state, client, reference.messages[2], session, stream=True)
    _assert_same(reference.turns[2], out, 3)
    after = engines.read()
    for b, a in zip(before, after, strict=True):
        assert a["leases_expired"] > b["leases_expired"]
        assert a["lease_misses"] > b["lease_misses"]
    _end_session(state, client, engines, "expiry")


def test_a_decode_engine_restarted_mid_session(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    launched, state = cluster
    engines = Engines(state)
    session = {"session_id": "restart"}
    _play(state, client, reference, session, range(1, 2))
    before = engines.read()[0]
    _play(state, client, reference, session, range(2, 3))
    # Restart between turns, once turn 2's reply is back on the prefill engine.
    wait_for(lambda: engines.read()[0]["receives_done"] > before["receives_done"],
             "turn 2's push back")
    victim = next(e for e in launched.engines if e.spec.role == "decode")
    victim.stop()
    victim.start()
    wait_for(victim.is_healthy, "the decode engine healthy again", timeout=300)
    prefill_before, _ = engines.read()

    out = _turn(state, client, reference.messages[2], session, stream=True)
    _assert_same(reference.turns[2], out, 3)
    decode_after = engines.read()[1]
    block = int(decode_after["block_size"])
    total = out.stats["prompt_tokens"]["total"]
    # The new engine (a new NIXL agent, after a new handshake) had nothing: it got every block.
    assert decode_after["blocks_received"] == math.ceil(total / block)
    # And the prefill engine, which knew the old agent, registered again for the push back.
    wait_for(lambda: engines.read()[0]["blocks_received"] > prefill_before["blocks_received"],
             "the reply pushed back by the restarted decode engine")
    assert engines.read()[0]["receives_failed"] == prefill_before["receives_failed"]
    _end_session(state, client, engines, "restart")


def test_an_idle_engine_ends_an_expired_lease_without_another_request(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    """After a turn nothing reaches either engine (the router keeps the session for minutes,
    so it sends no release): each engine's lease still ends at its TTL and its blocks come
    back. vLLM's engine core sleeps on its input queue while it has no request; the connector
    wakes it at the lease's deadline."""
    _, state = cluster
    engines = Engines(state)
    before = engines.read()
    _play(state, client, reference, {"session_id": "idle"}, range(1, 2))
    # The reply's push back is the last request: the prefill engine's receive of it.
    wait_for(lambda: engines.read()[0]["receives_done"] > before[0]["receives_done"],
             "the turn's push back")
    assert all(c["pinned_blocks"] > 0 for c in engines.read())
    wait_for(lambda: all(c.get("pinned_blocks") == 0 and c.get("leases") == 0
                         and c.get("kv_cache_usage") == 0 for c in engines.read()),
             "both idle engines' leases expired and every block free",
             timeout=ENGINE_LEASE_S + 30)
    for b, a in zip(before, engines.read(), strict=True):
        assert a["leases_expired"] > b["leases_expired"]
    assert client.delete(f"{state.router}/v1/turnkv/sessions/idle").status_code == 200


@launcher_test
def test_down_stops_exactly_the_cluster(launcher: tuple[Cluster, ClusterState]) -> None:
    """`turnkv down` stops every process of the cluster (the engines the state file names:
    the pool records there an engine a test restarted) and nothing else. The pool starts the
    pair again for whichever test needs it next."""
    _, state = launcher
    # Each engine's connector ID, which names the host tier's region down removes.
    assert all(engine.engine_id for engine in state.engines)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
    try:
        subprocess.run([*TURNKV, "down", "--run-dir", state.run_dir], check=True)
        for server in [*state.engines, state.router_process]:
            assert server is not None
            assert not ProcessRef(server.pid, server.create_time).is_alive()
            assert group_members(server.pid) == []
        assert bystander.poll() is None, "turnkv down touched a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()
