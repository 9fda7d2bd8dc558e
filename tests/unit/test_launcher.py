from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from turnkv_server.engine.metrics import PromptTokenSources, parse_prompt_token_sources
from turnkv_server.launcher import (
    Cluster,
    ClusterConfig,
    ClusterState,
    EngineSpec,
    EngineStartError,
)
from turnkv_server.launcher.cluster import _core_sets, stop_cluster
from turnkv_server.launcher.engine import SECRET_ENV, EngineProcess, first_error, resolve_dtype
from turnkv_server.launcher.kv_transfer import (
    disk_tier,
    host_tier,
    kv_transfer_config,
    shared_tier,
)
from turnkv_server.launcher.processes import (
    ProcessRef,
    group_members,
    pin_group,
    raise_on_sigterm,
    shared_memory_of,
    stop_group,
    unpinned_threads,
)
from turnkv_server.launcher.state import ServerState
from turnkv_server.ports import SIDE_CHANNEL_REPORT_ENV, read_report


def _spec(**changes: object) -> EngineSpec:
    base: dict[str, object] = dict(name="prefill-0", role="prefill", model=Path("/m"),
                                   served_model_name="m", port=8100, cores=(0,))
    base.update(changes)
    return EngineSpec(**base)  # type: ignore[arg-type]


def test_engine_command_and_environment(tmp_path: Path) -> None:
    spec = _spec(port=0, nixl_port=0,
                 kv_transfer_config=kv_transfer_config("standard", "prefill", "e0"),
                 prefix_caching=False, kv_cache_bytes=1 << 28, dtype="float32")
    cmd = spec.command(tmp_path / "http.addr")
    # vLLM's server through the wrapper that binds the port and reports it.
    assert cmd[1:5] == ["-m", "turnkv_server.launcher.serve_engine",
                        "--port-file", str(tmp_path / "http.addr")]
    assert cmd[cmd.index("--port") + 1] == "0"
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    # No request body in the engine's log with a refused request's stack.
    assert "--no-log-error-stack" in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)
    assert '"kv_role": "kv_producer"' in cmd[cmd.index("--kv-transfer-config") + 1]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    env = spec.environment(tmp_path, tmp_path / "tmp", tmp_path / "side.addr")
    assert env["VLLM_RPC_BASE_PATH"] == env["TMPDIR"] == str(tmp_path / "tmp")
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    # Port 0: the connector binds a free port and reports it here.
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "0"
    assert env[SIDE_CHANNEL_REPORT_ENV] == str(tmp_path / "side.addr")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1" and env["UCX_NET_DEVICES"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # the byte size wins
    assert SECRET_ENV not in env


def test_a_tier_puts_the_turnkv_connector_first_under_vllms_multiconnector() -> None:
    """MultiConnector loads from the first connector that reports tokens: turnkv's, so that
    KV the peer pushes wins; the tier serves the rest. vLLM reads the load-failure policy
    and the engine ID from the top level only."""
    plain = kv_transfer_config("turnkv", "decode", "e1", connector_settings={"a": 1})
    assert plain is not None and plain["kv_connector"] == "TurnkvConnector"
    tiered = kv_transfer_config("turnkv", "decode", "e1", connector_settings={"a": 1},
                                tier_host_blocks=64)
    assert tiered is not None
    assert (tiered["kv_connector"], tiered["kv_load_failure_policy"], tiered["engine_id"]) == (
        "MultiConnector", "recompute", "e1")
    turnkv, tier = tiered["kv_connector_extra_config"]["connectors"]
    assert turnkv == {k: v for k, v in plain.items() if k != "engine_id"}
    # vLLM's offloading connector with its store fence over the blocks the peer writes.
    assert (tier["kv_connector"], tier["kv_connector_module_path"]) == (
        "HostTierConnector", "turnkv_server.tier.offloading_connector")
    extra = tier["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"], extra["host_blocks"]) == (
        "HostOffloadingSpec", "turnkv_server.tier.vllm_spec", 64)
    # Replies are an agent's next prompt: vLLM's default would store prompts only.
    assert extra["offload_prompt_only"] is False
    # Aggregated and single engines load no connector; aggregated ones with engine leases
    # load turnkv's (no peer) and the tier, and with a tier alone vLLM's offloading alone.
    assert kv_transfer_config("affinity", "engine", "e2") is None
    assert kv_transfer_config("single", "single", "e2", tier_host_blocks=64) is None
    offload = kv_transfer_config("affinity", "engine", "e2", tier_host_blocks=64)
    assert offload is not None and offload["kv_connector"] == "OffloadingConnector"
    assert "kv_connector_module_path" not in offload
    assert offload["kv_connector_extra_config"]["eviction_policy"] == "lru"
    aggregated = kv_transfer_config("affinity", "engine", "e2", tier_host_blocks=64,
                                    engine_leases=True)
    assert aggregated is not None and aggregated["kv_connector"] == "MultiConnector"
    assert aggregated["kv_connector_extra_config"]["connectors"][0]["kv_connector"] == (
        "TurnkvConnector")
    with pytest.raises(ValueError):
        kv_transfer_config("turnkv", "prefill", "e0", tier_host_blocks=0)


def test_a_disk_tier_puts_the_host_tier_under_vllms_tiering_with_ours_below() -> None:
    disk = disk_tier("/var/tmp/turnkv-tier", 1 << 30)
    assert disk == {"type": "CheckedDiskTier", "module_path": "turnkv_server.tier.disk",
                    "root_dir": "/var/tmp/turnkv-tier", "max_bytes": 1 << 30}
    extra = host_tier(64, disk=disk)["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"], extra["host_blocks"]) == (
        "HostTieringOffloadingSpec", "turnkv_server.tier.vllm_spec", 64)
    assert extra["secondary_tiers"] == [disk] and extra["offload_prompt_only"] is False
    # Either way the sessions' hints order the host tier's evictions.
    assert (extra["eviction_policy"], extra["cache_policy_module_path"]) == (
        "SessionOrderPolicy", "turnkv_server.tier.session_order")
    tiered = kv_transfer_config("turnkv", "prefill", "e0", tier_host_blocks=64, tier_disk=disk)
    assert tiered is not None
    below = tiered["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert below["secondary_tiers"] == [disk]
    assert "secondary_tiers" not in host_tier(64)["kv_connector_extra_config"]
    for root, size in (("", 1 << 30), ("/tmp/t", 0), ("/tmp/t", True), ("/tmp/t", "1024")):
        with pytest.raises(ValueError):
            disk_tier(root, size)  # type: ignore[arg-type]


def test_a_turnkv_clusters_engines_share_a_file_tier_below_their_host_tiers(
        tmp_path: Path) -> None:
    """One folder for every engine, after any disk tier of their own, emptied at start and
    removed at stop; the router is told. Not without a host tier, not on simulated hosts
    unless asked, and never for another mode."""
    run = tmp_path / "run"
    cluster = Cluster(ClusterConfig(mode="turnkv", run_dir=run, tier_host_blocks=64,
                                    tier_disk_bytes=1 << 30))
    stale = run / "tier-shared" / "old.bin"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    specs = cluster._engine_specs(Path("/m"), "m")
    assert not stale.exists()
    belows = [spec.kv_transfer_config["kv_connector_extra_config"]["connectors"][1][
        "kv_connector_extra_config"]["secondary_tiers"] for spec in specs
        if spec.kv_transfer_config]
    assert len(belows) == 2
    for below in belows:
        assert [t["type"] for t in below] == ["CheckedDiskTier", "SharedFileTier"]
        assert below[1] == shared_tier(str(run / "tier-shared"))
    assert "--shared-tier" in cluster.router_command()
    (run / "tier-shared").mkdir()
    # The host tier's region that vLLM leaves in /dev/shm when an engine is stopped goes too.
    engine_id = specs[0].kv_transfer_config["engine_id"]
    region = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    region.write_bytes(b"")
    cluster.engines = [EngineProcess(spec, run) for spec in specs]
    cluster.stop()
    assert not (run / "tier-shared").exists() and not region.exists()
    assert ClusterConfig(mode="turnkv", tier_host_blocks=64).shares_tier()
    assert not ClusterConfig(mode="turnkv").shares_tier()
    assert not ClusterConfig(mode="turnkv", tier_host_blocks=64, tier_shared=False).shares_tier()
    assert not ClusterConfig(mode="affinity", tier_host_blocks=64).shares_tier()
    plain = Cluster(ClusterConfig(mode="turnkv", run_dir=run))
    assert "--shared-tier" not in plain.router_command()
    for wrong in (dict(mode="turnkv"), dict(mode="affinity", tier_host_blocks=64)):
        with pytest.raises(ValueError, match="tier_shared"):
            ClusterConfig(tier_shared=True, **wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        shared_tier("")


def test_the_side_channel_secret_is_per_cluster_and_only_in_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "inherited")

    def cluster(**config: Any) -> Cluster:
        return Cluster(ClusterConfig(run_dir=tmp_path / "run", **config))

    first, second = cluster(mode="turnkv"), cluster(mode="turnkv")
    specs = first._engine_specs(Path("/m"), "m")
    secret = first.side_channel_secret
    assert len(secret) == 64 and secret != second.side_channel_secret
    assert [s.side_channel_secret for s in specs] == [secret, secret]
    # Every port is left to the engine that binds it.
    assert [(s.port, s.nixl_port) for s in specs] == [(0, 0), (0, 0)]
    for spec in specs:
        assert spec.environment(tmp_path, tmp_path)[SECRET_ENV] == secret
        assert secret not in " ".join(spec.command(tmp_path / "p"))  # ps shows command lines
        assert secret not in repr(spec)
    assert secret not in repr(first.config)
    operators = "operator's own, " + "x" * 32
    assert cluster(mode="turnkv", side_channel_secret=operators).side_channel_secret == (
        operators)
    # One every engine would refuse is refused before any starts, without being repeated.
    for weak in ("operator's", "REPLACE-ME-" + "x" * 32):
        with pytest.raises(ValueError, match="openssl rand") as err:
            cluster(mode="turnkv", side_channel_secret=weak)
        assert weak not in str(err.value)
    # Upstream's connectors have no use for it, and an inherited one is not passed on.
    baseline = cluster(mode="standard")._engine_specs(Path("/m"), "m")
    assert all(SECRET_ENV not in s.environment(tmp_path, tmp_path) for s in baseline)


def test_connector_settings_naming_a_secret_are_refused_before_vllm_logs_them() -> None:
    # vLLM logs the whole --kv-transfer-config at startup; the launcher's secret goes in the
    # engines' environment.
    for name in ("side_channel_secret", "side_channel_secret_file"):
        for tier in (None, 64):
            with pytest.raises(ValueError, match=name) as err:
                kv_transfer_config("turnkv", "prefill", "e0", tier_host_blocks=tier,
                                   connector_settings={name: "s3cr3t-value"})
            assert "s3cr3t-value" not in str(err.value)
    for config in (kv_transfer_config("turnkv", "decode", "e1", connector_settings={"a": 1}),
                   kv_transfer_config("turnkv", "decode", "e1", tier_host_blocks=64)):
        assert config is not None and config["kv_load_failure_policy"] == "recompute"


def test_the_state_file_holds_no_secret(tmp_path: Path) -> None:
    cluster = Cluster(ClusterConfig(mode="turnkv", run_dir=tmp_path))
    cluster.engines = [EngineProcess(spec, tmp_path)
                       for spec in cluster._engine_specs(Path("/m"), "m")]
    for engine in cluster.engines:
        engine.ref = ProcessRef.of(os.getpid())
    cluster._record("m", Path("/m"), "http://127.0.0.1:1")
    assert cluster.side_channel_secret not in (tmp_path / "state.json").read_text()


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


def test_down_stops_the_recorded_engines_and_removes_their_host_tier_regions(
        tmp_path: Path) -> None:
    """`turnkv down` reads the cluster from its state file: the engine's process stops, and
    the /dev/shm region vLLM leaves behind for its host tier (named by the engine ID the state
    file records) and the shared tier's folder go with it."""
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    engine_id = f"test-down-{os.getpid()}-{time.monotonic_ns()}"
    region = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    try:
        region.write_bytes(b"")
        (tmp_path / "tier-shared").mkdir()
        ref = ProcessRef.of(engine.pid)
        server = ServerState(name="engine-0", role="engine", url="http://127.0.0.1:2",
                             pid=ref.pid, create_time=ref.create_time, log="l",
                             engine_id=engine_id)
        stop_cluster(ClusterState(mode="turnkv", model="/m", served_model_name="m",
                                  run_dir=str(tmp_path), router="http://127.0.0.1:3",
                                  engines=[server]))
        assert engine.wait(timeout=10) is not None
        assert not region.exists() and not (tmp_path / "tier-shared").exists()
    finally:
        engine.kill()
        engine.wait()
        region.unlink(missing_ok=True)


SEGMENT_HOLDER = """
import sys, time
from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(create=True, size=4096)
print(segment.name, flush=True)
time.sleep(60)
"""


# A named semaphore, as a spawned process's multiprocessing lock is (vLLM's queues' locks): the
# process maps it under the temporary name glibc created it with, not its own.
SEMAPHORE_HOLDER = """
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()
print("sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("holder_code", [SEGMENT_HOLDER, SEMAPHORE_HOLDER],
                         ids=["segment", "semaphore"])
def test_down_removes_the_shared_memory_a_killed_engine_left(tmp_path: Path,
                                                             holder_code: str) -> None:
    """vLLM's processes keep their message queues in multiprocessing's /dev/shm segments, with
    named semaphores for their locks, which a process group killed with SIGKILL cannot unlink:
    the ones read while it ran (the state file's `shared_memory`) go when the cluster is
    stopped."""
    holder = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    assert holder.stdout is not None
    segment = Path("/dev/shm") / holder.stdout.readline().strip()
    try:
        ref = ProcessRef.of(holder.pid)
        found = shared_memory_of(ref.pid)
        assert str(segment) in found
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        assert segment.exists()  # what the launcher has to clean up
        server = ServerState(name="engine-0", role="engine", url="http://127.0.0.1:2",
                             pid=ref.pid, create_time=ref.create_time, log="l",
                             shared_memory=sorted(found))
        stop_cluster(ClusterState(mode="turnkv", model="/m", served_model_name="m",
                                  run_dir=str(tmp_path), router="http://127.0.0.1:3",
                                  engines=[server]))
        assert not segment.exists()
    finally:
        holder.kill()
        holder.wait()
        segment.unlink(missing_ok=True)


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


# A stand-in for an engine (vLLM takes half a minute): it binds its HTTP port and its side
# channel as the real one does (the port asked for, 0 for a free one), reports both, and
# answers /health.
FAKE_ENGINE = """
import http.server, os, sys
from turnkv_server.ports import bind_listener, write_report
args = sys.argv[1:]
http_sock = bind_listener("127.0.0.1", int(args[args.index("--port") + 1]))
write_report(args[args.index("--port-file") + 1], "127.0.0.1", http_sock.getsockname()[1])
side = bind_listener("127.0.0.1", int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
if os.environ.get("REPORT_SIDE_CHANNEL", "1") == "1":
    write_report(os.environ["TURNKV_SIDE_CHANNEL_REPORT"], "127.0.0.1", side.getsockname()[1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

server = http.server.HTTPServer(http_sock.getsockname(), Health, bind_and_activate=False)
server.socket.close()
server.socket = http_sock
server.serve_forever()
"""


def _fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineProcess:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)

    def command(self: EngineSpec, port_file: Path) -> list[str]:
        return [sys.executable, str(script), "--port-file", str(port_file),
                "--port", str(self.port)]

    monkeypatch.setattr(EngineSpec, "command", command)
    spec = Cluster(ClusterConfig(mode="turnkv", run_dir=tmp_path / "run"))._engine_specs(
        Path("/m"), "m")[0]
    return EngineProcess(spec, tmp_path / "run")


def _wait_healthy(engine: EngineProcess) -> None:
    deadline = time.monotonic() + 30
    while not engine.is_healthy():
        assert time.monotonic() < deadline, engine.log_tail()
        time.sleep(0.05)


def _listening_pids(port: int) -> set[int]:
    return {c.pid for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}


def test_engine_ports_come_from_the_engine_and_survive_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _fake_engine(tmp_path, monkeypatch)
    assert (engine.spec.port, engine.spec.nixl_port) == (0, 0)
    try:
        engine.start()
        _wait_healthy(engine)
        # The ports are the ones the engine bound and reported, not a guess of the launcher.
        http_port, side_port = engine.spec.port, engine.spec.nixl_port
        assert http_port and side_port
        assert read_report(engine.http_report) == ("127.0.0.1", http_port)
        assert read_report(engine.side_channel_report) == ("127.0.0.1", side_port)
        assert engine.ref is not None
        assert _listening_pids(http_port) == _listening_pids(side_port) == {engine.ref.pid}

        # Stopped, its ports stay held for it: nobody else gets them before its restart...
        engine.stop()
        for port in (http_port, side_port):
            with socket.socket() as squatter, pytest.raises(OSError):
                squatter.bind(("127.0.0.1", port))
        # ...which asks for them again (its peers and the router know them) and gets them.
        engine.start()
        _wait_healthy(engine)
        assert (engine.spec.port, engine.spec.nixl_port) == (http_port, side_port)
        assert _listening_pids(http_port) == {engine.ref.pid}
    finally:
        engine.stop()
        engine.release_ports()


def test_an_engine_that_reports_no_side_channel_fails_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPORT_SIDE_CHANNEL", "0")
    engine = _fake_engine(tmp_path, monkeypatch)
    try:
        engine.start()
        with pytest.raises(EngineStartError, match="reported no side channel"):
            _wait_healthy(engine)
    finally:
        engine.stop()
        engine.release_ports()


def test_a_clusters_engines_share_one_vllm_cache(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TURNKV_VLLM_CACHE_DIR", raising=False)

    def caches(**config: Any) -> set[str]:
        cluster = Cluster(ClusterConfig(mode="turnkv", run_dir=tmp_path / "run", **config))
        return {spec.environment(tmp_path / spec.name, tmp_path)["VLLM_CACHE_ROOT"]
                for spec in cluster._engine_specs(Path("/m"), "m")}

    assert caches() == {str(tmp_path / "run" / "vllm-cache")}
    assert caches(vllm_cache_dir=tmp_path / "mine") == {str(tmp_path / "mine")}
    monkeypatch.setenv("TURNKV_VLLM_CACHE_DIR", str(tmp_path / "session"))
    assert caches() == {str(tmp_path / "session")}


def test_a_clusters_engines_share_one_inductor_cache_in_the_vllm_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM compiles its logprob kernels with torch.compile even on eager engines, at an
    engine's first request that asks for logprobs: engines that share the compiled code
    compile them once."""
    monkeypatch.setenv("TURNKV_VLLM_CACHE_DIR", str(tmp_path / "session"))
    cluster = Cluster(ClusterConfig(mode="turnkv", run_dir=tmp_path / "run"))
    caches = {spec.environment(tmp_path / spec.name, tmp_path)["TORCHINDUCTOR_CACHE_DIR"]
              for spec in cluster._engine_specs(Path("/m"), "m")}
    assert caches == {str(tmp_path / "session" / "inductor")}


def test_engines_build_no_precompiled_header_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor precompiles its C++ header into the temp folder (each engine's own) at every
    process's first kernel, even one its cache holds: off, a cached kernel loads at once."""
    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    cluster = Cluster(ClusterConfig(mode="turnkv", run_dir=tmp_path / "run"))
    for spec in cluster._engine_specs(Path("/m"), "m"):
        environment = spec.environment(tmp_path / spec.name, tmp_path)
        assert environment.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS") == "0", spec.name


def test_a_sigterm_reaches_a_scripts_cluster_blocks_as_an_exception() -> None:
    """`raise_on_sigterm`: a killed script unwinds its `with Cluster(...)` blocks (which stop
    what they started) instead of dying with its engines and router still running."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        raise_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted: the handler runs as soon as the signal lands
    finally:
        signal.signal(signal.SIGTERM, before)
