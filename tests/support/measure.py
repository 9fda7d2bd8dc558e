"""What a cluster holds, read from outside it: each process's memory and each engine's KV blocks.

Shared by the integration tests that bound memory (test_load.py) and by the fuzzer and the
soak (scripts/fuzz_router.py, scripts/soak.py), so that a figure in docs/reliability.md and an
assertion in the suite are measured alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import psutil

from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher.processes import group_members

MIB = 2**20


@dataclass(frozen=True)
class ProcessMemory:
    """One process of a group: its name (vLLM names its engine core `VLLM::EngineCore`), its
    resident memory and the part of it no other process shares (USS), in MiB."""

    pid: int
    name: str
    rss_mib: float
    uss_mib: float


def group_memory(pgid: int) -> list[ProcessMemory]:
    """Every live process of a process group (an engine's API server, engine core and
    helpers; a router), by PID."""
    members = []
    for process in group_members(pgid):
        try:
            with process.oneshot():
                info = process.memory_full_info()
                name = process.name()
        except psutil.Error:
            continue
        members.append(ProcessMemory(process.pid, name, info.rss / MIB, info.uss / MIB))
    return sorted(members, key=lambda m: m.pid)


def group_rss_mib(pgid: int) -> float | None:
    """Resident memory of a process group in MiB; None if nothing of it is alive. (RSS counts
    pages shared between the group's processes once per process: an upper bound, but a leak
    shows all the same.)"""
    total, alive = 0, False
    for process in group_members(pgid):
        try:
            total += process.memory_info().rss
            alive = True
        except psutil.Error:
            continue
    return total / MIB if alive else None


def process_rss_mib(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).memory_info().rss) / MIB
    except psutil.Error:
        return None


# -- KV blocks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvState:
    """An engine's blocks pinned under leases, its live leases, and the share of its KV cache
    in use (vLLM's `kv_cache_usage_perc`, 0 to 1) with the blocks that share stands for; all
    None while the engine does not answer."""

    pinned_blocks: float | None = None
    leases: float | None = None
    kv_cache_usage: float | None = None
    blocks_in_use: int | None = None

    @property
    def clear(self) -> bool:
        return self.pinned_blocks == 0 and self.kv_cache_usage == 0


def kv_state(url: str) -> KvState:
    try:
        values = fetch_connector_counters(url, timeout=5.0)
    except (httpx.HTTPError, ValueError):
        return KvState()
    usable = values.get("num_gpu_blocks", 1.0) - 1  # vLLM keeps its null block back
    usage = values.get("kv_cache_usage", 0.0)
    return KvState(values.get("pinned_blocks", 0.0), values.get("leases", 0.0), usage,
                   round(usage * usable))


@dataclass
class Clearing:
    """How the engines' pinned and used blocks went down while nothing was sent."""

    seconds: float | None  # until every engine had none; None: not within the timeout
    last: dict[str, KvState]
    # (seconds, engine -> (pinned, in use)) at each change
    steps: list[tuple[float, dict[str, tuple[float | None, int | None]]]]


def wait_until_clear(urls: dict[str, str], timeout: float, poll: float = 1.0) -> Clearing:
    """Poll the engines (name -> URL), sending nothing, until no block is pinned or in use."""
    start = time.monotonic()
    steps: list[tuple[float, dict[str, tuple[float | None, int | None]]]] = []
    while True:
        state = {name: kv_state(url) for name, url in urls.items()}
        now = round(time.monotonic() - start, 1)
        reading = {n: (v.pinned_blocks, v.blocks_in_use) for n, v in state.items()}
        if not steps or steps[-1][1] != reading:
            steps.append((now, reading))
        if all(v.clear for v in state.values()):
            return Clearing(now, state, steps)
        if now > timeout:
            return Clearing(None, state, steps)
        time.sleep(poll)
