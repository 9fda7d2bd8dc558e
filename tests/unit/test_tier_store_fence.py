"""The host tier's pending stores against blocks reused for other tokens, in vLLM's own
scheduler with the launcher's connectors (turnkv's, then the tier, under `MultiConnector`).

vLLM's offloading worker may finish a store steps after the one that created it (ours copies
a few blocks a step: `tier.store_pacing`). Before an engine block that a pending store reads
holds other tokens, vLLM's offloading scheduler must list that store in the step's
`jobs_to_flush`, which the worker finishes before anything of the step writes the block
(`handle_preemptions`, before the forward pass and before the turnkv worker registers a
receive). The first test reads the scheduler's metadata alone (no worker: every store stays
pending); the second runs vLLM's offloading worker over ours and checks the bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.unit.engine_scheduler import BLOCK, EngineScheduler
from tests.unit.test_tier_vllm_spec import canonical, create
from tests.unit.tier_kv import CpuKV, cpu_kv
from turnkv_server.engine.protocol import Receive
from turnkv_server.launcher.kv_transfer import kv_transfer_config
from turnkv_server.tier.vllm_spec import HostCopyWorker

BLOCKS = 16  # one of them vLLM's null block
PEER = "127.0.0.1:7000"


def tier_engine(tmp_path: Path) -> EngineScheduler:
    """vLLM's scheduler with the connectors the launcher gives a turnkv engine with a tier."""
    config = kv_transfer_config("turnkv", "decode", "fence-test",
                                connector_settings={"max_pinned_fraction": 1.0},
                                tier_host_blocks=BLOCKS)
    assert config is not None
    return EngineScheduler(tmp_path, blocks=BLOCKS, kv_transfer=KVTransferConfig(**config))


def tier_jobs(engine: EngineScheduler) -> dict[int, object]:
    """The tier's jobs not yet reported done (vLLM's offloading scheduler's own record)."""
    _, tier = engine.scheduler.connector._connectors  # type: ignore[union-attr]
    return tier.scheduler._jobs  # type: ignore[no-any-return]


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


class TierWorker:
    """vLLM's offloading worker half over our `HostCopyWorker` and KV tensors of the engine's
    block count, called as the model runner calls it (upstream `gpu_model_runner.py`
    `execute_model`, `kv_connector_model_runner_mixin.py`)."""

    def __init__(self, engine: EngineScheduler) -> None:
        self.kv = cpu_kv(num_blocks=BLOCKS, seed=3)
        spec = create(self.kv, {"host_blocks": BLOCKS})
        self.worker = OffloadingConnectorWorker(spec, engine.scheduler.vllm_config,
                                                engine.scheduler.kv_cache_config)
        self.worker._init_worker(canonical(self.kv))
        assert isinstance(self.worker.worker, HostCopyWorker)

    def step(self, meta: OffloadingConnectorMetadata, writes: set[int]) -> KVConnectorOutput:
        """`writes`: engine blocks something else of the step writes once the tier's
        `handle_preemptions` is over (the forward pass, or the peer once the turnkv worker
        has registered them when the step's metadata is bound)."""
        self.worker.handle_preemptions(meta)
        for block in writes:
            for rows in self.kv.rows:
                rows[block] = 0x55
        self.worker.start_kv_transfers(meta)
        self.worker.prepare_store_kv(meta)
        self.worker.get_finished(set())
        done = self.worker.build_connector_worker_meta()
        return KVConnectorOutput(
            kv_connector_worker_meta=MultiKVConnectorWorkerMetadata((None, done)))

    def host_bytes(self, host_spec: LoadStoreSpec, scratch: int) -> bytes:
        """What one host chunk holds, read back into engine block `scratch`."""
        assert self.worker.worker is not None
        self.worker.worker.submit_load(10_000 + scratch, host_spec,
                                       GPULoadStoreSpec([scratch], group_sizes=[1],
                                                        block_indices=[0]))
        return self.kv.block_bytes(scratch)


def single_chunks(kv: CpuKV, meta: OffloadingConnectorMetadata
                  ) -> dict[int, tuple[LoadStoreSpec, bytes]]:
    """Each store of `meta` by engine block: its host chunk (a one-chunk spec) and the
    block's bytes now."""
    out: dict[int, tuple[LoadStoreSpec, bytes]] = {}
    for job in meta.store_jobs.values():
        for block, chunk in zip(job.src_spec.block_ids, job.dst_spec.block_ids,  # type: ignore[attr-defined]
                                strict=True):
            one = type(job.dst_spec)([int(chunk)])  # type: ignore[call-arg]
            out[int(block)] = (one, kv.block_bytes(int(block)))
    return out


@pytest.mark.parametrize("peer_writes", [False, True], ids=["computed", "received"])
def test_the_host_tier_keeps_a_finished_turns_kv_when_its_blocks_are_written_again(
    tmp_path: Path, peer_writes: bool
) -> None:
    """The same turns with the tier's worker copying stores a block a step: whoever writes
    the finished turn's blocks next, the host tier holds the turn's own KV."""
    engine = tier_engine(tmp_path)
    tier = TierWorker(engine)
    engine.add("a", list(range(5_000, 5_000 + 4 * BLOCK)))
    pending = tier_jobs(engine)
    stored: dict[int, tuple[LoadStoreSpec, bytes]] = {}
    stores: set[int] = set()
    for _ in range(3):
        output = engine.scheduler.schedule()
        meta = tier_metadata(output)
        stored |= single_chunks(tier.kv, meta)
        stores |= set(meta.store_jobs)
        engine.finish_step(output, tier.step(meta, writes=set()))
    assert "a" not in engine.scheduler.requests and stored
    assert stores & set(pending)  # a store still being copied

    params = {"receive": Receive("t1", PEER)} if peer_writes else {}
    engine.add("b", list(range(9_000, 9_000 + 13 * BLOCK + 8)), max_tokens=4, **params)
    output = engine.scheduler.schedule()
    written = set(engine.scheduler.kv_cache_manager.get_blocks("b").get_block_ids()[0])
    assert written & set(stored)  # the new request got blocks a store reads
    engine.finish_step(output, tier.step(tier_metadata(output), writes=written))
    for _ in range(30):  # until the finished turn's stores are reported
        if not stores & set(pending):
            break
        output = engine.scheduler.schedule()
        engine.finish_step(output, tier.step(tier_metadata(output), writes=set()))
    assert not stores & set(pending)

    scratch = 0  # vLLM's null block: nothing of the test's requests
    for block, (chunk, original) in sorted(stored.items()):
        assert tier.host_bytes(chunk, scratch) == original, f"engine block {block}"


def test_the_tier_connector_is_found_by_name_where_its_stats_arrive() -> None:
    """The API server rebuilds each `MultiConnector` child's stats by the child's class name
    (upstream `build_kv_connector_stats`); a connector loaded by module path only is not found
    there, and the engine answers 503 from its first stats on."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from turnkv_server.tier.offloading_connector import HostTierConnector

    assert KVConnectorFactory.get_connector_class_by_name("HostTierConnector") is \
        HostTierConnector
    stats = MultiConnector.build_kv_connector_stats({"HostTierConnector": {}})
    assert stats is not None
