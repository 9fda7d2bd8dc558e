"""On-disk model folders: manifests, checksums, locking and atomic publication.

Every provisioned model lives in `<home>/models/<name>/` with a `turnkv-model.json`
manifest listing the sha256 and size of every other file. A folder is only ever
published by renaming a fully built staging folder into place, so a reader sees either
nothing or a complete model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..paths import models_dir

MANIFEST = "turnkv-model.json"
MANIFEST_FORMAT = 1

Progress = Callable[[str], None]


class ModelError(RuntimeError):
    """A model could not be provisioned, verified or resolved."""


def say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line)


def model_folder(name: str, home: Path | None) -> Path:
    return models_dir(home) / name


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _payload_files(folder: Path) -> list[Path]:
    # Sorted so the manifest is byte-identical whenever the files are.
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST
    )


def write_manifest(folder: Path, name: str, source: dict[str, Any]) -> dict[str, Any]:
    # Some writers (safetensors via a temp file) leave 0600 files; a shared model cache should
    # be readable like any other file the user creates. The folder came from a plain mkdir, so
    # its mode is the umask-derived default (read here without touching the process umask,
    # which would race with other threads).
    file_mode = folder.stat().st_mode & 0o666
    for path in _payload_files(folder):
        path.chmod(file_mode)
    files = {
        p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in _payload_files(folder)
    }
    # No timestamps or host names: a deterministic build must give a deterministic manifest.
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "name": name,
        "source": source,
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def manifest_problem(
    folder: Path,
    name: str,
    *,
    deep: bool,
    source_check: Callable[[dict[str, Any]], bool] | None = None,
) -> str | None:
    """Why `folder` is not a valid published model, or None when it is.

    `deep=False` checks presence and sizes only (cheap, for the fast path); `deep=True` also
    re-hashes every file.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no readable {MANIFEST} in {folder}"
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("name") != name:
        return f"{folder / MANIFEST} is for another model or format"
    source = manifest.get("source")
    if source_check is not None and not (isinstance(source, dict) and source_check(source)):
        return f"{folder / MANIFEST} records a different source"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{folder / MANIFEST} lists no files"
    for rel, meta in files.items():
        path = folder / rel
        if not path.is_file():
            return f"missing file {path}"
        if path.stat().st_size != meta.get("size"):
            return f"size mismatch for {path}"
        if deep and sha256_file(path) != meta.get("sha256"):
            return f"sha256 mismatch for {path}"
    return None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' tqdm bars, which would interleave with our progress lines."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def build_lock(name: str, home: Path | None) -> Iterator[None]:
    """Serialise builders of one model across processes (two launchers starting at once)."""
    root = models_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{name}.lock").open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def staging(name: str, home: Path | None) -> Iterator[Path]:
    """A scratch folder next to the final one (same filesystem, so the rename is atomic).

    Must be used under `build_lock`. Leftovers of interrupted builds are removed first.
    """
    root = models_dir(home)
    for stale in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(built: Path, final: Path) -> None:
    """Move a complete model folder into place, replacing an invalid one if present."""
    if final.exists():
        # rename() cannot replace a non-empty directory: move the old one aside first. The
        # aside name matches the staging glob, so a crash here is cleaned up next time.
        aside = final.parent / f".{final.name}.tmp-old-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
        built.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        built.rename(final)


def build_once(name: str, home: Path | None, problem: Callable[[Path], str | None],
               build: Callable[[Path], Path], progress: Progress | None) -> Path:
    """`<home>/models/<name>/`: as it is where `problem` finds nothing wrong with it, else
    built by `build` (given an empty staging folder, it returns the model folder it built
    in it) and published. One process builds at a time; the others wait for it, then find
    its result."""
    final = model_folder(name, home)
    if problem(final) is None:
        return final
    with build_lock(name, home):
        # Another process may have finished the build while we waited for the lock.
        found = problem(final)
        if found is None:
            return final
        if final.exists():
            say(progress, f"rebuilding {name}: {found}")
        with staging(name, home) as tmp, quiet_transformers():
            publish(build(tmp), final)
    say(progress, f"{name} ready at {final}")
    return final
