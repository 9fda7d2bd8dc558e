"""Block tables of real torch KV layouts: every descriptor is exactly the block's bytes."""

from __future__ import annotations

import pytest
import torch

from turnkv_server.connector.blocktable import BlockTable, find_block_dim
from turnkv_server.connector.layout import UnsupportedLayout

BLOCKS, HEADS, SIZE, DIM = 6, 2, 4, 8


def cpu_layers(n: int = 3) -> list[torch.Tensor]:
    """vLLM's CPU layout: per layer [blocks, kv_heads, block_size, 2 * head_dim], all layers
    views of one buffer."""
    buffer = torch.zeros(n * BLOCKS * HEADS * SIZE * 2 * DIM)
    return list(buffer.view(n, BLOCKS, HEADS, SIZE, 2 * DIM).unbind(0))


def test_cpu_layout_one_range_per_layer() -> None:
    layers = cpu_layers()
    table = BlockTable.from_layers(layers, BLOCKS)
    assert len(table.ranges) == 3
    assert table.block_bytes == 3 * layers[0][0].nbytes
    descs = table.descriptors()
    for r, layer in enumerate(layers):
        for b in range(BLOCKS):
            address, length, device = descs[table.indices([b])[r]]
            assert (address, length, device) == (layer[b].data_ptr(), layer[b].nbytes, 0)


def test_flash_layout_keys_and_values_apart() -> None:
    layer = torch.zeros(2, BLOCKS, SIZE, HEADS, DIM)  # K and V planes, blocks second
    assert find_block_dim(layer, BLOCKS) == 1
    table = BlockTable.from_layers([layer], BLOCKS)
    assert len(table.ranges) == 2
    descs = table.descriptors()
    for plane in (0, 1):
        address, length, _ = descs[table.indices([5])[plane]]
        assert (address, length) == (layer[plane, 5].data_ptr(), layer[plane, 5].nbytes)


def test_indices_are_range_major_and_checked() -> None:
    table = BlockTable.from_layers(cpu_layers(2), BLOCKS)
    assert table.indices([1, 4]) == [1, 4, BLOCKS + 1, BLOCKS + 4]
    with pytest.raises(IndexError):
        table.indices([BLOCKS])


def test_wire_round_trip_and_compatibility() -> None:
    table = BlockTable.from_layers(cpu_layers(), BLOCKS)
    assert BlockTable.from_wire(table.to_wire()) == table
    assert table.compatible(BlockTable.from_layers(cpu_layers(), BLOCKS))
    assert not table.compatible(BlockTable.from_layers(cpu_layers(2), BLOCKS))


def test_no_block_dimension_is_refused() -> None:
    with pytest.raises(UnsupportedLayout, match="block count"):
        BlockTable.from_layers(cpu_layers(), BLOCKS + 1)


def test_layer_ranges_name_each_layers_ranges() -> None:
    layers = cpu_layers(3)
    table = BlockTable.from_layers([*layers, layers[1]], BLOCKS)  # the last shares layer 1's KV
    assert table.layer_ranges == ((0,), (1,), (2,), (1,))
    assert table.indices([4], table.layer_ranges[2]) == [2 * BLOCKS + 4]
    flash = BlockTable.from_layers([torch.zeros(2, BLOCKS, SIZE, HEADS, DIM) for _ in range(2)],
                                   BLOCKS)
    assert flash.layer_ranges == ((0, 1), (2, 3))
    assert BlockTable.from_wire(flash.to_wire()) == flash  # local knowledge, off the wire
