"""A turn whose history the host tier holds computes in the step that loads it, in vLLM's own
scheduler with the launcher's connectors (turnkv's, then the tier's, under `MultiConnector`),
and the tier connector's worker half as the model runner calls it.

vLLM's offloading connector loads asynchronously: the request waits a step for its blocks and
computes in the next. The tier's worker here copies a load when it is submitted, before the
forward pass of the same step (`tier.vllm_spec.LOADS_COPIED_AT_SUBMIT`), so
`HostTierConnector` declares its loads synchronous (`tier.offloading_connector`).
"""

from __future__ import annotations

from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.unit.engine_scheduler import BLOCK, EngineScheduler
from tests.unit.test_tier_store_fence import BLOCKS, tier_engine, tier_jobs, tier_metadata
from tests.unit.test_tier_vllm_spec import canonical, create
from tests.unit.tier_kv import cpu_kv
from turnkv_server.tier.offloading_connector import HostTierConnector
from turnkv_server.tier.vllm_spec import HostCopyWorker

SCRIBBLE = 0x55


class TierConnectorWorker:
    """`HostTierConnector`'s worker half over KV tensors of the engine's block count, called as
    the model runner calls a connector (upstream `kv_connector_model_runner_mixin.py`): bind
    the step's metadata, finish the stores it flushes, load, run the forward pass (here: write
    `writes`), queue the step's stores, report."""

    def __init__(self, engine: EngineScheduler) -> None:
        self.kv = cpu_kv(num_blocks=BLOCKS, seed=3)
        children = MultiConnector._get_connector_classes_and_configs(engine.scheduler.vllm_config)
        cls, config = children[1]
        assert cls is HostTierConnector
        self.connector = HostTierConnector(config, KVConnectorRole.WORKER,
                                           engine.scheduler.kv_cache_config)
        # Its offloading worker over these tensors (the engine's config describes the test
        # model's cache, not them), as `test_tier_store_fence.TierWorker` builds it.
        worker = OffloadingConnectorWorker(create(self.kv, {"host_blocks": BLOCKS}),
                                           engine.scheduler.vllm_config,
                                           engine.scheduler.kv_cache_config)
        worker._init_worker(canonical(self.kv))
        assert isinstance(worker.worker, HostCopyWorker)
        self.connector.connector_worker = worker

    def step(self, meta: OffloadingConnectorMetadata, writes: frozenset[int] = frozenset()
             ) -> KVConnectorOutput:
        self.connector.bind_connector_metadata(meta)
        self.connector.handle_preemptions(meta)
        self.connector.start_load_kv(None)  # type: ignore[arg-type]
        for block in writes:
            for rows in self.kv.rows:
                rows[block] = SCRIBBLE
        self.connector.wait_for_save()
        sending, receiving = self.connector.get_finished(set())
        done = self.connector.build_connector_worker_meta()
        self.connector.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=sending or None, finished_recving=receiving or None,
            kv_connector_worker_meta=MultiKVConnectorWorkerMetadata((None, done)))


def stored_turn(tmp_path: Path, history: list[int]
                ) -> tuple[EngineScheduler, TierConnectorWorker, dict[int, bytes]]:
    """An engine whose host tier holds `history`'s KV, none of it in the engine's cache
    (its blocks scribbled over): the engine, the tier's worker, and each history block's bytes
    as the turn left them, by its index in the history."""
    engine = tier_engine(tmp_path)
    tier = TierConnectorWorker(engine)
    engine.add("a", history)
    pending = tier_jobs(engine)
    blocks: list[int] = []  # "a"'s, once its first step allocates them
    for _ in range(40):  # the turn, then until every store it made is copied
        output = engine.scheduler.schedule()
        if "a" in engine.scheduler.requests and not blocks:
            blocks = list(engine.scheduler.kv_cache_manager.get_blocks("a").get_block_ids()[0])
        engine.finish_step(output, tier.step(tier_metadata(output)))
        if "a" not in engine.scheduler.requests and not pending:
            break
    assert "a" not in engine.scheduler.requests and not pending
    turn = {i: tier.kv.block_bytes(block) for i, block in enumerate(blocks[:len(history) // BLOCK])}
    assert engine.scheduler.reset_prefix_cache()  # the engine's cache forgets the history
    for rows in tier.kv.rows:
        rows[:] = SCRIBBLE
    return engine, tier, turn


def test_a_turn_the_host_tier_holds_computes_its_new_tokens_in_the_step_that_loads_it(
    tmp_path: Path
) -> None:
    history = list(range(5_000, 5_000 + 4 * BLOCK))
    engine, tier, turn = stored_turn(tmp_path, history)

    # More than a block of new tokens: the step that loads the history also completes a
    # block for the tier to store (upstream stores only after a load's step: none here).
    engine.add("b", [*history, *range(9_000, 9_000 + BLOCK + 8)], max_tokens=2)
    output = engine.scheduler.schedule()
    meta = tier_metadata(output)
    assert meta.load_jobs  # the history comes from the tier...
    assert engine.scheduler.requests["b"].status is RequestStatus.RUNNING
    assert output.num_scheduled_tokens["b"] == BLOCK + 8  # ...and only the new tokens computed
    kv = tier.step(meta)
    assert not kv.finished_recving  # nobody waits for the load: vLLM would refuse the report
    loaded = engine.scheduler.kv_cache_manager.get_blocks("b").get_block_ids()[0]
    for i, original in turn.items():
        assert tier.kv.block_bytes(loaded[i]) == original, f"history block {i}"
    engine.finish_step(output, kv)
    for _ in range(10):
        if "b" not in engine.scheduler.requests:
            break
        output = engine.scheduler.schedule()
        engine.finish_step(output, tier.step(tier_metadata(output)))
    assert "b" not in engine.scheduler.requests


def test_a_prompt_the_tier_holds_whole_still_computes_its_last_token(tmp_path: Path) -> None:
    """Every token of the prompt in the tier: the step loads all but the last one, which it
    computes (vLLM's own async load would load them all, and compute that token again in the
    next step)."""
    history = list(range(5_000, 5_000 + 4 * BLOCK))
    engine, tier, turn = stored_turn(tmp_path, history)

    engine.add("b", history, max_tokens=2)
    output = engine.scheduler.schedule()
    assert engine.scheduler.requests["b"].status is RequestStatus.RUNNING
    assert output.num_scheduled_tokens["b"] == 1
    kv = tier.step(tier_metadata(output))
    assert not kv.finished_recving
    loaded = engine.scheduler.kv_cache_manager.get_blocks("b").get_block_ids()[0]
    for i, original in turn.items():
        assert tier.kv.block_bytes(loaded[i]) == original, f"history block {i}"
    engine.finish_step(output, kv)
