"""Polling for what real engines do in their own time (a push back landing, a lease ending):
a deadline that fails with what was awaited, never a timing assertion."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0,
             interval: float = 0.2) -> None:
    """Return once `condition()` holds; fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)
