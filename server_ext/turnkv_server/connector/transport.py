"""The worker's transfer thread: KV bytes by NIXL WRITE, control over a signed side channel.

One protocol serves both directions (prefill to decode for a new turn, decode to prefill after
it). The engine that lacks blocks is the receiver; it allocates them and registers them with
the engine that has them, under a transfer ID both were given by the router. The sender writes
its blocks `first_block ...` into the receiver's registered blocks and notifies
("turnkv:<transfer_id>"); while its request still computes it may write each finished layer of
the blocks a step completed, and the last write carries only the rest. The messages and their
order are in `side_channel`; the receiver's rules in `receiving`, the sender's in `sending`,
the NIXL calls in `writes`.

What this guarantees (docs/architecture.md, docs/protocol.md):
- KV is copied only between engines with the same fingerprint (model, weights, dtypes, block
  size, layout), only when both hold the same tokens over the range copied, and only KV the
  sender computed;
- a receiver hands its blocks back to vLLM only when no write of the sender can still land in
  them (two-phase cancel that says whether a write may still land, a write fence for silent
  senders, and a quarantine otherwise), and completes a receive only on the notification of
  the agent it registered with;
- every NIXL call is failure-safe: a peer that dies mid-write fails its own transfers only,
  and one transfer whose step raises ends alone;
- side-channel messages are signed with the cluster's secret (a short or placeholder secret
  is refused), dropped when stale or replayed, and encrypted (CURVE keys derived from the
  secret); one peer's registrations and the number of peers are bounded.
What it does not: the NIXL data path (UCX) is neither authenticated nor encrypted; the
engines' network must keep everyone else out (docs/deploy.md).

Everything NIXL or ZeroMQ happens on this thread; the engine's step thread hands work over with
`receive`/`expect`/`send`/... and collects outcomes with `take_results`, both thread-safe. The
thread sleeps in `zmq.Poller.poll` and wakes on a message, a command, a timer, or (only while a
write or a live receive is in flight) a short tick to poll NIXL, so an idle engine's thread
costs nothing, and one holding only quarantined receives wakes about once a second.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.cluster_secret import ClusterKeys
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.orders import LayerReady
from turnkv_server.connector.outcomes import Outcomes, TransferResults
from turnkv_server.connector.receiving import Receiving
from turnkv_server.connector.sending import Sending
from turnkv_server.connector.settings import ConnectorSettings
from turnkv_server.connector.writes import Writer
from turnkv_server.engine.nixl_poll import poll_delay

__all__ = ["TransferAgent", "TransferResults"]

log = logging.getLogger(__name__)

# While a write or a live receive is in flight the thread polls NIXL this often; otherwise it
# sleeps until the next deadline.
TICK_MS = 2
# The longest NIXL's progress thread sleeps without a UCX event (`nixl_poll`): what an idle
# engine's agent wakes for. Transfers do not wait on it: the thread wakes on the UCX workers'
# events, and while a write is in flight this thread's ticks check its state, which progresses
# the sender's worker each time (NIXL's UCX backend does in every status check). It is only
# the backstop for a UCX event missed. (vLLM's own connectors keep `nixl_poll`'s default.)
NIXL_POLL_DELAY_US = 50_000


class TransferAgent:
    """One engine's end of the protocol; see the module docstring."""

    def __init__(self, engine_id: str, table: BlockTable, listen: tuple[str, int] | None,
                 receive_timeout_s: float = ConnectorSettings.receive_timeout_s,
                 send_timeout_s: float = ConnectorSettings.send_timeout_s, *,
                 secret: bytes, fingerprint: Fingerprint,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"turnkv-{engine_id}-{uuid.uuid4().hex[:12]}"
        self.table = table
        self.receive_timeout_s = receive_timeout_s
        self._clock = clock
        # Peers compare layouts as part of the fingerprint: byte lengths of each range.
        self.fingerprint = fingerprint.with_fields(
            {"layout": ",".join(str(length) for _, length, _ in table.ranges)})
        self._codec = sc.Codec(secret)
        keys = ClusterKeys(secret)
        with poll_delay(NIXL_POLL_DELAY_US):
            self._nixl = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._zmq = zmq.Context()
        self._outcomes = Outcomes()
        self._router: zmq.Socket[Any] | None = None
        self.address: str | None = None
        if listen is not None:
            self._router = self._zmq.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            keys.serve(self._router)
            host, port = listen
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                # Bound here, at once, and reported: a port chosen earlier and bound later
                # can be taken by anything else on the machine meanwhile.
                port = self._router.bind_to_random_port(f"tcp://{host}")
            self.address = f"{host}:{port}"
        self.writer = Writer(self._nixl, table, clock)
        self.receiving = Receiving(
            agent_name=self.name, engine_id=engine_id, nixl=self._nixl, table=table,
            fingerprint=self.fingerprint, codec=self._codec, keys=keys, context=self._zmq,
            outcomes=self._outcomes, clock=clock)
        self.sending = Sending(
            agent_name=self.name, writer=self.writer, fingerprint=self.fingerprint,
            codec=self._codec, router=self._router, outcomes=self._outcomes,
            send_timeout_s=send_timeout_s, clock=clock)
        self._commands: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = \
            queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        # Passes of the transfer thread's loop (each one a wake-up).
        self.passes = 0
        self._thread = threading.Thread(target=self._run, name="turnkv-transfer", daemon=True)

    # -- the step thread's side --------------------------------------------------------------

    def register_memory(self, buffers: list[tuple[int, int]]) -> None:
        """Register the cache's buffers (address, length) and prepare the local descriptors."""
        self.writer.register_memory(buffers)

    def start(self) -> None:
        self._thread.start()

    def receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                first_block: int, timeout_s: float | None = None, *, tokens: int,
                digest: bytes) -> None:
        """Register `blocks` with the sender at `peer` for `tokens` tokens of KV (their
        `digest`), starting at the request's block `first_block`."""
        timeout = min(timeout_s or self.receive_timeout_s, self.receive_timeout_s)
        self._command(self.receiving.receive, request_id, transfer_id, peer, list(blocks),
                      first_block, timeout, tokens, digest)

    def cancel_receive(self, transfer_id: str) -> None:
        """The receiving request was aborted: give its blocks back once that is safe."""
        self._command(self.receiving.cancel, transfer_id, "the request was aborted")

    def decline(self, transfer_id: str, peer: str) -> None:
        """Tell the peer this engine needs nothing under `transfer_id` (it had every block)."""
        self._command(self.receiving.decline, transfer_id, peer)

    def expect(self, transfer_id: str, token_ids: tuple[int, ...]) -> None:
        """A request that will send under `transfer_id` arrived (its prompt's token IDs)."""
        self._command(self.sending.expect, transfer_id, tuple(token_ids))

    def send(self, request_id: str, transfer_id: str, blocks: list[int],
             token_ids: tuple[int, ...]) -> None:
        """The request finished normally: write `blocks` to the registered receiver."""
        self._command(self.sending.send, request_id, transfer_id, list(blocks),
                      tuple(token_ids))

    def write_layer(self, transfer_id: str, layer: int, blocks: list[tuple[int, int]],
                    restart: bool = False, ready: LayerReady | None = None) -> None:
        """Layer `layer` of `blocks` ((index in the request, block ID) pairs) is computed:
        write it if a receiver has registered `transfer_id`, once `ready` (a GPU's event after
        the layer) has completed. `restart`: the request was preempted and computes again."""
        self._command(self.sending.write_layer, transfer_id, layer, blocks, restart, ready)

    def refuse(self, transfer_id: str) -> None:
        """This engine has nothing to send under `transfer_id`: fail its registration."""
        self._command(self.sending.refuse, transfer_id,
                      "the sender's request did not finish normally")

    def abandon(self, transfer_id: str) -> None:
        """Give up a send nobody has registered for yet and free its blocks: this engine
        needs them. A registration that comes later is told the transfer failed."""
        self._command(self.sending.abandon, transfer_id)

    def take_results(self) -> TransferResults:
        return self._outcomes.take()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._thread.is_alive():
            self._zmq.destroy(linger=0)
            return  # NIXL objects may still be in use; the process is ending anyway
        self.receiving.close()
        self._zmq.destroy(linger=0)
        # Give NIXL back what this agent took, so that agents can come and go in one process.
        self.sending.close()
        self.writer.close()

    def _command(self, handler: Callable[..., None], *args: Any) -> None:
        self._commands.put((handler, args))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- the transfer thread -----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        polled: set[str] = set()
        while not self._stop.is_set():
            self.passes += 1
            for address, link in self.receiving.links.items():
                if address not in polled:
                    poller.register(link.socket, zmq.POLLIN)
                    poller.register(link.monitor, zmq.POLLIN)
                    polled.add(address)
            try:
                ready = dict(poller.poll(self._timeout_ms_guarded()))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            # Each step is guarded on its own: one bad message or transfer must not stop
            # the others, nor the deadlines and notifications that follow it.
            if self._wake_r in ready:
                self._guard(self._drain_commands)
            if self._router is not None and self._router in ready:
                self._guard(self.sending.on_readable)
            for link in list(self.receiving.links.values()):
                # Connection events first: a sender's restart shows as a disconnect that
                # must not be read after the new agent's hello reply.
                if link.monitor in ready:
                    self._guard(self.receiving.on_monitor, link)
                if link.socket in ready:
                    self._guard(self.receiving.on_readable, link)
            self._progress()

    def _guard(self, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except Exception:
            log.exception("turnkv transfer thread")

    def _drain_commands(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._wake_r, 4096)
        while True:
            try:
                handler, args = self._commands.get_nowait()
            except queue.Empty:
                return
            self._guard(handler, *args)

    def _progress(self) -> None:
        now = self._clock()
        self._guard(self.receiving.read_notifications, now)
        self._guard(self.sending.progress, now)
        self._guard(self.receiving.tick, now)

    def _timeout_ms_guarded(self) -> int | None:
        try:
            return self._timeout_ms()
        except Exception:
            log.exception("turnkv transfer thread")
            return TICK_MS

    def _timeout_ms(self) -> int | None:
        if self.sending.busy() or self.receiving.live():
            return TICK_MS
        deadline = min(self.sending.next_deadline(), self.receiving.next_deadline())
        if deadline == math.inf:
            return None
        return max(TICK_MS, int((deadline - self._clock()) * 1000) + 1)
