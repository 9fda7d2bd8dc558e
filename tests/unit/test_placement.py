"""Placing a cluster's processes on simulated hosts (`turnkv_server.launcher.placement`,
`ClusterConfig.hosts`), on paper: no namespace is made, nothing runs inside one. The cluster
itself across hosts: tests/integration/test_cross_host.py (`make test-hosts`)."""

from __future__ import annotations

import dataclasses
import subprocess
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

import pytest

from turnkv_server.launcher import Cluster, ClusterConfig
from turnkv_server.launcher.engine import EngineProcess
from turnkv_server.launcher.host_plan import Host, plan
from turnkv_server.launcher.placement import ROUTER, bind_address, ucx_environment, wrap
from turnkv_server.ports import PortHold

HOSTS = plan("0000aa01", IPv4Network("10.213.0.0/24"), ["p", "d", "r"]).hosts
PREFILL, DECODE, ROUTER_HOST = HOSTS


def _cluster(tmp_path: Path, hosts: dict[str, Host], **config: Any) -> Cluster:
    return Cluster(ClusterConfig(mode="turnkv", run_dir=tmp_path / "run", hosts=hosts,
                                 **config))


def test_a_host_gives_its_address_namespace_and_interface() -> None:
    assert (bind_address(None), bind_address(PREFILL)) == ("127.0.0.1", "10.213.0.2")
    assert wrap(None, ["python", "-V"]) == ["python", "-V"]
    assert wrap(PREFILL, ["python", "-V"]) == ["ip", "netns", "exec", PREFILL.namespace,
                                                "python", "-V"]
    # On a host: its own interface and TCP, whatever this machine's environment says (UCX
    # would otherwise move KV around the simulated network).
    inherited = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "all"}
    assert ucx_environment(PREFILL, inherited) == {"UCX_NET_DEVICES": PREFILL.interface,
                                                   "UCX_TLS": "tcp"}
    assert ucx_environment(None, inherited) == {"UCX_NET_DEVICES": "lo"}
    assert ucx_environment(None, {}) == {"UCX_NET_DEVICES": "lo"}


def test_engines_on_simulated_hosts_share_no_file_tier_unless_asked() -> None:
    """Their file system is the simulation's: real hosts would have no folder in common."""
    hosts = {"prefill-0": PREFILL, "decode-0": DECODE}
    assert not ClusterConfig(mode="turnkv", tier_host_blocks=64, hosts=hosts).shares_tier()
    assert ClusterConfig(mode="turnkv", tier_host_blocks=64, hosts=hosts,
                         tier_shared=True).shares_tier()


def test_the_configuration_names_only_processes_it_has() -> None:
    assert ClusterConfig(num_decode=2).engine_names() == ["prefill-0", "decode-0", "decode-1"]
    assert ClusterConfig(mode="affinity").engine_names() == ["engine-0", "engine-1"]
    assert ClusterConfig(mode="single").engine_names() == ["single"]
    ClusterConfig(hosts={"prefill-0": PREFILL, "decode-0": DECODE, ROUTER: ROUTER_HOST})
    ClusterConfig(hosts={"decode-0": DECODE})  # the rest stays here
    with pytest.raises(ValueError, match="decode-1"):
        ClusterConfig(hosts={"decode-1": DECODE})
    # A single engine has no router in front of it.
    with pytest.raises(ValueError, match="no process named router"):
        ClusterConfig(mode="single", hosts={ROUTER: ROUTER_HOST})


def test_placed_engines_bind_their_hosts_address_and_use_its_interface(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "shm,tcp")
    cluster = _cluster(tmp_path, {"prefill-0": PREFILL})
    prefill, decode = cluster._engine_specs(Path("/m"), "m")
    assert (prefill.placed_on, prefill.host, decode.placed_on, decode.host) == (
        PREFILL, "10.213.0.2", None, "127.0.0.1")
    command = prefill.command(tmp_path / "http.addr")
    assert command[command.index("--host") + 1] == "10.213.0.2"
    env = prefill.environment(tmp_path, tmp_path / "tmp")
    assert (env["UCX_NET_DEVICES"], env["UCX_TLS"]) == (PREFILL.interface, "tcp")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.213.0.2"
    # An engine left here keeps the environment's UCX settings, as without hosts.
    env = decode.environment(tmp_path, tmp_path / "tmp")
    assert (env["UCX_NET_DEVICES"], env["UCX_TLS"]) == ("lo", "shm,tcp")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"


def test_a_placed_engine_starts_inside_its_host_and_is_stopped_by_its_pid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's command goes through `ip netns exec` (here a stand-in runs instead:
    nothing is made), its PID is recorded and its group stopped; no port is held for it in
    this namespace, where its host's address does not exist."""
    spec = _cluster(tmp_path, {"decode-0": DECODE})._engine_specs(Path("/m"), "m")[1]
    asked: list[list[str]] = []
    real_popen = subprocess.Popen

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        asked.append(argv)
        return real_popen(["sleep", "30"], **kwargs)

    monkeypatch.setattr("turnkv_server.launcher.engine.subprocess.Popen", popen)
    engine = EngineProcess(dataclasses.replace(spec, port=8100, nixl_port=5600), tmp_path)
    engine.start()
    try:
        assert asked[0][:4] == ["ip", "netns", "exec", DECODE.namespace]
        assert asked[0][4:] == engine.spec.command(engine.http_report)
        assert engine._hold is None
        assert engine.ref is not None and engine.ref.is_alive()
    finally:
        engine.stop()
    assert engine.ref is not None and not engine.ref.is_alive()
    assert engine._hold is None  # still none for its restart
    # The same engine left here holds its ports for a restart, as before.
    here = EngineProcess(dataclasses.replace(spec, placed_on=None, host="127.0.0.1",
                                             port=0, nixl_port=0), tmp_path)
    assert here._hold_ports() is None  # nothing known yet: the engine binds port 0
    here.spec = dataclasses.replace(here.spec, port=8100)
    hold = here._hold_ports()
    assert isinstance(hold, PortHold)
    hold.release()


def test_a_placed_router_runs_inside_its_host_and_names_engines_by_their_addresses(
        tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, {"prefill-0": PREFILL, "decode-0": DECODE,
                                  ROUTER: ROUTER_HOST})
    specs = cluster._engine_specs(Path("/m"), "m")
    cluster.engines = [EngineProcess(dataclasses.replace(s, port=8000, nixl_port=5600),
                                     tmp_path) for s in specs]
    command = cluster.router_command(0, tmp_path / "router.addr")
    assert command[:4] == ["ip", "netns", "exec", ROUTER_HOST.namespace]
    assert command[command.index("--host") + 1] == "10.213.0.4"
    assert command[command.index("--prefill") + 1] == "http://10.213.0.2:8000"
    assert command[command.index("--decode") + 1] == "http://10.213.0.3:8000"
    assert command[command.index("--prefill-nixl") + 1].endswith("@10.213.0.2:5600")
    assert command[command.index("--decode-nixl") + 1].endswith("@10.213.0.3:5600")
    # Without a host for it, the router stays here on loopback, as before.
    unplaced = _cluster(tmp_path, {"prefill-0": PREFILL})
    unplaced.engines = cluster.engines
    command = unplaced.router_command()
    assert command[1:3] == ["-m", "turnkv_server.router"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
