"""A bounded load test: 64 concurrent sessions on a real `turnkv` cluster (tiny model), for
40 seconds.

64 workers each play sessions back to back through the router: a few turns each, every turn a
short new message after the last reply, the last one `final`. The engines' KV caches hold 128
blocks (`tests.support.clusters.SHORT_LEASES`, shared with test_router_security.py), so the
leases of 64 live sessions press against the pin cap of 64. Nothing may fail; while
the load runs, each engine's pinned blocks stay under its cap; the router's memory is the same
after the load as after its first round (within a margin far below what a per-turn leak
would add); and when every session has ended, every KV block is free. Latency is printed,
not asserted.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import psutil
import pytest

from tests.support.clusters import SHORT_LEASES, ClusterPool, ClusterSpec, RouterView
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import ClusterState
from turnkv_server.launcher.processes import group_members

SESSIONS = 64
TURNS = 4
MAX_TOKENS = 8
LOAD_S = 40.0  # then each worker ends the session it is in
# Memory the router may gain between the first round and the end. Its sessions are bounded
# and released by `final`; what would break this is something kept per turn.
RSS_MARGIN_MIB = 96


CLUSTER = ClusterSpec("load", SHORT_LEASES, RouterView())
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture
def cluster(clusters: ClusterPool) -> ClusterState:
    return clusters.get(CLUSTER)[1]


def rss_mib(state: ClusterState) -> dict[str, float]:
    """Resident memory of each process group the launcher started (engines, router)."""
    servers = [*state.engines, *([state.router_process] if state.router_process else [])]
    out = {}
    for server in servers:
        total = 0
        for process in group_members(server.pid):
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        out[server.name] = total / 2**20
    return out


async def work(client: httpx.AsyncClient, state: ClusterState, worker: int,
               first_round: asyncio.Barrier, deadline: float, latencies: list[float],
               ttfts: list[float]) -> None:
    session = 0
    while True:
        await play(client, state, f"load-{worker}-{session}", latencies, ttfts)
        if session == 0:
            await first_round.wait()
        session += 1
        if time.monotonic() > deadline:
            return


async def play(client: httpx.AsyncClient, state: ClusterState, session: str,
               latencies: list[float], ttfts: list[float]) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a terse assistant for a load test."}]
    for turn in range(1, TURNS + 1):
        messages.append({"role": "user",
                         "content": f"Session {session}, turn {turn}: say something short."})
        body = {"model": state.served_model_name, "messages": messages,
                "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "turnkv": {"session_id": session, "turn": turn,
                           "hints": {"final": turn == TURNS, "next_turn_in": 1}}}
        start = time.monotonic()
        first: float | None = None
        text: list[str] = []
        stats: dict[str, Any] | None = None
        async with client.stream("POST", f"{state.router}/v1/chat/completions",
                                 json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.monotonic()
                        text.append(piece)
                stats = event.get("turnkv") or stats
        assert stats is not None, f"session {session} turn {turn}: no stats, stream cut short"
        latencies.append(time.monotonic() - start)
        ttfts.append((first or time.monotonic()) - start)
        messages.append({"role": "assistant", "content": "".join(text)})


def test_64_sessions_at_once_for_40_seconds(cluster: ClusterState) -> None:
    engines = [e.url for e in cluster.engines]
    caps = {url: int((fetch_connector_counters(url)["num_gpu_blocks"] - 1) * 0.5)
            for url in engines}
    latencies: list[float] = []
    ttfts: list[float] = []
    pinned_max = dict.fromkeys(engines, 0.0)
    memory: dict[str, dict[str, float]] = {}

    async def run() -> None:
        first_round = asyncio.Barrier(SESSIONS + 1)
        limits = httpx.Limits(max_connections=SESSIONS + 8)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            deadline = time.monotonic() + LOAD_S
            players = [asyncio.create_task(work(client, cluster, w, first_round, deadline,
                                                latencies, ttfts)) for w in range(SESSIONS)]
            await first_round.wait()
            memory["after the first sessions"] = rss_mib(cluster)
            while not all(p.done() for p in players):
                for url in engines:
                    pinned = (await asyncio.to_thread(fetch_connector_counters, url)
                              ).get("pinned_blocks", 0.0)
                    pinned_max[url] = max(pinned_max[url], pinned)
                await asyncio.wait(players, timeout=0.5)
            await asyncio.gather(*players)

    started = time.monotonic()
    asyncio.run(run())
    wall = time.monotonic() - started
    memory["at the end"] = rss_mib(cluster)
    turns = len(latencies)
    print(f"{turns} turns of {SESSIONS} sessions in {wall:.0f} s ({turns / wall:.1f} turns/s); "
          f"TTFT p50 {statistics.median(ttfts):.2f} s, "
          f"p99 {statistics.quantiles(ttfts, n=100)[98]:.2f} s; "
          f"turn p50 {statistics.median(latencies):.2f} s, "
          f"p99 {statistics.quantiles(latencies, n=100)[98]:.2f} s")
    print(f"pinned blocks at most {pinned_max} (caps {caps}); memory MiB {memory}")
    assert turns >= SESSIONS * TURNS and turns % TURNS == 0  # every session ran to `final`
    for url in engines:
        assert pinned_max[url] <= caps[url]
    # The router's memory is flat. (An engine's grows as its preallocated KV cache is first
    # touched, which is not a leak: its pinned blocks, above, and free blocks, below, say
    # what it holds.)
    start = memory["after the first sessions"]["router"]
    assert memory["at the end"]["router"] - start < RSS_MARGIN_MIB, memory

    # Every session ended with `final`: once the push backs are over, no block is in use.
    def free() -> bool:
        return all(fetch_connector_counters(url).get("kv_cache_usage") == 0 for url in engines)
    deadline = time.monotonic() + 60
    while not free():
        assert time.monotonic() < deadline, "KV blocks still in use after every session ended"
        time.sleep(0.5)
