"""Every serving mode by name: vLLM's own (`modes`) and turnkv's (`turnkv_mode`)."""

from __future__ import annotations

from turnkv_server.router.modes import UPSTREAM_MODES, Mode, ModeContext
from turnkv_server.router.turnkv_mode import Turnkv

MODES: dict[str, type[Mode]] = {"turnkv": Turnkv, **UPSTREAM_MODES}


def make_mode(name: str, ctx: ModeContext) -> Mode:
    try:
        return MODES[name](ctx)
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(MODES)}") from None
