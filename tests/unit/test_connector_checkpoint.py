"""The weights' digest: every byte counts, each file version is hashed once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from turnkv_server.connector import checkpoint
from turnkv_server.connector.checkpoint import checkpoint_digest

SIZE = 8 << 20


def folder(root: Path, data: bytes, name: str = "model.safetensors") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / name).write_bytes(data)
    return root


def test_weight_files_that_differ_only_in_the_middle_differ(tmp_path: Path) -> None:
    # A fine-tune that changed one tensor of the middle layers: same names, sizes, header.
    data = bytearray(b"\x01" * SIZE)
    a = folder(tmp_path / "a", bytes(data))
    data[SIZE // 2] ^= 0xFF
    b = folder(tmp_path / "b", bytes(data))
    cache = tmp_path / "cache"
    assert checkpoint_digest(a, cache_dir=cache) != checkpoint_digest(b, cache_dir=cache)
    # The same weights at another path (another host's mount) are the same model.
    copy = folder(tmp_path / "copy", (a / "model.safetensors").read_bytes())
    assert checkpoint_digest(copy, cache_dir=cache) == checkpoint_digest(a, cache_dir=cache)


def test_each_file_version_is_hashed_once(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = folder(tmp_path / "m", b"\x02" * SIZE)
    cache = tmp_path / "cache"
    hashed: list[Path] = []
    real_hash = checkpoint._hash_file

    def counting(file: Path) -> str:
        hashed.append(file)
        return real_hash(file)

    monkeypatch.setattr(checkpoint, "_hash_file", counting)
    first = checkpoint_digest(model, cache_dir=cache)
    assert checkpoint_digest(model, cache_dir=cache) == first
    assert len(hashed) == 1  # the second start read nothing
    # Rewritten in place, same size, the old modification time put back: hashed again.
    weights = model / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(SIZE // 2)
        f.write(b"\x03")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint_digest(model, cache_dir=cache) != first
    assert len(hashed) == 2


def test_a_home_that_cannot_be_written_hashes_every_time(tmp_path: Path) -> None:
    model = folder(tmp_path / "m", b"\x04" * 1024)
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    assert checkpoint_digest(model, cache_dir=blocked / "cache") == checkpoint_digest(
        model, cache_dir=tmp_path / "cache")


def test_weights_are_what_vllm_loads(tmp_path: Path) -> None:
    model = folder(tmp_path / "m", b"\x05" * 1024)
    (model / "pytorch_model.bin").write_bytes(b"\x06" * 1024)  # beside safetensors: not loaded
    (model / "tokenizer.json").write_text("{}")
    assert checkpoint.weight_files(model) == [model / "model.safetensors"]
    only_bin = folder(tmp_path / "bin", b"\x06" * 1024, name="pytorch_model.bin")
    assert checkpoint.weight_files(only_bin) == [only_bin / "pytorch_model.bin"]
    # A hub ID that is not in the local cache is named by itself and its revision.
    assert checkpoint_digest("org/not-cached", "main", cache_dir=tmp_path) == (
        "name:org/not-cached@main")
