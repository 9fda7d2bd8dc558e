"""`TurnkvConnector`'s own decisions: lease keys, cache resets, finding the engine core."""

from __future__ import annotations

import queue
import threading
from typing import Any

from vllm import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.request import Request, RequestStatus

from turnkv_server.connector.leases import LeaseLimits
from turnkv_server.connector.scheduler_side import SchedulerSide
from turnkv_server.connector.vllm_connector import TurnkvConnector, find_engine_core_wakeup

BLOCKS = 32


def scheduler_connector() -> tuple[TurnkvConnector, BlockPool]:
    """The scheduler's connector on a real block pool (vLLM's config is not needed here)."""
    pool = BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=16)
    connector = TurnkvConnector.__new__(TurnkvConnector)
    connector._scheduler = SchedulerSide(16, LeaseLimits())
    connector._worker = None
    connector.bind_gpu_block_pool(pool)
    return connector, pool


def finished(rid: str, params: dict[str, Any] | None, session_id: str | None) -> Request:
    extra = {"kv_transfer_params": {"turnkv": params}} if params is not None else None
    req = Request(rid, list(range(40)), SamplingParams(max_tokens=4, extra_args=extra), None,
                  session_id=session_id)
    req.status = RequestStatus.FINISHED_STOPPED
    return req


def test_vllms_own_session_id_is_never_a_lease_key() -> None:
    connector, pool = scheduler_connector()
    # A turn the router did not tag: its params carry no session, but the client set vLLM's
    # session_id (raw, not scoped to a tenant: another tenant may use the same one).
    untagged = finished("r1", {}, session_id="client-chosen")
    connector.on_new_request(untagged)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    assert connector.request_finished(untagged, ids)[1] == {"turnkv": {
        "held_blocks": 0, "local_tokens": 0, "received_tokens": 0, "receive_failed": False}}
    sched = connector._scheduler
    assert sched is not None and sched.holder is not None and len(sched.holder.leases) == 0
    # The router's tenant-scoped key is the only one.
    tagged = finished("r2", {"session": "tenant-hash"}, session_id="client-chosen")
    connector.on_new_request(tagged)
    connector.request_finished(tagged, ids)
    assert list(sched.holder.leases) == ["tenant-hash"]


def test_reset_cache_releases_every_lease() -> None:
    connector, pool = scheduler_connector()
    req = finished("r1", {"session": "s"}, None)
    connector.on_new_request(req)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    connector.request_finished(req, ids)
    pool.free_blocks([pool.blocks[i] for i in ids])
    assert pool.get_num_free_blocks() == BLOCKS - 4
    assert connector.reset_cache() is True
    assert pool.get_num_free_blocks() == BLOCKS - 1
    assert connector.has_pending_push_work() is False


def test_the_engine_cores_input_queue_is_found_from_the_scheduler() -> None:
    core = EngineCoreProc.__new__(EngineCoreProc)
    core.input_queue = queue.Queue()

    def construct(self: Any) -> Any:  # as EngineCore.__init__ builds the scheduler
        return find_engine_core_wakeup()

    wake = construct(core)
    assert wake is not None
    # The timer thread calls it; the engine core's loop takes it off its queue and steps.
    thread = threading.Thread(target=wake)
    thread.start()
    thread.join()
    assert core.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)
    # An in-process engine core has no queue to wake: lazy expiry only.
    assert find_engine_core_wakeup() is None
