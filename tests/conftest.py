from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import fuzz_seed, suite_summary
from turnkv_server.launcher.cluster import VLLM_CACHE_ENV

# Engines started by tests stay on loopback and never reach for a model hub.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_NO_USAGE_STATS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One fuzz seed for the run: pytest-xdist's workers inherit it from the process that starts them.
os.environ[fuzz_seed.ENV] = str(fuzz_seed.SEED)
# vLLM's development routes, `/reset_prefix_cache` among them: the integration tests' pool
# empties a shared engine set with it before a test that needs nothing left in it
# (tests.support.cluster_pool).
os.environ["VLLM_SERVER_DEV_MODE"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    # Here, not in tests/integration: a unit test may import an integration module.
    config.addinivalue_line(
        "markers", "cluster(spec): the test runs on the pool's cluster `spec` "
                   "(tests.support.clusters.ClusterSpec); the suite orders tests by it")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse-schedule", action="store_true",
        help="run the integration tests' stages, and the tests within each, in reverse order "
             "(tests/integration/conftest.py): a check that no test relies on an earlier one")


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One vLLM cache folder for every engine the session starts (`VLLM_CACHE_ENV`): only the
    first start inspects each model class, which saves about 10 s of a core per start."""
    folder = tmp_path_factory.mktemp("vllm-cache")
    previous = os.environ.get(VLLM_CACHE_ENV)
    os.environ[VLLM_CACHE_ENV] = str(folder)
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop(VLLM_CACHE_ENV, None)
        else:
            os.environ[VLLM_CACHE_ENV] = previous


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs two workers (`-n 2`): one runs every integration test, in the order
    tests/integration/conftest.py gives them (one cluster at a time, as without xdist); the
    other runs the unit tests meanwhile, on the cores the engines leave idle."""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "integration" if nodeid.startswith("tests/integration/") else nodeid

    return IntegrationApart(config, log)


_worker_summaries: list[dict[str, Any]] = []


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, in the controller
def pytest_testnodedown(node: Any, error: Any) -> None:
    summary = getattr(node, "workeroutput", {}).get(suite_summary.WORKER_OUTPUT)
    if summary:
        _worker_summaries.append(summary)


def pytest_report_header() -> str:
    return f"fuzz seed: {fuzz_seed.SEED} ({fuzz_seed.ENV}={fuzz_seed.SEED} replays the fuzz cases)"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The integration worker's summary (under pytest-xdist); the run's fuzz seed again
    after a failure (the header is not shown under -q): it replays the run's fuzz cases even
    when a fuzz test died without its own message (a timeout, a crash)."""
    for summary in _worker_summaries:
        stages: dict[str, float] = summary["stage_seconds"]
        suite_summary.write(terminalreporter, (tuple(s) for s in summary["starts"]), stages)
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(
            f"fuzz seed of this run: {fuzz_seed.SEED} ({fuzz_seed.ENV}={fuzz_seed.SEED} "
            "replays the fuzz cases)")
