"""The `push` mode: vLLM's `NixlPushConnector`. Prefill and decode are dispatched at the same
time; the decode engine registers its blocks with the prefill engine, which WRITEs into them.
"""

from __future__ import annotations

from typing import Any

from turnkv_server.engine.requests import PREFILL_FOR_REMOTE_DECODE
from turnkv_server.router.engines import Placement
from turnkv_server.router.modes.base import Mode, Turn, TurnPlan, engine_request_id


class Push(Mode):
    affinity = True

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        return TurnPlan(placement, prefill_params=dict(PREFILL_FOR_REMOTE_DECODE),
                        concurrent=True, decode_params=self._decode_params(turn, placement))

    def _decode_params(self, turn: Turn, placement: Placement) -> dict[str, Any]:
        peer = self.ctx.prefill_peers.get(placement.prefill.name)
        if peer is None:
            raise RuntimeError(f"push mode needs the NIXL side channel of {placement.prefill.name}"
                               " (--prefill-nixl ENGINE_ID@HOST:PORT)")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": peer.engine_id,
            "remote_host": peer.host,
            "remote_port": peer.port,
            "tp_size": 1,
            "pp_size": 1,
            # Upstream requires it; registrations are matched by the shared X-Request-Id.
            "remote_request_id": engine_request_id(turn),
            "remote_block_ids": [],
        }
