"""The runner's pure parts: the plan, counters, CPU deltas, the watchdog, turn records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import turnkv
from turnkv.protocol import KvMoved, PromptTokens, TurnPlacement
from turnkv_server.bench.cli import (
    VLLM_CPU_BLOCK_TOKENS as BLOCK_TOKENS,
)
from turnkv_server.bench.cli import (
    BenchOptions,
    _bound_kv_cache_bytes,
    _kv_cache_bytes,
    _max_model_len,
)
from turnkv_server.bench.counters import counter_deltas, parse_counters, parse_kv_cache_tokens
from turnkv_server.bench.cputime import cpu_delta, group_deltas
from turnkv_server.bench.driver import DriveOutcome, gaps_ms, record_turn, turn_message
from turnkv_server.bench.plan import (
    BenchSettings,
    PlanError,
    build_workload,
    cluster_config,
    kv_bytes_per_token,
    mode_settings,
    parse_modes,
    pick_baseline,
    run_config,
)
from turnkv_server.bench.results import TurnRecord
from turnkv_server.bench.runner import mode_status
from turnkv_server.bench.sizing import approx_tokens
from turnkv_server.bench.trace import write_trace
from turnkv_server.bench.watchdog import Watchdog
from turnkv_server.bench.workloads import TurnSpec, total_context_tokens
from turnkv_server.launcher import Cluster

# --- the plan -------------------------------------------------------------------------------


def test_parse_modes_keeps_order_and_drops_repeats() -> None:
    assert parse_modes("push, single,push,,standard-nocache") == [
        "push", "single", "standard-nocache"]


@pytest.mark.parametrize("text", ["", " , ", "standard,turbo"])
def test_parse_modes_rejects_unknown_or_empty(text: str) -> None:
    with pytest.raises(PlanError, match="choose from single"):
        parse_modes(text)


def test_baseline_defaults_to_standard_then_first_mode() -> None:
    assert pick_baseline(["single", "standard"], None) == "standard"
    assert pick_baseline(["push", "single"], None) == "push"
    assert pick_baseline(["push", "single"], "single") == "single"
    with pytest.raises(PlanError, match="not among the modes"):
        pick_baseline(["push"], "standard")


def test_cluster_config_is_the_same_for_every_mode_but_the_mode(tmp_path: Path) -> None:
    settings = BenchSettings(model="tiny", dtype="float32", kv_cache_bytes=2**26,
                             max_model_len=2048, kv_recompute_threshold=0)
    nocache = cluster_config("standard-nocache", settings, tmp_path)
    assert (nocache.mode, nocache.prefill_cache) == ("standard", False)
    end_write = cluster_config("turnkv-end-write", settings, tmp_path)
    assert (end_write.mode, end_write.connector_settings) == ("turnkv", {"layer_writes": False})
    assert cluster_config("turnkv", settings, tmp_path).connector_settings == {}
    tiered = replace(settings, tier_host_blocks=96)
    assert cluster_config("turnkv-tier", tiered, tmp_path).tier_host_blocks == 96
    # The P/D form with the tier; plain turnkv is the planner.
    assert "--fixed-pools" in cluster_config("turnkv-tier", tiered, tmp_path).router_args
    assert "--fixed-pools" not in cluster_config("turnkv", tiered, tmp_path).router_args
    # The ablation of the landing holds: turnkv's cluster, its router told to send at once.
    no_hold = cluster_config("turnkv-no-hold", tiered, tmp_path)
    assert no_hold.router_args == ("--no-landing-holds",) and no_hold.tier_host_blocks == 96
    assert "--no-landing-holds" not in cluster_config("turnkv", tiered, tmp_path).router_args
    assert cluster_config("turnkv", tiered, tmp_path).tier_host_blocks == 96
    assert cluster_config("affinity", tiered, tmp_path).tier_host_blocks is None
    for mode in ("single", "standard", "bidirectional", "push", "turnkv"):
        config = cluster_config(mode, settings, tmp_path / mode)
        assert (config.mode, config.prefill_cache) == (mode, True)
        assert (config.model, config.dtype, config.kv_cache_bytes, config.max_model_len,
                config.kv_recompute_threshold) == ("tiny", "float32", 2**26, 2048, 0)
    with pytest.raises(PlanError):
        cluster_config("mooncake", settings, tmp_path)


def test_itl_target_modes_are_turnkv_at_their_own_target(tmp_path: Path) -> None:
    assert parse_modes("turnkv-itl100,turnkv,turnkv-itl400") == [
        "turnkv-itl100", "turnkv", "turnkv-itl400"]
    for bad in ("turnkv-itl", "turnkv-itl1.5", "turnkv-itl-5", "standard-itl100"):
        with pytest.raises(PlanError, match="unknown mode"):
            parse_modes(bad)
    settings = BenchSettings(model="tiny", itl_target_ms=50.0)
    assert mode_settings("turnkv-itl250", settings).itl_target_ms == 250.0
    assert mode_settings("turnkv", settings).itl_target_ms == 50.0
    config = cluster_config("turnkv-itl250", settings, tmp_path)
    assert config.mode == "turnkv" and len(config.roles()) == 2
    args = list(config.router_args)
    assert args[args.index("--itl-target-ms") + 1] == "250.0"
    plain = cluster_config("turnkv", BenchSettings(model="tiny"), tmp_path)
    assert "--itl-target-ms" not in plain.router_args


def test_bound_is_affinity_with_the_cache_that_holds_every_session(tmp_path: Path) -> None:
    settings = BenchSettings(model="tiny", kv_cache_bytes=2**20, bound_kv_cache_bytes=2**24)
    bound = cluster_config("bound", settings, tmp_path)
    affinity = cluster_config("affinity", settings, tmp_path)
    assert (bound.mode, bound.num_aggregated, bound.kv_cache_bytes) == ("affinity", 2, 2**24)
    assert (affinity.mode, affinity.kv_cache_bytes) == ("affinity", 2**20)
    # Sized from the workload: every session's context, a spare block each and the null block.
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "num_hidden_layers": 30, "torch_dtype": "float32"}))
    per_token = 30 * 2 * 3 * 64 * 4
    options = BenchOptions(workload="agent-pressure", dtype="float32")
    small, tokens = _kv_cache_bytes(options, tmp_path)
    assert tokens == 3072
    workload = build_workload("agent-pressure", kv_cache_tokens=tokens)
    size = _bound_kv_cache_bytes(options, tmp_path, small, workload, approx_tokens)
    assert size is not None and size % (BLOCK_TOKENS * per_token) == 0
    blocks = size // (BLOCK_TOKENS * per_token)
    assert (blocks - len(workload.sessions) - 1) * BLOCK_TOKENS >= total_context_tokens(workload)
    assert size > 3 * small
    # Without a cache size (a workload without pressure) bound keeps the engines' default.
    assert _bound_kv_cache_bytes(options, tmp_path, None, workload, approx_tokens) is None


def test_settings_reject_nonpositive_limits() -> None:
    with pytest.raises(PlanError, match="stall_timeout_s"):
        BenchSettings(stall_timeout_s=0)
    with pytest.raises(PlanError, match="kv_cache_bytes"):
        BenchSettings(kv_cache_bytes=-1)


def test_kv_bytes_per_token_of_smollm2_shape(tmp_path: Path) -> None:
    # SmolLM2-135M: 30 layers, 9 heads of 64 (hidden 576), 3 KV heads; in bf16 that is
    # 30 layers x 2 (K and V) x 3 x 64 x 2 bytes = 22.5 KiB per token.
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "hidden_size": 576, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 22.5 * 1024
    assert kv_bytes_per_token(tmp_path, "float32") == 45 * 1024


def test_build_workload_from_preset_and_trace(tmp_path: Path) -> None:
    smoke = build_workload("smoke", seed=3, sessions=3, concurrency=1)
    assert (len(smoke.sessions), smoke.concurrency, smoke.seed) == (3, 1, 3)
    path = tmp_path / "t.jsonl"
    write_trace(smoke, path)
    replay = build_workload("trace", trace=path, concurrency=2)
    assert replay.sessions == smoke.sessions and replay.concurrency == 2


@pytest.mark.parametrize(("name", "trace", "message"), [
    ("trace", None, "needs --trace"),
    ("trace", Path("/nonexistent/t.jsonl"), "does not exist"),
    ("agent", Path("t.jsonl"), "goes with --workload trace"),
    ("agents", None, "unknown workload"),
])
def test_build_workload_errors(name: str, trace: Path | None, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        build_workload(name, trace=trace)


# --- counters and CPU -----------------------------------------------------------------------

METRICS = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 120.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 256.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 0.0
# HELP vllm:num_preemptions_total Preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
# HELP vllm:nixl_bytes_transferred Bytes per NIXL transfer.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 3.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 6144.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="163"} 1.0
"""


def test_parse_counters_reads_sources_histogram_sums_and_counts() -> None:
    counters = parse_counters(METRICS)
    assert counters == {
        "prompt_tokens_local_compute": 120.0,
        "prompt_tokens_local_cache_hit": 256.0,
        "prompt_tokens_external_kv_transfer": 0.0,
        "preemptions": 2.0,
        "nixl_bytes_transferred": 6144.0,
        "nixl_transfers": 3.0,
    }
    # Counters an engine does not export stay absent, never 0.
    assert "generation_tokens" not in counters


def test_counter_deltas_count_late_counters_from_zero() -> None:
    before = {"preemptions": 2.0}
    after = {"preemptions": 5.0, "nixl_transfers": 4.0}
    assert counter_deltas(before, after) == {"preemptions": 3.0, "nixl_transfers": 4.0}


def test_kv_cache_tokens_from_cache_config_info() -> None:
    assert parse_kv_cache_tokens(METRICS) == 163 * 128
    assert parse_kv_cache_tokens("") is None


def test_cpu_delta_per_process_start() -> None:
    before = {(10, 1.0): 5.0, (11, 1.0): 1.0}
    # Process 11 exited; 12 is new; pid 10 was reused by a process started later.
    after = {(10, 1.0): 7.5, (12, 2.0): 0.5, (10, 3.0): 0.25}
    assert cpu_delta(before, after) == pytest.approx(2.5 + 0.5 + 0.25)
    assert group_deltas({"router": before}, {"router": after, "decode-0": {(20, 1.0): 1.0}}
                        ) == {"router": 3.25, "decode-0": 1.0}


# --- the watchdog ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_ignores_silence_with_nothing_in_flight() -> None:
    clock = Clock()
    dog = Watchdog(30.0, clock=clock)
    clock.now += 1000  # every session in tool time
    assert not dog.stalled() and dog.silent_for() == 0.0
    dog.turn_started()  # the silence before this turn does not count
    assert not dog.stalled()
    clock.now += 29
    assert not dog.stalled()
    clock.now += 1
    assert dog.stalled() and dog.silent_for() == 30.0


def test_watchdog_progress_from_any_turn_resets_it() -> None:
    clock = Clock()
    dog = Watchdog(10.0, clock=clock)
    dog.turn_started()
    clock.now += 8
    dog.turn_started()  # a second turn joins: no reset, the first is still waiting
    clock.now += 3
    assert dog.stalled()
    dog.progress()
    assert not dog.stalled()
    dog.turn_ended()
    dog.turn_ended()
    dog.turn_ended()  # never below zero
    clock.now += 100
    assert dog.in_flight == 0 and not dog.stalled()


def test_watchdog_needs_a_positive_timeout() -> None:
    with pytest.raises(ValueError):
        Watchdog(0)


# --- turns ----------------------------------------------------------------------------------


def test_tool_results_go_as_prefixed_user_messages() -> None:
    tool = TurnSpec(user="3 files", role="tool", max_tokens=8, think_time_s=1.0)
    user = TurnSpec(user="hi", role="user", max_tokens=8, think_time_s=0.0)
    assert turn_message(tool) == {"role": "user", "content": "Tool result:\n3 files"}
    assert turn_message(user) == {"role": "user", "content": "hi"}


def test_gaps_between_chunks_in_ms() -> None:
    assert gaps_ms([1.0, 1.01, 1.5]) == [10.0, 490.0]
    assert gaps_ms([2.0]) == [] and gaps_ms([]) == []


def test_record_from_router_stats() -> None:
    stats = turnkv.TurnStats(
        session_id="s-1", turn=2, mode="bidirectional", completion_tokens=7,
        prompt_tokens=PromptTokens(total=900, prefill_reused=850, prefill_computed=50),
        kv=KvMoved(to_prefill_bytes=4096), client_ttft_ms=42.0, client_total_ms=90.0,
        fallback="lease_expired", prefill_node="prefill-0", decode_node="decode-0",
        prefetch="awaited")
    r = record_turn("bidirectional", "s-1", 1, stats, started_at=5.0, ended_at=5.1,
                    chunk_times=[1.0, 1.02, 1.05], sent=0.9, error=None)
    assert (r.turn, r.prompt_tokens, r.prefill_reused, r.prefill_computed) == (1, 900, 850, 50)
    assert r.prefill_cached is None and r.prefill_received is None
    assert (r.kv_to_prefill_bytes, r.kv_to_decode_bytes) == (4096, None)
    assert (r.ttft_ms, r.e2e_ms, r.completion_tokens) == (42.0, 90.0, 7)
    assert r.itl_ms == [20.0, 30.0] and r.fallback == "lease_expired" and r.error is None
    assert r.placement is None
    assert (r.prefill_node, r.decode_node, r.prefetch) == ("prefill-0", "decode-0", "awaited")
    planned = stats.model_copy(update={"placement": TurnPlacement(
        where="split", home="decode-0", prefill="prefill-0", why="split (the least waiting)")})
    split = record_turn("turnkv", "s-1", 1, planned, started_at=5.0, ended_at=5.1,
                        chunk_times=[], sent=0.9, error=None)
    assert (split.placement, split.placement_why) == ("split", "split (the least waiting)")


def test_record_of_a_cut_turn_keeps_what_the_client_saw() -> None:
    r = record_turn("push", "s-2", 0, None, started_at=5.0, ended_at=9.0,
                    chunk_times=[1.25, 1.5], sent=1.0, error="cut short: stalled")
    assert r.ttft_ms == 250.0 and r.itl_ms == [250.0]
    assert r.prompt_tokens is None and r.error == "cut short: stalled"
    assert record_turn("push", "s-2", 0, None, started_at=5.0, ended_at=9.0, chunk_times=[],
                       sent=1.0, error=None).error == "the turn returned no stats"


def _rec(error: str | None) -> TurnRecord:
    return TurnRecord(mode="m", session_id="s", turn=0, started_at=0.0, error=error)


def test_mode_status() -> None:
    assert mode_status(DriveOutcome(records=[_rec(None)])).state == "ok"
    partial = mode_status(DriveOutcome(records=[_rec(None), _rec("HTTP 400")]))
    assert partial.state == "ok" and partial.detail is not None and "1 turn(s)" in partial.detail
    assert mode_status(DriveOutcome(records=[_rec("HTTP 400")])).state == "failed"
    assert mode_status(DriveOutcome()).state == "failed"
    stalled = mode_status(DriveOutcome(records=[_rec(None)], stall="no output token for 90 s"))
    assert (stalled.state, stalled.detail) == ("stalled", "no output token for 90 s")


def test_memory_pressure_cache_leaves_room_for_the_null_block(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "num_hidden_layers": 30, "torch_dtype": "float32", "max_position_embeddings": 8192}))
    per_token = 30 * 2 * 3 * 64 * 4
    options = BenchOptions(workload="memory-pressure", dtype="float32")
    size, tokens = _kv_cache_bytes(options, tmp_path)
    # One block more than the workload is sized for: vLLM never hands out its null block.
    assert (size, tokens) == ((4096 + BLOCK_TOKENS) * per_token, 4096)
    assert _max_model_len(options, tmp_path, tokens) == 4096
    given = BenchOptions(workload="memory-pressure", dtype="float32",
                         kv_cache_bytes=10_000 * per_token)
    assert _kv_cache_bytes(given, tmp_path) == (10_000 * per_token, 77 * BLOCK_TOKENS)
    with pytest.raises(PlanError, match="two blocks"):
        _kv_cache_bytes(BenchOptions(workload="memory-pressure", dtype="float32",
                                     kv_cache_bytes=per_token), tmp_path)
    # Other workloads keep the engines' own sizing.
    assert _kv_cache_bytes(BenchOptions(workload="agent"), tmp_path) == (None, None)


def test_a_block_size_reaches_every_engine_and_sizes_the_caches(tmp_path: Path) -> None:
    """`--block-size` goes to each engine's command line, and the pressure presets' caches
    and the tiers are sized in blocks of that many tokens."""
    settings = BenchSettings(model="tiny", block_size=32)
    config = cluster_config("turnkv", settings, tmp_path)
    assert config.block_size == 32
    spec = Cluster(config)._engine_specs(Path("/m"), "m")[0]
    command = spec.command(tmp_path / "port")
    assert command[command.index("--block-size") + 1] == "32"
    plain = Cluster(cluster_config("turnkv", BenchSettings(model="tiny"), tmp_path / "p"))
    assert "--block-size" not in plain._engine_specs(Path("/m"), "m")[0].command(
        tmp_path / "port")


def test_a_runs_config_says_whether_its_mode_had_a_host_tier(tmp_path: Path) -> None:
    # The bench's setting names a tier for every mode; the run's own cluster says which had one.
    settings = BenchSettings(model="tiny", dtype="float32", tier_host_blocks=96)
    for mode, host_tier in (("turnkv", 96), ("affinity-offload", 96), ("affinity", None),
                            ("standard", None)):
        config = run_config(mode, settings, cluster_config(mode, settings, tmp_path))
        assert (config["tier_host_blocks"], config["host_tier_blocks"]) == (96, host_tier)
