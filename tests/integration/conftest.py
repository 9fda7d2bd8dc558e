from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import suite_summary
from tests.support.api_conversations import API_CONVERSATIONS
from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import ROUTER_CLUSTER, SINGLE_SMOLLM2, SINGLE_TINY, ClusterSpec
from tests.support.reference import SMOLLM2_SCRIPTS, TINY_SCRIPTS, References
from tests.support.stock_conversations import STOCK_CONVERSATIONS
from turnkv_server.launcher import ClusterState
from turnkv_server.models import build_tiny

# The order in which the pool's clusters come up (`tests.support.cluster_pool`): each engine
# set once, its users one after the other. The order is for speed only: every test gets its
# cluster healthy from the pool, and a test that needs nothing left in it by others asks for
# it clean (`ClusterPool.clean`), so that any test passes alone and in any order
# (`--reverse-schedule` runs the stages, and the tests within each, backwards). What keeps
# engine starts to one per set:
# - the single tiny engine first: it plays every tiny reference (`tiny_references`), and the
#   lease-eviction test sizes a prompt on it before the tier pair starts;
# - the tiny turnkv pair with 32-block caches and tiers: `lease-eviction`, `tier`, then other
#   routers in front of it (`tier-affinity`, `tier-pool`, `tier-admission`);
# - the tiny turnkv pair with 128-block caches, 3 s leases and a shared file tier: `security`,
#   `load`, then the planner's moves over the shared tier;
# - tiny turnkv engines: the shared-session routers, `cached_tokens`, the stock clients, the
#   Responses and Messages APIs (a turnkv router, then an affinity one), the faults, the
#   planner's pinned placements (test_planner_placements.py), then test_router.py, whose last
#   test leaves a decode engine dead;
# - tiny standard engines: an affinity router in front of the two decode engines, the APIs
#   through a standard router, then test_router.py (a dead decode engine again);
# - tiny bidirectional engines: the SDK, adapter and example tests (`router_cluster`), the
#   APIs, then test_router.py;
# - tiny push engines: the APIs, then test_router.py;
# - SmolLM2 turnkv engines (after the single SmolLM2 engine played its references): the demo
#   agent's test and test_turnkv_connector.py's turns, then its tests of the launcher, the last
#   of which stops the cluster through `turnkv down`.
SCHEDULE = ("single-tiny", "lease-eviction", "tier", "tier-affinity", "tier-pool", "tier-planner",
            "tier-admission", "security",
            "load", "planner-shared-tier", "shared-sessions",
            "usage-turnkv", "stock-clients", "api-routes", "api-routes-affinity", "faults",
            "planner-whole-split-move-copy-move-split", "planner-whole-split-whole",
            "planner-whole-split-split", "planner-whole-split-move",
            "planner-whole-split-move-copy", "planner-home-down",
            "router-turnkv", "router-affinity", "api-routes-standard", "router-standard",
            "router-cluster", "api-routes-bidirectional", "router-bidirectional",
            "api-routes-push", "router-push", "connector", "connector-launcher")
# Clusters that tests reach through a fixture of this file rather than a `cluster` mark.
FIXTURE_CLUSTERS = {"router_cluster": ROUTER_CLUSTER, "plain_engine": SINGLE_TINY}


def cluster_of(item: pytest.Item) -> ClusterSpec | None:
    mark = item.get_closest_marker("cluster")
    if mark is not None:
        spec = mark.args[0]
        assert isinstance(spec, ClusterSpec), mark
        return spec
    for fixture, spec in FIXTURE_CLUSTERS.items():
        if fixture in getattr(item, "fixturenames", ()):
            return spec
    return None


def is_integration(item: pytest.Item) -> bool:
    return "/integration/" in str(item.fspath)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_integration(item):
            item.add_marker(pytest.mark.integration)

    # Tests that start clusters of their own (or none) first, while the pool holds none; then
    # the pool's users, cluster by cluster. (The sort is stable: each group keeps its order.)
    def rank(item: pytest.Item) -> tuple[int, int, str]:
        spec = cluster_of(item)
        if spec is None:
            return (0, 0, "")
        known = spec.name in SCHEDULE
        return (1, SCHEDULE.index(spec.name) if known else len(SCHEDULE), spec.name)

    items.sort(key=rank)
    if config.getoption("--reverse-schedule"):
        items.reverse()
    for item in items:
        if is_integration(item):
            spec = cluster_of(item)
            _stage_of[item.nodeid] = spec.name if spec else "(clusters of their own, or none)"


# Each test's stage (its cluster's name), and the seconds each stage's tests took, setup and
# teardown included (where the pool starts clusters): the suite's summary prints them.
_stage_of: dict[str, str] = {}
_stage_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    stage = _stage_of.get(report.nodeid)
    if stage is not None:
        _stage_seconds[stage] = _stage_seconds.get(stage, 0.0) + report.duration


_pools: list[ClusterPool] = []


@pytest.fixture(scope="session")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterPool]:
    """At most one cluster alive at a time: the 2-core machine thrashes with two. `get` hands
    out a healthy one, `clean` one with nothing left in it by earlier tests."""
    pool = ClusterPool(tmp_path_factory)
    _pools.append(pool)
    try:
        yield pool
    finally:
        pool.release()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that starts a cluster of its own finds none of the pool's running (this runs
    before any fixture of the test, module-scoped ones included)."""
    if is_integration(item) and cluster_of(item) is None:
        for pool in _pools:
            pool.release()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand the summary's figures to the controller
    (tests/conftest.py prints them)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[suite_summary.WORKER_OUTPUT] = {
            "starts": [start for pool in _pools for start in pool.starts],
            "stage_seconds": dict(_stage_seconds)}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    suite_summary.write(terminalreporter, (start for pool in _pools for start in pool.starts),
                        _stage_seconds)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny()


@pytest.fixture(scope="session")
def tiny_references(clusters: ClusterPool) -> References:
    """The single tiny engine's answers to the suite's conversations (the stock clients' and
    the API clients' too), all played on the first request, before the first cluster that
    needs them starts."""
    references = References(clusters, SINGLE_TINY)
    references.prefetch((*TINY_SCRIPTS, *STOCK_CONVERSATIONS, *API_CONVERSATIONS))
    return references


@pytest.fixture(scope="session")
def smollm2_references(clusters: ClusterPool) -> References:
    """The single SmolLM2 engine's answers to test_turnkv_connector.py's conversation, played
    before the SmolLM2 pair (`SMOLLM2_TURNKV`) first starts: every user of the pair asks for
    them first, so the reference engine comes and goes once, whichever test starts the pair."""
    references = References(clusters, SINGLE_SMOLLM2)
    references.prefetch(SMOLLM2_SCRIPTS)
    return references


@pytest.fixture
def router_cluster(clusters: ClusterPool) -> ClusterState:
    """One prefill and one decode engine (tiny model, float32) behind the router in
    `bidirectional` mode, where a session's turns reuse its KV: shared by the SDK, adapter and
    example tests. `state.router` is the router's URL; clients use `state.router + "/v1"`."""
    return clusters.get(ROUTER_CLUSTER)[1]


@pytest.fixture
def plain_engine(clusters: ClusterPool) -> ClusterState:
    """One tiny engine, plain vLLM (`state.router` is the engine itself): the reference
    engine."""
    return clusters.get(SINGLE_TINY)[1]
