"""The shared tier (`turnkv_server.tier.shared_files`) under vLLM's own tiering manager, two
engines' managers on one folder (no engine): a chunk in no tier is a miss in the step it is
asked for, where vLLM's own file-system tier answers "retry" (and vLLM's connector holds the
request a step); a chunk one engine stored, the other finds and loads; a chunk that failed to
load is a miss until it is stored anew."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.unit.test_tier_vllm_spec import MODULE, canonical, keys, offloading_config, settle, store
from tests.unit.tier_kv import CpuKV, cpu_kv
from turnkv_server.launcher.kv_transfer import shared_tier
from turnkv_server.tier.shared_files import SharedFileTier

Engine = tuple[Any, Any, CpuKV]  # vLLM's scheduler-side manager, the worker, the engine's KV


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    """Engines' tiers, each its own host memory above `tmp_path`'s shared folder."""
    made: list[Engine] = []

    def engine(seed: int, tier: dict[str, Any] | None = None) -> Engine:
        kv = cpu_kv(num_blocks=8, seed=seed)
        below = tier or {**shared_tier(str(tmp_path)), "n_read_threads": 1,
                         "n_write_threads": 1}
        extra = {"spec_name": "HostTieringOffloadingSpec", "spec_module_path": MODULE,
                 "host_blocks": 2, "secondary_tiers": [below]}
        spec = OffloadingSpecFactory.create_spec(offloading_config(kv, extra))
        made.append((spec.get_manager(), spec.get_worker(canonical(kv)), kv))
        return made[-1]

    yield engine
    for manager, worker, _ in made:
        worker.shutdown()
        manager.shutdown()


def stored(engine: Engine, tag: str, blocks: list[int], job: int = 1
           ) -> tuple[list, list[bytes]]:
    """A request's chunks stored to host memory and cascaded to the shared folder."""
    manager, worker, kv = engine
    ctx = ReqContext(req_id=f"{tag}-{uuid.uuid4().hex[:6]}")
    manager.on_new_request(ctx)
    chunks = keys(tag, len(blocks))
    store(manager, worker, ctx, chunks, blocks, job=job, kv=kv)
    settle(manager, lambda: not manager.has_pending_work())
    manager.on_request_finished(ctx)
    return chunks, [kv.block_bytes(b) for b in blocks]


def test_the_tier_is_vllms_file_tier_loaded_by_module_path(engines) -> None:
    manager, _, _ = engines(seed=1)
    (tier,) = manager.secondary_tiers
    assert type(tier) is SharedFileTier and tier.tier_type == "SharedFileTier"


def test_a_chunk_in_no_tier_is_a_miss_at_once_where_vllms_tier_says_retry(
    engines, tmp_path: Path
) -> None:
    ctx = ReqContext(req_id="new-turn")
    ours, _, _ = engines(seed=1)
    ours.on_new_request(ctx)
    assert ours.lookup(keys("new", 1)[0], ctx) is LookupResult.MISS

    vllms, _, _ = engines(seed=2, tier={"type": "fs", "root_dir": str(tmp_path / "fs"),
                                       "n_read_threads": 1, "n_write_threads": 1})
    vllms.on_new_request(ctx)
    assert vllms.lookup(keys("new", 1)[0], ctx) is LookupResult.RETRY


def test_a_chunk_one_engine_stored_the_other_loads_byte_for_byte(engines) -> None:
    home, other = engines(seed=1), engines(seed=2)
    chunks, originals = stored(home, "a", [6, 7])
    manager, worker, kv = other
    ctx = ReqContext(req_id="a-moved")
    manager.on_new_request(ctx)
    # Found in the step it is asked for: a promotion into this engine's host memory starts.
    assert [manager.lookup(k, ctx) for k in chunks] == [LookupResult.HIT_PENDING] * 2
    settle(manager, lambda: all(manager.lookup(k, ctx) is LookupResult.HIT for k in chunks))
    load = manager.prepare_load(chunks, ctx)
    assert worker.submit_load(2, load, GPULoadStoreSpec([2, 3], [2], [0]))
    manager.complete_load(chunks, ctx)
    assert [kv.block_bytes(b) for b in (2, 3)] == originals


def test_a_chunk_that_failed_to_load_is_a_miss_until_stored_again(engines) -> None:
    home, other = engines(seed=1), engines(seed=2)
    chunks, _ = stored(home, "a", [6])
    manager, _, _ = other
    (tier,) = manager.secondary_tiers
    path = Path(tier.file_mapper.get_file_name(chunks[0]))
    path.unlink()
    path.mkdir()  # still there by name, and no read of it succeeds
    ctx = ReqContext(req_id="a-moved")
    manager.on_new_request(ctx)
    assert manager.lookup(chunks[0], ctx) is LookupResult.HIT_PENDING
    settle(manager, lambda: manager.lookup(chunks[0], ctx) is LookupResult.MISS)
    assert path.exists() and manager.lookup(chunks[0], ctx) is LookupResult.MISS

    manager.on_request_finished(ctx)

    path.rmdir()
    stored(other, "a", [1], job=1)  # this engine computed the chunk and stored it itself
    stored(other, "b", [2, 3], job=2)  # ...and it left host memory: the shared tier has it
    again = ReqContext(req_id="a-again")
    manager.on_new_request(again)
    assert manager.lookup(chunks[0], again) is LookupResult.HIT_PENDING
