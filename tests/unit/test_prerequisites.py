"""A test that cannot run here is skipped with its reason, and under CI fails with it."""

from __future__ import annotations

import pytest

from tests.support.prerequisites import cannot_run


@pytest.mark.parametrize("value", [None, "", "0", "false", "No"])
def test_outside_ci_a_test_that_cannot_run_is_skipped_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match="^kubectl is not installed$"):
        cannot_run("kubectl is not installed")


@pytest.mark.parametrize("value", ["1", "true", "yes", "gitlab"])
def test_under_ci_it_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="kubectl is not installed$"):
        cannot_run("kubectl is not installed")
