"""Simulated hosts for real (`turnkv_server.launcher.hosts`): namespaces on a private bridge.

Needs root (CAP_NET_ADMIN); skipped where `ip netns add` is not permitted (under CI, with
the `CI` environment variable set, failed with the reason: `tests.support.prerequisites`).
No engine: a few seconds of tiny Python servers and clients inside the namespaces. Nothing is sent
outside the simulated range: the forwarding check is a route lookup (`ip route get`), which
sends no packet.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.prerequisites import cannot_run
from turnkv_server.launcher.host_plan import DEFAULT_SUBNET, SUBNET_ENV, Host
from turnkv_server.launcher.hosts import (
    HostsError,
    HostSet,
    find_runs,
    netns_permitted,
    remove_stale,
)

pytestmark = pytest.mark.timeout(120)

SUBNET = os.environ.get(SUBNET_ENV) or DEFAULT_SUBNET
PORT = 7000  # inside a host's own namespace nothing else listens
PYTHON = [sys.executable, "-I", "-S", "-c"]
SERVER = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen()
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b"ok")
    conn.close()
"""
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])) as c:
        print(c.recv(2).decode())
except OSError as err:
    print(type(err).__name__)
    sys.exit(1)
"""


@pytest.fixture(scope="module", autouse=True)
def permitted() -> None:
    reason = netns_permitted()
    if reason is not None:
        cannot_run(f"simulated hosts need `ip netns add` (root), not permitted here: {reason}")


@pytest.fixture
def hosts() -> Iterator[HostSet]:
    with HostSet(["a", "b", "c"], subnet=SUBNET) as hosts:
        yield hosts
    assert _leftovers(hosts.tag) == []


@pytest.fixture
def server(hosts: HostSet) -> Iterator[Host]:
    """A TCP server in host `a` that answers "ok", stopped by its PID."""
    a = hosts["a"]
    proc = subprocess.Popen(a.argv([*PYTHON, SERVER, str(a.address), str(PORT)]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert proc.pid in hosts.pids("a")
        yield a
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _reply(host: Host, address: object, port: int = PORT, timeout: float = 2.0) -> str:
    """What a client inside `host` gets from address:port: "ok", or the error's name."""
    done = subprocess.run(host.argv([*PYTHON, CLIENT, str(address), str(port), str(timeout)]),
                          capture_output=True, text=True, timeout=timeout + 10)
    return done.stdout.strip()


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _leftovers(tag: str) -> list[str]:
    """Lines of `ip netns list`, `ip link`, `ip route` and `ip rule` that name the run or
    its blackhole (its metric is the tag's value)."""
    metric = f"metric {int(tag, 16)} "
    listings = [_ip("netns", "list"), _ip("link"), _ip("route", "show", "table", "all"),
                _ip("rule")]
    return [line for text in listings for line in text.splitlines()
            if f"tkv{tag}" in line or metric in line + " "]


def test_hosts_reach_each_other_and_the_bridge(hosts: HostSet, server: Host) -> None:
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    assert _reply(b, a.address) == "ok"
    assert _reply(c, a.address) == "ok"
    # The root namespace reaches a host over the bridge, and a host reaches the root
    # namespace's bridge address.
    with socket.create_connection((str(a.address), PORT), timeout=2) as conn:
        assert conn.recv(2) == b"ok"
    with socket.create_server((str(hosts.bridge_address), 0)) as listener:
        def answer() -> None:
            conn, _ = listener.accept()
            conn.sendall(b"ok")
            conn.close()
        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        assert _reply(b, hosts.bridge_address, listener.getsockname()[1]) == "ok"
        thread.join(timeout=5)
    # Inside a host: `lo` up, its address, a default route via the bridge, no IPv6 address.
    inside = subprocess.run(b.argv(["ip", "-j", "addr"]), capture_output=True, text=True,
                            check=True).stdout
    links = {link["ifname"]: link for link in json.loads(inside)}
    assert "UP" in links["lo"]["flags"]
    assert [(i["family"], i["local"]) for i in links[b.interface]["addr_info"]] == [
        ("inet", str(b.address))]
    routes = subprocess.run(b.argv(["ip", "route"]), capture_output=True, text=True).stdout
    assert f"default via {hosts.bridge_address} dev {b.interface}" in routes


def test_blackhole_and_no_forwarding_while_up(hosts: HostSet) -> None:
    blackholes = json.loads(_ip("-j", "route", "show", "table", "main", "type", "blackhole"))
    assert any(route["dst"] == SUBNET and route.get("metric") == int(hosts.tag, 16)
               for route in blackholes), blackholes
    bridge = hosts.plan.bridge
    assert f"dev {bridge} " in _ip("route", "get", str(hosts["a"].address))
    assert f"iif {bridge} " in _ip("rule") + " "
    # A lookup (no packet is sent) for a host's packet to an address past the range, as if it
    # came in on the bridge: refused, never routed out through another interface. Each of
    # the two guards refuses it alone: forwarding off on the bridge ("No route to host"),
    # and, with forwarding on there as `ip_forward=1` would set it, the rule ("Invalid
    # argument").
    past = hosts.subnet.network_address + hosts.subnet.num_addresses
    lookup = ["ip", "route", "get", str(past), "from", str(hosts["a"].address), "iif", bridge]
    forwarding = f"/proc/sys/net/ipv4/conf/{bridge}/forwarding"
    with open(forwarding) as sysctl:
        assert sysctl.read().strip() == "0"
    refused = subprocess.run(lookup, capture_output=True, text=True)
    assert refused.returncode != 0 and "No route to host" in refused.stderr, refused
    with open(forwarding, "w") as sysctl:  # the run's own bridge, removed with it
        sysctl.write("1\n")
    try:
        refused = subprocess.run(lookup, capture_output=True, text=True)
    finally:
        with open(forwarding, "w") as sysctl:
            sysctl.write("0\n")
    assert refused.returncode != 0 and "Invalid argument" in refused.stderr, refused


def test_shaped_link_rate_shows_in_tc(hosts: HostSet) -> None:
    b = hosts["b"]
    hosts.shape("b", 10)
    outside = _ip_tc("qdisc", "show", "dev", b.peer)
    inside = _ip_tc("-n", b.namespace, "qdisc", "show", "dev", b.interface)
    for shown in (outside, inside):
        assert "tbf" in shown and "rate 10Mbit" in shown, shown
    hosts.unshape("b")
    assert "tbf" not in _ip_tc("qdisc", "show", "dev", b.peer)


def _ip_tc(*args: str) -> str:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=True).stdout


def test_link_down_stops_traffic_and_up_restores_it(hosts: HostSet, server: Host) -> None:
    b = hosts["b"]
    assert _reply(b, server.address) == "ok"
    hosts.link_down("a")
    assert _reply(b, server.address, timeout=0.5) != "ok"
    hosts.link_up("a")
    deadline = time.monotonic() + 5
    while (reply := _reply(b, server.address, timeout=0.5)) != "ok":
        assert time.monotonic() < deadline, reply
    assert _reply(hosts["c"], server.address) == "ok"


def test_a_subnet_in_use_is_refused(hosts: HostSet) -> None:
    second = HostSet(["x"], subnet=SUBNET)
    with pytest.raises(HostsError, match="in use"):
        second.__enter__()
    assert _leftovers(second.tag) == []


def test_a_failed_start_removes_what_it_made_and_nothing_else() -> None:
    hosts = HostSet(["a", "b"], subnet=SUBNET)
    taken = hosts["b"].namespace  # someone else's, as far as the set knows
    _ip("netns", "add", taken)
    try:
        with pytest.raises(HostsError, match="File exists"):
            hosts.__enter__()
        listed = _ip("netns", "list").split()
        assert taken in listed and hosts["a"].namespace not in listed
    finally:
        _ip("netns", "del", taken)
    assert _leftovers(hosts.tag) == []


def test_a_failure_in_the_block_still_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), HostSet(["a", "b"], subnet=SUBNET) as hosts:
        assert _leftovers(hosts.tag)
        raise RuntimeError("boom")
    assert _leftovers(hosts.tag) == []
    assert SUBNET.rsplit(".", 1)[0] + "." not in _ip("route", "show", "table", "all")


def test_a_crashed_runs_objects_are_found_and_removed() -> None:
    # A run that dies without cleaning up: its process is gone, its objects are not.
    crash = ("import os, sys\nfrom turnkv_server.launcher.hosts import HostSet\n"
             "hosts = HostSet(['x', 'y'], subnet=sys.argv[1]).__enter__()\n"
             "print(hosts.tag, flush=True)\nos._exit(0)\n")
    tag = subprocess.run([sys.executable, "-c", crash, SUBNET], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        assert tag in find_runs()
        assert _leftovers(tag)
        removed = [run.tag for run in remove_stale()]
        assert tag in removed
    finally:
        remove_stale()
    assert _leftovers(tag) == []
    assert tag not in find_runs()
