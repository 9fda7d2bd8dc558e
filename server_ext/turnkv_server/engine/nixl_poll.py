"""NIXL's progress thread, tuned for CPU hosts: a poll delay instead of a busy loop.

NIXL's Python API creates every agent with a progress-thread poll delay of 0 us: the thread
busy-polls, and each idle engine burns most of a core. On a host where every engine owns one
core that ruins both the engine and its neighbour. Disabling the thread deadlocks vLLM's
connectors, but a poll delay of about a millisecond keeps transfers working at a small idle
cost (docs/install.md). `apply_poll_delay` must run before any agent exists.
"""

from __future__ import annotations

import os
from typing import Any

POLL_DELAY_ENV = "TURNKV_NIXL_POLL_DELAY_US"
DEFAULT_POLL_DELAY_US = 1000


def apply_poll_delay(delay_us: int | None = None) -> None:
    """Make every NIXL agent created from now on poll every `delay_us` microseconds."""
    if delay_us is None:
        delay_us = int(os.environ.get(POLL_DELAY_ENV, DEFAULT_POLL_DELAY_US))
    from nixl import _api

    bindings = _api.nixlBind
    create_agent = bindings.nixlAgent
    if getattr(create_agent, "_turnkv_patched", False):
        return

    def create_agent_with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return create_agent(name, config)

    create_agent_with_delay._turnkv_patched = True  # type: ignore[attr-defined]
    bindings.nixlAgent = create_agent_with_delay
