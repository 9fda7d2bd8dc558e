"""A bounded, checksummed disk tier below the host tier, as a secondary tier of vLLM's tiering.

    "secondary_tiers": [{"type": "CheckedDiskTier", "module_path": "turnkv_server.tier.disk",
                         "root_dir": "/var/tmp/turnkv-tier", "max_bytes": 8589934592}]

vLLM's tiering manager (upstream `vllm/v1/kv_offload/tiering/manager.py`) keeps the host tier as
its primary and cascades every chunk stored there to each secondary tier; a chunk found only in
a secondary tier is promoted (copied back into a host slot) before the engine loads it. vLLM's
`SecondaryTierFactory` (upstream `tiering/factory.py`) imports an out-of-tree tier from
``module_path`` and passes the entry's other keys to its constructor.

vLLM's own file-system tier (``"type": "fs"``) writes a file per chunk and never deletes one,
and serves whatever bytes a file holds. This one:

- is bounded: an index in the scheduler (`disk_index.DiskIndex`) holds every chunk the tier
  stored with its file, size and digest, within ``max_bytes``; a store evicts the least recently
  used chunks first (a `touch`, a lookup hit and a load refresh a chunk), never one being
  written or read, and deletes their files; a chunk that cannot fit even then is not stored
  and its store job reports failure, which vLLM tolerates (`_process_finished_jobs` releases
  the host slots either way; the failure is only counted);
- is checked: a load verifies each file's length and blake2b digest against the index before
  its bytes count (`disk_files`). A missing, short, long or altered file fails that chunk and
  the ones after it (`JobResult.successful_keys`: the chunks before it), and its entry and file
  are dropped, with one warning. vLLM's `TieringOffloadingManager._complete_promotion` then
  calls ``complete_write(failed_keys, False)`` on the host tier, which frees the slots it had
  allocated for them; the request, whose lookup was deferred while the promotion was pending,
  is looked up again, finds those chunks in no tier and matches fewer tokens, so the engine
  computes them. No engine load is ever scheduled for them: a bad file means a recompute,
  never wrong KV, and the worker's load-failure policy is not involved;
- owns its directory: ``<root_dir>/turnkv-disk-<engine id>``, removed at start (the index
  starts empty, so older files could never be served) and at shutdown.

All of `SecondaryTierManager`'s methods run on vLLM's scheduler thread and must not block: file
I/O runs on small thread pools (``n_read_threads``, ``n_write_threads``, 2 each by default);
the index is touched only on the scheduler thread. Deleting an evicted file is done inline
(a metadata operation), so a chunk evicted and stored again never loses its new file to a
late delete.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from turnkv_server.tier.disk_files import (
    ChunkRead,
    LoadOutcome,
    ReadFailure,
    StoreOutcome,
    chunk_file_name,
    load_chunks,
    store_chunks,
)
from turnkv_server.tier.disk_index import ChunkState, DiskIndex, DiskTierStats
from turnkv_server.tier.settings import resolve_disk

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

GAUGES = {
    "turnkv:disk_tier_bytes_used": "Bytes the turnkv disk tier holds or is writing.",
    "turnkv:disk_tier_entries": "Chunks the turnkv disk tier holds or is writing.",
}
COUNTERS = {  # DiskTierStats field -> metric
    "evictions": "turnkv:disk_tier_evictions",
    "skipped_stores": "turnkv:disk_tier_skipped_stores",
    "failed_stores": "turnkv:disk_tier_failed_stores",
    "checksum_failures": "turnkv:disk_tier_checksum_failures",
    "missing_files": "turnkv:disk_tier_missing_files",
    "read_errors": "turnkv:disk_tier_read_errors",
}
_FAILURE_COUNTER = {
    ReadFailure.CORRUPT: "checksum_failures",
    ReadFailure.MISSING: "missing_files",
    ReadFailure.ERROR: "read_errors",
}


def _timed(work: Callable[[], _T]) -> tuple[_T, float]:
    start = time.monotonic()
    result = work()
    return result, time.monotonic() - start


@dataclass
class _Load:
    keys: list[OffloadKey]  # the promotion's chunks, in order
    pinned: list[OffloadKey]  # the leading ones found READY and read; a gap ends the read
    future: cf.Future[tuple[LoadOutcome, float]]


@dataclass
class _Store:
    keys: list[OffloadKey]  # chunks reserved and being written, in order
    complete: bool  # every chunk of the job is stored or being stored
    future: cf.Future[tuple[StoreOutcome, float]]


def own_directory(root_dir: str, offloading_spec: object) -> Path:
    """This tier's directory under `root_dir`, emptied: one per engine (engines on one host
    have distinct engine ids), so engines sharing a `root_dir` never clear each other's."""
    config = getattr(offloading_spec, "config", None)
    engine_id = str(getattr(config, "engine_id", None) or "engine")
    directory = Path(root_dir) / ("turnkv-disk-" + re.sub(r"[^A-Za-z0-9._-]", "_", engine_id))
    if directory.exists() or directory.is_symlink():
        shutil.rmtree(directory)  # refuses a symlink: never follow one out of root_dir
    directory.mkdir(parents=True)
    return directory


class CheckedDiskTier(SecondaryTierManager):
    """vLLM's `SecondaryTierManager` over local files, bounded by ``max_bytes`` and checked by
    blake2b digests kept in its index (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE  # vLLM reports its hits as disk hits

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str | None = None,
        max_bytes: int | None = None,
        n_read_threads: int = 2,
        n_write_threads: int = 2,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # Defaults of None so that a missing key is refused by name, not by a TypeError.
        self.settings = resolve_disk(
            root_dir, max_bytes, n_read_threads, n_write_threads,
            chunk_bytes=self.block_size_bytes,
        )
        self.locality = Locality(locality) if locality is not None else None
        self.directory = own_directory(self.settings.root_dir, offloading_spec)
        self.index = DiskIndex(self.settings.max_bytes)
        # Chunk c of the primary view is bytes [c * size, (c + 1) * size) of this flat view.
        self._flat = primary_kv_view.cast("B")
        self._readers = cf.ThreadPoolExecutor(
            self.settings.read_threads, thread_name_prefix="turnkv_disk_read")
        self._writers = cf.ThreadPoolExecutor(
            self.settings.write_threads, thread_name_prefix="turnkv_disk_write")
        self._loads: dict[JobId, _Load] = {}
        self._stores: dict[JobId, _Store] = {}
        self._finished: list[JobResult] = []  # jobs that needed no I/O
        self._reported = DiskTierStats()  # what get_stats already reported
        self._logged_write_errors: set[str] = set()
        logger.info(
            "turnkv disk tier at %s: at most %d bytes (%d chunks of %d bytes)",
            self.directory, self.settings.max_bytes,
            self.settings.max_bytes // self.block_size_bytes, self.block_size_bytes,
        )

    @property
    def stats(self) -> DiskTierStats:
        return self.index.stats

    def _chunk(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._flat[chunk_id * size : (chunk_id + 1) * size]

    def _delete(self, name: str) -> None:
        try:
            (self.directory / name).unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("turnkv disk tier: cannot delete %s: %s", name, exc)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self.index.state(key)
        if state is ChunkState.READY:
            self.index.touch(key)  # about to be promoted: evict it last
            return LookupResult.HIT
        return LookupResult.RETRY if state is ChunkState.STORING else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            self.index.touch(key)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys: list[OffloadKey] = []
        writes: list[tuple[Path, memoryview]] = []
        complete = True
        for key, chunk_id in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            if key in self.index:  # stored or being stored already: a use, not a write
                self.index.touch(key)
                continue
            name = chunk_file_name(key)
            evicted = self.index.reserve(key, name, self.block_size_bytes)
            if evicted is None:
                complete = False  # no room even after eviction: not stored
                continue
            for entry in evicted:
                self._delete(entry.name)
            keys.append(key)
            writes.append((self.directory / name, self._chunk(int(chunk_id))))
        if not writes:
            self._finished.append(JobResult(job_metadata.job_id, complete, transfer_bytes=0))
            return
        future = self._writers.submit(_timed, lambda: store_chunks(writes))
        self._stores[job_metadata.job_id] = _Store(keys, complete, future)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        pinned: list[OffloadKey] = []
        reads: list[ChunkRead] = []
        for key, chunk_id in zip(keys, job_metadata.chunk_ids, strict=True):
            entry = self.index.pin(key)
            if entry is None or entry.digest is None:
                break  # evicted since its lookup (rare): this chunk and the rest fail
            pinned.append(key)
            reads.append(ChunkRead(self.directory / entry.name, entry.size, entry.digest,
                                   self._chunk(int(chunk_id))))
        future = self._readers.submit(_timed, lambda: load_chunks(reads))
        self._loads[job_metadata.job_id] = _Load(keys, pinned, future)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._finished = self._finished, []
        for job_id, load in list(self._loads.items()):
            if load.future.done():
                del self._loads[job_id]
                results.append(self._finish_load(job_id, load))
        for job_id, store in list(self._stores.items()):
            if store.future.done():
                del self._stores[job_id]
                results.append(self._finish_store(job_id, store))
        return results

    def _finish_load(self, job_id: JobId, load: _Load) -> JobResult:
        try:
            outcome, seconds = load.future.result()
        except Exception as exc:  # a fault of the read path itself: fail it like a bad file
            logger.exception("turnkv disk tier: load job %d failed", job_id)
            outcome, seconds = LoadOutcome(0, ReadFailure.ERROR, repr(exc)), 0.0
        for key in load.pinned:
            self.index.unpin(key)
        if outcome.failure is not None and outcome.verified < len(load.pinned):
            self._drop_bad_file(load.pinned[outcome.verified], outcome)
        loaded = load.keys[: outcome.verified]
        success = len(loaded) == len(load.keys)
        return JobResult(
            job_id, success,
            successful_keys=None if success or not loaded else tuple(loaded),
            transfer_time=seconds, transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    def _drop_bad_file(self, key: OffloadKey, outcome: LoadOutcome) -> None:
        entry = self.index.discard(key)
        if entry is None or outcome.failure is None:
            return
        counter = _FAILURE_COUNTER[outcome.failure]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        # Once per file: its entry is gone, so it cannot fail again.
        logger.warning(
            "turnkv disk tier: %s failed its check (%s: %s); dropped, the engine will "
            "recompute its tokens", self.directory / entry.name, outcome.failure.value,
            outcome.detail,
        )
        self._delete(entry.name)

    def _finish_store(self, job_id: JobId, store: _Store) -> JobResult:
        try:
            outcome, seconds = store.future.result()
        except Exception as exc:
            logger.exception("turnkv disk tier: store job %d failed", job_id)
            outcome, seconds = StoreOutcome(error=repr(exc)), 0.0
        written = store.keys[: len(outcome.digests)]
        for key, digest in zip(written, outcome.digests, strict=True):
            self.index.commit(key, digest)
        failed = store.keys[len(written) :]
        for key in failed:
            entry = self.index.discard(key)
            if entry is not None:
                self._delete(entry.name)
        if failed:
            self.stats.failed_stores += len(failed)
            if outcome.error not in self._logged_write_errors:  # a full disk fails every store
                self._logged_write_errors.add(str(outcome.error))
                logger.warning("turnkv disk tier: writing a chunk failed (%s); not stored",
                               outcome.error)
        return JobResult(
            job_id, store.complete and not failed, transfer_time=seconds,
            transfer_bytes=len(written) * self.block_size_bytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._stores or self._finished)

    def drain_jobs(self) -> None:
        futures: list[cf.Future[Any]] = [load.future for load in self._loads.values()]
        futures += [store.future for store in self._stores.values()]
        cf.wait(futures)

    def shutdown(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writers.shutdown(wait=True, cancel_futures=True)
        self._loads.clear()
        self._stores.clear()
        # vLLM closes the host region after its tiers: no view of it may outlive this call.
        self._flat.release()
        shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        metrics: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingGaugeMetadata(documentation=doc) for name, doc in GAUGES.items()
        }
        for field_name, name in COUNTERS.items():
            what = field_name.replace("_", " ")
            metrics[name] = OffloadingCounterMetadata(
                documentation=f"turnkv disk tier: {what} since the engine started.")
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What changed since the last call: gauges when they moved, counters' increments."""
        now, before = self.stats, self._reported
        stats = OffloadingConnectorStats()
        for name, value, old in (
            ("turnkv:disk_tier_bytes_used", now.bytes_used, before.bytes_used),
            ("turnkv:disk_tier_entries", now.entries, before.entries),
        ):
            if value != old:
                stats.set_gauge(name, value)
        for field_name, name in COUNTERS.items():
            increment = getattr(now, field_name) - getattr(before, field_name)
            if increment:
                stats.increase_counter(name, increment)
        self._reported = dataclasses.replace(now)
        return None if stats.is_empty() else stats
