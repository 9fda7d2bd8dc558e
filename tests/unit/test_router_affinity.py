"""The `affinity` mode: aggregated engines behind the router, each session kept on one engine.

Placement and plan are pure logic; the turn itself runs through the router (under uvicorn, as
deployed) in front of two stand-in engines (aiohttp servers answering like vLLM where the
router looks). The launcher's and the benchmark's side are checked without starting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from tests.support.local_servers import serving, start_engine_app
from turnkv_server.bench.plan import BenchSettings, cluster_config, layout, pick_baseline
from turnkv_server.launcher import Cluster, ClusterConfig
from turnkv_server.launcher.engine import EngineProcess
from turnkv_server.launcher.kv_transfer import kv_transfer_config
from turnkv_server.mode_names import BENCH_MODES, describe_bench_modes
from turnkv_server.router.aggregated import AggregatedPool, engine_pool
from turnkv_server.router.app import Router, create_app
from turnkv_server.router.config import RouterConfig
from turnkv_server.router.engines import EnginePool, Upstream
from turnkv_server.router.modes import make_mode
from turnkv_server.router.modes.base import ModeContext, Turn

# -- placement -------------------------------------------------------------------------------


def pool(count: int = 2) -> EnginePool:
    return AggregatedPool.of([f"http://e{i}" for i in range(count)])


def test_an_aggregated_pool_pairs_each_engine_with_itself() -> None:
    engines = pool()
    assert engines.aggregated and [e.name for e in engines.engines()] == ["engine-0", "engine-1"]
    assert {e.role for e in engines.engines()} == {"engine"}
    for _ in range(3):
        placement = engines.round_robin()
        assert placement.prefill is placement.decode
    with pytest.raises(ValueError, match="aggregated"):
        engine_pool(["http://p"], [], engines=["http://e"])
    assert not EnginePool.from_urls(["http://p"], ["http://d"]).aggregated


def test_new_sessions_spread_and_each_stays_on_its_engine() -> None:
    engines = pool()
    # Both idle: ties go round, so two new sessions land on different engines.
    first = engines.place(prefill=None, decode=None, prefix_id=None)
    second = engines.place(prefill=None, decode=None, prefix_id=None)
    assert {first.decode.name, second.decode.name} == {"engine-0", "engine-1"}
    assert first.reason == second.reason == "least_loaded"
    # A busy engine gets no new session while another is idle...
    first.decode.in_flight = 3
    third = engines.place(prefill=None, decode=None, prefix_id=None)
    assert third.decode is second.decode
    # ...but keeps its own sessions, however busy the other is not.
    home = first.decode.name
    again = engines.place(prefill=home, decode=home, prefix_id=None)
    assert (again.prefill.name, again.decode.name, again.reason) == (home, home, "affinity")


def test_a_session_whose_engine_fails_or_overflows_moves() -> None:
    engines = pool()
    down = engines.by_name("engine-0")
    assert down is not None
    down.healthy = False
    moved = engines.place(prefill="engine-0", decode="engine-0", prefix_id=None)
    assert (moved.decode.name, moved.prefill.name, moved.reason) == (
        "engine-1", "engine-1", "moved")
    assert engines.unhealthy("engine-0", "engine-0") == ["engine-0"]
    down.healthy = True
    down.in_flight = engines.max_in_flight
    assert engines.place(prefill="engine-0", decode="engine-0",
                         prefix_id=None).decode.name == "engine-1"


def test_a_new_session_goes_where_its_prefix_is_warm() -> None:
    engines = pool()
    warm = engines.place(prefill=None, decode=None, prefix_id="agent-v1")
    engines.remember_prefix("agent-v1", warm)
    engines.place(prefill=None, decode=None, prefix_id=None)  # moves the tie-break on
    again = engines.place(prefill=None, decode=None, prefix_id="agent-v1")
    assert (again.decode, again.reason) == (warm.decode, "prefix_warm")


# -- settings and plan -----------------------------------------------------------------------


def test_affinity_takes_engines_and_no_prefill_or_decode_engines() -> None:
    config = RouterConfig(mode="affinity", engine=["http://a", "http://b"])
    assert config.prefill == [] and config.decode == []
    with pytest.raises(ValueError, match="--engine"):
        RouterConfig(mode="affinity")
    with pytest.raises(ValueError, match="no --prefill"):
        RouterConfig(mode="affinity", engine=["http://a"], prefill=["http://p"])
    with pytest.raises(ValueError, match="affinity mode"):
        RouterConfig(mode="standard", prefill=["p"], decode=["d"], engine=["e"])
    with pytest.raises(ValueError, match="one prefill and one decode"):
        RouterConfig(mode="standard", decode=["d"])


def test_the_command_line_names_affinity_engines_and_refuses_a_mode_without_its_engines(
        capsys: pytest.CaptureFixture[str]) -> None:
    from turnkv_server.router.__main__ import main, parse_args
    from turnkv_server.router.config import from_args

    config = from_args(parse_args(["--mode", "affinity", "--engine", "http://a",
                                   "--engine", "http://b"]))
    assert config.engine == ["http://a", "http://b"] and config.mode == "affinity"
    with pytest.raises(SystemExit):
        main(["--mode", "standard", "--decode", "http://d"])
    assert "one prefill and one decode" in capsys.readouterr().err


def test_the_plan_serves_every_turn_on_one_engine_with_no_kv_transfer() -> None:
    engines = pool()
    mode = make_mode("affinity", ModeContext(upstream=Upstream(), prefill_peers={},
                                             decoder_kv_ttl=120.0, pool=engines))
    placement = engines.place(prefill=None, decode=None, prefix_id=None)
    turn = Turn(path="/v1/chat/completions", body={"messages": []}, tag=None, session=None,
                want_token_ids=False, stream=False)
    plan = asyncio.run(mode.plan(turn, placement))
    assert plan.prefill_params is None and plan.decode_params is None
    assert plan.alone is not None and plan.alone.prompt_token_ids is None
    assert not plan.concurrent and plan.prefill_send is None and plan.decode_send is None
    assert mode.affinity


def test_with_engine_leases_every_turn_tells_its_engine_the_sessions_lease() -> None:
    """Aggregated engines with the turnkv connector (`--engine-leases`): each turn carries the
    session's lease as turnkv mode's requests do (tenant-scoped key, TTL, hints); a one-off
    turn and a plain affinity router carry none."""
    from turnkv.protocol import CacheHints, TurnTag
    from turnkv_server.engine.protocol import parse
    from turnkv_server.router.__main__ import parse_args
    from turnkv_server.router.config import from_args
    from turnkv_server.router.modes.planned import lease_key
    from turnkv_server.router.sessions import Session, SessionKey

    assert from_args(parse_args(["--mode", "affinity", "--engine", "http://a",
                                 "--engine-leases"])).engine_leases
    assert not from_args(parse_args(["--mode", "affinity", "--engine", "http://a"])
                         ).engine_leases
    engines = pool()
    mode = make_mode("affinity", ModeContext(upstream=Upstream(), prefill_peers={},
                                             decoder_kv_ttl=120.0, pool=engines,
                                             engine_leases=True))
    placement = engines.place(prefill=None, decode=None, prefix_id=None)
    session = Session(SessionKey("t", "s"), 0.0, 0.0, 0.0)
    tag = TurnTag(session_id="s", hints=CacheHints(next_turn_in=30.0, priority=2))
    turn = Turn(path="/v1/chat/completions", body={"model": "m", "messages": []}, tag=tag,
                session=session, want_token_ids=False, stream=False)
    plan = asyncio.run(mode.plan(turn, placement))
    assert plan.decode_params is not None and plan.prefill_params is None
    params = parse(plan.decode_params)
    assert params is not None
    assert (params.session, params.next_turn_in_s, params.priority, params.release) == (
        lease_key(session), 30.0, 2, False)
    assert params.send is None and params.receive is None
    one_off = Turn(path="/v1/chat/completions", body={"messages": []}, tag=None, session=None,
                   want_token_ids=False, stream=False)
    assert asyncio.run(mode.plan(one_off, placement)).decode_params is None


# -- turns through the router -----------------------------------------------------------------


@dataclass
class StandIn:
    """An aggregated engine: answers chat completions as vLLM does with prefix caching on
    (`cached` of the prompt's `prompt` tokens), records what it was sent."""

    prompt: int = 300
    cached: int = 256
    delay_s: float = 0.0  # before it answers: turns that overlap
    seen: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.runner, self.url = await start_engine_app(self._handle)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.paths.append(request.path)
        self.seen.append(body)
        await asyncio.sleep(self.delay_s)
        if request.path == "/tokenize":
            return web.json_response({"tokens": list(range(self.prompt)), "count": self.prompt})
        usage = {"prompt_tokens": self.prompt, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": self.cached}}
        if not body.get("stream"):
            return web.json_response({
                "choices": [{"index": 0, "message": {"content": "a b"}, "token_ids": [1, 2]}],
                "prompt_token_ids": list(range(self.prompt)), "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]}]},
                      {"choices": [{"index": 0, "delta": {"content": " b"}, "token_ids": [2]}]},
                      {"choices": [], "usage": usage}):
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@contextlib.asynccontextmanager
async def affinity_router(engines: list[StandIn], engine_leases: bool = False,
                          **settings: Any) -> AsyncIterator[tuple[Router, str]]:
    """An affinity router under uvicorn in front of `engines`, with these `settings` too."""
    for engine in engines:
        await engine.start()
    app = create_app(RouterConfig(mode="affinity", engine=[e.url for e in engines],
                                  health_interval=60.0, engine_leases=engine_leases,
                                  **settings))
    try:
        async with serving(app) as url:
            yield app.state.router, url
    finally:
        for engine in engines:
            await engine.stop()


def turn(session: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2, "stream": stream, "turnkv": {"session_id": session}}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stats_of(client: httpx.AsyncClient, url: str, session: str, stream: bool
                   ) -> dict[str, Any]:
    reply = await client.post(f"{url}/v1/chat/completions", json=turn(session, stream))
    assert reply.status_code == 200, reply.text
    if not stream:
        return dict(reply.json()["turnkv"])
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: {")]
    assert [e for e in events if e.get("choices")], events  # the answer itself came through
    return dict(next(e["turnkv"] for e in events if "turnkv" in e))


def test_turns_stay_on_their_engine_alone_and_move_when_it_fails() -> None:
    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with affinity_router(engines) as (router, url), \
                httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(f"{url}/health")).json()["mode"] == "affinity"
            homes: dict[str, str] = {}
            for session in ("a", "b"):
                for number, stream in ((1, False), (2, True), (3, False)):
                    stats = await stats_of(client, url, session, stream)
                    assert stats["mode"] == "affinity" and stats["turn"] == number
                    # One engine computed the prompt and decoded: no prefill request.
                    assert stats["prefill_node"] is None, stats
                    homes.setdefault(session, stats["decode_node"])
                    assert stats["decode_node"] == homes[session] and not stats["moved"]
                    tokens = stats["prompt_tokens"]
                    assert (tokens["total"], tokens["decode_cached"],
                            tokens["decode_computed"]) == (300, 256, 44), tokens
                    assert tokens["prefill_computed"] is None
                    assert stats["kv"]["to_decode_tokens"] is None
                    assert stats["fallback"] is None and stats["prefix_break_at"] is None
            # Two sessions that started on idle engines: one each.
            assert sorted(homes.values()) == ["engine-0", "engine-1"]
            for engine in engines:
                # No tokenize, no one-token requests, no KV params: chat turns only.
                assert set(engine.paths) == {"/v1/chat/completions"} and len(engine.seen) == 3
                assert all(body.get("kv_transfer_params") is None for body in engine.seen)
                assert all("turnkv" not in body for body in engine.seen)
            # An engine that fails: its session's next turn moves to the other one, and stays.
            lost = engines[int(homes["a"][-1])]
            await lost.stop()
            moved = await stats_of(client, url, "a", False)
            assert moved["decode_node"] == homes["b"] and moved["moved"]
            assert moved["fallback"] == "engine_unavailable"
            after = await stats_of(client, url, "a", True)
            assert after["decode_node"] == homes["b"] and not after["moved"]
            assert all(e.in_flight == 0 for e in router.pool.engines())

    asyncio.run(main())


# -- launcher and benchmark ------------------------------------------------------------------


def test_an_affinity_cluster_is_plain_engines_behind_an_affinity_router(tmp_path: Path) -> None:
    config = ClusterConfig(mode="affinity", run_dir=tmp_path)
    assert config.roles() == ["engine", "engine"]
    assert ClusterConfig(mode="affinity", num_aggregated=3).roles() == ["engine"] * 3
    with pytest.raises(ValueError, match="affinity"):
        ClusterConfig(mode="affinity", num_aggregated=0)
    assert kv_transfer_config("affinity", "engine", "e0") is None
    cluster = Cluster(config)
    specs = cluster._engine_specs(tmp_path / "model", "m")
    assert [s.name for s in specs] == ["engine-0", "engine-1"]
    # One core each, their own where the machine has two.
    assert [len(s.cores) for s in specs] == [1, 1]
    assert len({s.cores for s in specs}) == min(2, len(os.sched_getaffinity(0)))
    assert all(s.kv_transfer_config is None and s.nixl_port is None and s.prefix_caching
               and s.side_channel_secret is None for s in specs)
    cluster.engines = [EngineProcess(s, tmp_path) for s in specs]
    command = cluster.router_command()
    assert command[command.index("--mode") + 1] == "affinity"
    assert command.count("--engine") == 2 and "--decode" not in command
    assert not any(arg.endswith("-nixl") for arg in command)


def test_the_benchmark_records_engines_and_cores_of_every_mode(tmp_path: Path) -> None:
    assert {"affinity", "single-2core"} <= set(BENCH_MODES)
    expected = {"single": (1, 1), "single-2core": (1, 2), "affinity": (2, 1),
                "standard": (2, 1), "turnkv": (2, 1)}
    for mode, (engines, cores) in expected.items():
        config = cluster_config(mode, BenchSettings(), tmp_path)
        assert (len(config.roles()), config.cores_per_engine) == (engines, cores), mode
        assert layout(mode) == {"engine_count": engines, "cores_per_engine": cores}
        assert f"{mode} ({engines}x{cores})" in describe_bench_modes()
    assert cluster_config("single-2core", BenchSettings(), tmp_path).mode == "single"
    # Affinity is what P/D is compared with first, when it runs.
    assert pick_baseline(["single", "standard", "affinity"], None) == "affinity"
    assert pick_baseline(["single", "standard"], None) == "standard"


def test_a_new_session_leaves_its_warm_engine_when_it_is_crowded() -> None:
    engines = pool()
    warm = engines.place(prefill=None, decode=None, prefix_id="agent-v1")
    engines.remember_prefix("agent-v1", warm)
    other = next(e for e in engines.decode if e is not warm.decode)
    # One live session more than the other engine: warmth still wins.
    homed = {warm.decode.name: 2, other.name: 1}
    again = engines.place(prefill=None, decode=None, prefix_id="agent-v1", homed=homed)
    assert (again.decode, again.reason) == (warm.decode, "prefix_warm")
    # Two more: the new session goes to the lighter engine.
    homed = {warm.decode.name: 3, other.name: 1}
    moved = engines.place(prefill=None, decode=None, prefix_id="agent-v1", homed=homed)
    assert (moved.decode, moved.prefill, moved.reason) == (other, other, "balanced")
    # A session with a home stays there however crowded it is.
    home = warm.decode.name
    assert engines.place(prefill=home, decode=home, prefix_id="agent-v1",
                         homed={home: 9}).decode is warm.decode


def test_idle_engines_take_new_sessions_by_how_many_they_are_home_to() -> None:
    engines = pool()
    first, second = engines.decode
    # Both idle: the one home to fewer sessions, whatever the tie-break says.
    for _ in range(3):
        placed = engines.place(prefill=None, decode=None, prefix_id=None,
                               homed={first.name: 4, second.name: 1})
        assert placed.decode is second
    # Turns in flight come first: the busy engine gets none.
    second.in_flight = 1
    assert engines.place(prefill=None, decode=None, prefix_id=None,
                         homed={first.name: 4, second.name: 1}).decode is first


def test_sessions_that_start_together_count_each_others_placement() -> None:
    """A new session's home counts from its placement, not from its first turn's end: five
    sessions that share a warm prefix and start while each other's first turns are in flight
    spread over both engines (every one went to the warm engine when only finished turns
    counted, which is how one engine of an agent-pressure run got 7 of 8 sessions)."""

    def body(session: str) -> dict[str, Any]:
        return {**turn(session, False), "turnkv": {"session_id": session,
                                                   "prefix_id": "agent-v1"}}

    async def run() -> list[int]:
        engines = [StandIn(delay_s=0.5), StandIn(delay_s=0.5)]
        async with affinity_router(engines) as (_, url), httpx.AsyncClient(timeout=30) as c:
            first = await c.post(f"{url}/v1/chat/completions", json=body("s0"))
            assert first.status_code == 200  # s0's engine is now where agent-v1 is warm
            replies = await asyncio.gather(*(c.post(f"{url}/v1/chat/completions",
                                                    json=body(f"s{i}")) for i in range(1, 6)))
            assert all(r.status_code == 200 for r in replies)
        return [len(e.seen) for e in engines]  # one request per session's turn

    counts = sorted(asyncio.run(run()))
    # Warm engine: s0 and every second newcomer; the other: the rest (balance_sessions 1).
    assert counts == [2, 4], counts


def test_a_hinted_pause_prefetches_the_history_before_the_session_is_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With engine leases, a turn hinting `next_turn_in` makes the router send its engine,
    `LEAD_S` before then, a one-token request over the session's history (prompt and output
    token IDs, the turn's cache salt) under the session's lease; the next turn says whether it
    was in time, waited for it, or came first (and called it off)."""
    from turnkv_server.engine.protocol import parse
    from turnkv_server.router.modes import prefetch

    monkeypatch.setattr(prefetch, "LEAD_S", 0.3)
    monkeypatch.setattr(prefetch, "MIN_PAUSE_S", 0.5)

    def body(session: str, next_turn_in: float | None = None) -> dict[str, Any]:
        hints = {} if next_turn_in is None else {"next_turn_in": next_turn_in}
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "cache_salt": "salt", "turnkv": {"session_id": session, "hints": hints}}

    async def main() -> None:
        engine = StandIn()
        async with affinity_router([engine], engine_leases=True) as (_, url), \
                httpx.AsyncClient(timeout=30) as client:
            async def chat(session: str, next_turn_in: float | None = None) -> dict[str, Any]:
                reply = await client.post(f"{url}/v1/chat/completions",
                                          json=body(session, next_turn_in))
                assert reply.status_code == 200, reply.text
                return dict(reply.json()["turnkv"])

            def prefetches() -> list[dict[str, Any]]:
                return [b for path, b in zip(engine.paths, engine.seen, strict=True)
                        if path == "/v1/completions"]

            # In time: sent LEAD_S before the hinted return, the turn after finds it done.
            assert (await chat("s", next_turn_in=0.8))["prefetch"] is None
            await asyncio.sleep(0.7)
            [warm] = prefetches()
            assert warm["prompt"] == [*range(engine.prompt), 1, 2] and warm["max_tokens"] == 1
            assert warm["cache_salt"] == "salt"
            lease = parse(warm["kv_transfer_params"])
            assert lease is not None and lease.session and not lease.release
            assert lease.next_turn_in_s == prefetch.LEAD_S
            assert (await chat("s"))["prefetch"] == "in_time"
            # Early: the turn comes before the prefetch started; none is ever sent.
            await chat("t", next_turn_in=5.0)
            assert (await chat("t"))["prefetch"] == "early"
            await asyncio.sleep(0.2)
            assert len(prefetches()) == 1
            # Awaited: the turn arrives while the (slow) prefetch runs, and waits for it.
            await chat("u", next_turn_in=0.6)
            engine.delay_s = 0.6
            await asyncio.sleep(0.4)
            started = asyncio.get_running_loop().time()
            stats = await chat("u")
            assert stats["prefetch"] == "awaited"
            assert asyncio.get_running_loop().time() - started >= 0.9  # the prefetch, then it
            # No hint, or `final`: nothing scheduled.
            engine.delay_s = 0.0
            await chat("v")
            assert (await chat("v"))["prefetch"] is None
            assert len(prefetches()) == 2
    asyncio.run(main())
