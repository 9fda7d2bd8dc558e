"""Where each KV block lives in memory: per-block regions derived from the KV tensors.

NIXL moves bytes between registered regions, so the connector must know, for block `b`, the
address ranges that hold it in every layer. Backends lay the cache out differently (vLLM's CPU
backend: per layer `[blocks, kv_heads, block_size, 2 * head_dim]`; GPU flash-attention:
`[2, blocks, block_size, kv_heads, head_dim]`, K and V apart), so nothing here assumes a
layout: a block is the sub-tensor at its index along the block dimension, cut into as few
contiguous byte ranges as its strides allow. The same code serves DRAM and VRAM (the caller
registers the memory type). Only the tensors' shapes, strides, dtypes and addresses are read.

Byte ranges say where a block is, not what its bytes mean: two caches whose blocks are cut into
ranges of the same lengths may still order heads and tokens differently. `describe_layout`
names the tensors' dtypes, shapes and memory order, for the engine's fingerprint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Protocol


class KVTensor(Protocol):
    """The part of `torch.Tensor` this module reads."""

    def data_ptr(self) -> int: ...
    def element_size(self) -> int: ...
    def stride(self) -> tuple[int, ...]: ...
    def is_contiguous(self) -> bool: ...
    def select(self, dim: int, index: int) -> KVTensor: ...
    def dim(self) -> int: ...
    def __getitem__(self, index: int) -> KVTensor: ...

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> object: ...


@dataclass(frozen=True)
class Region:
    """A contiguous byte range: what NIXL registers and addresses."""

    address: int
    length: int


class UnsupportedLayout(ValueError):
    """A KV cache this connector cannot describe block by block."""


def contiguous_regions(t: KVTensor) -> list[Region]:
    """`t`'s bytes as contiguous ranges, merging neighbours; splits along leading dimensions
    until the pieces are contiguous."""
    if t.is_contiguous():
        size = t.element_size()
        for n in t.shape:
            size *= n
        return [Region(t.data_ptr(), size)] if size else []
    if t.dim() == 0:
        raise UnsupportedLayout("a zero-dimensional tensor that is not contiguous")
    pieces: list[Region] = []
    for i in range(t.shape[0]):
        for region in contiguous_regions(t[i]):
            if pieces and pieces[-1].address + pieces[-1].length == region.address:
                last = pieces.pop()
                region = Region(last.address, last.length + region.length)
            pieces.append(region)
    return pieces


def block_regions(layers: Sequence[KVTensor], block_dim: int, block: int) -> list[Region]:
    """Every byte range that holds `block`, layer after layer."""
    regions: list[Region] = []
    for own in block_regions_by_layer(layers, block_dim, block):
        regions += own or []
    return regions


def block_regions_by_layer(layers: Sequence[KVTensor], block_dim: int,
                           block: int) -> list[list[Region] | None]:
    """`block`'s byte ranges in each of `layers`, in order.

    Tensors that share storage (layers viewing one buffer) are distinct views and each
    contributes its own ranges; a tensor repeated in `layers` (the same view twice, as vLLM
    passes shared KV) has its ranges once, at its first place, and `None` at the others.
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out: list[list[Region] | None] = []
    for t in layers:
        key = tensor_key(t)
        if key in seen:
            out.append(None)
            continue
        seen.add(key)
        if not 0 <= block_dim < t.dim():
            raise UnsupportedLayout(f"block dimension {block_dim} of a {t.dim()}-d KV tensor")
        if not 0 <= block < t.shape[block_dim]:
            raise IndexError(f"block {block} of {t.shape[block_dim]}")
        out.append(contiguous_regions(t.select(block_dim, block)))
    return out


def describe_layout(layers: Sequence[KVTensor], block_dim: int) -> str:
    """The KV tensors' dtypes, shapes (the block dimension as ``B``, so that caches of other
    sizes compare equal) and memory order (dimensions from the largest stride), layer after
    layer, runs of equal layers counted: ``"30x float32[B,3,32,128] order 0,1,2,3"``."""
    texts = [_describe_tensor(t, block_dim) for t in layers]
    return "; ".join(f"{len(list(run))}x {text}" for text, run in groupby(texts))


def _describe_tensor(t: KVTensor, block_dim: int) -> str:
    dims = ",".join("B" if d == block_dim else str(n) for d, n in enumerate(t.shape))
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    return f"{str(t.dtype).removeprefix('torch.')}[{dims}] order {','.join(map(str, order))}"


def tensor_key(t: KVTensor) -> tuple[int, tuple[int, ...]]:
    """What makes two entries of a layer list the same view of memory."""
    return t.data_ptr(), tuple(t.shape)


def check_parallelism(tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """The connector moves whole blocks between engines of one rank each, for now.

    Heterogeneous TP (a prefill engine at TP 4 feeding a decode engine at TP 8) needs each
    block split by KV head across ranks; docs/architecture.md plans it.
    """
    if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
        raise UnsupportedLayout(
            f"the turnkv connector supports tensor and pipeline parallel size 1 only, not "
            f"TP {tensor_parallel_size} / PP {pipeline_parallel_size}; run one engine per GPU "
            f"or use vLLM's NixlConnector (mode standard or bidirectional)")
