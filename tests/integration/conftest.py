from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState
from turnkv_server.models import build_tiny

ROUTER_CLUSTER = "router_cluster"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    # The session-scoped router cluster lives until the end of the run: run its users last,
    # so that it never shares the 2-core machine with another module's cluster.
    users = [i for i in items if ROUTER_CLUSTER in getattr(i, "fixturenames", ())]
    if users:
        others = [i for i in items if ROUTER_CLUSTER not in getattr(i, "fixturenames", ())]
        items[:] = others + users


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny()


@pytest.fixture(scope="session")
def router_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ClusterState]:
    """One prefill and one decode engine (tiny model, float32) behind the router in
    `bidirectional` mode, where a session's turns reuse its KV: shared by the SDK and the
    adapter tests. `state.router` is the router's URL; clients use `state.router + "/v1"`."""
    # Read back however few tokens are missing, so that reuse shows from turn 2 even with
    # the short prompts tests use.
    config = ClusterConfig(mode="bidirectional", model=str(tiny_model), dtype="float32",
                           run_dir=tmp_path_factory.mktemp("router-cluster"),
                           kv_recompute_threshold=0)
    with Cluster(config) as state:
        yield state
