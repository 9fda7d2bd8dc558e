"""`turnkv bench`: multi-turn workloads run against every serving mode, side by side.

Workloads (`workloads`, `presets`, `trace`) are plain data: sessions of turns with sizes, output
lengths, tool times and arrival times, generated from local text or replayed from a JSONL trace.
"""
