"""Simulated hosts on paper: their names, addresses and the commands that make them.

Nothing here touches the system, so all of it is unit-tested; `hosts` runs the commands.

Every object a run creates carries the project prefix and an 8-hex-digit run tag (the run's
PID and a random byte), so that a crashed run's leftovers can be told apart from this
machine's own objects and from a live run's. Objects without a name carry the tag elsewhere:
the blackhole route's metric is the tag's value and its protocol is `ROUTE_PROTOCOL`; the
bridge's rule names the bridge.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Any

PREFIX = "tkv"
# The routing protocol id on the run's blackhole route and rule. Unassigned in iproute2's
# rt_protos and the kernel's RTPROT_* list, so `proto 213` marks them as this project's.
ROUTE_PROTOCOL = 213
RTN_BLACKHOLE = 6  # a route's type as `ip -N` prints it
DEFAULT_SUBNET = "10.213.0.0/24"
SUBNET_ENV = "TURNKV_HOSTS_SUBNET"
IFNAME_MAX = 15  # IFNAMSIZ - 1: the kernel refuses longer interface names
MAX_HOSTS = 999  # three digits keep the veth names within IFNAME_MAX
PID_BITS = 22  # PID_MAX_LIMIT on 64-bit Linux is 2**22
RFC1918 = tuple(IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))

_TAG = r"[0-9a-f]{8}"
_HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_OBJECT = re.compile(rf"^{PREFIX}({_TAG})(?:b|[rh]\d{{1,3}}|-[a-z][a-z0-9-]*)$")


def make_tag(pid: int, random_byte: int) -> str:
    if not 0 < pid < 2**PID_BITS or not 0 <= random_byte < 256:
        raise ValueError(f"pid {pid} or random byte {random_byte} out of range")
    return f"{pid << 8 | random_byte:08x}"


def tag_pid(tag: str) -> int:
    return int(tag, 16) >> 8


def tag_of(name: str) -> str | None:
    """The run tag in the name of a namespace or link this project made, else None."""
    match = _OBJECT.match(name)
    return match.group(1) if match else None


def parse_subnet(text: str) -> IPv4Network:
    """The simulated range: inside RFC 1918, so that no address of it is anyone's on the
    internet, and small enough that a covering blackhole is cheap to reason about."""
    try:
        subnet = IPv4Network(text, strict=True)
    except ValueError as err:
        raise ValueError(f"simulated hosts' subnet {text!r}: {err}") from None
    if not any(subnet.subnet_of(block) for block in RFC1918):
        raise ValueError(f"simulated hosts' subnet {subnet} is not inside RFC 1918's private "
                         "ranges (10/8, 172.16/12, 192.168/16)")
    if not 16 <= subnet.prefixlen <= 29:
        raise ValueError(f"simulated hosts' subnet {subnet}: use a /16 to /29")
    return subnet


@dataclass(frozen=True)
class Host:
    name: str
    index: int
    namespace: str
    interface: str  # the host's end of its veth pair, inside its namespace
    peer: str  # the other end, a port of the bridge in the root namespace
    address: IPv4Address

    def argv(self, command: Sequence[str]) -> list[str]:
        """`command` run inside this host (needs root, like everything here)."""
        return netns_exec(self.namespace, command)


@dataclass(frozen=True)
class Plan:
    tag: str
    subnet: IPv4Network
    bridge: str
    bridge_address: IPv4Address
    hosts: tuple[Host, ...] = field(default_factory=tuple)

    @property
    def metric(self) -> int:
        """The blackhole route's metric: any value above the connected route's 0 lets the
        bridge's route win while it exists; the tag's value also names the run."""
        return int(self.tag, 16)


def plan(tag: str, subnet: IPv4Network, names: Sequence[str]) -> Plan:
    if not re.fullmatch(_TAG, tag):
        raise ValueError(f"run tag {tag!r} is not 8 hex digits")
    if not names:
        raise ValueError("no hosts asked for")
    if len(set(names)) != len(names):
        raise ValueError(f"host names repeat: {list(names)}")
    for name in names:
        if not _HOST_NAME.match(name):
            raise ValueError(f"host name {name!r}: use 1-32 of a-z, 0-9 and '-', "
                             "starting with a letter")
    # The network and broadcast addresses are unusable and the bridge takes the first.
    room = subnet.num_addresses - 3
    if len(names) > min(room, MAX_HOSTS):
        raise ValueError(f"{len(names)} hosts do not fit in {subnet} "
                         f"(at most {min(room, MAX_HOSTS)})")
    base = subnet.network_address
    hosts = tuple(
        Host(name=name, index=i, namespace=f"{PREFIX}{tag}-{name}",
                 interface=f"{PREFIX}{tag}h{i}", peer=f"{PREFIX}{tag}r{i}",
                 address=base + 2 + i)
        for i, name in enumerate(names))
    result = Plan(tag=tag, subnet=subnet, bridge=f"{PREFIX}{tag}b",
                  bridge_address=base + 1, hosts=hosts)
    longest = max([result.bridge, *(h.interface for h in hosts), *(h.peer for h in hosts)],
                  key=len)
    assert len(longest) <= IFNAME_MAX, longest
    return result


def netns_exec(namespace: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def blackhole_route(subnet: IPv4Network, metric: int) -> list[str]:
    """`ip route` arguments (after add/del) of the run's blackhole for its range."""
    return ["blackhole", str(subnet), "metric", str(metric), "proto", str(ROUTE_PROTOCOL)]


def bridge_rule(bridge: str) -> list[str]:
    """`ip rule` arguments (after add/del): whatever arrives on the bridge and is not for this
    machine's own addresses (the `local` table's rule comes first) is dropped, so nothing of
    the simulation is ever forwarded, whatever `net.ipv4.ip_forward` says now or later."""
    return ["iif", bridge, "blackhole", "protocol", str(ROUTE_PROTOCOL)]


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc qdisc replace dev X root` arguments shaping a link to `rate_mbit`."""
    kbit = round(rate_mbit * 1000)
    if kbit < 8:
        raise ValueError(f"rate {rate_mbit} Mbit/s is below tc's 8 kbit/s")
    bytes_per_s = kbit * 125
    # A burst of at least ten full frames, and 4 ms of traffic at high rates, where a smaller
    # bucket empties between two timer wake-ups and the link falls short of its rate.
    burst = max(15_140, bytes_per_s // 250)
    # A 100 ms queue: a shorter one drops enough at 1 Mbit/s to starve a TCP stream.
    return ["tbf", "rate", f"{kbit}kbit", "burst", str(burst), "latency", "100ms"]


def route_network(route: Mapping[str, Any]) -> IPv4Network | None:
    """The prefix of a route from `ip -j -4 route show`; None for a default route."""
    dst = str(route.get("dst", ""))
    if dst in ("", "default"):
        return None
    return IPv4Network(dst, strict=False)


def conflicts(routes: Iterable[Mapping[str, Any]], subnet: IPv4Network,
              own_metric: int | None = None) -> list[str]:
    """Routes (all tables) that overlap the simulated range, other than this run's own
    blackhole: an address or route of this machine there, or another run's range."""
    found = []
    for route in routes:
        network = route_network(route)
        if network is None or not network.overlaps(subnet):
            continue
        if (own_metric is not None and route.get("type") == "blackhole"
                and route.get("metric") == own_metric):
            continue
        what = f"{route.get('type', 'unicast')} {network}"
        where = route.get("dev") or route.get("table")
        found.append(f"{what} ({where})" if where else what)
    return found


@dataclass
class RunObjects:
    """What one run (one tag) left in the root namespace, read from `ip -j` listings."""

    tag: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # veth ends and the bridge, bridge last
    rules: list[int] = field(default_factory=list)  # priorities of rules naming its bridge
    routes: list[str] = field(default_factory=list)  # blackhole destinations

    @property
    def pid(self) -> int:
        return tag_pid(self.tag)


def project_objects(namespaces: Iterable[Mapping[str, Any]],
                    links: Iterable[Mapping[str, Any]],
                    rules: Iterable[Mapping[str, Any]],
                    routes: Iterable[Mapping[str, Any]]) -> dict[str, RunObjects]:
    """This project's objects among `ip -j netns list`, `ip -j link show`, `ip -j rule show`
    and `ip -j -4 route show table main`, by run tag. Only names the project's pattern
    matches, rules with the project's protocol on such a bridge, and blackhole routes with
    the project's protocol count: nothing else of the machine is ever listed here."""
    runs: dict[str, RunObjects] = {}

    def run(tag: str) -> RunObjects:
        return runs.setdefault(tag, RunObjects(tag))

    for ns in namespaces:
        tag = tag_of(str(ns.get("name", "")))
        if tag:
            run(tag).namespaces.append(str(ns["name"]))
    for link in links:
        tag = tag_of(str(link.get("ifname", "")))
        if tag:
            run(tag).links.append(str(link["ifname"]))
    for rule in rules:
        tag = tag_of(str(rule.get("iif", "")))
        if tag and str(rule.get("protocol")) == str(ROUTE_PROTOCOL):
            run(tag).rules.append(int(rule["priority"]))
    for route in routes:
        network = route_network(route)
        metric = route.get("metric")
        if (str(route.get("type")) in ("blackhole", str(RTN_BLACKHOLE))
                and isinstance(metric, int) and network
                and str(route.get("protocol")) == str(ROUTE_PROTOCOL)
                and 0 < metric < 2 ** (PID_BITS + 8)
                and any(network.subnet_of(block) for block in RFC1918)):
            run(f"{metric:08x}").routes.append(str(network))
    for objects in runs.values():
        objects.links.sort(key=lambda name: name.endswith("b"))
    return runs
