"""The disk tier's index: which chunks it holds, in what order to evict them, how many bytes.

The index is the disk tier's only record of what is on disk: it starts empty (the tier clears
its directory at start), and a chunk counts only once its store finished and its digest is
recorded here. It lives on vLLM's scheduler thread; the I/O threads never touch it.

- `reserve` makes room for a new chunk before its file is written, evicting least recently used
  chunks first, and refuses (None) when the chunk cannot fit even then; it never evicts a chunk
  whose store is in flight or that a load is reading (`pins`), and evicts nothing when the room
  cannot be found anyway. Reserved bytes count at once, so the bytes on disk plus those being
  written never exceed `max_bytes`.
- `commit` records a finished store's digest; only then is the chunk `READY`.
- `touch` and `pin` (a load) make a chunk the most recently used.

Standard library only: no vLLM.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


class ChunkState(enum.Enum):
    ABSENT = "absent"
    STORING = "storing"  # reserved, its file being written
    READY = "ready"


@dataclass
class IndexEntry:
    name: str  # the file, relative to the tier's directory
    size: int  # bytes
    digest: bytes | None = None  # blake2b of the bytes, once the store finished
    pins: int = 0  # loads reading it now

    @property
    def ready(self) -> bool:
        return self.digest is not None


@dataclass
class DiskTierStats:
    """The tier's counters since start: plain attributes, for tests and metrics."""

    bytes_used: int = 0  # stored and reserved bytes
    entries: int = 0  # stored and reserved chunks
    evictions: int = 0  # chunks evicted to make room
    skipped_stores: int = 0  # chunks not stored: no room even after eviction
    failed_stores: int = 0  # chunks whose write failed
    checksum_failures: int = 0  # files of the wrong length or digest
    missing_files: int = 0  # files gone from disk
    read_errors: int = 0  # other errors reading a file


class DiskIndex:
    """Chunks by key, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = DiskTierStats()
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def items(self) -> Iterator[tuple[bytes, IndexEntry]]:
        return iter(list(self._entries.items()))

    def get(self, key: bytes) -> IndexEntry | None:
        return self._entries.get(key)

    def state(self, key: bytes) -> ChunkState:
        entry = self._entries.get(key)
        if entry is None:
            return ChunkState.ABSENT
        return ChunkState.READY if entry.ready else ChunkState.STORING

    def reserve(self, key: bytes, name: str, size: int) -> list[IndexEntry] | None:
        """Room for `key`'s `size` bytes: the evicted entries (their files are the caller's
        to delete), or None when it cannot fit even after evicting every evictable chunk."""
        if key in self._entries:
            raise KeyError(f"chunk {key.hex()} is already in the disk index")
        needed = self.stats.bytes_used + size - self.max_bytes
        victims: list[bytes] = []
        for other, entry in self._entries.items():
            if needed <= 0:
                break
            if entry.ready and entry.pins == 0:
                victims.append(other)
                needed -= entry.size
        if needed > 0:
            self.stats.skipped_stores += 1
            return None  # evict nothing for a chunk that will not fit anyway
        evicted = [self._remove(other) for other in victims]
        self.stats.evictions += len(evicted)
        self._entries[key] = IndexEntry(name=name, size=size)
        self.stats.bytes_used += size
        self.stats.entries += 1
        return evicted

    def commit(self, key: bytes, digest: bytes) -> None:
        """`key`'s store finished with these bytes: it is READY from now on."""
        self._entries[key].digest = digest

    def discard(self, key: bytes) -> IndexEntry | None:
        """Forget `key` (a failed store, a bad file); its file is the caller's to delete."""
        return self._remove(key) if key in self._entries else None

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def pin(self, key: bytes) -> IndexEntry | None:
        """A load starts reading `key`: not evictable until `unpin`, and now most recently
        used. None if it is not READY."""
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            return None
        entry.pins += 1
        self._entries.move_to_end(key)
        return entry

    def unpin(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def _remove(self, key: bytes) -> IndexEntry:
        entry = self._entries.pop(key)
        self.stats.bytes_used -= entry.size
        self.stats.entries -= 1
        return entry
