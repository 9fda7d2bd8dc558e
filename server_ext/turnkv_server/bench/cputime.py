"""CPU seconds spent by each of a cluster's process groups while a benchmark mode ran.

An engine is a process group (the API server plus the engine core and workers vLLM spawns),
so its CPU time is the sum over the group's members. Snapshots key each process by (pid, start
time), so a process that started during the run counts from 0 and a recycled pid never
subtracts an unrelated process's time.
"""

from __future__ import annotations

from collections.abc import Mapping

import psutil

from turnkv_server.launcher.processes import group_members

# (pid, create_time) -> user + system CPU seconds of that process.
CpuSnapshot = dict[tuple[int, float], float]


def snapshot_group(pgid: int) -> CpuSnapshot:
    """CPU seconds of every live process in group `pgid`, now."""
    snap: CpuSnapshot = {}
    for proc in group_members(pgid):
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                snap[(proc.pid, proc.create_time())] = times.user + times.system
        except psutil.Error:
            continue
    return snap


def cpu_delta(before: Mapping[tuple[int, float], float],
              after: Mapping[tuple[int, float], float]) -> float:
    """CPU seconds spent between two snapshots by the processes alive at the second one.

    A process that exited in between is lost with its time (psutil cannot read a dead
    process); the engines' processes live as long as the engine, so this only drops helpers.
    """
    return sum(cpu - before.get(key, 0.0) for key, cpu in after.items())


def snapshot_groups(groups: Mapping[str, int]) -> dict[str, CpuSnapshot]:
    """A snapshot per named group: {"router": pgid, "prefill-0": pgid, ...}."""
    return {name: snapshot_group(pgid) for name, pgid in groups.items()}


def group_deltas(before: Mapping[str, CpuSnapshot],
                 after: Mapping[str, CpuSnapshot]) -> dict[str, float]:
    """CPU seconds per named group between two `snapshot_groups` results."""
    return {name: round(cpu_delta(before.get(name, {}), snap), 3)
            for name, snap in after.items()}
