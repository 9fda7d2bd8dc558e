"""What two engines must share before KV moves between them: fingerprints and token digests."""

from __future__ import annotations

from turnkv_server.connector.identity import Fingerprint, config_digest, token_digest


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


def test_a_config_digest_names_the_model_not_where_it_was_read() -> None:
    config = {"hidden_size": 64, "rope_parameters": {"rope_type": "default", "theta": 1e4},
              "_name_or_path": "/models/a", "transformers_version": "5.19.0"}
    moved = {**config, "_name_or_path": "/mnt/b", "transformers_version": "5.20.0"}
    assert config_digest(config) == config_digest(moved)
    assert config_digest(config) == config_digest(dict(reversed(list(config.items()))))
    scaled = {**config, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "theta": 1e4}}
    assert config_digest(config) != config_digest(scaled)
