"""Process-group bookkeeping shared by the launcher and `turnkv down`.

Every server the launcher starts leads its own process group (``start_new_session``), so the
engine and the helper processes that vLLM spawns can be found, re-pinned and stopped together,
and nothing else on the machine is ever touched. A recorded start time guards against a PID
that the kernel has handed to an unrelated process since.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

SHARED_MEMORY = Path("/dev/shm")
# The names Python's multiprocessing gives its shared-memory segments and named semaphores,
# which vLLM's engine and worker processes create (its message queues, their locks).
SEMAPHORE_PREFIX = "sem.mp-"
MULTIPROCESSING_NAMES = ("psm_", SEMAPHORE_PREFIX)


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


def shared_memory_of(pgid: int) -> set[str]:
    """The files in /dev/shm that Python's multiprocessing created and the group's processes
    map. A process that exits cleanly unlinks its own; a group killed with SIGKILL (a crash,
    the OOM killer, a test's fault, `stop_group` after its timeout) leaves them there, each as
    big as the queue it held, so whoever stops a group must remove them."""
    found, semaphores = set(), set()
    for proc in group_members(pgid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                if _is_multiprocessing_file(fields[5]):
                    found.add(fields[5])
                elif _is_semaphore_mapping(fields[5]):
                    semaphores.add(int(fields[4]))
    return found | _semaphores_by_inode(semaphores)


def _is_semaphore_mapping(path: str) -> bool:
    # glibc's sem_open creates a named semaphore under a temporary name, maps it, links it to
    # its real name and unlinks the temporary one: a process maps "sem.XXXXXX (deleted)".
    file = Path(path.removesuffix(" (deleted)"))
    return str(file) != path and file.parent == SHARED_MEMORY and file.name.startswith("sem.")


def _semaphores_by_inode(inodes: set[int]) -> set[str]:
    """The multiprocessing semaphores in /dev/shm whose files are these inodes (a semaphore
    still mapped keeps its inode)."""
    found: set[str] = set()
    if not inodes:
        return found
    with contextlib.suppress(OSError), os.scandir(SHARED_MEMORY) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.name.startswith(SEMAPHORE_PREFIX) and entry.inode() in inodes:
                    found.add(entry.path)
    return found


def _remove_shared_memory(paths: Iterable[str]) -> None:
    """Unlink what `shared_memory_of` found, once its processes are gone."""
    for path in paths:
        if _is_multiprocessing_file(path):
            Path(path).unlink(missing_ok=True)


def _is_multiprocessing_file(path: str) -> bool:
    # A mapped file already unlinked reads as "<path> (deleted)": nothing left to remove.
    file = Path(path)
    return (file.parent == SHARED_MEMORY and file.name.startswith(MULTIPROCESSING_NAMES)
            and not path.endswith(" (deleted)"))


def raise_on_sigterm() -> None:
    """Make SIGTERM (a CI runner, `kill`) a `KeyboardInterrupt` in the main thread, so that a
    script's `with Cluster(...)` blocks still stop what they started."""
    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)


def stop_group(ref: ProcessRef, timeout: float = 15.0, shared_memory: Iterable[str] = ()
               ) -> None:
    """SIGTERM the group that ``ref`` leads, then SIGKILL whatever is left after ``timeout``;
    then remove the multiprocessing files in /dev/shm its processes mapped (`shared_memory_of`,
    read now and, as `shared_memory`, earlier: the group may have been killed since)."""
    pgid = ref.pid
    files = set(shared_memory)
    if ref.is_alive() or group_members(pgid):
        files |= shared_memory_of(pgid)
        _terminate(pgid, timeout)
    _remove_shared_memory(files)


def _terminate(pgid: int, timeout: float) -> None:
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
