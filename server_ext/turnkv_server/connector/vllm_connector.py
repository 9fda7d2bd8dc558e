"""`TurnkvConnector`: the turnkv connector as vLLM loads it.

    --kv-transfer-config '{"kv_connector": "TurnkvConnector",
                           "kv_connector_module_path": "turnkv_server.connector.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"lease_ttl_s": 300, ...}}'

The same class runs on prefill and decode engines; what a request does is up to the router's
`kv_transfer_params["turnkv"]` (`turnkv_server.engine.protocol`). This module only adapts
vLLM's interface (`kv_connector/v1/base.py`) to the two halves: `scheduler_side` (pure logic
on the block pool) and `worker_side` (NIXL). Its settings, and what it requires of the engine
(the side channel's secret in the environment or a file, never in this config; the load-failure
policy "recompute"), are in `settings`.

Each worker also describes its engine (`engine_identity.engine_fingerprint`: digests of the
model's weights and resolved configuration, the dtypes, block size, attention backend and KV
layout); two engines exchange KV only if their descriptions match.

The scheduler's connector finds vLLM's engine-core input queue when it is bound (vLLM binds it
inside the engine core's constructor), so that leases expire on time on an idle engine (see
`idle_expiry`), and checks the load-failure policy of the scheduler that binds it.

A receive is reported to vLLM as one of two kinds of failure. Given up while its sender might
still write (quarantined), it is a failed receive (`failed_recving`): vLLM frees the request's
blocks and computes its prompt in other ones, while the scheduler side keeps the old blocks out
of use until the worker says they are settled. Failed with nothing in flight, its blocks are
load errors (`get_block_ids_with_load_errors`): vLLM computes them again in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from turnkv_server.engine.nixl_poll import apply_poll_delay

apply_poll_delay()

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from turnkv_server.connector import settings  # noqa: E402
from turnkv_server.connector import stats as stats_  # noqa: E402
from turnkv_server.connector.engine_identity import engine_fingerprint  # noqa: E402
from turnkv_server.connector.layout import check_parallelism  # noqa: E402
from turnkv_server.connector.leases import LeaseLimits  # noqa: E402
from turnkv_server.connector.orders import StepOrders  # noqa: E402
from turnkv_server.connector.scheduler_side import SchedulerSide  # noqa: E402
from turnkv_server.connector.worker_side import WorkerSide  # noqa: E402


class SettledReceives(KVConnectorWorkerMetadata):
    """Worker to scheduler: the requests whose quarantined receive blocks may go back into use
    (`receiving`). One worker per engine (`check_parallelism`), so a union aggregates."""

    def __init__(self, request_ids: set[str]) -> None:
        self.request_ids = set(request_ids)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SettledReceives)
        return SettledReceives(self.request_ids | other.request_ids)


def _log_like_vllm() -> None:
    # vLLM configures only its own logger; the connector's messages belong in the same log.
    ours, theirs = logging.getLogger("turnkv_server"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_log_like_vllm()

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TurnkvConnector"]

log = logging.getLogger(__name__)


_Owner = TypeVar("_Owner")


def constructing(cls: type[_Owner]) -> _Owner | None:
    """The nearest `self` up the stack that is a `cls`: the vLLM object (engine core,
    scheduler) whose constructor is building or binding this connector."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, cls):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def find_engine_core_wakeup() -> Callable[[], None] | None:
    """A function that wakes vLLM's engine core when it sleeps on its input queue, or None.

    The scheduler and its connector are built inside the engine core's constructor, which
    creates the queue first. A wake-up is vLLM's own no-op message on that queue
    (`queue.Queue` is thread-safe); vLLM's signal handling sends the same one to end an idle
    engine.
    """
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore

    inbox = getattr(constructing(EngineCore), "input_queue", None)
    if isinstance(inbox, queue.Queue):
        message = (EngineCoreRequestType.WAKEUP, None)
        return lambda: inbox.put_nowait(message)
    return None


class TurnkvMetadata(KVConnectorMetadata):
    def __init__(self, orders: StepOrders) -> None:
        self.orders = orders


class TurnkvStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats_.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return stats_.is_empty(self.data)


class TurnkvPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = stats_.build_metric_set(self._counter_cls, self._gauge_cls, labelnames,
                                                per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._metrics.observe(transfer_stats_data, engine_idx)


class TurnkvConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        parallel = vllm_config.parallel_config
        check_parallelism(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        settings.refuse_secret_in_config(extra)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        given = settings.ConnectorSettings.from_extra(extra)
        if role == KVConnectorRole.SCHEDULER:
            policy = LeaseLimits(given.lease_ttl_s, given.lease_max_ttl_s,
                                 given.max_pinned_fraction)
            self._scheduler = SchedulerSide(
                vllm_config.cache_config.block_size, policy,
                max_quarantined_fraction=given.max_quarantined_fraction)
        else:
            self._worker = WorkerSide(
                str(self._kv_transfer_config.engine_id),
                settings.side_channel_listen(extra, os.environ),
                given.receive_timeout_s, given.send_timeout_s,
                layer_writes=given.layer_writes,
                secret=settings.side_channel_secret(extra, os.environ),
                fingerprint=engine_fingerprint(vllm_config),
                report_path=os.environ.get(settings.REPORT_ENV) or None)

    # -- scheduler side ----------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        # vLLM binds the pool at the end of its scheduler's constructor, once the scheduler
        # has adopted the engine's load-failure policy (the outer config's, under
        # MultiConnector, which this connector's own config is not).
        scheduler = constructing(Scheduler)
        if scheduler is not None:
            settings.require_recompute(scheduler.recompute_kv_load_failures)
        wake = find_engine_core_wakeup()
        if wake is None:
            log.info("turnkv: no engine-core input queue found: leases expire when the engine "
                     "next steps")
        self._sched().bind(gpu_block_pool, gpu_block_pool.num_gpu_blocks, wake=wake)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks.get_block_ids()[0],
                                               num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched, counts = self._sched(), scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            sched.scheduled(new.req_id, new.block_ids[0] if new.block_ids else [], True,
                            new.num_computed_tokens, counts.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]
            sched.scheduled(req_id, added[0] if added else [], req_id in cached.resumed_req_ids,
                            cached.num_computed_tokens[i], counts.get(req_id, 0))
        return TurnkvMetadata(sched.build_orders(scheduler_output.total_num_scheduled_tokens))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Leases are keyed by the router's tenant-scoped session only, never by vLLM's own
        # `request.session_id` (the client's, which another tenant may use too).
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Before vLLM frees the blocks of the requests it lists (it does so after this call).
        self._sched().received(set(connector_output.finished_recving or ()),
                               set(connector_output.invalid_block_ids or ()),
                               set(connector_output.failed_recving or ()))
        self._sched().sent(set(connector_output.finished_sending or ()))
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, SettledReceives):
            self._sched().settled(meta.request_ids)

    def has_pending_block_frees(self) -> bool:
        return self._sched().has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._sched().has_pending_push_work()

    def reset_cache(self) -> bool:
        return self._sched().reset_cache()

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, TurnkvMetadata):
            self._work().apply(connector_metadata.orders)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Loads are asynchronous: the transfer thread waits for the peer's writes."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loaded synchronously."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """This layer of the step's completed blocks goes to registered receivers now."""
        self._work().layer_computed(layer_name)

    def wait_for_save(self) -> None:
        """Sends are asynchronous and keep their blocks until reported in `get_finished`."""

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """As vLLM's, with the receives given up while their sender might still write as
        failed receives (in both sets, as vLLM asks): vLLM then frees those requests' blocks
        and computes their prompts in other ones, while the scheduler side keeps the freed
        blocks out of use."""
        sending, recving = self._work().get_finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=self._work().take_quarantined())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        settled = self._work().take_settled()
        return SettledReceives(settled) if settled else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- both --------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self._scheduler or self._worker
        data = half.take_stats() if half is not None else {}
        return TurnkvStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TurnkvStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return TurnkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker


# Under vLLM's `MultiConnector` (turnkv beside a lower tier) each child's stats cross from the
# engine core to the API server as plain data, found again by the child's class name in vLLM's
# connector registry (upstream `kv_connector/v1/multi_connector.py`,
# `build_kv_connector_stats`): unregistered, the API server's output handler fails on the
# first stats and the engine answers 503. Loading the connector by module path imports this
# module in both processes.
with contextlib.suppress(ValueError):  # registered already (imported under two names)
    KVConnectorFactory.register_connector("TurnkvConnector", __name__, "TurnkvConnector")
