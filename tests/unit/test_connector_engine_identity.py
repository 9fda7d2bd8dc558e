"""The engine's fingerprint, from vLLM's own configuration of an engine (no weights loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.unit.vllm_engine import engine_config, model_folder, turnkv
from turnkv_server.connector.checkpoint import checkpoint_digest
from turnkv_server.connector.engine_identity import engine_fingerprint
from turnkv_server.connector.identity import Fingerprint

WEIGHTS = b"\x01" * 4096


def fingerprint(folder: Path, **model: Any) -> Fingerprint:
    return engine_fingerprint(engine_config(folder, turnkv(), **model))


def differing(a: Fingerprint, b: Fingerprint) -> list[str]:
    return [line.split(":")[0] for line in a.differences(b)]


def model(root: Path, weights: bytes = WEIGHTS) -> Path:
    folder = model_folder(root)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_the_fingerprint_names_what_the_kv_depends_on(tmp_path: Path) -> None:
    folder = model(tmp_path / "m")
    fields = dict(fingerprint(folder).fields)
    assert fields["model"] == checkpoint_digest(folder)
    assert (fields["dtype"], fields["kv_cache_dtype"], fields["block_size"]) == (
        "torch.float32", "auto", "16")
    assert (fields["revision"], fields["quantization"]) == ("-/-", "-")
    assert fields["attention_backend"] == "CPU_ATTN"  # what vLLM picks on this host
    assert "kv_cache_layout" in fields and "config" in fields
    # The same checkpoint at another path (another host's mount) is the same engine, and
    # the fingerprint is the same at every call.
    assert fingerprint(model(tmp_path / "elsewhere")) == fingerprint(folder)


def test_what_config_json_does_not_say_still_counts(tmp_path: Path) -> None:
    folder = model(tmp_path / "m")
    base = fingerprint(folder)
    # Rope scaling given on the command line: the KV of every position changes.
    rope = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    assert differing(base, fingerprint(folder, hf_overrides=rope)) == ["config"]
    # Remote code of another revision.
    assert differing(base, fingerprint(folder, code_revision="abc123")) == ["revision"]
    assert differing(base, fingerprint(folder, dtype="bfloat16")) == ["dtype"]
    # A fine-tune: same files, same config, other weights.
    tuned = model(tmp_path / "tuned", WEIGHTS[:-1] + b"\x02")
    assert differing(base, fingerprint(tuned)) == ["model"]
