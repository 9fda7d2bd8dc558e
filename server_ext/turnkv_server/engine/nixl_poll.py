"""NIXL's progress thread, tuned for CPU hosts: a poll delay instead of a busy loop.

NIXL's Python API creates every agent with a progress-thread poll delay of 0 us: the thread
busy-polls, and each idle engine burns most of a core. On a host where every engine owns one
core that ruins both the engine and its neighbour. Disabling the thread deadlocks vLLM's
connectors; a poll delay keeps transfers working. The delay is not how fast NIXL reacts: the
thread sleeps in `poll()` on the UCX workers' event descriptors and wakes on their events; it
is the longest it sleeps without one (UCX transports that miss an event in corner cases are
progressed then), and so, on an idle engine, how often it wakes for nothing (see
docs/install.md). `apply_poll_delay` must run before any agent exists; `poll_delay` sets
another delay for the agents created inside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

POLL_DELAY_ENV = "TURNKV_NIXL_POLL_DELAY_US"
DEFAULT_POLL_DELAY_US = 1000

_delay_us: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "turnkv_nixl_poll_delay_us", default=None)


def apply_poll_delay(delay_us: int | None = None) -> None:
    """Make every NIXL agent created from now on poll every `delay_us` microseconds (or for
    those created inside `poll_delay`, every its delay)."""
    if delay_us is None:
        delay_us = int(os.environ.get(POLL_DELAY_ENV, DEFAULT_POLL_DELAY_US))
    from nixl import _api

    bindings = _api.nixlBind
    create_agent = bindings.nixlAgent
    if getattr(create_agent, "_turnkv_patched", False):
        return

    def create_agent_with_delay(name: str, config: Any) -> Any:
        chosen = _delay_us.get()
        config.pthrDelay = delay_us if chosen is None else chosen
        return create_agent(name, config)

    create_agent_with_delay._turnkv_patched = True  # type: ignore[attr-defined]
    bindings.nixlAgent = create_agent_with_delay


@contextlib.contextmanager
def poll_delay(delay_us: int) -> Iterator[None]:
    """The NIXL agents created inside poll every `delay_us` microseconds."""
    apply_poll_delay()
    token = _delay_us.set(delay_us)
    try:
        yield
    finally:
        _delay_us.reset(token)
