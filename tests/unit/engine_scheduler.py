"""vLLM's own scheduler with the turnkv connector, stepped by hand: no model, no worker.

`EngineScheduler` builds vLLM's `Scheduler` (block pool, KV cache manager, admission, the
running loop, its calls into the connector) from a model config alone (`vllm_engine`), as
the engine core does, and stands in for the model runner only: each step, a request that has
computed its prompt samples one token, and the connector's worker half reports nothing unless
a test says so (`step(kv=...)`). A lower tier can sit beside turnkv under vLLM's
`MultiConnector`: `DeferredTier` is a connector whose lookup answers "ask again later" (None)
while `DeferredTier.deferring` is set, as vLLM's offloading connector does while it promotes
KV from disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from tests.unit.vllm_engine import (
    BLOCK_SIZE,
    ConnectorBeside,
    engine_config,
    model_folder,
    scheduler,
    turnkv,
)
from turnkv_server.connector.scheduler_side import SchedulerSide
from turnkv_server.connector.vllm_connector import TurnkvConnector
from turnkv_server.engine.protocol import TurnParams

BLOCK = BLOCK_SIZE
# Leases may take the whole cache: tests fill it with them.
TURNKV = turnkv(kv_connector_extra_config={"max_pinned_fraction": 1.0})
MAX_LEN = 4096


class DeferredTier(ConnectorBeside):
    """A lower tier that has nothing, and whose lookup is deferred while `deferring`."""

    deferring: ClassVar[bool] = False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return (None, False) if DeferredTier.deferring else (0, False)


def kv_transfer_config(tier: bool) -> KVTransferConfig:
    if not tier:
        return KVTransferConfig(**TURNKV)
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [
            TURNKV, {"kv_connector": "DeferredTier", "kv_connector_module_path": __name__,
                     "kv_role": "kv_both"}]})


class EngineScheduler:
    """vLLM's scheduler over `blocks` KV blocks of `BLOCK` tokens, turnkv its connector
    (`tier`: under MultiConnector, `DeferredTier` below it; `kv_transfer`: this config
    instead)."""

    def __init__(self, model_dir: Path, blocks: int, tier: bool = False,
                 kv_transfer: KVTransferConfig | None = None) -> None:
        config = engine_config(model_folder(model_dir), kv_transfer or kv_transfer_config(tier),
                               blocks=blocks, max_len=MAX_LEN, max_seqs=16)
        self.scheduler = scheduler(config)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.replies: dict[str, dict[str, Any] | None] = {}

    @property
    def turnkv(self) -> SchedulerSide:
        connector = self.scheduler.connector
        children = getattr(connector, "_connectors", [connector])
        turnkv = next(c for c in children if isinstance(c, TurnkvConnector))
        return turnkv._sched()

    def add(self, rid: str, tokens: list[int], max_tokens: int = 1, **params: Any) -> Request:
        extra = {"kv_transfer_params": {"turnkv": TurnParams(**params).to_wire()}} \
            if params else None
        request = Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                      extra_args=extra),
                          None, block_hasher=self._hasher)
        self.scheduler.add_request(request)
        return request

    def step(self, kv: KVConnectorOutput | None = None) -> SchedulerOutput:
        """One engine step: schedule, then what the model runner would return (one token per
        request whose prompt is computed; `kv`: the connector's worker half's report)."""
        output = self.scheduler.schedule()
        self.finish_step(output, kv)
        return output

    def finish_step(self, output: SchedulerOutput, kv: KVConnectorOutput | None = None) -> None:
        """The second half of `step`, for a test that runs a worker between the two."""
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = self.scheduler.requests[rid]
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv)
        for outputs in self.scheduler.update_from_output(output, runner).values():
            for out in outputs.outputs:
                if out.finished:
                    self.replies[out.request_id] = out.kv_transfer_params

    def run_until_finished(self, rid: str, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if rid not in self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"{rid} did not finish in {max_steps} steps")
