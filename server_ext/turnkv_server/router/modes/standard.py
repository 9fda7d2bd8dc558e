"""The `standard` mode: vLLM's pull-based P/D (NixlConnector), round robin, no session reuse:
what deployments run today. `standard-nocache` is the same router mode, in front of prefill
engines whose prefix cache is off (a launcher setting): the baseline of vLLM's multi-turn blog.

The prefill engine computes the prompt and keeps its blocks; the decode request follows with
the params the prefill's response returned, and the decode engine READs the blocks.
"""

from __future__ import annotations

from turnkv_server.engine.requests import PREFILL_FOR_REMOTE_DECODE
from turnkv_server.router.engines import Placement
from turnkv_server.router.modes.base import Mode, Turn, TurnPlan


class Standard(Mode):
    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        return TurnPlan(placement, prefill_params=dict(PREFILL_FOR_REMOTE_DECODE))
