"""The benchmark's `<mode>-untagged` modes: the mode's own cluster, its turns sent by a stock
openai client with no session and no hints (`turnkv_server.bench.untagged`). The plan is
checked without starting anything; the driver plays a small workload through the router in
front of stand-in engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from tests.unit.test_router_affinity import StandIn, affinity_router
from turnkv_server.bench.driver import Driver, DriveSettings
from turnkv_server.bench.plan import BenchSettings, build_workload, cluster_config, parse_modes
from turnkv_server.mode_names import bench_layout, cluster_mode, tagged_mode, untagged


def test_an_untagged_mode_is_its_modes_cluster(tmp_path: Path) -> None:
    assert parse_modes("turnkv,turnkv-untagged,affinity-untagged") == [
        "turnkv", "turnkv-untagged", "affinity-untagged"]
    assert parse_modes("turnkv-itl500-untagged") == ["turnkv-itl500-untagged"]
    for mode in ("turnkv", "affinity", "turnkv-itl500", "single"):
        variant = mode + "-untagged"
        assert untagged(variant) and not untagged(mode) and tagged_mode(variant) == mode
        assert cluster_mode(variant) == cluster_mode(mode)
        assert bench_layout(variant) == bench_layout(mode)
        settings = BenchSettings(model="m")
        assert dataclasses.replace(cluster_config(variant, settings, tmp_path),
                                   run_dir=None) == dataclasses.replace(
            cluster_config(mode, settings, tmp_path), run_dir=None)
    assert not untagged("nonsense-untagged")


def test_the_untagged_driver_plays_the_workload_with_a_stock_client() -> None:
    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with affinity_router(engines) as (router, url):
            workload = build_workload("smoke", seed=0)
            outcome = await Driver(workload, DriveSettings(
                base_url=url, model="m", mode="affinity-untagged")).run()
            turns = sum(len(s.turns) for s in workload.sessions)
            assert outcome.stall is None and not outcome.session_errors
            assert len(outcome.records) == turns
            for record in outcome.records:
                assert record.error is None and record.mode == "affinity-untagged"
                assert record.ttft_ms is not None and record.prompt_tokens == 300
            # No session named, no hint sent: the router inferred one session a conversation.
            counted = {s.key.session_id: s.turns for s in router.sessions.table}
            assert sorted(counted.values()) == sorted(len(s.turns) for s in workload.sessions)
            assert all(session.startswith("inf-") for session in counted)
            assert not any(body.get("turnkv") for e in engines for body in e.seen)
    asyncio.run(main())
