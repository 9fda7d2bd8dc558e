"""Multi-turn conversations for tests: long enough to span several KV blocks per turn."""

from __future__ import annotations

import copy
from typing import Any

SYSTEM = (
    "You are a careful coding assistant. You read files, search code and explain what you find "
    "in short, precise answers. Tools available: list_files(path), read_file(path), "
    "search(pattern). Always cite the file and line you rely on."
)

USER_TURNS = [
    "I am looking at a small key-value store written in Python. The module store.py defines a "
    "class Store with methods get, put, delete and scan, and a write-ahead log in wal.py that "
    "appends one JSON line per mutation and fsyncs every hundred lines. Explain what can go "
    "wrong if the process crashes between a put and the next fsync.",
    "Here is the output of the read_file tool for wal.py: def append(self, record): "
    "self._fh.write(json.dumps(record) + '\\n'); self._count += 1; if self._count % 100 == 0: "
    "os.fsync(self._fh.fileno()). And the recovery code replays every line it can parse and "
    "stops at the first line that fails to parse. Is the recovery correct for torn writes?",
    "Thanks. Now the search tool found three callers of Store.scan: the compactor, the backup "
    "job and the HTTP handler for range queries. The compactor holds a lock while scanning; the "
    "other two do not. Could a concurrent put make scan return a key twice or skip one?",
    "Suppose we switch the log to fsync on every append. Estimate the cost for a workload of "
    "two thousand small writes per second on a disk with one millisecond fsync latency, and "
    "suggest a group-commit design that keeps durability while batching the fsync calls.",
    "Finally, write a short checklist that a reviewer should use for any future change to the "
    "write-ahead log, covering crash safety, concurrency, recovery and performance testing.",
    "The read_file tool returned compactor.py: it copies live keys into a new segment, renames "
    "the segment over the old one and then truncates the log. What happens if the process dies "
    "after the rename but before the truncate, and how should recovery treat that state?",
    "A teammate proposes memory-mapping the segments instead of reading them with buffered "
    "file objects. List the benefits and the risks for this store, including behaviour when a "
    "segment is truncated by another process while it is mapped.",
    "Summarise everything we found today in five bullet points, most severe problem first, "
    "and say which file each problem lives in.",
]


def conversation(replies: list[str], turns: int) -> list[list[dict[str, Any]]]:
    """The messages of each of `turns` turns, given the assistant replies of the turns before."""
    per_turn = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[turn]})
        per_turn.append(copy.deepcopy(messages))
        if turn < len(replies):
            messages.append({"role": "assistant", "content": replies[turn]})
    return per_turn
