"""The host tier's pending stores against blocks reused for other tokens, in vLLM's own
scheduler with the launcher's connectors (turnkv's, then the tier, under `MultiConnector`).

vLLM's offloading worker may finish a store steps after the one that created it (ours copies
a few blocks a step: `tier.store_pacing`). Before an engine block that a pending store reads
holds other tokens, vLLM's offloading scheduler must list that store in the step's
`jobs_to_flush`, which the worker finishes before anything of the step writes the block
(`handle_preemptions`, before the forward pass and before the turnkv worker registers a
receive). No worker runs here, so every store stays pending."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus

from tests.unit.engine_scheduler import BLOCK, EngineScheduler
from turnkv_server.engine.protocol import Receive
from turnkv_server.launcher.kv_transfer import kv_transfer_config

BLOCKS = 16  # one of them vLLM's null block
PEER = "127.0.0.1:7000"


def tier_engine(tmp_path: Path) -> EngineScheduler:
    """vLLM's scheduler with the connectors the launcher gives a turnkv engine with a tier."""
    config = kv_transfer_config("turnkv", "decode", "fence-test",
                                connector_settings={"max_pinned_fraction": 1.0},
                                tier_host_blocks=BLOCKS)
    assert config is not None
    return EngineScheduler(tmp_path, blocks=BLOCKS, kv_transfer=KVTransferConfig(**config))


def tier_metadata(output: SchedulerOutput) -> OffloadingConnectorMetadata:
    _, tier = output.kv_connector_metadata.metadata  # type: ignore[union-attr]
    assert isinstance(tier, OffloadingConnectorMetadata)
    return tier


@pytest.mark.parametrize("peer_writes", [False, True], ids=["computed", "received"])
def test_a_pending_store_is_flushed_in_the_step_its_blocks_go_to_another_request(
    tmp_path: Path, peer_writes: bool
) -> None:
    """A turn without a session (no lease holds its blocks) ends with its stores pending;
    the next request takes its freed blocks. `computed`: the request is scheduled and
    computes its prompt in them (vLLM's fence sees its blocks in the step's output).
    `received`: turnkv's connector has the peer push the prompt into them, the request
    waiting unscheduled meanwhile (only the tier's `update_state_after_alloc` sees them)."""
    engine = tier_engine(tmp_path)
    engine.add("a", list(range(5_000, 5_000 + 4 * BLOCK)))
    stores: dict[int, set[int]] = {}  # job: the engine blocks it reads
    for _ in range(3):  # the prompt's step, then the finished request's last stores
        meta = tier_metadata(engine.step())
        stores |= {job: {int(b) for b in t.src_spec.block_ids}  # type: ignore[attr-defined]
                   for job, t in meta.store_jobs.items()}
    assert "a" not in engine.scheduler.requests and stores  # finished, stores pending

    params = {"receive": Receive("t1", PEER)} if peer_writes else {}
    # Every free block but one: the request must take the finished turn's.
    engine.add("b", list(range(9_000, 9_000 + 13 * BLOCK + 8)), max_tokens=4, **params)
    output = engine.step()
    status = engine.scheduler.requests["b"].status
    assert (status is RequestStatus.WAITING_FOR_REMOTE_KVS) == peer_writes
    reused = set(engine.scheduler.kv_cache_manager.get_blocks("b").get_block_ids()[0])
    reading = {job for job, blocks in stores.items() if blocks & reused}
    assert reading  # a pending store reads a block the new request got
    assert reading <= tier_metadata(output).jobs_to_flush
