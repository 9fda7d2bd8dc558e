"""The worker's transfer thread: KV bytes by NIXL WRITE, control over a ZeroMQ side channel.

One protocol serves both directions (prefill to decode for a new turn, decode to prefill after
it). The engine that lacks blocks is the receiver; it allocates them and registers them with
the engine that has them, under a transfer ID both were given by the router:

    receiver                                      sender
    hello {agent, NIXL metadata, block table} --> add_remote_agent (once per peer agent)
    register {transfer_id, blocks, first_block} -->
                                                  (waits for its request to finish)
              <-- NIXL WRITE of the blocks, notification "turnkv:<transfer_id>"
              <-- or `failed {transfer_id, reason}` over the side channel

The sender writes its blocks `first_block ...` into the receiver's registered blocks, range by
range. When the registration arrives while the sender's request is still computing (a prefill
and its decode are dispatched together), the sender does not wait for the end: after each layer
of a step, it writes that layer of the blocks the step completed (`write_layer`), so that when
the request ends only what was not streamed remains (blocks complete before the registration, or
layers computed before it arrived), in one last write that carries the notification. That last
write starts once the layer writes have completed, so the notification never overtakes them.

Every failure ends the transfer on both sides: the receiver reports its blocks as load
errors (vLLM recomputes them) and the sender lets its request's blocks go. Deadlines keep a
late write out of blocks the receiver has given up on: the sender starts a write only within
half the receiver's timeout of the registration's arrival.

Everything NIXL or ZeroMQ happens on this thread; the engine's step thread hands work over with
`receive`/`send` and collects outcomes with `take_results`, both thread-safe. The thread sleeps
in `zmq.Poller.poll` and wakes on a message, a command, or (only while a transfer is pending) a
short tick to poll NIXL, so an idle engine's thread costs nothing.

Agent names are unique per process start, so a restarted peer is a new agent: a registration
from an agent the sender does not know is answered `unknown_agent`, and the receiver says hello
again and re-registers once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.stats import TransferCounters

log = logging.getLogger(__name__)

NOTIF_PREFIX = b"turnkv:"
# While a transfer is pending the thread polls NIXL this often; idle, it blocks.
TICK_MS = 2


@dataclass
class TransferResults:
    """What finished since the last `take_results`."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    counters: TransferCounters = field(default_factory=TransferCounters)


@dataclass
class _Stream:
    """The layer-by-layer writes of one transfer, while the sender's request computes."""

    # Layer -> indices (in the sender's request) of the blocks whose final content was written.
    done: dict[int, set[int]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    nbytes: int = 0
    # The request was preempted and recomputes: what was streamed may have been read from
    # blocks since reused, so the last write sends everything, after these writes end.
    stopped: bool = False
    failed: bool = False


@dataclass
class _Receive:
    request_id: str
    peer: str
    blocks: list[int]
    first_block: int
    deadline: float
    started: float
    timeout_s: float
    retried: bool = False
    registered: bool = False


@dataclass
class _Send:
    request_id: str
    blocks: list[int]
    deadline: float
    finished_at: float


@dataclass
class _Registration:
    agent: str
    identity: bytes
    blocks: list[int]
    first_block: int
    write_deadline: float


@dataclass
class _Write:
    request_id: str
    identity: bytes
    handle: Any
    nbytes: int
    nblocks: int
    started: float
    streamed: int = 0


@dataclass
class _Peer:
    socket: zmq.Socket[Any]
    hello: str = "none"  # none -> sent -> ok
    waiting: list[str] = field(default_factory=list)


class TransferAgent:
    """One engine's end of the protocol; see the module docstring."""

    def __init__(self, engine_id: str, table: BlockTable, listen: tuple[str, int] | None,
                 receive_timeout_s: float = 120.0, send_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"turnkv-{engine_id}-{uuid.uuid4().hex[:12]}"
        self.table = table
        self.receive_timeout_s = receive_timeout_s
        self.send_timeout_s = send_timeout_s
        self._clock = clock
        self._nixl = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._registered: Any = None
        self._local_dlist: Any = None
        self._remote: dict[str, tuple[Any, BlockTable]] = {}
        self._zmq = zmq.Context()
        self._router: zmq.Socket[Any] | None = None
        self.address: str | None = None
        if listen is not None:
            self._router = self._zmq.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            host, port = listen
            self._router.bind(f"tcp://{host}:{port}")
            self.address = f"{host}:{port}"
        self._peers: dict[str, _Peer] = {}
        self._receives: dict[str, _Receive] = {}
        self._sends: dict[str, _Send] = {}
        self._regs: dict[str, _Registration] = {}
        self._writes: dict[str, _Write] = {}
        self._streams: dict[str, _Stream] = {}
        # Layer writes of transfers that ended early, kept until NIXL is done with them.
        self._draining: list[Any] = []
        # Transfers cancelled before the sender's request finished, until when to remember them.
        self._cancelled: dict[str, float] = {}
        # Transfers this engine cannot serve, for registrations still on their way.
        self._refused: dict[str, float] = {}
        self._commands: queue.SimpleQueue[tuple[str, tuple[Any, ...]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._results = TransferResults()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="turnkv-transfer", daemon=True)

    # -- the step thread's side --------------------------------------------------------------

    def register_memory(self, buffers: list[tuple[int, int]]) -> None:
        """Register the cache's buffers (address, length) and prepare the local descriptors."""
        reg = self._nixl.get_reg_descs(
            [(address, length, self.table.device, "") for address, length in buffers],
            self.table.mem_type)
        self._nixl.register_memory(reg)
        self._registered = reg
        descs = self._nixl.get_xfer_descs(self.table.descriptors(), self.table.mem_type)
        self._local_dlist = self._nixl.prep_xfer_dlist("NIXL_INIT_AGENT", descs)

    def start(self) -> None:
        self._thread.start()

    def receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                first_block: int, timeout_s: float | None = None) -> None:
        timeout = min(timeout_s or self.receive_timeout_s, self.receive_timeout_s)
        self._command("receive", (request_id, transfer_id, peer, blocks, first_block, timeout))

    def send(self, request_id: str, transfer_id: str, blocks: list[int]) -> None:
        self._command("send", (request_id, transfer_id, blocks))

    def write_layer(self, transfer_id: str, layer: int, blocks: list[tuple[int, int]],
                    restart: bool = False) -> None:
        """Layer `layer` of `blocks` ((index in the request, block ID) pairs) is final: write
        it now if a receiver has registered `transfer_id`. `restart`: the request was
        preempted and computes again."""
        self._command("write_layer", (transfer_id, layer, blocks, restart))

    def refuse(self, transfer_id: str) -> None:
        """This engine has nothing to send under `transfer_id`: fail its registration."""
        self._command("refuse", (transfer_id,))

    def abandon(self, transfer_id: str) -> None:
        """Give up a send nobody has registered for yet and free its blocks: this engine
        needs them. A registration that comes later is told the transfer failed."""
        self._command("abandon", (transfer_id,))

    def decline(self, transfer_id: str, peer: str) -> None:
        """Tell the peer this engine needs nothing under `transfer_id` (it had every block)."""
        self._command("decline", (transfer_id, peer))

    def take_results(self) -> TransferResults:
        with self._lock:
            results, self._results = self._results, TransferResults()
        return results

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._zmq.destroy(linger=0)
        if self._thread.is_alive():
            return  # NIXL objects may still be in use; the process is ending anyway
        # Give NIXL back what this agent took, so that agents can come and go in one process.
        with contextlib.suppress(Exception):
            for write in self._writes.values():
                self._nixl.release_xfer_handle(write.handle)
            for handle in self._draining + [h for st in self._streams.values()
                                            for h in st.handles]:
                self._nixl.release_xfer_handle(handle)
            for agent, (dlist, _) in self._remote.items():
                self._nixl.release_dlist_handle(dlist)
                self._nixl.remove_remote_agent(agent)
            if self._local_dlist is not None:
                self._nixl.release_dlist_handle(self._local_dlist)
            if self._registered is not None:
                self._nixl.deregister_memory(self._registered)
        self._writes, self._remote, self._streams, self._draining = {}, {}, {}, []
        self._local_dlist = self._registered = None

    def _command(self, name: str, args: tuple[Any, ...]) -> None:
        self._commands.put((name, args))
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
        while not self._stop.is_set():
            for peer in self._peers.values():
                if peer.socket not in poller:
                    poller.register(peer.socket, zmq.POLLIN)
            try:
                ready = dict(poller.poll(self._timeout_ms()))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            try:
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    self._drain_commands()
                if self._router is not None and self._router in ready:
                    self._on_router()
                for address, peer in list(self._peers.items()):
                    if peer.socket in ready:
                        self._on_peer(address, peer)
                self._progress()
            except Exception:  # the thread must outlive any one bad message or transfer
                log.exception("turnkv transfer thread")

    def _timeout_ms(self) -> int | None:
        if self._writes or self._receives or self._draining or \
                any(st.handles for st in self._streams.values()):
            return TICK_MS
        deadlines = [s.deadline for s in self._sends.values()] + \
            [r.write_deadline for r in self._regs.values()] + \
            list(self._cancelled.values()) + list(self._refused.values())
        if deadlines:
            return max(TICK_MS, int((min(deadlines) - self._clock()) * 1000) + 1)
        return None

    def _drain_commands(self) -> None:
        while True:
            try:
                name, args = self._commands.get_nowait()
            except queue.Empty:
                return
            if name == "receive":
                self._start_receive(*args)
            elif name == "send":
                self._start_send(*args)
            elif name == "write_layer":
                self._write_layer(*args)
            elif name == "refuse":
                (transfer_id,) = args
                reg = self._regs.pop(transfer_id, None)
                self._drop_stream(transfer_id)
                if reg is not None:
                    self._reply(reg.identity, {"op": "failed", "transfer_id": transfer_id,
                                               "reason": "the sender's request did not run"})
                else:
                    self._refused[transfer_id] = self._clock() + self.send_timeout_s
            elif name == "abandon":
                (transfer_id,) = args
                send = self._sends.pop(transfer_id, None)
                if send is not None:  # else it is being written, or already over
                    self._refused[transfer_id] = self._clock() + self.send_timeout_s
                    self._finish_send(send.request_id, failed=True)
            elif name == "decline":
                transfer_id, address = args
                self._send_msg(self._peer(address), {"op": "cancel", "transfer_id": transfer_id})

    # receiver

    def _start_receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                       first_block: int, timeout_s: float) -> None:
        now = self._clock()
        self._receives[transfer_id] = _Receive(request_id, peer, blocks, first_block,
                                               now + timeout_s, now, timeout_s)
        self._register(transfer_id)

    def _register(self, transfer_id: str) -> None:
        rx = self._receives[transfer_id]
        peer = self._peer(rx.peer)
        if peer.hello != "ok":
            peer.waiting.append(transfer_id)
            if peer.hello == "none":
                self._send_msg(peer, {"op": "hello", "agent": self.name,
                                      "meta": self._nixl.get_agent_metadata(),
                                      "table": self.table.to_wire()})
                peer.hello = "sent"
            return
        self._send_msg(peer, {"op": "register", "agent": self.name, "transfer_id": transfer_id,
                              "blocks": rx.blocks, "first_block": rx.first_block,
                              "timeout_s": rx.timeout_s})
        rx.registered = True

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            socket = self._zmq.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://{address}")
            peer = self._peers[address] = _Peer(socket)
        return peer

    def _on_peer(self, address: str, peer: _Peer) -> None:
        while True:
            try:
                frames = peer.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = msgspec.msgpack.decode(frames[-1])
            op = msg.get("op")
            if op == "hello_ok":
                peer.hello = "ok"
                waiting, peer.waiting = peer.waiting, []
                for transfer_id in waiting:
                    if transfer_id in self._receives:
                        self._register(transfer_id)
            elif op == "hello_refused":
                peer.hello = "none"
                for transfer_id in peer.waiting:
                    self._fail_receive(transfer_id, str(msg.get("reason")))
                peer.waiting = []
            elif op == "unknown_agent":
                # The sender restarted since our hello: say it again, register once more.
                peer.hello = "none"
                rx = self._receives.get(msg.get("transfer_id", ""))
                if rx is not None and not rx.retried:
                    rx.retried = True
                    self._register(msg["transfer_id"])
                elif rx is not None:
                    self._fail_receive(msg["transfer_id"], "sender does not know this agent")
            elif op == "failed":
                self._fail_receive(msg.get("transfer_id", ""), str(msg.get("reason")))

    def _fail_receive(self, transfer_id: str, reason: str, tell_peer: bool = False) -> None:
        rx = self._receives.pop(transfer_id, None)
        if rx is None:
            return
        log.warning("turnkv: receive %s for %s failed (%s); its blocks will be recomputed",
                    transfer_id, rx.request_id, reason)
        if tell_peer and rx.peer in self._peers:
            self._send_msg(self._peers[rx.peer], {"op": "cancel", "transfer_id": transfer_id})
        with self._lock:
            self._results.finished_recving.add(rx.request_id)
            self._results.failed_blocks.update(rx.blocks)
            self._results.counters.receives_failed += 1

    def _on_notifs(self) -> None:
        for _agent, messages in self._nixl.get_new_notifs().items():
            for message in messages:
                if not message.startswith(NOTIF_PREFIX):
                    continue
                transfer_id = message[len(NOTIF_PREFIX):].decode()
                rx = self._receives.pop(transfer_id, None)
                if rx is None:
                    continue  # given up on already; its blocks were reported and recomputed
                with self._lock:
                    c = self._results.counters
                    c.receives_done += 1
                    c.blocks_received += len(rx.blocks)
                    c.bytes_received += len(rx.blocks) * self.table.block_bytes
                    c.receive_seconds += self._clock() - rx.started
                    self._results.finished_recving.add(rx.request_id)

    # sender

    def _start_send(self, request_id: str, transfer_id: str, blocks: list[int]) -> None:
        now = self._clock()
        if self._cancelled.pop(transfer_id, None) is not None:
            self._finish_send(request_id)
            return
        self._sends[transfer_id] = _Send(request_id, blocks, now + self.send_timeout_s, now)
        self._try_write(transfer_id)

    def _on_router(self) -> None:
        assert self._router is not None
        while True:
            try:
                identity, payload = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not two frames: not ours
            try:
                msg = msgspec.msgpack.decode(payload)
                self._on_message(identity, msg)
            except Exception as exc:
                log.warning("turnkv: bad side-channel message: %s", exc)

    def _on_message(self, identity: bytes, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "hello":
            table = BlockTable.from_wire(msg["table"])
            if not table.compatible(self.table):
                self._reply(identity, {"op": "hello_refused",
                                       "reason": "KV layouts differ (another model or dtype?)"})
                return
            agent = msg["agent"]
            if agent not in self._remote:
                name = self._nixl.add_remote_agent(msg["meta"])
                descs = self._nixl.get_xfer_descs(table.descriptors(), table.mem_type)
                self._remote[agent] = (self._nixl.prep_xfer_dlist(name, descs), table)
            self._reply(identity, {"op": "hello_ok", "agent": self.name})
        elif op == "register":
            transfer_id = msg["transfer_id"]
            if msg["agent"] not in self._remote:
                self._reply(identity, {"op": "unknown_agent", "transfer_id": transfer_id})
                return
            if self._refused.pop(transfer_id, None) is not None:
                self._reply(identity, {"op": "failed", "transfer_id": transfer_id,
                                       "reason": "the sender's request did not run"})
                return
            timeout = min(float(msg.get("timeout_s", self.receive_timeout_s)), 3600.0)
            self._regs[transfer_id] = _Registration(
                msg["agent"], identity, [int(b) for b in msg["blocks"]],
                int(msg["first_block"]), self._clock() + timeout / 2)
            self._try_write(transfer_id)
        elif op == "cancel":
            # The receiver needs nothing (it had every block) or gave up.
            transfer_id = msg.get("transfer_id", "")
            self._regs.pop(transfer_id, None)
            self._drop_stream(transfer_id)
            send = self._sends.pop(transfer_id, None)
            if send is not None:
                self._finish_send(send.request_id)
            else:
                self._cancelled[transfer_id] = self._clock() + self.send_timeout_s

    def _reply(self, identity: bytes, msg: dict[str, Any]) -> None:
        assert self._router is not None
        self._router.send_multipart([identity, msgspec.msgpack.encode(msg)])

    def _write_layer(self, transfer_id: str, layer: int, blocks: list[tuple[int, int]],
                     restart: bool) -> None:
        reg = self._regs.get(transfer_id)
        if reg is None:
            return  # nobody registered yet, or the last write is under way
        stream = self._streams.get(transfer_id)
        if stream is None:
            # Nothing was written before a restart, so there is nothing to distrust.
            stream = self._streams[transfer_id] = _Stream()
        elif restart and not stream.stopped:
            stream.stopped = True
            stream.done.clear()
        remote = self._remote.get(reg.agent)
        if stream.stopped or stream.failed or remote is None or \
                self._clock() > reg.write_deadline or layer >= len(self.table.layer_ranges):
            return
        end = reg.first_block + len(reg.blocks)
        wanted = [(k, block) for k, block in blocks if reg.first_block <= k < end]
        if not wanted:
            return
        remote_dlist, remote_table = remote
        ranges = self.table.layer_ranges[layer]
        try:
            handle = self._nixl.make_prepped_xfer(
                "WRITE", self._local_dlist, self.table.indices([b for _, b in wanted], ranges),
                remote_dlist,
                remote_table.indices([reg.blocks[k - reg.first_block] for k, _ in wanted],
                                     ranges), b"")
            state = self._nixl.transfer(handle)
        except Exception as exc:  # the last write reports it to the receiver
            log.warning("turnkv: layer write for %s failed: %s", transfer_id, exc)
            stream.failed = True
            return
        if state == "ERR":
            self._nixl.release_xfer_handle(handle)
            stream.failed = True
            return
        stream.handles.append(handle)
        stream.done.setdefault(layer, set()).update(k for k, _ in wanted)
        stream.nbytes += len(wanted) * sum(self.table.ranges[r][1] for r in ranges)

    def _drop_stream(self, transfer_id: str) -> None:
        stream = self._streams.pop(transfer_id, None)
        if stream is not None:
            self._draining += stream.handles

    def _try_write(self, transfer_id: str) -> None:
        send, reg = self._sends.get(transfer_id), self._regs.get(transfer_id)
        if send is None or reg is None:
            return
        stream = self._streams.get(transfer_id)
        if stream is not None and stream.handles:
            return  # layer writes still in flight; `_progress` comes back when they end
        del self._sends[transfer_id], self._regs[transfer_id]
        self._streams.pop(transfer_id, None)
        source = send.blocks[reg.first_block:reg.first_block + len(reg.blocks)]
        remote = self._remote.get(reg.agent)
        reason = None
        if stream is not None and stream.failed:
            reason = "a layer-by-layer write failed"
        elif len(source) < len(reg.blocks):
            reason = (f"sender holds {len(send.blocks)} blocks, asked for blocks "
                      f"{reg.first_block}..{reg.first_block + len(reg.blocks) - 1}")
        elif remote is None:
            reason = "receiver agent gone"
        elif self._clock() > reg.write_deadline:
            reason = "registration arrived too late"
        if reason is not None:
            self._reply(reg.identity, {"op": "failed", "transfer_id": transfer_id,
                                       "reason": reason})
            self._finish_send(send.request_id, failed=True)
            return
        assert remote is not None
        remote_dlist, remote_table = remote
        local, remote_indices = self._last_write(source, reg, remote_table, stream)
        try:
            handle = self._nixl.make_prepped_xfer(
                "WRITE", self._local_dlist, local, remote_dlist, remote_indices,
                NOTIF_PREFIX + transfer_id.encode())
            state = self._nixl.transfer(handle)
        except Exception as exc:  # stale metadata, a dead peer: NIXL raises
            self._reply(reg.identity, {"op": "failed", "transfer_id": transfer_id,
                                       "reason": f"NIXL write failed: {exc}"})
            self._finish_send(send.request_id, failed=True)
            return
        if state == "ERR":
            self._nixl.release_xfer_handle(handle)
            self._reply(reg.identity, {"op": "failed", "transfer_id": transfer_id,
                                       "reason": "NIXL write failed"})
            self._finish_send(send.request_id, failed=True)
            return
        self._writes[transfer_id] = _Write(send.request_id, reg.identity, handle,
                                           len(source) * self.table.block_bytes, len(source),
                                           self._clock(), stream.nbytes if stream else 0)

    def _last_write(self, source: list[int], reg: _Registration, remote_table: BlockTable,
                    stream: _Stream | None) -> tuple[list[int], list[int]]:
        """Descriptor indices (local, remote) of what the receiver still lacks."""
        if stream is None or not stream.done:
            return self.table.indices(source), remote_table.indices(reg.blocks)
        local: list[int] = []
        remote: list[int] = []
        for layer, ranges in enumerate(self.table.layer_ranges):
            done = stream.done.get(layer, set())
            todo = [i for i in range(len(source)) if reg.first_block + i not in done]
            local += self.table.indices([source[i] for i in todo], ranges)
            remote += remote_table.indices([reg.blocks[i] for i in todo], ranges)
        if not local:
            # Every layer of every block is there; the notification still needs a write.
            return self.table.indices(source[-1:]), remote_table.indices(reg.blocks[-1:])
        return local, remote

    def _finish_send(self, request_id: str, failed: bool = False,
                     write: _Write | None = None) -> None:
        with self._lock:
            self._results.finished_sending.add(request_id)
            c = self._results.counters
            if failed:
                c.sends_failed += 1
            elif write is not None:
                c.sends_done += 1
                c.blocks_sent += write.nblocks
                c.bytes_sent += write.nbytes
                c.bytes_streamed += write.streamed
                c.send_seconds += self._clock() - write.started

    # both

    def _progress(self) -> None:
        now = self._clock()
        for transfer_id, write in list(self._writes.items()):
            state = self._nixl.check_xfer_state(write.handle)
            if state == "PROC":
                continue
            del self._writes[transfer_id]
            self._nixl.release_xfer_handle(write.handle)
            if state != "DONE":
                self._reply(write.identity, {"op": "failed", "transfer_id": transfer_id,
                                             "reason": f"NIXL write ended {state}"})
            self._finish_send(write.request_id, failed=state != "DONE", write=write)
        self._draining, _ = self._settle(self._draining)
        for transfer_id, stream in list(self._streams.items()):
            if not stream.handles:
                continue
            stream.handles, failed = self._settle(stream.handles)
            stream.failed |= failed
            if not stream.handles:
                self._try_write(transfer_id)
        if self._receives:
            self._on_notifs()
        for transfer_id, rx in list(self._receives.items()):
            if now > rx.deadline:
                self._fail_receive(transfer_id, "timed out", tell_peer=True)
        for transfer_id, send in list(self._sends.items()):
            if now > send.deadline:
                # Nobody registered for these blocks in time: let the request's blocks go.
                del self._sends[transfer_id]
                self._finish_send(send.request_id, failed=True)
        for table in (self._cancelled, self._refused):
            for transfer_id, until in list(table.items()):
                if now > until:
                    del table[transfer_id]
        for transfer_id, reg in list(self._regs.items()):
            if now > reg.write_deadline:
                del self._regs[transfer_id]
                self._drop_stream(transfer_id)
                self._reply(reg.identity, {"op": "failed", "transfer_id": transfer_id,
                                           "reason": "the sender's request never came"})

    def _settle(self, handles: list[Any]) -> tuple[list[Any], bool]:
        """Release the handles NIXL is done with: (those still in flight, whether any failed)."""
        pending, failed = [], False
        for handle in handles:
            state = self._nixl.check_xfer_state(handle)
            if state == "PROC":
                pending.append(handle)
            else:
                self._nixl.release_xfer_handle(handle)
                failed |= state != "DONE"
        return pending, failed

    def _send_msg(self, peer: _Peer, msg: dict[str, Any]) -> None:
        peer.socket.send(msgspec.msgpack.encode(msg))
