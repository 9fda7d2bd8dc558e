"""The serving modes, by name (`turnkv_server.mode_names`): vLLM's own (`standard`,
`bidirectional`, `push`), turnkv's (`turnkv`: what every turn of it runs, `planned`, and what
moves KV, the P/D form of `--fixed-pools` among it, `turnkv`) and session-affinity routing over
aggregated engines (`affinity`, the baseline); `base` says what a mode is."""

from __future__ import annotations

from typing import cast

from turnkv_server.mode_names import ROUTER_MODES, RouterMode
from turnkv_server.router.modes.affinity import Affinity
from turnkv_server.router.modes.base import Mode, ModeContext
from turnkv_server.router.modes.bidirectional import Bidirectional
from turnkv_server.router.modes.push import Push
from turnkv_server.router.modes.standard import Standard
from turnkv_server.router.modes.turnkv import PdTurnkv

MODES: dict[RouterMode, type[Mode]] = {
    # The planner's turns (`planned.Turnkv`) with the P/D machinery that moves KV.
    "turnkv": PdTurnkv,
    "standard": Standard,
    # The same router mode; the launcher turns the prefill engines' prefix cache off.
    "standard-nocache": Standard,
    "bidirectional": Bidirectional,
    "push": Push,
    "affinity": Affinity,
}
if tuple(MODES) != ROUTER_MODES:
    raise ImportError(f"router modes {ROUTER_MODES} but classes for {tuple(MODES)}")


def make_mode(name: str, ctx: ModeContext) -> Mode:
    if name not in ROUTER_MODES:
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(ROUTER_MODES)}")
    return MODES[cast(RouterMode, name)](ctx)
