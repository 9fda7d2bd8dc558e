"""The cluster under soak (scripts/soak.py): its engines, routers and Redis; what each holds
over time (memory of every process, each engine's KV blocks); its faults (a process killed
with SIGKILL and started again on the same ports); and what is left once the clients end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

from tests.support.clusters import RouterProcess
from tests.support.measure import (
    Clearing,
    group_memory,
    kv_state,
    process_rss_mib,
    wait_until_clear,
)
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterState
from turnkv_server.launcher.engine import EngineProcess
from turnkv_server.launcher.processes import group_members
from turnkv_server.ports import PortHold

# How long a restarted engine may take to answer its health check again.
ENGINE_START_S = 300.0


@dataclass
class Router:
    """A router the clients talk to: the launcher's (`process` None: the launcher stops it)
    or one started here."""

    name: str
    url: str
    pid: int
    process: RouterProcess | None = None

    @classmethod
    def start(cls, name: str, launched: Cluster, port: int = 0) -> Router:
        process = RouterProcess(launched, launched.run_dir / "logs" / f"{name}.log", port)
        return cls(name, process.url, process.process.pid, process)

    def kill_9(self) -> None:
        """SIGKILL the router's process group, as a crash or the OOM killer would, and wait
        until it is gone (its port is then free for the restart)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class Fault:
    what: str  # "decode engine", "prefill engine" or a router's name
    planned_at_s: float
    killed_at_s: float | None = None
    back_at_s: float | None = None
    error: str | None = None


class Soak:
    """The cluster under soak and the samples taken of it. `routers` is the live list the
    clients read: a restarted router replaces its entry."""

    def __init__(self, launched: Cluster, state: ClusterState, routers: list[Router]) -> None:
        self.launched, self.state, self.routers = launched, state, routers
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.lock = threading.Lock()  # the routers list, swapped by a restart
        self.redis_pid = next((p.pid for p in psutil.Process().children()
                               if p.name() == "redis-server"), None)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def engine_urls(self) -> dict[str, str]:
        return {e.spec.name: e.spec.url for e in self.launched.engines}

    def sample(self, counts: dict[str, int]) -> dict[str, Any]:
        """Memory of every process (an engine's or router's whole process group, and each of
        its processes), each engine's KV blocks, and `counts` (turns so far)."""
        groups: dict[str, int | None] = {
            e.spec.name: e.ref.pid if e.ref is not None else None for e in self.launched.engines}
        with self.lock:
            groups |= {r.name: r.pid for r in self.routers}
        rss: dict[str, float | None] = {}
        processes: dict[str, dict[str, dict[str, float]]] = {}
        for name, pid in groups.items():
            members = group_memory(pid) if pid is not None else []
            rss[name] = round(sum(m.rss_mib for m in members), 1) if members else None
            labels = Counter(m.name for m in members)
            processes[name] = {(m.name if labels[m.name] == 1 else f"{m.name} {m.pid}"):
                               {"rss_mib": round(m.rss_mib, 1), "uss_mib": round(m.uss_mib, 1)}
                               for m in members}
        for name, pid in (("redis", self.redis_pid), ("soak client", os.getpid())):
            value = process_rss_mib(pid) if pid is not None else None
            rss[name] = None if value is None else round(value, 1)
        point = {"t_s": self.now(), "rss_mib": rss, "pids": groups, "processes": processes,
                 "kv": {name: kv_state(url) for name, url in self.engine_urls().items()},
                 **counts}
        self.samples.append(point)
        return point

    # -- faults ------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        """Kill what `fault` names and start it again; an error is recorded, not raised: the
        soak goes on."""
        try:
            if fault.what.endswith(" engine"):
                self._restart_engine(fault, fault.what.removesuffix(" engine"))
            else:
                self._restart_router(fault)
        except Exception as exc:
            fault.error = f"{type(exc).__name__}: {exc}"

    def _restart_engine(self, fault: Fault, role: str) -> None:
        engine: EngineProcess = next(e for e in self.launched.engines if e.spec.role == role)
        assert engine.ref is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.ref.pid, signal.SIGKILL)
        fault.killed_at_s = self.now()
        engine.stop()  # reaps what is left, and holds its ports for the restart
        engine.start()
        deadline = time.monotonic() + ENGINE_START_S
        while not engine.is_healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine.spec.name} not healthy {ENGINE_START_S:.0f} s "
                                   "after its restart")
            time.sleep(0.5)
        engine.pin()
        self._wait_routers_see_healthy()
        fault.back_at_s = self.now()

    def _restart_router(self, fault: Fault) -> None:
        with self.lock:
            index = next(i for i, r in enumerate(self.routers) if r.name == fault.what)
            victim = self.routers[index]
        port = int(victim.url.rsplit(":", 1)[1])
        victim.kill_9()
        fault.killed_at_s = self.now()
        # Hold the port until the new process binds it: the clients know this address.
        with PortHold("127.0.0.1", [port]):
            heir = Router.start(fault.what, self.launched, port)
        with self.lock:
            self.routers[index] = heir
        fault.back_at_s = self.now()

    def _wait_routers_see_healthy(self) -> None:
        """Until every router's health probe has seen every engine healthy."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.lock:
                routers = list(self.routers)
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if all(all(e["healthy"] for e in httpx.get(
                        f"{r.url}/v1/turnkv/stats", timeout=5).json()["engines"])
                        for r in routers):
                    return
            time.sleep(0.5)

    # -- the end -----------------------------------------------------------------------------

    def aftermath(self, open_sessions: set[str], wait_s: float) -> dict[str, Any]:
        """Release the sessions whose `final` turn did not end them, wait until no engine
        request is in flight, then wait up to `wait_s` (the leases' TTL and some) without
        sending anything until no block is pinned or in use, and read every engine's
        counters."""
        router = self.routers[-1].url
        released: dict[str, int] = {}
        in_flight: dict[str, dict[str, int]] = {}
        with httpx.Client(timeout=30) as client:
            for session in sorted(open_sessions):
                with contextlib.suppress(httpx.HTTPError):
                    released[session] = client.delete(
                        f"{router}/v1/turnkv/sessions/{session}").status_code
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                in_flight = {}
                for r in self.routers:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        in_flight[r.name] = {e["name"]: e["in_flight"] for e in client.get(
                            f"{r.url}/v1/turnkv/stats").json()["engines"]}
                if all(not any(v.values()) for v in in_flight.values()):
                    break
                time.sleep(0.5)
            idle = wait_until_clear(self.engine_urls(), timeout=wait_s)
            ticked: Clearing | None = None
            if idle.seconds is None:
                # One request makes a lazy expiry run: tells a leak from a late expiry.
                with contextlib.suppress(httpx.HTTPError):
                    client.post(f"{router}/v1/chat/completions", json={
                        "model": self.state.served_model_name, "max_tokens": 1,
                        "messages": [{"role": "user", "content": "tick"}]})
                ticked = wait_until_clear(self.engine_urls(), timeout=30)
        return {"sessions_released_at_end": len(released),
                "release_statuses": dict(Counter(released.values())),
                "in_flight": in_flight,
                "clear_idle": idle.seconds is not None, "clear_idle_after_s": idle.seconds,
                "kv_idle": idle.last, "kv_idle_steps": idle.steps,
                "clear_after_a_request": None if ticked is None else ticked.seconds is not None,
                "kv_after_a_request": None if ticked is None else ticked.last,
                "engine_counters": {name: counters(url)
                                    for name, url in self.engine_urls().items()}}


def counters(url: str) -> dict[str, float] | None:
    """An engine's turnkv counters and KV usage; None while it does not answer."""
    try:
        return fetch_connector_counters(url, timeout=5.0)
    except (httpx.HTTPError, ValueError):
        return None
