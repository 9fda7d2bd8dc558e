"""Two real NIXL agents in one process (UCX over loopback), for the transfer protocol's tests.

Each `Engine` owns a small CPU "KV cache" and a `TransferAgent` over it; a receiver registers
blocks, a sender writes its own blocks into them. On one machine NIXL completes loopback
writes at once, so a slow or broken link is simulated by wrapping the sender's NIXL agent
(`GatedStates`, `DeadPeerStates`): the writes themselves are real, only what NIXL reports of
them is held back or turned into the errors a dead peer causes. `SilentSender` and
`SideChannelClient` speak the real, signed (and encrypted) side channel without an agent.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import zmq

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.cluster_secret import ClusterKeys
from turnkv_server.connector.identity import Fingerprint, token_digest
from turnkv_server.connector.transport import TransferAgent, TransferResults
from turnkv_server.engine.nixl_poll import apply_poll_delay

BLOCKS, LAYERS = 8, 2
# 32 random-looking bytes: the side channel refuses short secrets.
SECRET = b"4f1c0e9a7b3d52e8c6a190f4d7b2e35a"
MODEL = Fingerprint.of({"model": "tiny", "dtype": "float32", "block_size": 16})
# The sending request's prompt; a receiver asks for the KV of a prefix of it.
PROMPT = tuple(range(1000, 1064))
# What the sending request holds when it finishes: its prompt and the token it sampled, whose
# KV vLLM never computes.
SENT = (*PROMPT, 7)

Pair = tuple["Engine", "Engine", str]


class Engine:
    """An agent over its own cache: LAYERS layers of [BLOCKS, 4, 16] float32."""

    def __init__(self, name: str, fill: float, *, listen: bool = False, port: int = 0,
                 secret: bytes = SECRET, fingerprint: Fingerprint = MODEL,
                 **timeouts: float) -> None:
        self.buffer = torch.full((LAYERS, BLOCKS, 4, 16), fill)
        layers = list(self.buffer.unbind(0))
        self.agent = TransferAgent(name, BlockTable.from_layers(layers, BLOCKS),
                                   ("127.0.0.1", port) if listen else None, **timeouts,
                                   secret=secret, fingerprint=fingerprint)
        storage = self.buffer.untyped_storage()
        self.agent.register_memory([(storage.data_ptr(), storage.nbytes())])
        self.agent.start()
        self.results = TransferResults()

    @property
    def address(self) -> str:
        assert self.agent.address is not None
        return self.agent.address

    def receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                first_block: int, tokens: tuple[int, ...] = PROMPT,
                timeout_s: float | None = None) -> None:
        self.agent.receive(request_id, transfer_id, peer, blocks, first_block, timeout_s,
                           tokens=len(tokens), digest=token_digest(tokens))

    def send(self, request_id: str, transfer_id: str, blocks: list[int],
             tokens: tuple[int, ...] = SENT) -> None:
        self.agent.send(request_id, transfer_id, blocks, tokens)

    def collect(self) -> TransferResults:
        new = self.agent.take_results()
        self.results.finished_sending |= new.finished_sending
        self.results.finished_recving |= new.finished_recving
        self.results.failed_blocks |= new.failed_blocks
        self.results.quarantined |= new.quarantined
        self.results.settled |= new.settled
        self.results.counters.add(new.counters)
        return self.results

    def received(self, request_id: str) -> Callable[[], bool]:
        return lambda: request_id in self.collect().finished_recving

    def sent(self, request_id: str) -> Callable[[], bool]:
        return lambda: request_id in self.collect().finished_sending

    def settled(self, request_id: str) -> Callable[[], bool]:
        return lambda: request_id in self.collect().settled


@contextmanager
def engine_pair(receive_timeout_s: float = 1.0) -> Iterator[Pair]:
    """A listening sender (every byte of its block b says b + 1) and a receiver (-1.0)."""
    apply_poll_delay()
    sender = Engine("sender", fill=0.0, listen=True, send_timeout_s=3.0)
    receiver = Engine("receiver", fill=-1.0, receive_timeout_s=receive_timeout_s)
    for b in range(BLOCKS):
        sender.buffer[:, b] = b + 1.0
    try:
        yield sender, receiver, sender.address
    finally:
        receiver.agent.close()
        sender.agent.close()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def holds_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` stays true for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.02)
    return True


def registered(engine: Engine, transfer_id: str) -> Callable[[], bool]:
    # The sender's thread owns its registrations; reading one attribute is enough here.
    def check() -> bool:
        out = engine.agent.sending.transfers.get(transfer_id)
        return out is not None and out.reg is not None
    return check


def writing(engine: Engine, transfer_id: str) -> Callable[[], bool]:
    """Whether the sender has a write of `transfer_id` in flight: a test about what happens to
    an in-flight write waits for it, since what it does next (a cancel from the receiver) may
    reach the sender's thread before the write command does."""
    def check() -> bool:
        out = engine.agent.sending.transfers.get(transfer_id)
        return out is not None and bool(out.writes)
    return check


def untouched(engine: Engine, but: tuple[int, ...] = ()) -> bool:
    rest = [b for b in range(BLOCKS) if b not in but]
    return bool((engine.buffer[:, rest] == -1.0).all())


def unused_address() -> str:
    """A port nobody listens on."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{unused.getsockname()[1]}"


class SilentSender:
    """A sender that answers the hello, takes the registration, then goes silent: a stopped
    or wedged engine whose socket is still open. Speaks the real, signed protocol."""

    def __init__(self) -> None:
        self.codec = sc.Codec(SECRET)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        ClusterKeys(SECRET).serve(self.socket)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.seen: list[Any] = []

    def serve_until_registered(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.socket.poll(50):
                continue
            identity, *frames = self.socket.recv_multipart()
            message = self.codec.decode(frames)
            self.seen.append(message)
            if isinstance(message, sc.Hello):
                self.socket.send_multipart(
                    [identity, *self.codec.encode(sc.HelloOk(agent="silent-sender"))])
            elif isinstance(message, sc.Register):
                return
        raise AssertionError("no registration")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


SEND_TIMEOUT_MS = 2000


class SideChannelClient:
    """A raw connection to a sender's side channel, as a cluster member's would be (the
    cluster's keys, unless not `encrypted`); frames are sent as given, so they may be stale,
    replayed or forged."""

    def __init__(self, address: str, *, encrypted: bool = True) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if encrypted:
            ClusterKeys(SECRET).connect(self.socket)
        self.socket.connect(f"tcp://{address}")

    def send(self, frames: list[bytes]) -> bool:
        """Whether the frames left: a connection the side channel refused (its handshake
        failed) may have no pipe to queue them on, and a DEALER's send then waits for one."""
        try:
            self.socket.send_multipart(frames)
        except zmq.Again:
            return False
        return True

    def answer(self, timeout_s: float) -> list[bytes] | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return list(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


class RecordingProxy:
    """A TCP relay in front of `target` ("host:port") that keeps every byte a client sends
    through it: what a listener on the network would see."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._bytes = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def recorded(self) -> bytes:
        with self._lock:
            return bytes(self._bytes)

    def _run(self) -> None:
        pairs: dict[socket.socket, socket.socket] = {}
        from_client: set[socket.socket] = set()
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener, *pairs], [], [], 0.05)
            for sock in ready:
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    server = socket.create_connection(self._target)
                    pairs[client], pairs[server] = server, client
                    from_client.add(client)
                    continue
                data = sock.recv(65536) if sock in pairs else b""
                if not data:
                    other = pairs.pop(sock, None)
                    if other is not None:
                        pairs.pop(other, None)
                        other.close()
                    sock.close()
                    continue
                if sock in from_client:
                    with self._lock:
                        self._bytes += data
                pairs[sock].sendall(data)
        for sock in pairs:
            sock.close()


class GatedStates:
    """The sender's NIXL agent, with transfers reported in flight until the gate opens: a
    slow link, on a machine where loopback writes complete at once. `fail`: once open, NIXL
    reports them failed ("ERR"), as it does for a write whose connection broke."""

    def __init__(self, nixl: Any, *, fail: bool = False) -> None:
        self._nixl = nixl
        self.open = False
        self.fail = fail

    def check_xfer_state(self, handle: Any) -> str:
        state = str(self._nixl.check_xfer_state(handle))
        if not self.open:
            return "PROC"
        return "ERR" if self.fail else state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nixl, name)


class DeadPeerStates(GatedStates):
    """NIXL raises on every call about a write to a peer that died mid-WRITE, and refuses to
    release its handle (it cannot cancel an active transfer); writes posted while `dead` are
    such writes."""

    def __init__(self, nixl: Any) -> None:
        super().__init__(nixl)
        self.dead = True
        self._doomed: set[int] = set()

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._nixl.make_prepped_xfer(*args, **kwargs)
        if self.dead:
            self._doomed.add(id(handle))
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        if id(handle) in self._doomed:
            raise RuntimeError("nixlRemoteDisconnectError")
        return str(self._nixl.check_xfer_state(handle))

    def release_xfer_handle(self, handle: Any) -> None:
        if id(handle) in self._doomed:
            raise RuntimeError("could not cancel an active transfer")
        self._nixl.release_xfer_handle(handle)

    def recover(self) -> None:
        """NIXL is done with the doomed writes at last: their handles can be released."""
        self._doomed.clear()
