from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnkv_server.engine_metrics import PromptTokenSources, parse_prompt_token_sources
from turnkv_server.launcher import ClusterConfig, ClusterState, EngineSpec
from turnkv_server.launcher.cluster import _core_sets, kv_transfer_config
from turnkv_server.launcher.engine import first_error, resolve_dtype
from turnkv_server.launcher.processes import (
    PORT_FLOOR,
    ProcessRef,
    ephemeral_range,
    free_ports,
    group_members,
    pin_group,
    stop_group,
    unpinned_threads,
)
from turnkv_server.launcher.state import ServerState


def _spec(**changes: object) -> EngineSpec:
    base: dict[str, object] = dict(name="prefill-0", role="prefill", model=Path("/m"),
                                   served_model_name="m", port=8100, cores=(0,))
    base.update(changes)
    return EngineSpec(**base)  # type: ignore[arg-type]


def test_engine_command_and_environment(tmp_path: Path) -> None:
    spec = _spec(nixl_port=5600, kv_transfer_config=kv_transfer_config("standard", "prefill", "e0"),
                 prefix_caching=False, kv_cache_bytes=1 << 28, dtype="float32")
    cmd = spec.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)
    assert '"kv_role": "kv_producer"' in cmd[cmd.index("--kv-transfer-config") + 1]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    env = spec.environment(tmp_path, tmp_path / "tmp")
    assert env["VLLM_RPC_BASE_PATH"] == env["TMPDIR"] == str(tmp_path / "tmp")
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1" and env["UCX_NET_DEVICES"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # the byte size wins


def test_auto_dtype_is_float32_without_native_bf16(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("flags : fpu sse avx fma\n")
    bf16 = tmp_path / "bf16"
    bf16.write_text("flags : fpu avx512f avx512_bf16\n")
    assert resolve_dtype("auto", plain) == "float32"
    assert resolve_dtype("auto", bf16) == "auto"
    assert resolve_dtype("bfloat16", plain) == "bfloat16"


def test_cores_are_shared_only_when_engines_outnumber_them() -> None:
    available = sorted(os.sched_getaffinity(0))
    sets = _core_sets(len(available), 1)
    assert sorted(s[0] for s in sets) == available
    wrapped = _core_sets(len(available) + 1, 1)
    assert wrapped[-1] == wrapped[0]


def test_cluster_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        ClusterConfig(mode="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one engine"):
        ClusterConfig(num_decode=0)
    with pytest.raises(ValueError, match="cores_per_engine"):
        ClusterConfig(cores_per_engine=0)


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    # Outgoing connections take ephemeral ports: a server port picked there can be gone
    # before the server binds it.
    low, _ = ephemeral_range()
    if low - PORT_FLOOR >= 1000:
        assert all(PORT_FLOOR <= port < low for port in ports), ports


def test_pin_and_stop_a_process_group_but_nothing_else() -> None:
    # A leader with a child in its group, and a bystander in a group of its own.
    script = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"  # noqa: E501
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(group_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(group_members(leader.pid)) == 2
        core = sorted(os.sched_getaffinity(0))[0]
        pin_group(leader.pid, [core])
        assert unpinned_threads(leader.pid, [core]) == []

        ref = ProcessRef.of(leader.pid)
        stop_group(ref, timeout=5)
        leader.wait(timeout=5)
        assert group_members(leader.pid) == []
        assert not ref.is_alive()
        assert bystander.poll() is None
    finally:
        for proc in (leader, bystander):
            proc.kill()
            proc.wait()


def test_a_reused_pid_is_not_taken_for_the_recorded_process() -> None:
    ref = ProcessRef.of(os.getpid())
    assert ref.is_alive()
    assert not ProcessRef(pid=ref.pid, create_time=ref.create_time - 100).is_alive()


def test_first_error_skips_warnings(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO starting\n"
        "(APIServer) WARNING [x.py:1] can cause `OSError: [Errno 24] Too many open files`\n"
        "(Worker) ERROR [y.py:2] RuntimeError: Cannot find any model weights with `/m`\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert first_error(log) == "RuntimeError: Cannot find any model weights with `/m`"
    assert first_error(tmp_path / "missing.log") is None


def test_state_round_trip(tmp_path: Path) -> None:
    server = ServerState(name="decode-0", role="decode", url="http://127.0.0.1:2", pid=1,
                         create_time=1.0, cores=[1], log="l")
    state = ClusterState(mode="standard", model="/m", served_model_name="m",
                         run_dir=str(tmp_path), router="http://127.0.0.1:3", engines=[server])
    state.save()
    loaded = ClusterState.load(tmp_path)
    assert loaded == state
    assert loaded.endpoints()["decode"] == ["http://127.0.0.1:2"]
    assert loaded.endpoints()["router"] == "http://127.0.0.1:3"


def test_prompt_token_sources_parse_and_subtract() -> None:
    text = (
        "# TYPE vllm:prompt_tokens_by_source_total counter\n"
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 7.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 128.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 41.0\n'
    )
    now = parse_prompt_token_sources(text)
    assert now == PromptTokenSources(7, 128, 41)
    assert (now - PromptTokenSources(1, 0, 40)).total == 135
    assert parse_prompt_token_sources("") == PromptTokenSources()
