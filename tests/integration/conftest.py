from __future__ import annotations

from pathlib import Path

import pytest

from turnkv_server.models import build_tiny


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny()
