"""The disk tier (`turnkv_server.tier.disk`): real files under tmp_path, a primary view shaped as
vLLM's tiering manager hands one to its secondary tiers ((num_chunks, chunk_bytes), `strides[0]`
the chunk size), and, at the end, vLLM's own factory and tiering manager above it."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tests.unit.test_tier_vllm_spec import canonical, offloading_config, settle, store
from tests.unit.tier_kv import cpu_kv
from turnkv_server.tier.disk import COUNTERS, GAUGES, CheckedDiskTier
from turnkv_server.tier.disk_files import chunk_file_name
from turnkv_server.tier.disk_index import DiskIndex
from turnkv_server.tier.settings import TierSettingsError
from turnkv_server.tier.vllm_spec import HostTieringOffloadingSpec

CHUNK = 1024  # bytes per primary chunk: one file
SPEC = SimpleNamespace(config=SimpleNamespace(engine_id="engine-a"))  # only stored, and named


def primary(num_chunks: int = 8, seed: int = 0) -> tuple[np.ndarray, memoryview]:
    """Random bytes viewed as vLLM's shared region is: int8 rows, one per chunk."""
    rows = np.random.default_rng(seed).integers(-128, 128, (num_chunks, CHUNK), dtype=np.int8)
    return rows, memoryview(rows)


def key(i: int) -> OffloadKey:
    return make_offload_key(f"block-{i}".encode().ljust(32, b"."), 0)


def job(job_id: int, keys: list[OffloadKey], chunks: list[int], *, load: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64),
                       is_promotion=load, req_context=ReqContext(req_id=f"r{job_id}"))


def finish(tier: CheckedDiskTier, *job_ids: int) -> dict[int, JobResult]:
    """Poll as vLLM's tiering manager does until these jobs are reported."""
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + 10
    while set(results) != set(job_ids):
        assert time.monotonic() < deadline, f"jobs {set(job_ids) - set(results)} never finished"
        results.update((r.job_id, r) for r in tier.get_finished_jobs())
        time.sleep(0.002)
    return results


def files(tier: CheckedDiskTier) -> set[str]:
    return {str(p.relative_to(tier.directory)) for p in tier.directory.rglob("*") if p.is_file()}


def indexed(tier: CheckedDiskTier) -> set[str]:
    return {entry.name for _, entry in tier.index.items()}


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    tiers: list[CheckedDiskTier] = []

    def build(view: memoryview, max_bytes: int = 16 * CHUNK, **kw: Any) -> CheckedDiskTier:
        tier = CheckedDiskTier(SPEC, view, "CheckedDiskTier", root_dir=str(tmp_path),
                               max_bytes=max_bytes, n_read_threads=1, n_write_threads=1, **kw)
        tiers.append(tier)
        return tier

    yield build
    for tier in tiers:
        tier.shutdown()


def stored(tier: CheckedDiskTier, keys: list[OffloadKey], chunks: list[int],
           job_id: int = 1) -> JobResult:
    tier.submit_store(job(job_id, keys, chunks, load=False))
    return finish(tier, job_id)[job_id]


def test_stored_chunks_load_back_byte_for_byte(make) -> None:
    rows, view = primary()
    tier = make(view)
    keys = [key(i) for i in range(3)]
    tier.submit_store(job(1, keys, [0, 1, 2], load=False))
    # Until vLLM collects the store, the chunks are in flight: retry, not hit or miss.
    assert [tier.lookup(k, ReqContext("x")) for k in keys] == [LookupResult.RETRY] * 3
    assert finish(tier, 1)[1].success
    assert [tier.lookup(k, ReqContext("x")) for k in keys] == [LookupResult.HIT] * 3
    assert tier.lookup(key(9), ReqContext("x")) is LookupResult.MISS
    assert files(tier) == indexed(tier) == {chunk_file_name(k) for k in keys}
    assert tier.directory == Path(tier.settings.root_dir) / "turnkv-disk-engine-a"

    originals = rows[0:3].copy()
    rows[3:6] = 0
    tier.submit_load(job(2, keys, [5, 3, 4], load=True))
    result = finish(tier, 2)[2]
    assert (result.success, result.successful_keys) == (True, None)
    assert result.transfer_bytes == 3 * CHUNK
    assert np.array_equal(rows[[5, 3, 4]], originals)
    assert (tier.stats.bytes_used, tier.stats.entries) == (3 * CHUNK, 3)


def test_a_chunk_already_on_disk_is_not_written_again(make) -> None:
    _, view = primary()
    tier = make(view)
    stored(tier, [key(0)], [0])
    before = (tier.directory / chunk_file_name(key(0))).stat().st_mtime_ns
    assert stored(tier, [key(0)], [1], job_id=2).success
    assert (tier.directory / chunk_file_name(key(0))).stat().st_mtime_ns == before
    assert tier.stats.entries == 1


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "counter"),
    [
        (flip_a_byte, "checksum_failures"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "checksum_failures"),  # short
        (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "checksum_failures"),  # long
        (Path.unlink, "missing_files"),
    ],
    ids=["flipped", "truncated", "extended", "deleted"],
)
def test_a_damaged_file_fails_its_chunk_and_the_rest_never_counts_as_loaded(
    make, caplog, damage, counter
) -> None:
    rows, view = primary()
    tier = make(view)
    keys = [key(i) for i in range(3)]
    stored(tier, keys, [0, 1, 2])
    bad = tier.directory / chunk_file_name(keys[1])
    damage(bad)

    first = rows[0].copy()
    with caplog.at_level(logging.WARNING, logger="turnkv_server.tier.disk"):
        tier.submit_load(job(2, keys, [5, 6, 7], load=True))
        result = finish(tier, 2)[2]
    # As vLLM's fs tier reports it: the chunks before the bad one loaded, the rest did not.
    assert (result.success, result.successful_keys) == (False, (keys[0],))
    assert result.transfer_bytes == CHUNK
    assert np.array_equal(rows[5], first)
    assert getattr(tier.stats, counter) == 1
    assert len([r for r in caplog.records if str(bad) in r.getMessage()]) == 1  # once
    # The bad chunk is gone from the index and the disk; its neighbours stay.
    assert [tier.lookup(k, ReqContext("x")) for k in keys] == [
        LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    assert not bad.exists() and files(tier) == indexed(tier)
    assert (tier.stats.bytes_used, tier.stats.entries) == (2 * CHUNK, 2)


def test_a_bad_first_chunk_fails_the_whole_load(make) -> None:
    _, view = primary()
    tier = make(view)
    keys = [key(0), key(1)]
    stored(tier, keys, [0, 1])
    (tier.directory / chunk_file_name(keys[0])).unlink()
    tier.submit_load(job(2, keys, [4, 5], load=True))
    result = finish(tier, 2)[2]
    assert (result.success, result.successful_keys) == (False, None)
    assert tier.lookup(keys[0], ReqContext("x")) is LookupResult.MISS


def test_the_bound_evicts_least_recently_used_chunks_and_their_files(make) -> None:
    _, view = primary()
    tier = make(view, max_bytes=3 * CHUNK + CHUNK // 2)  # room for three chunks
    for i in range(3):
        stored(tier, [key(i)], [i], job_id=10 + i)
    tier.touch([key(0)], ReqContext("x"))  # used again: key 1 is now the oldest
    stored(tier, [key(3)], [3], job_id=20)
    assert [k for k in map(key, range(4)) if k in tier.index] == [key(0), key(2), key(3)]
    assert tier.stats.evictions == 1 and tier.stats.bytes_used == 3 * CHUNK
    assert files(tier) == indexed(tier)

    tier.submit_load(job(21, [key(2)], [6], load=True))  # a load refreshes too
    finish(tier, 21)
    result = stored(tier, [key(4), key(5)], [4, 5], job_id=22)
    assert result.success
    assert [k for k in map(key, range(6)) if k in tier.index] == [key(2), key(4), key(5)]
    assert tier.stats.bytes_used <= tier.settings.max_bytes
    assert files(tier) == indexed(tier)


def test_chunks_being_read_are_never_evicted_and_a_store_without_room_is_skipped(make) -> None:
    _, view = primary()
    tier = make(view, max_bytes=2 * CHUNK)
    stored(tier, [key(0), key(1)], [0, 1])
    tier.submit_load(job(2, [key(0), key(1)], [4, 5], load=True))  # both pinned until collected
    tier.submit_store(job(3, [key(2)], [2], load=False))
    results = finish(tier, 2, 3)
    assert not results[3].success  # vLLM counts a failed cascade and releases the host slots
    assert key(2) not in tier.index and tier.stats.skipped_stores == 1
    assert tier.stats.evictions == 0 and tier.stats.bytes_used == 2 * CHUNK
    assert results[2].success


def test_a_store_bigger_than_the_tier_keeps_what_fits(make) -> None:
    _, view = primary()
    tier = make(view, max_bytes=2 * CHUNK)
    result = stored(tier, [key(i) for i in range(3)], [0, 1, 2])
    assert not result.success
    assert [k in tier.index for k in map(key, range(3))] == [True, True, False]
    assert tier.stats.bytes_used == 2 * CHUNK and files(tier) == indexed(tier)


def test_the_index_never_exceeds_its_bound() -> None:
    index = DiskIndex(max_bytes=10)
    for i in range(50):
        evicted = index.reserve(bytes([i]), f"{i}", 3 + i % 4)
        assert evicted is not None
        index.commit(bytes([i]), b"d")
        assert index.stats.bytes_used <= 10
        assert index.stats.bytes_used == sum(e.size for _, e in index.items())
    assert index.reserve(b"big", "big", 11) is None and index.stats.skipped_stores == 1


def test_start_clears_the_tiers_own_directory_only_and_shutdown_removes_it(
    make, tmp_path: Path
) -> None:
    stale = tmp_path / "turnkv-disk-engine-a" / "ab" / "old.bin"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from a previous run")
    other = tmp_path / "turnkv-disk-engine-b" / "keep.bin"
    other.parent.mkdir()
    other.write_bytes(b"another engine's")
    _, view = primary()
    tier = make(view)
    assert not stale.exists() and other.exists()
    stored(tier, [key(0)], [0])
    tier.shutdown()
    assert not tier.directory.exists() and other.exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"root_dir": None}, "needs root_dir"),
        ({"max_bytes": None}, "needs max_bytes"),
        ({"max_bytes": 0}, "max_bytes must be a positive integer"),
        ({"max_bytes": -5}, "max_bytes must be a positive integer"),
        ({"max_bytes": "8192"}, "max_bytes must be a positive integer"),
        ({"max_bytes": True}, "max_bytes must be a positive integer"),
        ({"max_bytes": 1.5e9}, "max_bytes must be a positive integer"),
        ({"max_bytes": CHUNK - 1}, "max_bytes=1023 holds no chunk"),
        ({"n_read_threads": 0}, "n_read_threads must be a positive integer"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(tmp_path: Path, settings, message) -> None:
    _, view = primary()
    full: dict[str, Any] = {"root_dir": str(tmp_path), "max_bytes": 4 * CHUNK, **settings}
    with pytest.raises(TierSettingsError, match=message) as refused:
        CheckedDiskTier(SPEC, view, "CheckedDiskTier", **full)
    assert isinstance(refused.value, ValueError)
    assert not (tmp_path / "turnkv-disk-engine-a").exists()


def test_vllms_factory_builds_the_tier_by_module_path(tmp_path: Path) -> None:
    _, view = primary()
    config = {"type": "CheckedDiskTier", "module_path": "turnkv_server.tier.disk",
              "root_dir": str(tmp_path), "max_bytes": 4 * CHUNK}
    tier = SecondaryTierFactory.create_secondary_tier(config, view, SPEC)  # type: ignore[arg-type]
    try:
        assert isinstance(tier, CheckedDiskTier) and tier.tier_type == "CheckedDiskTier"
        assert tier.block_size_bytes == CHUNK and tier.settings.max_bytes == 4 * CHUNK
        assert tier.cache_hit_source is CacheHitSource.DISK  # vLLM labels its hits as disk's
        assert config["type"] == "CheckedDiskTier"  # the factory works on a copy
    finally:
        tier.shutdown()


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[tuple[HostTieringOffloadingSpec, Any]]:
    kv = cpu_kv(num_blocks=8, seed=11)
    extra = {"spec_name": "HostTieringOffloadingSpec",
             "spec_module_path": "turnkv_server.tier.vllm_spec", "host_blocks": 2,
             "secondary_tiers": [{"type": "CheckedDiskTier",
                                  "module_path": "turnkv_server.tier.disk",
                                  "root_dir": str(tmp_path), "max_bytes": 1 << 30}]}
    config = offloading_config(kv, extra)
    assert set(GAUGES) | set(COUNTERS.values()) <= set(
        HostTieringOffloadingSpec.build_metric_definitions(extra))
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, HostTieringOffloadingSpec)
    yield spec, kv
    spec.get_manager().shutdown()  # our tier first: it must leave no view of the region alive
    assert not Path(f"/dev/shm/vllm_offload_{config.engine_id}.mmap").exists()
    assert not list(tmp_path.rglob("*.bin"))


def test_under_vllms_tiering_a_corrupt_file_becomes_a_miss_and_the_rest_loads(tiered) -> None:
    spec, kv = tiered
    manager, worker = spec.get_manager(), spec.get_worker(canonical(kv))
    (tier,) = manager.secondary_tiers  # type: ignore[attr-defined]
    ctx = ReqContext(req_id=f"a-{uuid.uuid4().hex[:6]}")
    manager.on_new_request(ctx)
    session = [make_offload_key(f"a-{i}".encode().ljust(32, b"."), 0) for i in range(2)]
    store(manager, worker, ctx, session, [6, 7], job=1, kv=kv)
    original = kv.block_bytes(6)
    settle(manager, lambda: not manager.has_pending_work())
    manager.on_request_finished(ctx)
    assert tier.stats.entries == 2

    ctx_b = ReqContext(req_id="b")  # another session takes host memory: a is on disk only
    manager.on_new_request(ctx_b)
    other = [make_offload_key(f"b-{i}".encode().ljust(32, b"."), 0) for i in range(2)]
    store(manager, worker, ctx_b, other, [0, 1], job=2, kv=kv)
    settle(manager, lambda: not manager.has_pending_work())
    manager.on_request_finished(ctx_b)
    flip_a_byte(tier.directory / chunk_file_name(session[1]))

    for rows in kv.rows:
        rows.zero_()
    ctx_a2 = ReqContext(req_id="a-turn-2")
    manager.on_new_request(ctx_a2)
    # vLLM promotes both from disk; the second fails its check, so its host slot is freed and
    # the next lookup finds it nowhere: the engine would compute it.
    settle(manager, lambda: [manager.lookup(k, ctx_a2) for k in session] == [
        LookupResult.HIT, LookupResult.MISS])
    assert tier.stats.checksum_failures == 1
    load_spec = manager.prepare_load(session[:1], ctx_a2)
    assert worker.submit_load(3, load_spec, GPULoadStoreSpec([3], [1], [0]))
    manager.complete_load(session[:1], ctx_a2)
    assert kv.block_bytes(3) == original
    stats = manager.get_stats()
    assert stats is not None
    assert stats.data["data"]["turnkv:disk_tier_checksum_failures"] == {(): 1}
    worker.shutdown()
