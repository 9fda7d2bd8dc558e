"""The disk tier's chunk files: one file per offload chunk, written whole, read back verified.

A chunk's bytes are the primary (host) tier's row for it, `chunk_bytes` long. A store hashes
them (blake2b, 16 bytes) and writes them to a temporary file that is renamed over the final
name, so a reader never sees half a file under the final name. The digest goes back to the
caller, whose index keeps it: the index, not the file, is the authority on what a chunk's bytes
must be, so a file that was truncated, extended, rewritten or deleted behind the tier's back
fails its read instead of being served.

A load reads each file straight into its destination slot and only then checks the length and
the digest. That is safe because the destination is a slot vLLM's tiering manager allocated for
this promotion and keeps unreadable until the promotion reports success; a failed check reports
failure, and the manager frees the slot with whatever bytes it holds.

Standard library only: no vLLM, no torch. Runs on the tier's I/O threads; nothing here touches
the index.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CHECKSUM_BYTES = 16


def checksum(data: memoryview | bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()


def chunk_file_name(key: bytes) -> str:
    """Where a chunk lives under the tier's directory: 256 subdirectories by the first byte
    of the key (a block hash: evenly spread), so no directory holds every file."""
    name = key.hex()
    return f"{name[:2]}/{name}.bin"


class ReadFailure(enum.Enum):
    MISSING = "missing"  # no file under the chunk's name
    CORRUPT = "corrupt"  # wrong length or wrong digest
    ERROR = "error"  # any other OS error (EIO, EMFILE, ...)


@dataclass(frozen=True)
class ChunkRead:
    """One chunk of a load: its file, the expected length and digest, and where it goes."""

    path: Path
    size: int
    digest: bytes
    dest: memoryview  # the primary tier's slot, `size` bytes


@dataclass
class LoadOutcome:
    verified: int  # leading chunks whose bytes were read and verified
    failure: ReadFailure | None = None  # why chunk `verified` failed; None if none did
    detail: str = ""


@dataclass
class StoreOutcome:
    digests: list[bytes] = field(default_factory=list)  # per leading chunk written
    error: str | None = None  # why the next chunk's write failed; None if none did


def _write_all(fd: int, data: memoryview) -> None:
    # os.write may write less than asked (signals, some filesystems): loop until done.
    while data:
        written = os.write(fd, data)
        if written <= 0:
            raise OSError(f"write returned {written}")
        data = data[written:]


def write_chunk(path: Path, data: memoryview) -> bytes:
    """Write `data` to `path` atomically (temporary file, then rename); return its digest."""
    digest = checksum(data)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return digest


def _read_into(fd: int, dest: memoryview) -> int:
    total = 0
    while total < len(dest):
        got = os.readv(fd, [dest[total:]])
        if got == 0:
            break
        total += got
    return total


def read_verified(chunk: ChunkRead) -> tuple[ReadFailure, str] | None:
    """Read `chunk` into its destination; None if its length and digest match, else why not."""
    try:
        fd = os.open(chunk.path, os.O_RDONLY)
    except FileNotFoundError:
        return ReadFailure.MISSING, "no such file"
    except OSError as exc:
        return ReadFailure.ERROR, str(exc)
    try:
        size = os.fstat(fd).st_size
        if size != chunk.size:
            return ReadFailure.CORRUPT, f"{size} bytes, expected {chunk.size}"
        got = _read_into(fd, chunk.dest)
        if got != chunk.size:
            return ReadFailure.CORRUPT, f"read {got} bytes, expected {chunk.size}"
        if checksum(chunk.dest) != chunk.digest:
            return ReadFailure.CORRUPT, "checksum mismatch"
    except OSError as exc:
        return ReadFailure.ERROR, str(exc)
    finally:
        os.close(fd)
    return None


def load_chunks(chunks: Sequence[ChunkRead]) -> LoadOutcome:
    """Read chunks in order, stopping at the first that fails: a prefix lookup cannot use
    chunks past a missing one, and the caller reports the verified prefix as loaded."""
    for index, chunk in enumerate(chunks):
        failed = read_verified(chunk)
        if failed is not None:
            return LoadOutcome(verified=index, failure=failed[0], detail=failed[1])
    return LoadOutcome(verified=len(chunks))


def store_chunks(writes: Sequence[tuple[Path, memoryview]]) -> StoreOutcome:
    """Write chunks in order, stopping at the first write that fails (a full disk fails the
    rest too)."""
    outcome = StoreOutcome()
    for path, data in writes:
        try:
            outcome.digests.append(write_chunk(path, data))
        except OSError as exc:
            outcome.error = str(exc)
            break
    return outcome
