"""The session's clusters (the `clusters` fixture): at most one engine set alive, shared by
every test that asks for it, and handed out in a state no earlier test decides.

Starting engines is most of the suite's time, and the test machine has two cores: two
clusters alive at once slow each other to a crawl. The pool keeps one `EngineSet` running
and puts the router a `ClusterSpec` asks for in front of it (`tests.support.clusters`).
`tests/integration/conftest.py` orders the tests so that each engine set comes up once; that
order is for speed only:

- `get(spec)` hands out a set whose engines all answer `/health` (and a router of the spec's
  own that does, and that sees every engine healthy): a set that an earlier test left with an
  engine dead, stopped or failing is started again, and a router that died is replaced. The
  state it returns names each engine's current process (a test may have restarted one).
- `clean(spec)` is `get(spec)` brought to a known state: the spec's router holds no session
  and no engine request, and every engine holds no lease, no block and nothing in its prefix
  cache (vLLM's prefix-cache reset, which the turnkv connector makes release every lease
  first). Tests that count blocks, leases or an engine's own work ask for it instead of
  relying on what the tests before them gave back.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

from tests.support.clusters import ClusterSpec, EngineSet, RouterProcess, RouterView
from turnkv_server import local_http
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import Cluster, ClusterState, ProcessRef
from turnkv_server.launcher.engine import EngineProcess
from turnkv_server.launcher.state import ServerState

# How long an engine may answer slowly (or a router wait for its requests to end) before the
# pool calls it broken and starts its set again.
HEALTH_TIMEOUT_S = 5.0
# Blocks still in use this long after the router went idle (a transfer in flight, blocks
# quarantined after a failed one) are not given back soon: the set is started again instead.
RESET_WAIT_S = 60.0
# The gauges an engine with nothing in it shows (absent: an engine without a connector).
EMPTY = ("leases", "pinned_blocks", "quarantined_blocks", "kv_cache_usage")


@dataclass
class _View:
    spec: ClusterSpec
    launched: Cluster
    state: ClusterState
    router: RouterProcess
    admin_key: str | None
    stack: ExitStack


@dataclass
class _Running:
    engines: EngineSet
    launched: Cluster
    state: ClusterState
    view: _View | None = None


class ClusterPool:
    """At most one engine set alive; `get` and `clean` start what a spec needs, stopping the
    rest."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self._tmp = tmp
        self._running: _Running | None = None
        # What was started, and how long it took: the suite's summary prints it.
        self.starts: list[tuple[str, float]] = []

    def get(self, spec: ClusterSpec) -> tuple[Cluster, ClusterState]:
        """The spec's cluster, every engine and its router healthy: `launched` (the
        launcher's `Cluster`, or for a router of the spec's own, a `Cluster` naming the
        engines it routes to: its `router_command` is that router's) and its state
        (`state.router`: where to send requests)."""
        running = self._running
        if running is not None and (running.engines != spec.engines
                                    or not all(map(_engine_healthy, running.launched.engines))):
            self.release()
            running = None
        if running is None:
            started = time.monotonic()
            config = spec.engines.config(self._tmp.mktemp(spec.engines.name))
            launched = Cluster(config)
            running = _Running(spec.engines, launched, launched.start())
            self._running = running
            self.starts.append((f"engines {spec.engines.name}", time.monotonic() - started))
        _refresh(running.state, running.launched, save=True)
        if spec.router is None:
            self._stop_view(running)
            return running.launched, running.state
        view = running.view
        if view is None or view.spec != spec or not _router_healthy(view):
            view = self._restart_view(spec, spec.router, running)
        _refresh(view.state, view.launched)
        return view.launched, view.state

    def clean(self, spec: ClusterSpec) -> tuple[Cluster, ClusterState]:
        """`get(spec)` with nothing in it from earlier tests: the spec's router (started
        anew if it holds any session) has no engine request in flight, and every engine of
        the set holds no lease and no block, its prefix cache empty."""
        self.get(spec)
        running = self._running
        assert running is not None
        view = running.view
        if view is not None and spec.router is not None and not _router_idle(view):
            self._restart_view(spec, spec.router, running)
        served = running.state.served_model_name
        if not all(_reset(engine) for engine in running.launched.engines):
            self.release()  # blocks held past RESET_WAIT_S: a fresh set holds none
            self.get(spec)
            running = self._running
            assert running is not None
            assert all(_reset(engine) for engine in running.launched.engines), \
                "a freshly started engine set refused vLLM's prefix-cache reset"
        for engine in running.launched.engines:
            _tick(engine, served)
        return self.get(spec)

    def release(self) -> None:
        """Stop whatever runs (tests that start clusters of their own come next)."""
        running, self._running = self._running, None
        if running is not None:
            self._stop_view(running)
            running.launched.stop()

    def _restart_view(self, spec: ClusterSpec, router: RouterView, running: _Running) -> _View:
        self._stop_view(running)
        started = time.monotonic()
        running.view = self._start_view(spec, router, running)
        self.starts.append((f"router {spec.name}", time.monotonic() - started))
        return running.view

    def _start_view(self, spec: ClusterSpec, view: RouterView, running: _Running) -> _View:
        run_dir = self._tmp.mktemp(spec.name)
        (run_dir / "logs").mkdir()
        stack = ExitStack()
        try:
            extra = stack.enter_context(view.service(run_dir)) if view.service else ()
            config = dataclasses.replace(
                running.launched.config, mode=view.mode or running.launched.config.mode,
                run_dir=run_dir, num_prefill=view.prefill,
                num_decode=view.decode, router_args=(*view.args, *extra),
                short_delta_tokens=view.short_delta_tokens, register_as_current=False,
                # The view starts a router only: the engines' tiers are theirs already.
                tier_host_blocks=None, tier_disk_bytes=None)
            launched = Cluster(config)
            engines = running.launched.engines
            prefill = [e for e in engines if e.spec.role == "prefill"][: view.prefill]
            decode = [e for e in engines if e.spec.role == "decode"][: view.decode]
            assert (len(prefill), len(decode)) == (view.prefill, view.decode), spec
            launched.engines = [*prefill, *decode]
            router = RouterProcess(launched, run_dir / "logs" / "router.log")
            stack.callback(router.stop)
            state = ClusterState(
                mode=config.mode, model=running.state.model,
                served_model_name=running.state.served_model_name, run_dir=str(run_dir),
                router=router.url, engines=[e.server_state() for e in launched.engines],
                router_process=ServerState(
                    name="router", role="router", url=router.url, pid=router.process.pid,
                    create_time=ProcessRef.of(router.process.pid).create_time,
                    log=str(router.log)))
        except BaseException:
            stack.close()
            raise
        return _View(spec, launched, state, router, _option(config.router_args, "--admin-key"),
                     stack)

    @staticmethod
    def _stop_view(running: _Running) -> None:
        view, running.view = running.view, None
        if view is not None:
            view.stack.close()


def _refresh(state: ClusterState, launched: Cluster, save: bool = False) -> None:
    """Name each engine's current process in `state` (a test restarted one in place), and in
    the launcher's state file (`turnkv status`, `turnkv down`) if `save`."""
    current = [e.server_state() for e in launched.engines]
    if current != state.engines:
        state.engines = current
        if save:
            state.save()


def _answers(url: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
    try:
        return local_http.get(url, headers=headers, timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError:
        return None


def _engine_healthy(engine: EngineProcess) -> bool:
    """Alive, and its /health says 200 in time (not killed, stopped, or left without its
    engine core)."""
    if engine.ref is None or not engine.ref.is_alive():
        return False
    health = _answers(f"{engine.spec.url}/health")
    return health is not None and health.status_code == 200


def _router_stats(view: _View) -> dict[str, object] | None:
    headers = {"authorization": f"Bearer {view.admin_key}"} if view.admin_key else None
    stats = _answers(f"{view.router.url}/v1/turnkv/stats", headers)
    return stats.json() if stats is not None and stats.status_code == 200 else None


def _router_healthy(view: _View) -> bool:
    """The view's router runs, answers, and sees every engine it routes to as healthy (a
    router that probes rarely would otherwise keep an engine an earlier test restarted out
    of placement)."""
    health = _answers(f"{view.router.url}/health")
    if view.router.process.poll() is not None or health is None or health.status_code != 200:
        return False
    stats = _router_stats(view)
    engines = stats.get("engines") if stats is not None else None
    return isinstance(engines, list) and all(e["healthy"] for e in engines)


def _router_idle(view: _View) -> bool:
    """No session held and, within HEALTH_TIMEOUT_S, no engine request in flight (push
    backs and lease releases run on after their turns)."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        stats = _router_stats(view)
        if stats is None or stats.get("sessions") != 0:
            return False
        engines = stats.get("engines")
        if isinstance(engines, list) and all(e["in_flight"] == 0 for e in engines):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _reset(engine: EngineProcess) -> bool:
    """vLLM's prefix-cache reset on `engine` (the turnkv connector releases every lease
    first), retried while blocks are still in use; False if they stay in use RESET_WAIT_S."""
    deadline = time.monotonic() + RESET_WAIT_S
    while True:
        reply = local_http.post(f"{engine.spec.url}/reset_prefix_cache", timeout=30)
        assert reply.status_code != 404, (
            "the engines serve no /reset_prefix_cache: tests/conftest.py starts them with "
            "VLLM_SERVER_DEV_MODE=1")
        reply.raise_for_status()
        if reply.json().get("success"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _tick(engine: EngineProcess, served_model_name: str) -> None:
    """One token of one request without a session: vLLM publishes its gauges (the cache's
    usage, the connector's leases) after a step, and the reset runs none. Then wait until they
    show the engine empty."""
    reply = local_http.post(f"{engine.spec.url}/v1/completions", timeout=120, json={
        "model": served_model_name, "prompt": [0], "max_tokens": 1, "temperature": 0})
    reply.raise_for_status()
    deadline = time.monotonic() + RESET_WAIT_S
    while True:
        counters = fetch_connector_counters(engine.spec.url)
        held = {name: counters[name] for name in EMPTY if counters.get(name, 0.0) != 0}
        if not held:
            return
        assert time.monotonic() < deadline, f"{engine.spec.name} not empty after a reset: {held}"
        time.sleep(0.2)


def _option(args: tuple[str, ...], name: str) -> str | None:
    """The value after `name` in a command line's arguments."""
    return next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name), None)
