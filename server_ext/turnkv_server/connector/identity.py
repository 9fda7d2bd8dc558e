"""What must match before one engine's KV may be copied into another's.

KV is copied by position, so two things are checked before any byte moves:

- the engines: a `Fingerprint` travels in the hello; a peer whose fingerprint differs is
  refused, and the reason names what differs. It names what a block's bytes depend on: the
  weights (a digest of every byte, `checkpoint`), the model's configuration as the engine
  resolved it (`config_digest`: overrides such as rope scaling included), the revision and
  quantization, the compute and KV dtypes, the block size (`engine_identity`), the attention
  backend and KV cache layout vLLM chose, the KV tensors' shapes and memory order
  (`layout.describe_layout`) and the byte ranges of a block (`transport`). Byte lengths alone
  pass bf16 against fp16, another checkpoint of the same shape, or heads and tokens swapped;
- the tokens: each registration carries a `token_digest` of the token IDs its KV covers (from
  the first token, since a position's KV depends on every token before it), and the sender
  compares it with the digest of its own request's tokens. A history rendered differently on
  the two engines (another chat template, a date in the system prompt, a field `/tokenize`
  does not see) then costs a recompute, never KV of other tokens.

Pure standard library: the connector's two halves and the tests import it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DIGEST_BYTES = 16
# Keys of a model config that name where or with what it was read, not the model.
_NOT_THE_MODEL = ("transformers_version",)


def token_digest(token_ids: Sequence[int]) -> bytes:
    """A digest of a token ID sequence, the same on every host."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True)
class Fingerprint:
    """Named facts about an engine that two engines exchanging KV must share."""

    fields: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, fields: Mapping[str, object]) -> Fingerprint:
        return cls(tuple(sorted((str(k), str(v)) for k, v in fields.items())))

    def with_fields(self, fields: Mapping[str, object]) -> Fingerprint:
        return Fingerprint.of({**dict(self.fields), **fields})

    def differences(self, other: Fingerprint) -> list[str]:
        """What differs, as `name: ours != theirs` (empty when they match)."""
        ours, theirs = dict(self.fields), dict(other.fields)
        return [f"{name}: {ours.get(name, '-')} != {theirs.get(name, '-')}"
                for name in sorted(ours.keys() | theirs.keys())
                if ours.get(name) != theirs.get(name)]

    def to_wire(self) -> dict[str, str]:
        return dict(self.fields)

    @classmethod
    def from_wire(cls, wire: Mapping[str, str]) -> Fingerprint:
        return cls.of(wire)


def config_digest(config: Mapping[str, object]) -> str:
    """A digest of a model's configuration as the engine resolved it (a Hugging Face config's
    `to_dict()`, overrides applied), the same for the same model on every host: private keys
    (``_name_or_path``, the folder it was read from) and the library's version are left out,
    keys are sorted."""
    text = json.dumps(_model_facts(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).hexdigest()


def _model_facts(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _model_facts(v) for k, v in value.items()
                if not str(k).startswith("_") and k not in _NOT_THE_MODEL}
    if isinstance(value, (list, tuple)):
        return [_model_facts(v) for v in value]
    return value
