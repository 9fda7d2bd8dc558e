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

It also loads in the step that computes. vLLM's offloading connector loads asynchronously: a
request the host tier holds waits a step for its blocks (loaded during that step, reported done
at its end) and computes its prompt in the next. Where the tier's worker copies a load when it is
submitted (this project's specs: `vllm_spec.LOADS_COPIED_AT_SUBMIT`), before the forward pass of
the same step, the load is as good as synchronous, so it is declared so: the request computes the
rest of its prompt in the step that loads its history, as a prefix-cache hit would. Under load
the step waited out is another request's prompt, seconds on a CPU. The load then leaves at least
the prompt's last token to compute (vLLM computes one, and a synchronous load of every token
would leave the step nothing to schedule), and its completion is not reported as a finished
receive (vLLM expects those only of requests waiting for remote KV).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from turnkv_server.tier.vllm_spec import LOADS_COPIED_AT_SUBMIT

# vLLM's offloading scheduler's set of the engine blocks allocated in the current step, which
# it checks against the blocks pending stores read (upstream `build_connector_meta`).
_ALLOCATED_THIS_STEP = "_current_batch_allocated_block_ids"
# Its load jobs of the current step, and its state per request (each with `transfer_jobs`).
_STEP_LOADS = "_current_batch_load_jobs"
_REQUESTS = "_req_status"


@dataclass(frozen=True)
class _Uncached:
    """An engine block as vLLM's offloading scheduler reads one, its hash not yet set."""

    block_id: int
    is_null: bool
    block_hash: None = None


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
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._loads_in_step = extra.get("spec_name") in LOADS_COPIED_AT_SUBMIT
        if self._loads_in_step and self.connector_scheduler is not None and not all(
            isinstance(getattr(self.connector_scheduler, name, None), dict)
            for name in (_STEP_LOADS, _REQUESTS)
        ):
            # Without them a store could be built while the step's load is pending (upstream
            # asserts), and the worker half, which cannot see this, would report no load:
            # refuse to start, as for the store fence.
            raise RuntimeError(
                f"vLLM's offloading scheduler has no {_STEP_LOADS} or {_REQUESTS}: its jobs "
                "changed upstream (kv_connector/v1/offloading/scheduler.py)")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self._loads_in_step:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        # At most up to the prompt's last token, which the step computes.
        most = request.num_tokens - 1 - num_computed_tokens
        bound = self._max_loadable_tokens(request, num_computed_tokens)
        tokens, _ = self.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens,
            max_num_new_tokens=max(0, most if bound is None else min(most, bound)))
        return tokens, False

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
        elif self._loads_in_step:
            # vLLM caches the blocks of a synchronous load before telling the connector of
            # them, and vLLM's offloading scheduler loads from the first block past the
            # request's local hit that is not cached yet (it takes a cached one for a block
            # something else filled): seen as they are, there would be nothing to load.
            # (Read as blocks: upstream reads `block_id`, `is_null` and `block_hash` only.)
            blocks = KVCacheBlocks(tuple(
                cast(list[KVCacheBlock], [_Uncached(block.block_id, block.is_null)
                                          for block in group])
                for group in blocks.blocks))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if not self._loads_in_step:
            return super().build_connector_meta(scheduler_output)
        # Upstream stores a request's new blocks only once its load is over, the load a step
        # before (it knows no other kind): the step's own loads are hidden from its stores.
        # Their blocks are stored from the next step on, when the worker has loaded them.
        requests = getattr(self.scheduler, _REQUESTS)
        hidden = [(job_id, requests[job.req_id])
                  for job_id, job in getattr(self.scheduler, _STEP_LOADS).items()
                  if job.req_id in requests]
        for job_id, request in hidden:
            request.transfer_jobs.discard(job_id)
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            for job_id, request in hidden:
                request.transfer_jobs.add(job_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, receiving = super().get_finished(finished_req_ids)
        # Loads in the step: no request waits for one (see the module's docstring).
        return sending, set() if self._loads_in_step else receiving


# Under `MultiConnector` each child's stats reach the API server as plain data and are found
# again by the child's class name in vLLM's connector registry (upstream
# `kv_connector/v1/multi_connector.py`, `build_kv_connector_stats`): unregistered, the API
# server's output handler fails on the first stats and the engine answers 503. Loading the
# connector by module path imports this module in both processes.
with contextlib.suppress(ValueError):  # registered already (imported under two names)
    KVConnectorFactory.register_connector("HostTierConnector", __name__, "HostTierConnector")
