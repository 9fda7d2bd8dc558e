"""Which engine block goes to which host slot, for one transfer.

vLLM's offloading scheduler hands the worker, per transfer, the engine blocks (grouped by KV cache
group, each group's blocks logically consecutive in the request) and the host chunks they map to.
A chunk holds `blocks_per_chunk` consecutive engine blocks of a request, so a group whose first
block is not chunk-aligned (its logical index `block_index` is not a multiple of
`blocks_per_chunk`) starts in the middle of its first chunk, and its last chunk may be partial.
This module turns that into three index arrays per group: engine row, host chunk, slot in the
chunk. It follows the arithmetic of `SingleDirectionOffloadingHandler.transfer_async` (upstream
`vllm/v1/kv_offload/cpu/gpu_worker.py`), where the engine side always has one block per "chunk".
Numpy only: no vLLM, no torch, so it is checked on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]


class AddressingError(ValueError):
    """The engine blocks and host chunks of a transfer do not describe the same blocks."""


@dataclass(frozen=True)
class GroupCopy:
    """One KV cache group's part of a transfer: block `i` is engine row `engine_rows[i]` and
    host slot `host_slots[i]` of chunk `host_chunks[i]`."""

    group: int
    engine_rows: IndexArray
    host_chunks: IndexArray
    host_slots: IndexArray

    def __len__(self) -> int:
        return len(self.engine_rows)


def plan_copies(
    engine_blocks: Sequence[int] | npt.NDArray[np.integer],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    host_chunks: Sequence[int] | npt.NDArray[np.integer],
    blocks_per_chunk: int,
) -> list[GroupCopy]:
    """The per-group index arrays of one transfer. Groups with no blocks are left out and take
    no chunks, as upstream. Raises `AddressingError` when the counts disagree: a copy to the
    wrong slot would be wrong KV served later, never an error, so nothing is guessed."""
    if blocks_per_chunk <= 0:
        raise AddressingError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    if len(group_sizes) != len(block_indices):
        raise AddressingError(
            f"{len(group_sizes)} group sizes but {len(block_indices)} block indices"
        )
    engine = np.asarray(engine_blocks, dtype=np.int64).reshape(-1)
    chunks = np.asarray(host_chunks, dtype=np.int64).reshape(-1)
    if int(sum(group_sizes)) != len(engine):
        raise AddressingError(
            f"group sizes {list(group_sizes)} add up to {sum(group_sizes)} blocks, "
            f"but the transfer names {len(engine)} engine blocks"
        )

    copies: list[GroupCopy] = []
    engine_offset = chunk_offset = 0
    for group, (size, block_index) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size < 0 or block_index < 0:
            raise AddressingError(f"group {group}: size {size}, block index {block_index}")
        if size == 0:
            continue
        # The group's first block sits `skip` slots into its first chunk.
        skip = block_index % blocks_per_chunk
        num_chunks = -(-(size + skip) // blocks_per_chunk)
        if chunk_offset + num_chunks > len(chunks):
            raise AddressingError(
                f"group {group} needs {num_chunks} host chunk(s) from position {chunk_offset}, "
                f"but the transfer names {len(chunks)}"
            )
        positions = skip + np.arange(size, dtype=np.int64)
        group_chunks = chunks[chunk_offset : chunk_offset + num_chunks]
        copies.append(
            GroupCopy(
                group=group,
                engine_rows=engine[engine_offset : engine_offset + size],
                host_chunks=group_chunks[positions // blocks_per_chunk],
                host_slots=positions % blocks_per_chunk,
            )
        )
        engine_offset += size
        chunk_offset += num_chunks
    if chunk_offset != len(chunks):
        raise AddressingError(
            f"the transfer names {len(chunks)} host chunks but its blocks fill {chunk_offset}"
        )
    return copies
