"""Simulated hosts on paper: names, addresses, commands and what counts as the project's
(`turnkv_server.launcher.host_plan`). Nothing here touches the network."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import pytest

from turnkv_server.launcher.host_plan import (
    IFNAME_MAX,
    MAX_HOSTS,
    ROUTE_PROTOCOL,
    blackhole_route,
    bridge_rule,
    conflicts,
    make_tag,
    netns_exec,
    parse_subnet,
    plan,
    project_objects,
    tag_of,
    tag_pid,
    tbf_args,
)

SUBNET = IPv4Network("10.213.0.0/24")


def test_tag_holds_the_pid_and_fits_a_metric() -> None:
    tag = make_tag(4_194_303, 255)  # the largest PID Linux hands out
    assert tag == "3fffffff" and tag_pid(tag) == 4_194_303
    assert make_tag(1, 0) == "00000100" and tag_pid("00000100") == 1
    for pid, byte in ((0, 0), (2**22, 0), (5, 256), (5, -1)):
        with pytest.raises(ValueError):
            make_tag(pid, byte)


def test_names_fit_the_interface_limit_and_carry_prefix_and_tag() -> None:
    names = [f"h{i}" for i in range(MAX_HOSTS)]
    p = plan("3fffffff", IPv4Network("10.0.0.0/16"), names)
    links = [p.bridge, *(h.peer for h in p.hosts), *(h.interface for h in p.hosts)]
    assert max(len(link) for link in links) == IFNAME_MAX
    assert p.bridge == "tkv3fffffffb"
    last = p.hosts[-1]
    assert (last.peer, last.interface, last.namespace) == (
        "tkv3fffffffr998", "tkv3fffffffh998", "tkv3fffffff-h998")
    assert all(tag_of(name) == "3fffffff" for name in [*links, last.namespace])
    assert len(set(links)) == len(links)


def test_addresses_bridge_first_then_hosts_in_order() -> None:
    p = plan("0000abcd", SUBNET, ["prefill", "decode", "redis"])
    assert p.bridge_address == IPv4Address("10.213.0.1")
    assert [str(h.address) for h in p.hosts] == ["10.213.0.2", "10.213.0.3", "10.213.0.4"]
    assert [h.index for h in p.hosts] == [0, 1, 2]
    assert p.metric == 0xABCD


def test_plan_refuses_bad_hosts() -> None:
    with pytest.raises(ValueError, match="repeat"):
        plan("0000abcd", SUBNET, ["a", "a"])
    with pytest.raises(ValueError, match="no hosts"):
        plan("0000abcd", SUBNET, [])
    for bad in ("A", "1a", "a b", "a_b", "x" * 33, "a/b"):
        with pytest.raises(ValueError, match="host name"):
            plan("0000abcd", SUBNET, [bad])
    # A /29 holds 8 addresses: network, broadcast and the bridge leave 5 hosts.
    small = IPv4Network("10.213.0.0/29")
    assert len(plan("0000abcd", small, list("abcde")).hosts) == 5
    with pytest.raises(ValueError, match="do not fit"):
        plan("0000abcd", small, list("abcdef"))
    with pytest.raises(ValueError, match="tag"):
        plan("ABCD", SUBNET, ["a"])


def test_subnet_must_be_private_and_exact() -> None:
    assert parse_subnet("172.16.5.0/24") == IPv4Network("172.16.5.0/24")
    assert parse_subnet("192.168.77.0/24") == IPv4Network("192.168.77.0/24")
    for outside in ("192.0.2.0/24", "8.8.8.0/24", "172.32.0.0/24", "100.64.0.0/24"):
        with pytest.raises(ValueError, match="RFC 1918"):
            parse_subnet(outside)
    with pytest.raises(ValueError, match="host bits"):
        parse_subnet("10.213.0.1/24")
    for size in ("10.0.0.0/8", "10.213.0.0/30"):
        with pytest.raises(ValueError, match="/16 to /29"):
            parse_subnet(size)
    with pytest.raises(ValueError):
        parse_subnet("not a subnet")


def test_commands() -> None:
    p = plan("0000abcd", SUBNET, ["a"])
    assert p.hosts[0].argv(["python", "-c", "x"]) == [
        "ip", "netns", "exec", "tkv0000abcd-a", "python", "-c", "x"]
    assert netns_exec("n", ["true"]) == ["ip", "netns", "exec", "n", "true"]
    assert blackhole_route(SUBNET, 0xABCD) == [
        "blackhole", "10.213.0.0/24", "metric", str(0xABCD), "proto", str(ROUTE_PROTOCOL)]
    assert bridge_rule("tkv0000abcdb") == [
        "iif", "tkv0000abcdb", "blackhole", "protocol", str(ROUTE_PROTOCOL)]


def test_tbf_rates_and_buckets() -> None:
    assert tbf_args(10) == ["tbf", "rate", "10000kbit", "burst", "15140", "latency", "100ms"]
    # 1 Gbit/s: the bucket holds 4 ms of traffic.
    assert tbf_args(1000)[1:5] == ["rate", "1000000kbit", "burst", "500000"]
    assert tbf_args(0.5)[2] == "500kbit"
    with pytest.raises(ValueError):
        tbf_args(0.001)


def test_conflicts_are_overlapping_routes_other_than_this_runs_blackhole() -> None:
    routes = [
        {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
        {"dst": "192.0.2.0/24", "dev": "eth0"},
        {"dst": "127.0.0.0/8", "dev": "lo", "table": "local", "type": "local"},
        {"type": "blackhole", "dst": "10.213.0.0/24", "protocol": "213", "metric": 7},
    ]
    assert conflicts(routes, SUBNET, own_metric=7) == []
    assert conflicts(routes, SUBNET) == ["blackhole 10.213.0.0/24"]
    assert conflicts(routes, SUBNET, own_metric=8) == ["blackhole 10.213.0.0/24"]
    covering = [{"dst": "10.0.0.0/8", "dev": "tun0"}]
    assert conflicts(covering, SUBNET) == ["unicast 10.0.0.0/8 (tun0)"]
    assert conflicts([{"dst": "10.213.0.9", "dev": "x", "type": "local", "table": "local"}],
                     SUBNET) == ["local 10.213.0.9/32 (x)"]
    assert conflicts([{"dst": "10.213.1.0/24", "dev": "y"}], SUBNET) == []


def test_only_the_projects_objects_are_listed() -> None:
    tag = "0000abcd"
    found = project_objects(
        namespaces=[{"name": f"tkv{tag}-prefill"}, {"name": "tkvother"}, {"name": "cni-1"},
                    {"name": f"tkv{tag}-Bad"}],
        links=[{"ifname": f"tkv{tag}b"}, {"ifname": f"tkv{tag}r0"}, {"ifname": f"tkv{tag}h1"},
               {"ifname": "eth0"}, {"ifname": "tkv0000abcdr1234"}, {"ifname": "docker0"}],
        rules=[{"priority": 0, "table": "255"},
               {"priority": 32765, "iif": f"tkv{tag}b", "action": "blackhole",
                "protocol": "213"},
               {"priority": 100, "iif": f"tkv{tag}b", "table": "5"}],
        routes=[{"type": "6", "dst": "10.213.0.0/24", "protocol": "213", "metric": 0xABCD},
                {"type": "6", "dst": "10.9.0.0/24", "protocol": "4", "metric": 1},
                {"type": "6", "dst": "8.8.8.0/24", "protocol": "213", "metric": 2},
                {"type": "1", "dst": "10.8.0.0/24", "protocol": "213", "metric": 3}])
    assert list(found) == [tag]
    run = found[tag]
    assert run.namespaces == [f"tkv{tag}-prefill"]
    assert run.links == [f"tkv{tag}r0", f"tkv{tag}h1", f"tkv{tag}b"]  # the bridge last
    assert run.rules == [32765]
    assert run.routes == ["10.213.0.0/24"]
    assert run.pid == 0xAB
