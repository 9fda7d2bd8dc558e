"""A digest of a checkpoint's weights: every byte of every weight file, each file hashed once.

Two fine-tunes of one base have the same file names, sizes and safetensors header, and may
differ in a single tensor anywhere in the file; a digest of samples could miss that one, so
every byte is hashed (SHA-256, which OpenSSL runs with the CPU's SHA instructions where there
are some; a sharded checkpoint's files are hashed in parallel).

The engine reads the same files to load them, but an engine restarted on unchanged files
should not pay again: each file's digest is remembered under ``$TURNKV_HOME/weight-digests``
(model folders are often read-only), keyed by the file's resolved path, device, inode, size,
and modification and change times. A file rewritten in place changes its change time at least,
so it is hashed again; a file that changed while it was hashed is not remembered. Where the
home cannot be written, every start hashes.

A model named by a hub ID is found in the local hub cache at its revision (vLLM downloaded it
before the connector starts); one that is not there is named by its ID and revision.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from turnkv_server.paths import turnkv_home

log = logging.getLogger(__name__)

DIGEST_HEX = 32
# What vLLM loads weights from; a folder with safetensors is loaded from those alone.
_SAFETENSORS = ".safetensors"
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
_MAX_THREADS = 8


def digest_cache_dir() -> Path:
    return turnkv_home() / "weight-digests"


def checkpoint_digest(model: str | Path, revision: str | None = None,
                      cache_dir: Path | None = None) -> str:
    """A digest naming the weights of a model: a local folder or file, or a hub ID."""
    path = Path(model)
    if not path.exists():
        snapshot = _hub_snapshot(str(model), revision)
        if snapshot is None:
            return f"name:{model}@{revision or '-'}"
        path = snapshot
    files = weight_files(path)
    cache = digest_cache_dir() if cache_dir is None else cache_dir
    with ThreadPoolExecutor(max(1, min(len(files), os.cpu_count() or 1, _MAX_THREADS))) as pool:
        digests = list(pool.map(lambda f: file_digest(f, cache), files))
    h = hashlib.sha256()
    for file, digest in zip(files, digests, strict=True):
        h.update(f"{file.name}\0{digest}\0".encode())
    return h.hexdigest()[:DIGEST_HEX]


def weight_files(path: Path) -> list[Path]:
    """The files of a checkpoint vLLM would load its weights from, by name."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file())
    safetensors = [p for p in files if p.name.endswith(_SAFETENSORS)]
    return safetensors or [p for p in files if p.name.endswith(_OTHER_WEIGHTS)]


def file_digest(file: Path, cache: Path) -> str:
    """The SHA-256 of `file`'s bytes, remembered in `cache` for this version of the file."""
    key = _version_key(file)
    entry = cache / hashlib.sha256(key.encode()).hexdigest()
    try:
        remembered = entry.read_text().strip()
        if len(remembered) == 64:
            return remembered
    except OSError:
        pass
    digest = _hash_file(file)
    if _version_key(file) == key:  # unchanged while it was read
        _remember(entry, digest)
    return digest


def _hash_file(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _version_key(file: Path) -> str:
    real = file.resolve()
    st = real.stat()
    fields: Sequence[object] = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                st.st_ctime_ns)
    return "\0".join(map(str, fields))


def _remember(entry: Path, digest: str) -> None:
    temporary = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(digest)
        os.replace(temporary, entry)  # whole or not at all: engines may start side by side
    except OSError as exc:
        log.info("turnkv: cannot remember weight digests in %s (%s): the next start hashes "
                 "the weights again", entry.parent, exc)
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub ID, or not in the local cache: named by its ID
        return None
