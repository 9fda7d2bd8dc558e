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
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.conversation import conversation
from tests.support.oracle import Completion, RoutedCompletion, compare, greedy_chat, routed_chat
from tests.support.redis_server import redis_server
from turnkv_server.engine_metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState
from turnkv_server.ports import read_report

TURNS = 5
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[list[list[dict[str, Any]]], list[Completion]]:
    config = ClusterConfig(mode="single", model=str(tiny_model), dtype="float32",
                           run_dir=tmp_path_factory.mktemp("single"))
    with Cluster(config) as state, httpx.Client(timeout=300) as client:
        replies: list[str] = []
        outputs = []
        for turn in range(TURNS):
            out = greedy_chat(state.router, state.served_model_name,
                              conversation(replies, TURNS)[turn], MAX_TOKENS, client=client)
            outputs.append(out)
            replies.append(out.text)
    return conversation(replies, TURNS), outputs


@pytest.fixture(scope="module")
def cluster(reference: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Cluster, ClusterState]]:
    run_dir = tmp_path_factory.mktemp("shared")
    with redis_server(run_dir) as url:
        config = ClusterConfig(mode="turnkv", model=str(tiny_model), dtype="float32",
                               run_dir=run_dir, router_args=("--redis", url))
        launched = Cluster(config)
        with launched as state:
            yield launched, state


class Router:
    """Another router process on the cluster's engines and Redis; stopped by its PID."""

    def __init__(self, launched: Cluster, log: Path) -> None:
        port_file = log.with_suffix(".addr")
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [*launched.router_command(0, port_file)], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.url = ""
        deadline = time.monotonic() + 60
        while True:
            bound = read_report(port_file)
            if bound is not None:
                self.url = f"http://{bound[0]}:{bound[1]}"
            try:
                if bound and httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, f"router exited; see {log}"
            assert time.monotonic() < deadline, f"router not healthy; see {log}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def test_turns_move_between_routers_and_survive_a_killed_router(
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState],
) -> None:
    launched, state = cluster
    messages, expected = reference
    logs = Path(state.run_dir) / "logs"
    second = Router(launched, logs / "router-2.log")
    replacement: Router | None = None
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

            # The launcher's router dies between turns; the other one carries on.
            assert state.router_process is not None
            os.kill(state.router_process.pid, signal.SIGKILL)
            out = turn(second.url, 3)
            assert (out.stats["decode_node"], out.stats["prefill_node"]) == (decode, None)

            # A new router process starts from Redis alone and continues the session.
            replacement = Router(launched, logs / "router-3.log")
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
    reference: tuple[list[list[dict[str, Any]]], list[Completion]],
    cluster: tuple[Cluster, ClusterState],
) -> None:
    launched, state = cluster
    messages, expected = reference
    logs = Path(state.run_dir) / "logs"
    doomed = Router(launched, logs / "router-4.log")
    heir: Router | None = None
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
            heir = Router(launched, logs / "router-5.log")
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
