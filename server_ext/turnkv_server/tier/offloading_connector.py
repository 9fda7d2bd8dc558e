"""vLLM's `OffloadingConnector`, fenced against KV that another connector writes.

vLLM's offloading scheduler (upstream `kv_connector/v1/offloading/scheduler.py`) lets a store
job finish after the step that created it, and before an engine block that a pending store
reads is used for other tokens it makes the worker finish that store (`jobs_to_flush`, waited
on in the worker's `handle_preemptions` before the forward pass). It learns which blocks are
reused from the blocks of the requests the step schedules, and from the requests it loads
itself (`update_state_after_alloc` with external tokens). Under `MultiConnector` beside the
turnkv connector that misses one writer: a request whose prompt the peer pushes (turnkv's
asynchronous receive) gets its blocks in one step, waits unscheduled while NIXL writes into
them, and is scheduled only once its KV has landed. The offloading connector is told of those
blocks (`MultiConnector.update_state_after_alloc` passes every child the request's blocks, with
no external tokens but to the chosen one), and ignores them: a store still pending on a block
the peer then overwrites copies the peer's KV under the old tokens' key.

`HostTierConnector` counts the blocks of every allocation as reused in the step that allocates
them, as vLLM does for its own loads, so that the store is finished before the turnkv worker
registers those blocks with the peer (it does so when the step's metadata is bound, after
`handle_preemptions`). For a request the step schedules this repeats what the scheduler finds
anyway.
"""

from __future__ import annotations

import contextlib

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

# vLLM's offloading scheduler's set of the engine blocks allocated in the current step, which
# it checks against the blocks pending stores read (upstream `build_connector_meta`).
_ALLOCATED_THIS_STEP = "_current_batch_allocated_block_ids"


class HostTierConnector(OffloadingConnector):
    """vLLM's offloading connector whose store fence also covers blocks another connector
    fills asynchronously."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None and not isinstance(
            getattr(self.connector_scheduler, _ALLOCATED_THIS_STEP, None), set
        ):
            # Without it, stores could read blocks the peer overwrites: refuse to start.
            raise RuntimeError(
                f"vLLM's offloading scheduler has no {_ALLOCATED_THIS_STEP}: its store fence "
                "changed upstream (kv_connector/v1/offloading/scheduler.py)")

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            # The blocks the engine's own prefix cache hit hold these tokens already and are
            # not written again: fencing them would flush (and store again) a session's whole
            # history every turn. Only the blocks past the hit are new to this request.
            allocated: set[int] = getattr(self.scheduler, _ALLOCATED_THIS_STEP)
            for group in self.scheduler.config.kv_group_configs:
                hit = request.num_computed_tokens // group.tokens_per_block
                allocated.update(block.block_id
                                 for block in blocks.blocks[group.group_idx][hit:]
                                 if not block.is_null)
        super().update_state_after_alloc(request, blocks, num_external_tokens)


# Under `MultiConnector` each child's stats reach the API server as plain data and are found
# again by the child's class name in vLLM's connector registry (upstream
# `kv_connector/v1/multi_connector.py`, `build_kv_connector_stats`): unregistered, the API
# server's output handler fails on the first stats and the engine answers 503. Loading the
# connector by module path imports this module in both processes.
with contextlib.suppress(ValueError):  # registered already (imported under two names)
    KVConnectorFactory.register_connector("HostTierConnector", __name__, "HostTierConnector")
