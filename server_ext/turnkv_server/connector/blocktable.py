"""One engine's KV cache as NIXL sees it: registered buffers and a descriptor per block region.

`layout.block_regions` cuts one block into contiguous ranges, layer after layer. Every block of
a paged cache has the same shape, so block `b`'s ranges are block 0's moved by a fixed stride
per range: the table keeps block 0's ranges and those strides (checked on the last block), and
a peer can address any of our blocks from that short description. Descriptor `r * N + b` is
range `r` of block `b` (N blocks): a transfer of some blocks is a list of indices on each side.
`layer_ranges` says which ranges belong to which layer (of the cache as the engine lists it),
so one layer of some blocks can be written on its own while the model computes the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv_server.connector.layout import (
    KVTensor,
    UnsupportedLayout,
    block_regions,
    block_regions_by_layer,
    tensor_key,
)


@dataclass(frozen=True)
class BlockTable:
    num_blocks: int
    # (address of the range in block 0, its length, bytes between consecutive blocks)
    ranges: tuple[tuple[int, int, int], ...]
    mem_type: str = "DRAM"
    device: int = 0
    # Range indices of each layer, in the engine's layer order; local knowledge, not on the
    # wire (a compatible peer's ranges line up one for one).
    layer_ranges: tuple[tuple[int, ...], ...] = field(default=(), compare=False)

    @classmethod
    def from_layers(cls, layers: Sequence[KVTensor], num_blocks: int, mem_type: str = "DRAM",
                    device: int = 0) -> BlockTable:
        """Describe `layers` (each with a dimension of size `num_blocks`, the block index)."""
        if not layers:
            raise UnsupportedLayout("no KV tensors to describe")
        block_dim = find_block_dim(layers[0], num_blocks)
        first = block_regions(layers, block_dim, 0)
        by_layer = _ranges_by_layer(layers, block_dim)
        if num_blocks == 1:
            return cls(1, tuple((r.address, r.length, 0) for r in first), mem_type, device,
                       by_layer)
        second = block_regions(layers, block_dim, 1)
        last = block_regions(layers, block_dim, num_blocks - 1)
        if not len(first) == len(second) == len(last):
            raise UnsupportedLayout("blocks of one cache cut into different numbers of ranges")
        ranges = []
        for a, b, z in zip(first, second, last, strict=True):
            stride = b.address - a.address
            if a.length != b.length or z.address != a.address + (num_blocks - 1) * stride:
                raise UnsupportedLayout("KV blocks are not evenly strided in memory")
            ranges.append((a.address, a.length, stride))
        return cls(num_blocks, tuple(ranges), mem_type, device, by_layer)

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length, _ in self.ranges)

    def descriptors(self) -> list[tuple[int, int, int]]:
        """(address, length, device) of every block range, in index order."""
        return [(address + b * stride, length, self.device)
                for address, length, stride in self.ranges
                for b in range(self.num_blocks)]

    def indices(self, blocks: Sequence[int], ranges: Sequence[int] | None = None) -> list[int]:
        """Descriptor indices of `blocks`, range-major (every block's range 0, then range 1...);
        only `ranges` of each block if given (one layer's, say)."""
        n = self.num_blocks
        for b in blocks:
            if not 0 <= b < n:
                raise IndexError(f"block {b} of {n}")
        which = range(len(self.ranges)) if ranges is None else ranges
        return [r * n + b for r in which for b in blocks]

    def compatible(self, other: BlockTable) -> bool:
        """Whether blocks can be copied range for range between the two caches."""
        return [length for _, length, _ in self.ranges] == \
            [length for _, length, _ in other.ranges]

    def to_wire(self) -> dict[str, Any]:
        return {"num_blocks": self.num_blocks, "ranges": [list(r) for r in self.ranges],
                "mem_type": self.mem_type, "device": self.device}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> BlockTable:
        return cls(int(wire["num_blocks"]),
                   tuple((int(a), int(n), int(s)) for a, n, s in wire["ranges"]),
                   str(wire["mem_type"]), int(wire["device"]))


def _ranges_by_layer(layers: Sequence[KVTensor], block_dim: int) -> tuple[tuple[int, ...], ...]:
    # A layer listed twice (shared KV) owns the ranges of its first listing.
    owned: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
    out, n = [], 0
    for t, regions in zip(layers, block_regions_by_layer(layers, block_dim, 0), strict=True):
        if regions is not None:
            owned[tensor_key(t)] = tuple(range(n, n + len(regions)))
            n += len(regions)
        out.append(owned[tensor_key(t)])
    return tuple(out)


def find_block_dim(tensor: KVTensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: the first of size `num_blocks`.

    CPU: `[blocks, kv_heads, block_size, 2 * head_dim]` (0); flash-attention:
    `[2, blocks, ...]` (1). A cache whose other dimensions could also equal the block count is
    ambiguous only if one comes first, which no vLLM layout does.
    """
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise UnsupportedLayout(f"no dimension of size {num_blocks} (the block count) in a KV "
                            f"tensor of shape {tuple(tensor.shape)}")
