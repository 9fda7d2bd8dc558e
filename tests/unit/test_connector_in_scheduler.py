"""The connector inside vLLM's own scheduler (alone, and beside another connector under vLLM's
`MultiConnector`): what vLLM does with what the connector reports about a receive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tests.unit.vllm_engine import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    ConnectorBeside,
    engine_config,
    model_folder,
    scheduler,
    step,
    turnkv,
)
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.outcomes import Outcomes
from turnkv_server.connector.scheduler_side import SchedulerSide
from turnkv_server.connector.vllm_connector import TurnkvConnector
from turnkv_server.connector.worker_side import WorkerSide
from turnkv_server.engine.protocol import Receive, TurnParams

PROMPT = 70  # tokens: 5 blocks, the last partial
PEER = "127.0.0.1:7000"


class BesideConnector(ConnectorBeside):
    """A connector that loads any request asking for it (`kv_transfer_params["beside"]`)
    asynchronously, once; what its worker reports, the test says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loading: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        wanted = bool((request.kv_transfer_params or {}).get("beside"))
        tokens = request.num_prompt_tokens - num_computed_tokens
        if not wanted or tokens <= 0 or request.request_id in self.loading:
            return 0, False
        return tokens, True

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens:
            self.loading.add(request.request_id)


class ReportingAgent:
    """The transfer thread's side of `WorkerSide` (NIXL is not needed to say how a receive
    ended): its results are a real `Outcomes`."""

    def __init__(self) -> None:
        self.outcomes = Outcomes()
        self.address = None

    def take_results(self) -> Any:
        return self.outcomes.take()


def worker_connector() -> tuple[TurnkvConnector, ReportingAgent]:
    connector = TurnkvConnector.__new__(TurnkvConnector)
    connector._scheduler = None
    connector._worker = WorkerSide("e", None, 120.0, 60.0, secret=b"s" * 32,
                                   fingerprint=Fingerprint.of({}))
    agent = ReportingAgent()
    connector._worker.agent = agent
    return connector, agent


def worker_output(connector: TurnkvConnector, aggregator: KVOutputAggregator
                  ) -> KVConnectorOutput:
    """What the worker's connector reports at the end of a step, through vLLM's aggregation
    of the workers' outputs (`kv_connector_model_runner_mixin`, `KVOutputAggregator`)."""
    results = connector.get_transfer_results(set())
    out = KVConnectorOutput(
        finished_sending=results.finished_sending, finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=connector.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=connector.build_connector_worker_meta())
    merged = aggregator.aggregate([ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                                     kv_connector_output=out)])
    assert merged is not None and merged.kv_connector_output is not None
    return merged.kv_connector_output


def turnkv_side(sched: Scheduler) -> SchedulerSide:
    connector = sched.connector
    if not isinstance(connector, TurnkvConnector):  # under MultiConnector: its first child
        connector = connector._connectors[0]  # type: ignore[union-attr]
    assert isinstance(connector, TurnkvConnector) and connector._scheduler is not None
    return connector._scheduler


def request(rid: str, params: dict[str, Any], max_tokens: int = 1) -> Request:
    """A request as the engine core makes one (hashing its blocks for the prefix cache)."""
    init_none_hash(sha256)
    return Request(rid, [100 + i for i in range(PROMPT)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params}), None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def reply(outputs: dict[int, Any], rid: str) -> dict[str, Any]:
    (out,) = [o for many in outputs.values() for o in many.outputs if o.request_id == rid]
    assert out.finished
    return out.kv_transfer_params["turnkv"]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return model_folder(tmp_path / "model")


def test_an_engine_that_would_fail_a_request_on_a_failed_load_refuses_the_connector(
        folder: Path) -> None:
    # vLLM's default policy answers every failed load with an error (scheduler.py,
    # `_handle_failed_recving`); every fallback of turnkv is a recompute.
    with pytest.raises(ValueError, match="kv_load_failure_policy.*recompute"):
        scheduler(engine_config(folder, turnkv(kv_load_failure_policy="fail")))
    # Under MultiConnector the engine's policy is the outer config's, whatever a child says.
    with pytest.raises(ValueError, match="kv_load_failure_policy.*recompute"):
        scheduler(engine_config(folder, {
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [turnkv()]}}))
    child = {k: v for k, v in turnkv().items() if k != "kv_load_failure_policy"}
    sched = scheduler(engine_config(folder, {
        "kv_connector": "MultiConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [child]}}))
    assert sched.recompute_kv_load_failures
    assert scheduler(engine_config(folder, turnkv())).recompute_kv_load_failures


def test_a_secret_in_the_config_stops_the_engine_at_its_scheduler(folder: Path) -> None:
    # The scheduler's connector is built first: the engine stops before any worker starts.
    inline = turnkv(kv_connector_extra_config={"side_channel_secret": "x" * 32})
    with pytest.raises(ValueError, match="TURNKV_SIDE_CHANNEL_SECRET"):
        scheduler(engine_config(folder, inline))


def test_the_engines_settings_reach_the_scheduler_half(folder: Path) -> None:
    sched = scheduler(engine_config(folder, turnkv(kv_connector_extra_config={
        "max_pinned_fraction": 0.75, "max_quarantined_fraction": 0.1})))
    assert isinstance(sched.connector, TurnkvConnector)
    side = sched.connector._sched()
    assert side.policy.max_pinned_fraction == 0.75
    assert side.max_quarantined_fraction == 0.1


def test_a_quarantined_receive_reaches_vllm_as_a_failed_one(folder: Path) -> None:
    sched = scheduler(engine_config(folder, turnkv()))
    side = turnkv_side(sched)
    pool = sched.kv_cache_manager.block_pool
    worker, agent = worker_connector()
    aggregator = KVOutputAggregator(expected_finished_count=1)
    params = {"turnkv": TurnParams(receive=Receive("t1", PEER)).to_wire()}
    sched.add_request(request("r1", params))
    out, _ = step(sched)
    req = sched.requests["r1"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (receiving,) = sched.kv_cache_manager.get_block_ids("r1")
    assert out.kv_connector_metadata.orders.receives[0].blocks == receiving  # type: ignore
    # The receive is given up while the sender may still write into its blocks.
    agent.outcomes.quarantined("r1")
    step(sched, worker_output(worker, aggregator))
    # vLLM took it as a failed receive: the prompt is computed whole, in other blocks...
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"r1": PROMPT}
    (computing,) = sched.kv_cache_manager.get_block_ids("r1")
    assert not set(computing) & set(receiving)
    # ...while the received-into blocks stay out of the free queue until settled.
    assert all(pool.blocks[b].ref_cnt == 1 for b in receiving)
    assert reply(outputs, "r1")["receive_failed"] is True
    free = pool.get_num_free_blocks()
    agent.outcomes.settled("r1")
    step(sched, worker_output(worker, aggregator))
    assert pool.get_num_free_blocks() == free + len(receiving)
    assert side.holder is not None and side.holder.quarantined == {}


def test_a_failed_load_of_the_connector_beside_turnkv_is_not_turnkvs(folder: Path) -> None:
    beside = {"kv_connector": "BesideConnector", "kv_role": "kv_both",
              "kv_connector_module_path": __name__}
    sched = scheduler(engine_config(folder, {
        "kv_connector": "MultiConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [turnkv(), beside]}}))
    side = turnkv_side(sched)
    # A session's turn that the other connector (a lower tier, say) loads, and fails to.
    sched.add_request(request("r1", {"turnkv": TurnParams(session="s").to_wire(),
                                     "beside": True}))
    step(sched)
    assert sched.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"}))
    assert side.holder is not None and side.holder.quarantined == {}
    assert side.holder.next_wake() == float("inf")
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"r1": PROMPT}
    assert reply(outputs, "r1")["receive_failed"] is False
    # The session's blocks are held, and nothing else is kept from vLLM.
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - -(-PROMPT // BLOCK_SIZE)
