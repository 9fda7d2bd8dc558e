"""Simulated hosts on one machine: one network namespace per host, on a private bridge.

Each host is a namespace with `lo` up and one end of a veth pair, which has an address of
the simulated range and a default route via the bridge; the pair's other end is a port of
a bridge in the root namespace that holds the range's first address. Hosts reach each other
and the root namespace; nothing of the simulation can leave the machine:

- a blackhole route for the whole range in the root namespace, added before anything else
  and removed last. Its metric is above the bridge's connected route's (0), so the bridge's
  route wins while the bridge is up; when the bridge is down or gone, the range's packets
  are dropped instead of following the default route out;
- a rule that drops whatever arrives on the bridge and is not for one of the machine's own
  addresses, and `forwarding` off on the bridge: no packet from a host is ever routed on,
  even if `net.ipv4.ip_forward` is on or is turned on later;
- no IPv6 address on any of the run's links (`addrgenmode none`).

`HostSet` creates the hosts for the length of a `with` block and removes every object it
made when the block ends, however it ends. A run killed before that leaves objects named
with its tag; `remove_stale()` (or `python -m turnkv_server.launcher.hosts --remove-stale`)
removes those of runs whose process is gone, and only objects of this project.
Everything here needs CAP_NET_ADMIN (and CAP_SYS_ADMIN for `ip netns`): run as root.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from turnkv_server.launcher.host_plan import (
    DEFAULT_SUBNET,
    PREFIX,
    SUBNET_ENV,
    Host,
    Plan,
    RunObjects,
    blackhole_route,
    bridge_rule,
    conflicts,
    make_tag,
    parse_subnet,
    plan,
    project_objects,
    tbf_args,
)

log = logging.getLogger(__name__)
TIMEOUT_S = 30.0
# What `ip` and `tc` say about an object that is already gone: removing it again is done.
_GONE = ("Cannot find device", "No such file or directory", "No such process")
_DENIED = ("Operation not permitted", "Permission denied")
_open_tags: set[str] = set()  # runs of this process still up: never stale


class HostsError(RuntimeError):
    """A command that makes, changes or removes simulated hosts failed."""


def _check(argv: Sequence[str], missing_ok: bool = False) -> str:
    command = " ".join(argv)
    try:
        # LC_ALL=C: the messages matched below are the untranslated ones.
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT_S,
                              env={**os.environ, "LC_ALL": "C"}, check=False)
    except FileNotFoundError:
        raise HostsError(f"`{argv[0]}` is not installed: simulated hosts need iproute2's "
                         "`ip` and `tc`") from None
    except subprocess.TimeoutExpired:
        raise HostsError(f"`{command}` took over {TIMEOUT_S:.0f} s") from None
    if done.returncode == 0:
        return done.stdout
    error = (done.stderr.strip() or done.stdout.strip()).replace("\n", "; ")
    error = error or f"exit code {done.returncode}"
    if missing_ok and any(text in error for text in _GONE):
        return ""
    if any(text in error for text in _DENIED):
        raise HostsError(f"`{command}`: {error}. Simulated hosts need CAP_NET_ADMIN (and "
                         "CAP_SYS_ADMIN for `ip netns`): run as root")
    raise HostsError(f"`{command}` failed: {error}")


def _listing(argv: Sequence[str]) -> list[dict[str, Any]]:
    out = _check(argv).strip()
    return json.loads(out) if out else []


def _routes_everywhere() -> list[dict[str, Any]]:
    return _listing(["ip", "-j", "-4", "route", "show", "table", "all"])


def _no_ipv6(ip: list[str], link: str) -> None:
    """No IPv6 link-local address on `link`: set on its own, before the link goes up (in one
    command with `up`, the kernel brings the link up first)."""
    # Without IPv6 in the kernel there is no address to prevent.
    if Path("/proc/sys/net/ipv6").exists():
        _check([*ip, "link", "set", link, "addrgenmode", "none"])


class HostSet:
    """`names` simulated hosts, up inside `with HostSet([...]) as hosts:`.

    `hosts[name]` is a `Host`: its `address`, its `interface` (what UCX and servers bind to
    inside it) and `argv(command)`, the command run inside it. The subnet is `subnet`, else
    the environment's `TURNKV_HOSTS_SUBNET`, else 10.213.0.0/24; it must be unused here.
    """

    def __init__(self, names: Sequence[str], subnet: str | None = None) -> None:
        chosen = parse_subnet(subnet or os.environ.get(SUBNET_ENV) or DEFAULT_SUBNET)
        self.plan: Plan = plan(make_tag(os.getpid(), random.randrange(256)), chosen, names)
        self._undo: list[list[str]] = []  # how to remove each object made, in making order
        self._shaped: set[str] = set()

    @property
    def tag(self) -> str:
        return self.plan.tag

    @property
    def subnet(self) -> IPv4Network:
        return self.plan.subnet

    @property
    def bridge_address(self) -> IPv4Address:
        """The root namespace's address on the bridge: each host's default gateway."""
        return self.plan.bridge_address

    def __getitem__(self, name: str) -> Host:
        for host in self.plan.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no simulated host {name!r} (hosts: {self.names})")

    def __iter__(self) -> Iterator[Host]:
        return iter(self.plan.hosts)

    @property
    def names(self) -> list[str]:
        return [host.name for host in self.plan.hosts]

    def __enter__(self) -> HostSet:
        try:
            self._create()
        except BaseException:
            self.close(quiet=True)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # After a failure in the block, a cleanup error is logged, not raised over it.
        self.close(quiet=exc_type is not None)

    def _make(self, argv: list[str], undo: list[str]) -> None:
        # The undo is remembered only once the object exists: a failed add (say, "File
        # exists") must never lead to removing what someone else made.
        _check(argv)
        self._undo.append(undo)

    def _create(self) -> None:
        p = self.plan
        hint = (f"choose another private subnet (subnet=... or {SUBNET_ENV}), or remove a "
                "crashed run's objects: python -m turnkv_server.launcher.hosts --remove-stale")
        in_use = conflicts(_routes_everywhere(), p.subnet)
        if in_use:
            raise HostsError(f"{p.subnet} is in use on this machine: {', '.join(in_use)}; "
                             f"{hint}")
        _open_tags.add(p.tag)
        route = blackhole_route(p.subnet, p.metric)
        self._make(["ip", "route", "add", *route], ["ip", "route", "del", *route])
        # Two runs that checked at once both see each other's blackhole now: both give up.
        in_use = conflicts(_routes_everywhere(), p.subnet, own_metric=p.metric)
        if in_use:
            raise HostsError(f"{p.subnet} was claimed at the same time: {', '.join(in_use)}; "
                             f"{hint}")
        rule = bridge_rule(p.bridge)
        self._make(["ip", "rule", "add", *rule], ["ip", "rule", "del", *rule])
        self._make(["ip", "link", "add", "name", p.bridge, "type", "bridge"],
                   ["ip", "link", "del", p.bridge])
        Path(f"/proc/sys/net/ipv4/conf/{p.bridge}/forwarding").write_text("0\n")
        prefix = f"/{p.subnet.prefixlen}"
        _check(["ip", "addr", "add", f"{p.bridge_address}{prefix}", "dev", p.bridge])
        _no_ipv6(["ip"], p.bridge)
        _check(["ip", "link", "set", p.bridge, "up"])
        for host in p.hosts:
            self._make(["ip", "netns", "add", host.namespace],
                       ["ip", "netns", "del", host.namespace])
            # Created with its other end already in the namespace: no half-moved pair.
            self._make(["ip", "link", "add", "name", host.peer, "type", "veth", "peer", "name",
                        host.interface, "netns", host.namespace],
                       ["ip", "link", "del", host.peer])
            _no_ipv6(["ip"], host.peer)
            _check(["ip", "link", "set", host.peer, "master", p.bridge, "up"])
            inside = ["ip", "-n", host.namespace]
            _check([*inside, "link", "set", "lo", "up"])
            _check([*inside, "addr", "add", f"{host.address}{prefix}", "dev", host.interface])
            _no_ipv6(inside, host.interface)
            _check([*inside, "link", "set", host.interface, "up"])
            _check([*inside, "route", "add", "default", "via", str(p.bridge_address)])

    def close(self, quiet: bool = False) -> None:
        """Remove everything this set made, newest first; every removal is tried."""
        if self._undo:
            for host in self.plan.hosts:
                with_pids = self._pids_or_none(host)
                if with_pids:
                    log.warning("processes %s still run in simulated host %s: its namespace "
                                "lives on, without a network, until they end",
                                with_pids, host.name)
        errors = []
        for undo in reversed(self._undo):
            try:
                _check(undo, missing_ok=True)
            except HostsError as err:
                errors.append(str(err))
        self._undo.clear()
        self._shaped.clear()
        _open_tags.discard(self.plan.tag)
        if errors:
            message = (f"simulated hosts {self.plan.tag}: not all removed ({'; '.join(errors)})"
                       "; python -m turnkv_server.launcher.hosts --remove-stale retries")
            if not quiet:
                raise HostsError(message)
            log.error("%s", message)

    def pids(self, name: str) -> list[int]:
        """Processes running inside host `name`."""
        out = _check(["ip", "netns", "pids", self[name].namespace])
        return [int(pid) for pid in out.split()]

    def _pids_or_none(self, host: Host) -> list[int] | None:
        try:
            return self.pids(host.name)
        except HostsError:
            return None  # a namespace never made or already gone

    def shape(self, name: str, rate_mbit: float) -> None:
        """Limit host `name`'s link to `rate_mbit` in each direction (tc tbf on both ends)."""
        host = self[name]
        qdisc = ["qdisc", "replace", "dev"]
        _check(["tc", *qdisc, host.peer, "root", *tbf_args(rate_mbit)])
        _check(["tc", "-n", host.namespace, *qdisc, host.interface, "root",
                *tbf_args(rate_mbit)])
        self._shaped.add(name)

    def unshape(self, name: str) -> None:
        host = self[name]
        if name in self._shaped:
            _check(["tc", "qdisc", "del", "dev", host.peer, "root"], missing_ok=True)
            _check(["tc", "-n", host.namespace, "qdisc", "del", "dev", host.interface, "root"],
                   missing_ok=True)
            self._shaped.discard(name)

    def link_down(self, name: str) -> None:
        """Cut host `name` off, as a pulled cable: its bridge-side end goes down, so the host
        keeps its address and routes and is reachable again after `link_up`."""
        _check(["ip", "link", "set", self[name].peer, "down"])

    def link_up(self, name: str) -> None:
        _check(["ip", "link", "set", self[name].peer, "up"])


def netns_permitted() -> str | None:
    """None if this process may make simulated hosts, else why not."""
    probe = f"{PREFIX}{make_tag(os.getpid(), random.randrange(256))}-probe"
    try:
        _check(["ip", "netns", "add", probe])
    except HostsError as err:
        return str(err)
    try:
        _check(["ip", "netns", "del", probe])
    except HostsError as err:
        return f"could not remove the probe namespace {probe}: {err}"
    return None


def find_runs() -> dict[str, RunObjects]:
    """This project's simulated-host objects on this machine, by run tag."""
    return project_objects(
        _listing(["ip", "-j", "netns", "list"]),
        _listing(["ip", "-j", "link", "show"]),
        # -N: protocols as numbers, even where rt_protos names ours.
        _listing(["ip", "-N", "-j", "-4", "rule", "show"]),
        # Not filtered by `proto`: `ip` then leaves the protocol out, which
        # `project_objects` checks.
        _listing(["ip", "-N", "-j", "-4", "route", "show", "table", "main", "type", "blackhole"]))


def _alive(run: RunObjects) -> bool:
    if run.tag in _open_tags:
        return True
    # This process's own tag, once closed, is a leftover; another live PID may own its run.
    return run.pid != os.getpid() and psutil.pid_exists(run.pid)


def remove_stale(include_live: bool = False) -> list[RunObjects]:
    """Remove the objects of runs whose process is gone (with `include_live`, of every run
    not open in this process too). Only names, rules and routes of this project are listed;
    nothing else is touched. Returns what was removed."""
    removed = []
    for run in find_runs().values():
        if run.tag in _open_tags or (_alive(run) and not include_live):
            continue
        bridge = f"{PREFIX}{run.tag}b"
        for link in run.links:
            _check(["ip", "link", "del", link], missing_ok=True)
        for namespace in run.namespaces:
            _check(["ip", "netns", "del", namespace], missing_ok=True)
        for priority in run.rules:
            _check(["ip", "rule", "del", "priority", str(priority), *bridge_rule(bridge)],
                   missing_ok=True)
        for subnet in run.routes:
            route = blackhole_route(IPv4Network(subnet), int(run.tag, 16))
            _check(["ip", "route", "del", *route], missing_ok=True)
        removed.append(run)
    return removed


def _describe(run: RunObjects) -> str:
    state = "live" if _alive(run) else "stale"
    objects = [*run.namespaces, *run.links, *(f"rule {p}" for p in run.rules),
               *(f"blackhole {r}" for r in run.routes)]
    return f"{run.tag} (pid {run.pid}, {state}): {', '.join(objects)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m turnkv_server.launcher.hosts",
        description="List or remove the simulated hosts' objects (namespaces, links, the "
                    "bridge's rule, blackhole routes) that runs of turnkv left on this machine.")
    parser.add_argument("--remove-stale", action="store_true",
                        help="remove those of runs whose process is gone")
    parser.add_argument("--include-live", action="store_true",
                        help="with --remove-stale: also those of runs still running")
    args = parser.parse_args(argv)
    try:
        if args.remove_stale:
            for run in remove_stale(include_live=args.include_live):
                print(f"removed {_describe(run)}")
        for run in find_runs().values():
            print(_describe(run))
    except HostsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
