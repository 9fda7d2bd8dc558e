"""Where turnkv keeps its state on disk (models, caches)."""

from __future__ import annotations

import os
from pathlib import Path


def turnkv_home() -> Path:
    """`$TURNKV_HOME` if set, else `~/.cache/turnkv`."""
    env = os.environ.get("TURNKV_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "turnkv"


def models_dir(home: Path | None = None) -> Path:
    """The folder that holds provisioned models: `<home>/models`."""
    return (home if home is not None else turnkv_home()) / "models"
