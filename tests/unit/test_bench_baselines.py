"""The benchmark's baselines: what each one starts, and how the modes are listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnkv_server.bench.cli import (
    VLLM_CPU_BLOCK_TOKENS as BLOCK_TOKENS,
)
from turnkv_server.bench.cli import (
    BenchOptions,
    _bound_kv_cache_bytes,
    _kv_cache_bytes,
    _tier_host_blocks,
)
from turnkv_server.bench.plan import BenchSettings, build_workload, cluster_config, parse_modes
from turnkv_server.bench.sizing import approx_tokens
from turnkv_server.bench.workloads import total_context_tokens
from turnkv_server.launcher import Cluster
from turnkv_server.launcher.engine import EngineProcess, EngineSpec
from turnkv_server.mode_names import (
    BENCH_BASELINES,
    BENCH_MODES,
    DEFAULT_BENCH_MODES,
    TURNKV_BENCH_MODES,
    describe_bench_modes,
    has_host_tier,
)


def _specs(mode: str, settings: BenchSettings, run_dir: Path) -> tuple[Cluster, list[EngineSpec]]:
    cluster = Cluster(cluster_config(mode, settings, run_dir))
    return cluster, cluster._engine_specs(Path("/m"), "m")


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = config["kv_connector_extra_config"]
    return extra


def test_affinity_offload_is_affinity_with_vllms_offloading_and_its_lru(tmp_path: Path) -> None:
    """Two aggregated engines with vLLM's `OffloadingConnector` alone: the host tier of
    `affinity-tier`, as big, under vLLM's LRU; no turnkv connector, so no leases and no hint
    order; the router plain `affinity`."""
    settings = BenchSettings(model="tiny", kv_cache_bytes=2**20, bound_kv_cache_bytes=2**24,
                             tier_host_blocks=96)
    cluster, specs = _specs("affinity-offload", settings, tmp_path / "offload")
    _, tiered = _specs("affinity-tier", settings, tmp_path / "tier")
    config = cluster.config
    assert (config.mode, config.roles(), config.cores_per_engine) == (
        "affinity", ["engine", "engine"], 1)
    assert config.kv_cache_bytes == 2**20 and not config.engine_leases
    for spec, tier_spec in zip(specs, tiered, strict=True):
        offload = spec.kv_transfer_config
        assert offload is not None, "affinity-offload's engines load no connector"
        assert offload["kv_connector"] == "OffloadingConnector", offload
        assert "Turnkv" not in json.dumps(offload)
        extra = _extra(offload)
        # vLLM's own cache policy, not the sessions' order.
        assert extra["eviction_policy"] == "lru" and "cache_policy_module_path" not in extra
        # Replies are an agent's next prompt: they are offloaded too.
        assert extra["offload_prompt_only"] is False
        assert tier_spec.kv_transfer_config is not None
        _, tier = _extra(tier_spec.kv_transfer_config)["connectors"]
        assert extra["host_blocks"] == _extra(tier)["host_blocks"] == 96
        assert (extra["spec_name"], extra["spec_module_path"]) == (
            _extra(tier)["spec_name"], _extra(tier)["spec_module_path"])
        # A failed host read is recomputed, as under affinity-tier.
        assert offload["kv_load_failure_policy"] == "recompute"
        # No turnkv connector: no side channel, no secret.
        assert spec.nixl_port is None and spec.side_channel_secret is None
        assert "--kv-transfer-config" in spec.command(tmp_path / "port")
    cluster.engines = [EngineProcess(s, tmp_path) for s in specs]
    router = cluster.router_command()
    assert router[router.index("--mode") + 1] == "affinity"
    assert "--engine-leases" not in router and router.count("--engine") == 2
    # Without a sized tier (no pressure preset, no --kv-cache-bytes) it has no tier to run.
    plain = cluster_config("affinity-offload", BenchSettings(), tmp_path / "plain")
    assert plain.tier_host_blocks is None


def test_every_tier_holds_what_bounds_cache_holds(tmp_path: Path) -> None:
    """`affinity-offload`, `affinity-tier` and the turnkv tiers get one size: `bound`'s cache
    in blocks; without a sized cache (the default `agent` workload), every session's context
    all the same, so that the default modes run on every workload."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "num_hidden_layers": 30, "torch_dtype": "float32"}))
    block_bytes = BLOCK_TOKENS * 30 * 2 * 3 * 64 * 4
    options = BenchOptions(workload="agent-pressure", dtype="float32")
    small, tokens = _kv_cache_bytes(options, tmp_path)
    workload = build_workload("agent-pressure", kv_cache_tokens=tokens)
    bound = _bound_kv_cache_bytes(options, tmp_path, small, workload, approx_tokens)
    assert bound is not None
    assert _tier_host_blocks(options, tmp_path, small, workload, approx_tokens) == (
        bound // block_bytes)
    agent = build_workload("agent")
    blocks = _tier_host_blocks(BenchOptions(dtype="float32"), tmp_path, None, agent,
                               approx_tokens)
    assert (blocks - len(agent.sessions) - 1) * BLOCK_TOKENS >= total_context_tokens(agent)
    assert {m for m in BENCH_MODES if has_host_tier(m)} == {
        "affinity-offload", "affinity-tier", "turnkv", "turnkv-own-tier", "turnkv-no-hold",
        "turnkv-tier", "turnkv-pool"}
    assert has_host_tier("affinity-offload-untagged") and not has_host_tier("affinity")
    # turnkv's engines share a file tier below their host tiers; turnkv-own-tier's do not.
    settings = BenchSettings(tier_host_blocks=64)
    assert cluster_config("turnkv", settings, tmp_path / "t").shares_tier()
    assert not cluster_config("turnkv-own-tier", settings, tmp_path / "o").shares_tier()
    assert not cluster_config("affinity-offload", settings, tmp_path / "a").shares_tier()


def test_the_default_is_every_baseline_beside_turnkv() -> None:
    """The baselines as a platform runs them without turnkv, then turnkv; turnkv's forms and
    options are listed as its own, not as baselines."""
    assert parse_modes(DEFAULT_BENCH_MODES) == [
        "single", "single-2core", "affinity", "affinity-offload", "bound", "standard",
        "standard-nocache", "bidirectional", "push", "turnkv"]
    assert list(BENCH_BASELINES) == parse_modes(DEFAULT_BENCH_MODES)[:-1]
    assert set(TURNKV_BENCH_MODES) == {
        "turnkv", "turnkv-own-tier", "turnkv-no-hold", "turnkv-end-write", "turnkv-tier",
        "turnkv-pool", "affinity-tier"}
    described = describe_bench_modes()
    assert described.index("affinity-offload (2x1)") < described.index("turnkv (2x1)")
    assert described.index("turnkv (2x1)") < described.index("affinity-tier (2x1)")
    assert (*BENCH_BASELINES, *TURNKV_BENCH_MODES) == BENCH_MODES
