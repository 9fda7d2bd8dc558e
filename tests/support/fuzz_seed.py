"""A fuzz in the suite draws new cases on every run, and a failure says how to draw them again.

Every hypothesis test decorated with `fuzz(...)` draws its cases from one seed per run of the
suite: `TURNKV_FUZZ_SEED` if set, else a fresh random one. When such a test fails, its error
ends with the line that replays it (the same seed draws the same cases: no example database is
read or written, so nothing but the seed decides them):

    TURNKV_FUZZ_SEED=1234567 pytest 'tests/...::test_name'

The cases that once found a fault stay beside the fuzz as the test's `@example`s, run on every
run whatever the seed.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import seed, settings

ENV = "TURNKV_FUZZ_SEED"

F = TypeVar("F", bound=Callable[..., Any])


def run_seed(environ: dict[str, str] | None = None) -> int:
    """The seed of this run: `TURNKV_FUZZ_SEED`, else a fresh one."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if value:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{ENV} must be an integer, not {value!r}") from None
    return random.SystemRandom().randrange(2**32)


SEED = run_seed()


def replay_line(test: Callable[..., Any], fuzz_seed: int) -> str:
    """How to replay `test`'s cases: pytest names the test it runs (parameters included) in
    PYTEST_CURRENT_TEST; else the test function's own."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    where = current or f"{test.__module__.replace('.', '/')}.py::{test.__name__}"
    return f"replay this fuzz's cases: {ENV}={fuzz_seed} pytest '{where}'"


def fuzz(max_examples: int, **more: Any) -> Callable[[F], F]:
    """Decorates a `@given` test: `max_examples` cases drawn from this run's seed (`SEED`, read
    when the test runs), no deadline, no example database; `more`: other hypothesis
    settings. A failure names the seed and how to replay it."""

    def decorate(test: F) -> F:
        configured = settings(max_examples=max_examples, deadline=None, database=None,
                              derandomize=False, **more)(test)

        @functools.wraps(configured)
        def replayable(*args: Any, **kwargs: Any) -> Any:
            chosen = SEED
            seed(chosen)(configured)
            try:
                return configured(*args, **kwargs)
            except (Exception, pytest.fail.Exception) as error:
                error.add_note(replay_line(test, chosen))
                raise

        return replayable  # type: ignore[return-value]

    return decorate
