"""The integration suite's own summary: each cluster start and the time per stage.

The worker that ran the integration tests holds the figures; under pytest-xdist it hands
them to the controller (`WORKER_OUTPUT`), which prints them, since only the controller's
summary reaches the terminal.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

WORKER_OUTPUT = "integration_summary"


def write(terminalreporter: pytest.TerminalReporter, starts: Iterable[tuple[str, float]],
          stage_seconds: dict[str, float]) -> None:
    starts = list(starts)
    if starts:
        terminalreporter.section("clusters started (tests.support.cluster_pool)")
        for what, seconds in starts:
            terminalreporter.write_line(f"{seconds:6.1f}s  {what}")
        total = sum(seconds for _, seconds in starts)
        terminalreporter.write_line(f"{total:6.1f}s  in all, {len(starts)} starts")
    if stage_seconds:
        terminalreporter.section("time per stage (tests/integration/conftest.py SCHEDULE)")
        for stage, seconds in stage_seconds.items():
            terminalreporter.write_line(f"{seconds:6.1f}s  {stage}")
