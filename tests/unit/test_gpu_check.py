"""scripts/gpu_check.py in host memory: the GPU layouts' blocks move whole through the protocol.

The script is what a session with a GPU runs (docs/benchmarks.md, "On a GPU"); here its byte
check runs on CPU tensors shaped as vLLM's GPU attention backends shape them (FlashAttention's
`[2, blocks, ...]`: K and V of a block are two ranges per layer; FlashInfer's
`[blocks, 2, ...]`: one), two real NIXL agents in one process, so the layouts' descriptions
and the script itself cannot rot between GPU sessions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_check  # noqa: E402

SMALL = gpu_check.Shape(layers=3, kv_heads=2, head_size=32, blocks=12, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", gpu_check.LAYOUTS)
def test_a_gpu_layouts_blocks_arrive_bit_for_bit_and_nothing_else_changes(layout: str) -> None:
    gpu_check.apply_poll_delay()
    result = gpu_check.check_bytes(SMALL, layout, "cpu", two_processes=False, seed=3)
    assert result["blocks_moved"] == 4
    assert result["failed_blocks"] == []
    assert result["moved_equal"] and result["others_untouched"], result


def test_the_check_sees_a_block_that_did_not_arrive() -> None:
    # The oracle of the byte check itself: a poisoned (NaN) receiver block differs from its
    # source, and an untouched one equals what it was.
    engine = gpu_check.Engine("e", SMALL, "flash-attn", "cpu", listen=False)
    try:
        poisoned = engine.blocks_bytes([0])[0]
        engine.fill_random(5)
        filled = engine.blocks_bytes([0, 0])
        assert not torch.equal(poisoned, filled[0])
        assert torch.equal(filled[0], filled[1])
    finally:
        engine.close()
