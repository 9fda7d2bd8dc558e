"""The connector's worker half: the engine's KV cache registered with NIXL, and orders carried out.

vLLM calls it from the model runner every step (empty steps included). It hands the
scheduler's orders to the transfer thread (`transport.TransferAgent`) and reports back what
finished: requests whose blocks arrived or were written, and, for a failed receive, the block
IDs that vLLM must recompute. It never waits on the network: a step costs a queue put and a
dictionary swap, and each layer of a step that completes blocks of a sending request one more
queue put (the layer-by-layer writes).

On a GPU the model's kernels run ahead of the host: when vLLM says a layer is computed, its
KV may not be in memory yet. Each such layer gets a CUDA event recorded on the forward's
stream, and the transfer thread waits for it before it writes the layer (the step never
waits). The last write, when the request ends, needs none: vLLM has read the step's sampled
tokens back by then, so every kernel before it has completed.

The engine's fingerprint gains the KV tensors' description (`layout.describe_layout`) when the
cache is registered, before the transfer agent offers it to peers.

Once the transfer agent has bound its side channel (port 0: a free port, bound at once), the
address it got is written to `report_path` (the launcher reads it there).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from turnkv_server.connector.blocktable import BlockTable, find_block_dim
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.layout import describe_layout
from turnkv_server.connector.orders import StepOrders, StreamOrder
from turnkv_server.connector.transport import TransferAgent
from turnkv_server.ports import parse_address, write_report

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, engine_id: str, listen: tuple[str, int] | None,
                 receive_timeout_s: float, send_timeout_s: float,
                 layer_writes: bool = True, *, secret: bytes, fingerprint: Fingerprint,
                 report_path: str | None = None) -> None:
        self.engine_id = engine_id
        self.listen = listen
        self.receive_timeout_s = receive_timeout_s
        self.send_timeout_s = send_timeout_s
        self.secret = secret
        self.fingerprint = fingerprint
        self.report_path = report_path
        self.agent: TransferAgent | None = None
        self._failed_blocks: set[int] = set()
        self._quarantined: set[str] = set()
        self._settled: set[str] = set()
        self._stats: dict[str, Any] = {}
        self.layer_writes = layer_writes
        self._layer_index: dict[str, int] = {}
        self._streams: list[StreamOrder] = []
        self._on_gpu = False

    def register_kv_caches(self, caches: Mapping[str, Any], num_blocks: int) -> None:
        """Describe and register the cache (torch tensors by layer name), start the thread."""
        layers = list(caches.values())
        self._layer_index = {name: i for i, name in enumerate(caches)}
        device = layers[0].device
        self._on_gpu = device.type == "cuda"
        self.layer_writes &= device.type in ("cpu", "cuda")
        mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        table = BlockTable.from_layers(layers, num_blocks, mem_type, device.index or 0)
        # What the blocks' bytes mean, beside where they are: peers compare it in the hello.
        self.fingerprint = self.fingerprint.with_fields(
            {"kv_tensors": describe_layout(layers, find_block_dim(layers[0], num_blocks))})
        # Layers are views; register each underlying buffer once.
        buffers: dict[int, int] = {}
        for t in layers:
            storage = t.untyped_storage()
            buffers[storage.data_ptr()] = storage.nbytes()
        self.agent = TransferAgent(self.engine_id, table, self.listen,
                                   self.receive_timeout_s, self.send_timeout_s,
                                   secret=self.secret, fingerprint=self.fingerprint)
        self.agent.register_memory(sorted(buffers.items()))
        self.agent.start()
        self.report_address()
        log.info("turnkv: %d KV blocks of %d bytes registered (%s), agent %s, side channel %s",
                 num_blocks, table.block_bytes, mem_type, self.agent.name, self.agent.address)
        # What a peer must match; a refused peer's log names the field that differs.
        log.info("turnkv: engine fingerprint %s", self.agent.fingerprint.to_wire())

    def report_address(self) -> None:
        """Write the side channel's bound address to `report_path`, if one was asked for."""
        address = self._agent().address
        if self.report_path and address:
            write_report(self.report_path, *parse_address(address))

    def apply(self, orders: StepOrders) -> None:
        """The step's orders, before its forward pass. Expectations first: a request that
        arrives and ends in one step is expected before it is sent or refused."""
        agent = self._agent()
        self._streams = orders.streams if self.layer_writes else []
        for expect in orders.expects:
            agent.expect(expect.transfer_id, expect.token_ids)
        for receive in orders.receives:
            agent.receive(receive.request_id, receive.transfer_id, receive.peer,
                          receive.blocks, receive.first_block, receive.timeout_s,
                          tokens=receive.tokens, digest=receive.digest)
        for send in orders.sends:
            agent.send(send.request_id, send.transfer_id, send.blocks, send.token_ids)
        for transfer_id, peer in orders.declines:
            agent.decline(transfer_id, peer)
        for transfer_id in orders.refusals:
            agent.refuse(transfer_id)
        for transfer_id in orders.abandons:
            agent.abandon(transfer_id)
        for transfer_id in orders.cancels:
            agent.cancel_receive(transfer_id)

    def layer_computed(self, layer_name: str) -> None:
        if not self._streams:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        agent = self._agent()
        ready = _recorded_event() if self._on_gpu else None
        for stream in self._streams:
            agent.write_layer(stream.transfer_id, layer, stream.blocks, stream.restart, ready)

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self.agent is None:
            return set(), set()
        results = self.agent.take_results()
        # vLLM reads load errors (and the connector its failed receives and settled
        # quarantines) right after this, in the same step: keep them until then.
        self._failed_blocks |= results.failed_blocks
        self._quarantined |= results.quarantined
        self._settled |= results.settled
        counters = results.counters
        for name in counters.__dataclass_fields__:
            value = getattr(counters, name)
            if value:
                self._stats[name] = self._stats.get(name, 0) + value
        return results.finished_sending, results.finished_recving

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_quarantined(self) -> set[str]:
        """Requests whose receive failed while its sender might still write: vLLM recomputes
        them in other blocks (`failed_recving`)."""
        quarantined, self._quarantined = self._quarantined, set()
        return quarantined

    def take_settled(self) -> set[str]:
        """Requests whose quarantined blocks may go back into use."""
        settled, self._settled = self._settled, set()
        return settled

    def take_stats(self) -> dict[str, Any]:
        stats, self._stats = self._stats, {}
        return stats

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def _agent(self) -> TransferAgent:
        if self.agent is None:
            raise RuntimeError("the turnkv connector's KV caches were never registered")
        return self.agent


def _recorded_event() -> torch.cuda.Event:
    """An event on the current stream, after the kernels enqueued so far (the layer's).
    Blocking: the transfer thread sleeps while it waits instead of spinning a core."""
    event = torch.cuda.Event(blocking=True)
    event.record()
    return event
