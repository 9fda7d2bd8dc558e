"""The shared tier: vLLM's file-system tier in one folder that every engine of a cluster on this
machine reads, its lookups answered at once.

vLLM's tier (upstream `vllm/v1/kv_offload/tiering/fs/manager.py`) is written for storage whose
`stat` is a network round trip: it answers a lookup it has not made yet with RETRY and makes it
on a thread of its own (`tiering/async_lookup.py`), and vLLM's offloading connector leaves a
request waiting while any of its chunks is RETRY (upstream `offloading/scheduler.py`). Every
turn reaches that lookup, because its new tokens' chunks are in no tier yet: the host tier
misses them and asks the shared one. So every turn waited one more engine step before it could
be scheduled, and on a busy engine a step is a decode of the batch or a chunk of another
session's prompt. Here the folder is on this machine (the run folder), where a `stat` costs
microseconds: `SharedFileTier` answers HIT or MISS on the scheduler's thread, and a turn whose
chunks no tier holds is scheduled in the step it arrives, as under the host tier alone.

A chunk whose load failed is answered MISS from then on (vLLM's tier does the same through its
cached verdicts, so that a doomed promotion is not issued again and again) until this engine
stores it anew; the set of such chunks is bounded.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

# Chunks remembered as unreadable; the oldest is forgotten first (a forgotten one is looked up
# again, fails its load again and is computed: never served).
MAX_UNREADABLE = 65_536


class SharedFileTier(FileSystemTierManager):
    """vLLM's file-system tier whose lookups are a `stat` on the scheduler's thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # vLLM's, as its factory calls it
        super().__init__(*args, **kwargs)
        self._unreadable: OrderedDict[OffloadKey, None] = OrderedDict()
        self._loading: dict[JobId, list[OffloadKey]] = {}
        self._storing: dict[JobId, list[OffloadKey]] = {}

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._unreadable or not os.path.exists(self.file_mapper.get_file_name(key)):
            return LookupResult.MISS
        return LookupResult.HIT

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._storing[job_metadata.job_id] = list(job_metadata.keys)
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loading[job_metadata.job_id] = list(job_metadata.keys)
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = list(super().get_finished_jobs())
        for result in results:
            stored = self._storing.pop(result.job_id, None)
            if stored is not None and result.success:
                for key in stored:
                    self._unreadable.pop(key, None)
            loaded = self._loading.pop(result.job_id, None)
            if loaded is not None and not result.success:
                self._mark_unreadable(loaded[len(result.successful_keys or ()):])
        return results

    def _mark_unreadable(self, keys: Collection[OffloadKey]) -> None:
        for key in keys:
            self._unreadable[key] = None
            self._unreadable.move_to_end(key)
        while len(self._unreadable) > MAX_UNREADABLE:
            self._unreadable.popitem(last=False)
