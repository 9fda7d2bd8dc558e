"""Per-block regions from KV tensors of any layout, checked against the tensors' own bytes."""

from __future__ import annotations

import ctypes

import pytest
import torch

from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.layout import (
    Region,
    UnsupportedLayout,
    block_regions,
    check_parallelism,
    contiguous_regions,
    describe_layout,
)


def bytes_at(regions: list[Region]) -> bytes:
    """Read the memory the regions name (CPU tensors only: the test's own buffers)."""
    return b"".join(ctypes.string_at(r.address, r.length) for r in regions)


def test_cpu_layout_one_region_per_block_and_layer() -> None:
    # vLLM CPU: per layer [blocks, kv_heads, block_size, 2 * head_dim], views of one buffer.
    buffer = torch.arange(2 * 4 * 2 * 8 * 6, dtype=torch.float32)
    layers = list(buffer.view(2, 4, 2, 8, 6).unbind(0))
    regions = block_regions(layers, block_dim=0, block=3)
    assert len(regions) == 2 and all(r.length == 2 * 8 * 6 * 4 for r in regions)
    expected = b"".join(layer[3].contiguous().numpy().tobytes() for layer in layers)
    assert bytes_at(regions) == expected


def test_gpu_like_layout_splits_k_and_v() -> None:
    # Flash-attention style: [2 (K, V), blocks, block_size, kv_heads, head_dim].
    layer = torch.randn(2, 5, 4, 2, 8)
    regions = block_regions([layer], block_dim=1, block=2)
    assert len(regions) == 2  # K's block and V's block, apart
    assert bytes_at(regions) == layer[:, 2].contiguous().numpy().tobytes()


def test_neighbouring_pieces_merge_and_strided_ones_do_not() -> None:
    t = torch.arange(24, dtype=torch.int8).view(4, 6)
    assert contiguous_regions(t) == [Region(t.data_ptr(), 24)]
    column_pair = t[:, :2]  # 2 bytes of every 6-byte row
    regions = contiguous_regions(column_pair)
    assert [r.length for r in regions] == [2, 2, 2, 2]
    assert bytes_at(regions) == column_pair.contiguous().numpy().tobytes()


def test_a_repeated_view_counts_once() -> None:
    layer = torch.zeros(3, 2, 4)
    assert len(block_regions([layer, layer], block_dim=0, block=1)) == 1


def test_bad_block_or_dimension() -> None:
    layer = torch.zeros(3, 2, 4)
    with pytest.raises(IndexError):
        block_regions([layer], block_dim=0, block=3)
    with pytest.raises(UnsupportedLayout):
        block_regions([layer], block_dim=3, block=0)


def test_tensor_parallelism_above_one_is_refused_clearly() -> None:
    check_parallelism(1)
    with pytest.raises(UnsupportedLayout, match="TP 2 / PP 1"):
        check_parallelism(2)
    with pytest.raises(UnsupportedLayout, match="PP 2"):
        check_parallelism(1, 2)


def test_the_description_tells_apart_caches_whose_block_ranges_match() -> None:
    blocks = 8
    nhd = torch.zeros(2, blocks, 16, 4, 32)  # [K/V, blocks, tokens, heads, head_dim]
    hnd = torch.zeros(2, blocks, 4, 16, 32)  # [K/V, blocks, heads, tokens, head_dim]
    # Byte ranges alone match: a block is two ranges of the same length in both.
    assert BlockTable.from_layers([nhd], blocks).compatible(BlockTable.from_layers([hnd], blocks))
    assert describe_layout([nhd, nhd], 1) == "2x float32[2,B,16,4,32] order 0,1,2,3,4"
    assert describe_layout([hnd, hnd], 1) != describe_layout([nhd, nhd], 1)
    # Heads and tokens swapped in memory only (equal counts, so the same shapes).
    square = torch.zeros(2, blocks, 16, 16, 32)
    swapped = torch.zeros(2, blocks, 16, 16, 32).transpose(2, 3)
    assert describe_layout([swapped], 1) == "1x float32[2,B,16,16,32] order 0,1,3,2,4"
    assert describe_layout([square], 1) != describe_layout([swapped], 1)
    # Caches of other sizes and the same layout are described alike; another dtype is not.
    assert describe_layout([torch.zeros(2, 99, 16, 4, 32)], 1) == describe_layout([nhd], 1)
    assert describe_layout([nhd.to(torch.bfloat16)], 1) != describe_layout([nhd], 1)
