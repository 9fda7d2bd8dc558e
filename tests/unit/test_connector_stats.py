"""The connector's counters and gauges as vLLM's Prometheus logger exposes them on `/metrics`
(vLLM hands `build_prom_metrics` its metric classes; here prometheus_client's own, in a
registry of the test's)."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from vllm import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

from turnkv_server.connector.scheduler_side import SchedulerSide
from turnkv_server.connector.stats import build_metric_set
from turnkv_server.engine.protocol import Receive, TurnParams

LABELS = ["model_name", "engine"]


def exposed(registry: CollectorRegistry, name: str) -> float | None:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(f"turnkv:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_quarantined_blocks_reach_metrics_as_a_gauge_and_declines_as_a_counter() -> None:
    registry = CollectorRegistry()
    metrics = build_metric_set(partial(Counter, registry=registry),
                               partial(Gauge, registry=registry), LABELS, {0: ["m", "0"]})
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=16)
    side = SchedulerSide(16, max_quarantined_fraction=0.1)
    side.bind(pool, 32)  # the cap: 3 blocks

    def receive(rid: str) -> list[int]:
        params = {"turnkv": TurnParams(receive=Receive(f"t-{rid}", "127.0.0.1:7000")).to_wire()}
        req = Request(rid, list(range(64)), SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": params}), None)
        side.on_new_request(req)
        matched, _ = side.get_num_new_matched_tokens(req, 0)
        ids = [b.block_id for b in pool.get_new_blocks(4)]
        side.update_state_after_alloc(req, ids, matched)
        return ids

    ids = receive("r1")
    side.received({"r1"}, set(), {"r1"})
    pool.free_blocks([pool.blocks[i] for i in ids])
    receive("r2")  # 4 quarantined, over the cap: declined
    metrics.observe(side.take_stats(), 0)
    assert exposed(registry, "quarantined_blocks") == 4
    assert exposed(registry, "receives_declined_quarantine_total") == 1
    side.settled({"r1"})
    metrics.observe(side.take_stats(), 0)
    assert exposed(registry, "quarantined_blocks") == 0
