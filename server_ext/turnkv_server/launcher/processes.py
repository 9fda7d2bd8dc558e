"""Process-group bookkeeping shared by the launcher and `turnkv down`.

Every server the launcher starts leads its own process group (``start_new_session``), so the
engine and the helper processes that vLLM spawns can be found, re-pinned and stopped together,
and nothing else on the machine is ever touched. A recorded start time guards against a PID
that the kernel has handed to an unrelated process since.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessRef:
    """A process group leader as recorded in a cluster's state file."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid=pid, create_time=psutil.Process(pid).create_time())

    def is_alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return (
                abs(proc.create_time() - self.create_time) < 0.01
                and proc.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of one process group (zombies excluded)."""
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def stop_group(ref: ProcessRef, timeout: float = 15.0) -> None:
    """SIGTERM the group that ``ref`` leads, then SIGKILL whatever is left after ``timeout``."""
    pgid = ref.pid
    if not ref.is_alive() and not group_members(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def pin_group(pgid: int, cores: Iterable[int]) -> None:
    """Pin every thread of every process in the group to ``cores``.

    Thread-level, not process-level: NIXL and OpenMP set per-thread affinities after start,
    and a process-wide ``taskset -p`` would miss threads that already moved.
    """
    mask = set(cores)
    for proc in group_members(pgid):
        for tid in _thread_ids(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.sched_setaffinity(tid, mask)


def unpinned_threads(pgid: int, cores: Iterable[int]) -> list[tuple[int, int, set[int]]]:
    """(pid, tid, affinity) of each thread in the group not confined to ``cores``."""
    allowed = set(cores)
    strays = []
    for proc in group_members(pgid):
        for tid in _thread_ids(proc.pid):
            try:
                affinity = os.sched_getaffinity(tid)
            except OSError:
                continue
            if not affinity <= allowed:
                strays.append((proc.pid, tid, affinity))
    return strays


def _thread_ids(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


# The launcher chooses no ports: its servers bind port 0 and report theirs
# (`turnkv_server.ports`). `free_ports` remains for tests that need a port number before the
# process that binds it exists (a peer that is meant to be dead, say), where a port taken in
# between makes a test fail, not a cluster. They are picked below the kernel's ephemeral range,
# where outgoing connections (the engines open many) would take them at random.
PORT_FLOOR = 20_000


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free right now (held open together while picking),
    outside the ephemeral range where it leaves room; else any free ones.

    Free now, not when the caller binds them: anything on the machine can take one between.
    A server should bind port 0 itself (`turnkv_server.ports`).
    """
    low, _ = ephemeral_range()
    candidates = list(range(PORT_FLOOR, low)) if low - PORT_FLOOR >= 1000 else []
    random.shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            if len(sockets) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
