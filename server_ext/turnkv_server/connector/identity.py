"""What must match before one engine's KV may be copied into another's.

KV is copied by position, so two things are checked before any byte moves:

- the engines: a `Fingerprint` of the model (its name and a digest of its weights), the
  compute and KV dtypes, the block size and the KV layout travels in the hello; a peer whose
  fingerprint differs is refused, and the reason names what differs. Byte lengths alone pass
  bf16 against fp16, or another checkpoint of the same shape;
- the tokens: each registration carries a `token_digest` of the token IDs its KV covers (from
  the first token, since a position's KV depends on every token before it), and the sender
  compares it with the digest of its own request's tokens. A history rendered differently on
  the two engines (another chat template, a date in the system prompt, a field `/tokenize`
  does not see) then costs a recompute, never KV of other tokens.

Pure standard library: the connector's two halves and the tests import it.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DIGEST_BYTES = 16
# Weight files are sampled, not read whole: their first and last MiB name a checkpoint.
_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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


def checkpoint_digest(model: str | Path) -> str:
    """A digest naming the weights of a local model folder (or file).

    Reads each weight file's size and its first and last MiB: two checkpoints of the same
    architecture differ there, and hashing gigabytes at engine start would cost minutes.
    A model that is not on disk (a hub name) is named by itself.
    """
    path = Path(model)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    else:
        return f"name:{model}"
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                h.update(f.read(_SAMPLE_BYTES))
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        h.update(config.read_bytes())
    return h.hexdigest()
