"""vLLM's own NIXL connectors, with NIXL's progress thread tuned for CPU hosts.

NIXL's Python API creates every agent with a progress-thread poll delay of 0 us: the thread
busy-polls, and each idle engine burns most of a core. On a host where every engine owns one
core that ruins both the engine and its neighbour. Disabling the thread deadlocks the stock
connector, but a poll delay of about a millisecond keeps transfers working at 2-3% idle CPU
(see docs/install.md).

vLLM imports this module in each of its processes when it is named as
``kv_connector_module_path``; importing it patches NIXL before any agent exists and re-exports
the upstream connector classes unchanged, so vLLM's name-based checks still recognise them.
"""

from __future__ import annotations

import os
from typing import Any

POLL_DELAY_ENV = "TURNKV_NIXL_POLL_DELAY_US"
DEFAULT_POLL_DELAY_US = 1000


def _patch_nixl_poll_delay(delay_us: int) -> None:
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


_patch_nixl_poll_delay(int(os.environ.get(POLL_DELAY_ENV, DEFAULT_POLL_DELAY_US)))

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnector,
    NixlPushConnector,
)

__all__ = ["NixlConnector", "NixlPushConnector", "POLL_DELAY_ENV"]
