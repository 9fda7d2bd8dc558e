"""The receiving end's connections to senders' side channels: one `Link` per address.

Each link is a ZeroMQ DEALER, encrypted with the cluster's CURVE keys, with a monitor socket
that reports its connection dropping or failing to come back. `SenderLinks` opens links,
sends signed messages on them, and says hello (this engine's NIXL metadata, block table and
fingerprint) with backoff until a hello is answered; what an answer means is
`receiving.Receiving`'s to decide.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.cluster_secret import ClusterKeys
from turnkv_server.connector.identity import Fingerprint

log = logging.getLogger(__name__)

HELLO_RETRY_S = 1.0
HELLO_RETRY_MAX_S = 8.0


@dataclass
class Link:
    """This engine's connection to one sender's side channel."""

    address: str
    socket: zmq.Socket[Any]
    monitor: zmq.Socket[Any]
    agent: str | None = None  # the sender agent that answered our hello
    hello: str = "none"  # none -> sent -> ok
    hello_sent_at: float = -math.inf
    hello_wait_s: float = HELLO_RETRY_S
    waiting: list[str] = field(default_factory=list)
    last_ping: float = -math.inf
    # The agent whose connection dropped, until we know whether it is gone (a reconnect is
    # refused, or another agent answers) or back (it answers our hello again).
    suspect: str | None = None


class SenderLinks:
    def __init__(self, *, agent_name: str, engine_id: str, nixl: Any, table: BlockTable,
                 fingerprint: Fingerprint, codec: sc.Codec, keys: ClusterKeys,
                 context: zmq.Context[Any], clock: Callable[[], float]) -> None:
        self.name = agent_name
        self.engine_id = engine_id
        self.nixl = nixl
        self._table = table
        self._fingerprint = fingerprint
        self._codec = codec
        self._keys = keys
        self._zmq = context
        self._clock = clock
        self.links: dict[str, Link] = {}

    def get(self, address: str) -> Link:
        """The link to `address`, opened if new."""
        link = self.links.get(address)
        if link is None:
            socket = self._zmq.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            self._keys.connect(socket)
            monitor = socket.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
            socket.connect(f"tcp://{address}")
            link = self.links[address] = Link(address, socket, monitor)
        return link

    def events(self, link: Link) -> Iterator[int]:
        """The connection events waiting on `link`'s monitor."""
        while True:
            try:
                yield int(recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"])
            except zmq.Again:
                return

    def send(self, link: Link, message: sc.Message) -> None:
        try:
            link.socket.send_multipart(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            # The queue towards an unreachable peer is full; hellos are retried and a
            # receive that cannot register gives up at its deadline.
            log.warning("turnkv: side channel to %s is full; dropped %s", link.address,
                        type(message).__name__)

    def hello(self, link: Link, again: bool = False) -> None:
        """Say hello on `link` (`again`: with the backoff started over)."""
        if again:
            link.hello_wait_s = HELLO_RETRY_S
        link.hello, link.hello_sent_at = "sent", self._clock()
        self.send(link, sc.Hello(agent=self.name, engine_id=self.engine_id,
                                 meta=self.nixl.get_agent_metadata(),
                                 table=self._table.to_wire(),
                                 fingerprint=self._fingerprint.to_wire()))

    def answered(self, link: Link, agent: str) -> None:
        link.suspect = None
        link.agent, link.hello, link.hello_wait_s = agent, "ok", HELLO_RETRY_S

    def retry_hellos(self, now: float) -> None:
        for link in self.links.values():
            if link.hello == "sent" and now >= link.hello_sent_at + link.hello_wait_s:
                link.hello_wait_s = min(link.hello_wait_s * 2, HELLO_RETRY_MAX_S)
                self.hello(link)

    def next_hello(self) -> float:
        return min((link.hello_sent_at + link.hello_wait_s
                    for link in self.links.values() if link.hello == "sent"), default=math.inf)

    def close(self) -> None:
        for link in self.links.values():
            link.socket.disable_monitor()
            link.monitor.close(linger=0)
            link.socket.close(linger=0)
        self.links.clear()
