"""A test that cannot run on this machine (no root for simulated hosts, no kubectl) is
skipped with the reason, except under CI: with the `CI` environment variable set (`.ci/run`
sets it, as CI services do), it fails with that reason instead, so that a green CI run is one
in which every such test ran."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

# What a `CI` variable set to say "no" holds.
NOT_CI = ("", "0", "false", "no")


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in NOT_CI


def cannot_run(reason: str) -> NoReturn:
    """Skip the test for `reason`; under CI, fail it for that reason."""
    if under_ci():
        pytest.fail(f"cannot run, and CI is set: {reason}", pytrace=False)
    pytest.skip(reason)
