"""A tier below the engine's KV cache: an evicted session's KV kept in host memory (and, through
vLLM's tiering, on local disk) and loaded back on its next turn instead of recomputed.

Built on vLLM's own offloading framework (`OffloadingConnector` and `vllm/v1/kv_offload/`):
vLLM keeps the scheduler side (which blocks are offloaded, where, what to evict); this package
gives it a worker that runs on CPU hosts. See docs/tier.md.

- `settings`: the tier's settings, checked (host size in blocks or bytes, `offload_prompt_only`);
- `addressing`: which engine block goes to which host chunk slot, per transfer;
- `host_copy`: the copy between the engine's KV tensors and the host buffer (torch, CPU);
- `vllm_spec`: the specs vLLM loads by module path (`HostOffloadingSpec`,
  `HostTieringOffloadingSpec`) and their worker, its stores paced over the engine's steps
  (`store_pacing`);
- `offloading_connector`: `HostTierConnector`, vLLM's `OffloadingConnector` whose store fence
  also covers the blocks the turnkv connector's peer writes (loaded beside turnkv);
- `disk`: `CheckedDiskTier`, a bounded, checksummed disk tier below host memory, loaded by
  vLLM's tiering as a secondary tier; its index (`disk_index`) and chunk files (`disk_files`)
  are plain Python;
- `shared_files`: `SharedFileTier`, vLLM's file-system tier whose lookups are answered at once,
  one folder below every engine of a cluster on one machine. `vllm_spec`,
  `offloading_connector`, `disk` and `shared_files` are the only modules here that import vLLM.

Importing this package imports nothing of vLLM.
"""
