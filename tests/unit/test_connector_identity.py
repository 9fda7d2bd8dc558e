"""What two engines must share before KV moves between them: fingerprints and token digests."""

from __future__ import annotations

from pathlib import Path

from turnkv_server.connector.identity import Fingerprint, checkpoint_digest, token_digest


def test_token_digests_tell_any_difference_and_only_a_difference() -> None:
    tokens = list(range(5000))
    assert token_digest(tokens) == token_digest(tuple(tokens))
    assert token_digest(tokens) != token_digest(tokens[:-1])
    edited = tokens.copy()
    edited[2500] = 1
    assert token_digest(tokens) != token_digest(edited)
    # Not a sum or a set: the order of the tokens counts.
    assert token_digest([1, 2]) != token_digest([2, 1])


def test_fingerprints_name_what_differs() -> None:
    ours = Fingerprint.of({"model": "abc", "dtype": "float32", "block_size": 128})
    assert ours.differences(Fingerprint.of({"block_size": "128", "dtype": "float32",
                                            "model": "abc"})) == []
    theirs = ours.with_fields({"dtype": "bfloat16", "layout": "4096"})
    assert ours.differences(theirs) == ["dtype: float32 != bfloat16", "layout: - != 4096"]
    assert Fingerprint.from_wire(ours.to_wire()) == ours


def test_two_checkpoints_of_the_same_shape_differ(tmp_path: Path) -> None:
    for name, byte in (("a", b"\x01"), ("b", b"\x02")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text('{"hidden_size": 64}')
        # Same names, same sizes, other weights: a fine-tune of the same base.
        (folder / "model.safetensors").write_bytes(byte * (3 << 20))
    assert checkpoint_digest(tmp_path / "a") != checkpoint_digest(tmp_path / "b")
    # The same weights at another path (another host's mount) are the same model.
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in (tmp_path / "a").iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert checkpoint_digest(copy) == checkpoint_digest(tmp_path / "a")
    assert checkpoint_digest("org/some-model") == "name:org/some-model"
