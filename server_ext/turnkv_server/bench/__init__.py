"""`turnkv bench`: multi-turn workloads run against every serving mode, side by side.

Workloads (`workloads`, `presets`, `trace`) are plain data: sessions of turns with sizes, output
lengths, tool times and arrival times, generated from local text (`corpus`, `prompts`,
`tool_outputs`, sized by `sizing`) or replayed from a JSONL trace.

A run (`cli`) checks its `plan` before any engine starts; the `runner` then starts a fresh
cluster per mode, plays the workload through the SDK (`driver`, stopped by the `watchdog` on a
stall) and takes engine counters (`counters`) and CPU times (`cputime`) around it. `results`
holds what was measured, `report` renders it. `estimate` and `estimate_cli` (`turnkv
estimate`) are arithmetic, not measurement: the same turns' TTFT on a described GPU cluster.
"""
