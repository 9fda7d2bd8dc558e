"""Routers sharing sessions through a real redis-server (turnkv mode, tiny model, float32).

Two routers stand in front of one prefill/decode pair. A conversation's turns go to one and
then the other; one router is killed (SIGKILL) between turns and a new process takes over from
the same state. Every turn equals a single engine's greedy output, and each router serves the
session as if it had served all of it: the same decode engine, the history known (turns after
the first are short deltas on the decode engine, which needs the history's token IDs), the
turn count carried on, and `final` ends the session for every router.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import (
    FIXED_POOLS,
    TINY_ENGINES,
    ClusterSpec,
    RouterProcess,
    RouterView,
    redis_store,
)
from tests.support.oracle import Completion, RoutedCompletion, compare, routed_chat
from tests.support.reference import SHORT_SCRIPT, References
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterState

TURNS = SHORT_SCRIPT.turns
MAX_TOKENS = SHORT_SCRIPT.max_tokens
# The tiny turnkv engines (one prefill, two decode): the routers here serve their first two.
CLUSTER = ClusterSpec("shared-sessions", TINY_ENGINES["turnkv"],
                      RouterView(prefill=1, decode=1, args=FIXED_POOLS, service=redis_store))
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture(scope="module")
def reference(tiny_references: References
              ) -> tuple[list[list[dict[str, Any]]], list[Completion]]:
    played = tiny_references[SHORT_SCRIPT]
    return played.messages, played.turns


@pytest.fixture
def cluster(clusters: ClusterPool) -> tuple[Cluster, ClusterState]:
    return clusters.get(CLUSTER)


def test_turns_move_between_routers_and_survive_a_killed_router(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState],
) -> None:
    launched, state = cluster
    messages, expected = reference
    logs = Path(state.run_dir) / "logs"
    second = RouterProcess(launched, logs / "router-2.log")
    replacement: RouterProcess | None = None
    try:
        with httpx.Client(timeout=300) as client:
            def turn(router: str, n: int) -> RoutedCompletion:
                out = routed_chat(router, state.served_model_name, messages[n - 1], MAX_TOKENS,
                                  session={"session_id": "roaming", "turn": n,
                                           "hints": {"final": n == TURNS}},
                                  stream=n % 2 == 0, client=client)
                verdict = compare(expected[n - 1], out.completion)
                print(f"turn {n} via {router}: {verdict.describe()}; {out.stats['prompt_tokens']}")
                assert verdict.acceptable, f"turn {n}: {verdict.describe()}"
                return out

            def record(router: str) -> dict[str, Any]:
                return client.get(f"{router}/v1/turnkv/sessions/roaming").json()

            first = turn(state.router, 1)
            decode = first.stats["decode_node"]
            # The other router knows the session: its history, its engines, its turn.
            assert record(second.url)["turns"] == 1
            out = turn(second.url, 2)
            assert out.stats["decode_node"] == decode
            assert out.stats["prefill_node"] is None  # a short delta: the history was known

            # The first router dies between turns (the pool starts the spec's router anew for
            # the next test that asks for it); the other one carries on.
            assert state.router_process is not None
            os.kill(state.router_process.pid, signal.SIGKILL)
            out = turn(second.url, 3)
            assert (out.stats["decode_node"], out.stats["prefill_node"]) == (decode, None)

            # A new router process starts from Redis alone and continues the session.
            replacement = RouterProcess(launched, logs / "router-3.log")
            assert record(replacement.url)["turns"] == 3
            assert record(replacement.url)["totals"]["turns"] == 3
            out = turn(replacement.url, 4)
            assert (out.stats["decode_node"], out.stats["prefill_node"]) == (decode, None)
            turn(replacement.url, 5)  # final: every router forgets the session
            for router in (second.url, replacement.url):
                assert client.get(f"{router}/v1/turnkv/sessions/roaming").status_code == 404
    finally:
        second.stop()
        if replacement is not None:
            replacement.stop()


def test_a_router_killed_mid_stream(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]], clusters: ClusterPool
) -> None:
    # Clean: every block in use at the end would be this test's.
    launched, state = clusters.clean(CLUSTER)
    messages, expected = reference
    logs = Path(state.run_dir) / "logs"
    doomed = RouterProcess(launched, logs / "router-4.log")
    heir: RouterProcess | None = None
    try:
        with httpx.Client(timeout=300) as client:
            body = {"model": state.served_model_name, "messages": messages[0],
                    "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True,
                    "turnkv": {"session_id": "orphan", "turn": 1}}
            received, done = 0, False
            try:
                with client.stream("POST", f"{doomed.url}/v1/chat/completions",
                                   json=body) as response:
                    for line in response.iter_lines():
                        done = done or line == "data: [DONE]"
                        received += line.startswith("data: ")
                        if received == 1:
                            doomed.process.kill()
            except httpx.HTTPError:
                pass  # the connection dropped under the client: what a dead router does
            assert received >= 1 and not done
            # The agent replays the turn on another router: exact, and the session goes on.
            heir = RouterProcess(launched, logs / "router-5.log")
            for n in (1, 2):
                out = routed_chat(heir.url, state.served_model_name, messages[n - 1],
                                  MAX_TOKENS, session={"session_id": "orphan", "turn": n,
                                                       "hints": {"final": n == 2}},
                                  stream=False, client=client)
                verdict = compare(expected[n - 1], out.completion)
                assert verdict.acceptable, f"turn {n}: {verdict.describe()}"
        # The killed router's engine requests were aborted with its connections: once the
        # session's `final` released its leases, no block is in use.
        engines = [e.url for e in state.engines]
        deadline = time.monotonic() + 60
        while not all(fetch_connector_counters(url).get("kv_cache_usage") == 0
                      for url in engines):
            assert time.monotonic() < deadline, "KV blocks still in use"
            time.sleep(0.5)
    finally:
        doomed.stop()
        if heir is not None:
            heir.stop()


def test_the_router_command_is_the_launchers(cluster: tuple[Cluster, ClusterState]) -> None:
    launched, _ = cluster
    cmd = launched.router_command(1234)
    assert cmd[:3] == [sys.executable, "-m", "turnkv_server.router"]
    assert "--redis" in cmd and cmd[cmd.index("--port") + 1] == "1234"
