"""vLLM's own NIXL connectors, with NIXL's progress thread tuned for CPU hosts (`nixl_poll`).

vLLM imports this module in each of its processes when it is named as
``kv_connector_module_path``; importing it patches NIXL before any agent exists and re-exports
the upstream connector classes unchanged, so vLLM's name-based checks still recognise them.
The upstream modes (`standard`, `bidirectional`, `push`) run through it.
"""

from __future__ import annotations

from turnkv_server.nixl_poll import POLL_DELAY_ENV, apply_poll_delay

apply_poll_delay()

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnector,
    NixlPushConnector,
)

__all__ = ["NixlConnector", "NixlPushConnector", "POLL_DELAY_ENV"]
