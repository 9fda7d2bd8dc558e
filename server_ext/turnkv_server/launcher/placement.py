"""Where a cluster's processes run: the launcher's own network namespace, or simulated hosts.

`ClusterConfig.hosts` maps process names ("prefill-0", "decode-0", "engine-1", "single", and
`ROUTER` for the launcher's router) to simulated hosts (`turnkv_server.launcher.hosts`); a
name it leaves out runs where the launcher runs, on 127.0.0.1, as without hosts.

A process placed on a host:

- runs inside the host's network namespace: its command goes through `ip netns exec`, which
  execs it, so the PID the launcher records, re-pins and stops is the server's own (PIDs are
  global; only the network is the host's);
- listens on the host's address only (HTTP, the KV connector's side channel), the address
  its peers on other hosts and the launcher (over the bridge) reach;
- if it is an engine, tells UCX to use the host's interface and TCP only (`ucx_environment`).

Port reservations (`turnkv_server.ports.PortHold`) bind in the launcher's namespace, where a
host's address does not exist; a placed engine binds port 0 and reports the port it got as
every engine does, and a restart asks for the same port again inside its host, where nothing
but that host's own processes listens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from turnkv_server.launcher.host_plan import Host

ROUTER = "router"  # the launcher's router in `ClusterConfig.hosts`
LOOPBACK = "127.0.0.1"


def bind_address(host: Host | None) -> str:
    """Where a server listens: its host's address, else loopback."""
    return LOOPBACK if host is None else str(host.address)


def wrap(host: Host | None, argv: Sequence[str]) -> list[str]:
    """`argv`, run inside `host` when it has one."""
    return list(argv) if host is None else host.argv(argv)


def ucx_environment(host: Host | None, inherited: Mapping[str, str]) -> dict[str, str]:
    """UCX's network settings for an engine (NIXL moves KV through UCX).

    Unplaced: the environment's `UCX_NET_DEVICES`, else `lo` (UCX otherwise listens on every
    interface), and whatever `UCX_TLS` the environment holds. On a host: its interface, never
    `lo` (UCX would offer a loopback address to peers on other hosts), and TCP only.
    Simulated hosts share one machine, and UCX left to choose its transports moves KV between
    them around the simulated network, through the memory they share (almost none of a
    prompt's KV crossed its host's link; docs/architecture.md), so neither `HostSet.shape`
    nor `link_down` would have touched it. Real hosts without RDMA
    use TCP too (docs/deploy.md).
    """
    if host is None:
        return {"UCX_NET_DEVICES": inherited.get("UCX_NET_DEVICES", "lo")}
    return {"UCX_NET_DEVICES": host.interface, "UCX_TLS": "tcp"}


def unknown_names(hosts: Mapping[str, Host], names: Sequence[str]) -> list[str]:
    """Names in `hosts` that are none of `names`: a typo would otherwise leave a process
    unplaced without a word."""
    return sorted(set(hosts) - set(names))
