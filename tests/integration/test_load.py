"""Bounded load on a real `turnkv` cluster (tiny model): 64 concurrent sessions for 30 seconds,
and thousands of cheap turns for the router's memory.

64 workers each play sessions back to back through the router: a few turns each, every turn a
short new message after the last reply, the last one `final`. The engines' KV caches hold 128
blocks (`tests.support.clusters.SHORT_LEASES`, shared with test_router_security.py), so the
leases of 64 live sessions press against the pin cap of 64. Nothing may fail; while
the load runs, each engine's pinned blocks stay under its cap; and when every session has
ended, every KV block is free. Latency is printed, not asserted.

The router's memory: after a warm-up, thousands of one-token turns (sessions of a few turns,
streamed or not, ended by `final`), the router's resident memory read every few hundred
turns; its growth per thousand turns (least squares over the readings) stays under a bound
that a router keeping 1 KiB of every turn passes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import SHORT_LEASES, ClusterSpec, RouterView
from tests.support.measure import group_rss_mib
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import ClusterState

SESSIONS = 64
TURNS = 4
MAX_TOKENS = 8
LOAD_S = 30.0  # then each worker ends the session it is in


CLUSTER = ClusterSpec("load", SHORT_LEASES, RouterView())
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture
def cluster(clusters: ClusterPool) -> ClusterState:
    """Clean: the pins and blocks counted here are the load's alone."""
    return clusters.clean(CLUSTER)[1]


def rss_mib(state: ClusterState) -> dict[str, float | None]:
    """Resident memory of each process group the launcher started (engines, router)."""
    servers = [*state.engines, *([state.router_process] if state.router_process else [])]
    return {server.name: group_rss_mib(server.pid) for server in servers}


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


def test_64_sessions_at_once_for_30_seconds(cluster: ClusterState) -> None:
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

    # Every session ended with `final`: once the push backs are over, no block is in use.
    def free() -> bool:
        return all(fetch_connector_counters(url).get("kv_cache_usage") == 0 for url in engines)
    deadline = time.monotonic() + 60
    while not free():
        assert time.monotonic() < deadline, "KV blocks still in use after every session ended"
        time.sleep(0.5)


# -- the router's memory ---------------------------------------------------------------------

# Turns played before the first reading: the router's session table, connection pools and
# allocator arenas fill up to what this load needs.
WARM_UP_TURNS = 1_000
MEASURED_TURNS = 2_000
READ_EVERY = 250  # turns
CHEAP_SESSIONS = 8  # at once
CHEAP_TURNS = 4  # per session
# Growth the router may show per thousand turns after the warm-up. What it keeps of a turn is
# bounded (sessions end with `final`); a router that kept even 1 KiB of every turn would grow
# about 1 MiB per thousand.
MAX_GROWTH_MIB_PER_1000_TURNS = 0.5


def reply(text: str, stream: bool) -> str:
    """The assistant's text in an answer, streamed or not: the next turn's history."""
    if not stream:
        return str(json.loads(text)["choices"][0]["message"]["content"] or "")
    pieces = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[len("data: "):]).get("choices") or []:
                pieces.append((choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


async def cheap_turns(client: httpx.AsyncClient, state: ClusterState, count: int,
                      prefix: str, read: Callable[[int], None] | None = None) -> None:
    """`count` one-token turns, CHEAP_SESSIONS sessions at once, each of CHEAP_TURNS turns
    (every other one streamed), the last `final`; `read(turns_done)` every READ_EVERY turns."""
    done = 0
    sessions = iter(range(count // CHEAP_TURNS))

    async def session_worker() -> None:
        nonlocal done
        for number in sessions:
            session = f"{prefix}-{number}"
            messages: list[dict[str, Any]] = []
            for turn in range(1, CHEAP_TURNS + 1):
                messages.append({"role": "user", "content": f"{session} turn {turn}"})
                stream = (number + turn) % 2 == 0
                body = {"model": state.served_model_name, "messages": messages,
                        "max_tokens": 1, "temperature": 0, "stream": stream,
                        "turnkv": {"session_id": session, "turn": turn,
                                   "hints": {"final": turn == CHEAP_TURNS}}}
                async with client.stream("POST", f"{state.router}/v1/chat/completions",
                                         json=body) as response:
                    text = (await response.aread()).decode()
                assert response.status_code == 200, text
                assert '"turnkv"' in text, f"{session} turn {turn}: no stats: {text}"
                messages.append({"role": "assistant", "content": reply(text, stream)})
                done += 1
                if read is not None and done % READ_EVERY == 0:
                    read(done)

    await asyncio.gather(*(session_worker() for _ in range(CHEAP_SESSIONS)))


def test_the_routers_memory_per_thousand_turns(cluster: ClusterState) -> None:
    assert cluster.router_process is not None
    router_pid = cluster.router_process.pid
    readings: list[tuple[int, float]] = []

    def read(turns: int) -> None:
        rss = group_rss_mib(router_pid)
        assert rss is not None, "the router is gone"
        readings.append((turns, rss))

    async def run() -> None:
        limits = httpx.Limits(max_connections=CHEAP_SESSIONS + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await cheap_turns(client, cluster, WARM_UP_TURNS, "warm-up")
            read(0)
            await cheap_turns(client, cluster, MEASURED_TURNS, "memory", read)

    started = time.monotonic()
    asyncio.run(run())
    turns, mib = zip(*readings, strict=True)
    growth = statistics.linear_regression(turns, mib).slope * 1000
    print(f"{MEASURED_TURNS} turns after {WARM_UP_TURNS} of warm-up in "
          f"{time.monotonic() - started:.0f} s; router RSS {mib[0]:.1f} -> {mib[-1]:.1f} MiB, "
          f"{growth:+.3f} MiB per 1000 turns; readings (turns, MiB): "
          f"{[(t, round(m, 2)) for t, m in readings]}")
    assert growth < MAX_GROWTH_MIB_PER_1000_TURNS, readings
