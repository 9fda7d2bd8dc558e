"""The receiving end of transfers: register blocks with a sender, hand them back only when safe.

A receive's blocks belong to a request that waits for them. vLLM reuses them as soon as the
receive is reported finished, so they are handed back for the request to compute into only
when no write of the sender can still land in them:

- the sender's notification arrived: every write is in, the KV is complete;
- the sender answered `Failed` before we gave up: it settles every write of the transfer first;
- the registration never left this engine (its hello was not answered): nobody can write.

Otherwise (the request was aborted, the deadline passed, the sender's connection dropped or
another agent answers at its address) the receive is *quarantined*: its request is reported as
a failed receive, which makes vLLM free the request's blocks and compute the prompt in other
ones, while the scheduler side keeps these blocks out of use (`BlockHolder.quarantine`). No time
bound on a write makes it safe to hand them back earlier: UCX over TCP delivers writes held up by
a broken link whenever the link comes back, and a 7 s cut once landed a write in blocks a request
was recomputing into, 15 s after we had last asked for it. The quarantine ends (`settled`):

- when the notification arrives after all: every write is in;
- `WRITE_GRACE_S` after the sender answers our `Cancel` (`Cancelled` or `Failed`, sent once
  its writes settled), or after another agent answers at its address (it restarted): what the
  old connection still carried has drained by then;
- otherwise at `QUARANTINE_MAX_S`, longer than Linux keeps retransmitting on a TCP connection
  (`tcp_retries2`, about 15 minutes), with a warning: a sender that neither answers nor can
  be reached costs its receive's blocks for that long, never wrong KV.

A receive gives up (and cancels) when its request is aborted, or at its deadline: the
router's timeout from its start, extended for as long as the sender reports the request that
will send it alive (a prefill queued behind others is slow, not dead).

Hellos are retried with backoff until answered; a sender that restarted is met again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.outcomes import Outcomes

log = logging.getLogger(__name__)

NOTIF_PREFIX = b"turnkv:"
# A pending sender's pongs keep its receives alive this long each.
SILENCE_S = 5.0
HELLO_RETRY_S = 1.0
HELLO_RETRY_MAX_S = 8.0
# The longest a quarantined receive's blocks are held without word from its sender (above).
QUARANTINE_MAX_S = 1000.0


@dataclass
class Receive:
    request_id: str
    transfer_id: str
    peer: str
    blocks: list[int]
    first_block: int
    tokens: int
    digest: bytes
    timeout_s: float
    started: float
    deadline: float
    # The sender agent the registration went to; None while it has not left this engine.
    registered_with: str | None = None
    # When this engine last told the sender it wants the transfer (registration or ping).
    last_wanted: float = -math.inf
    retried: bool = False
    # Set once given up (quarantined): why, when its blocks may go back into use, and whether
    # that is the grace after the sender's word (`_drain`) rather than the long bound.
    giving_up: str | None = None
    release_at: float = math.inf
    drained: bool = False


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


class Receiving:
    def __init__(self, *, agent_name: str, engine_id: str, nixl: Any, table: BlockTable,
                 fingerprint: Fingerprint, codec: sc.Codec, context: zmq.Context[Any],
                 outcomes: Outcomes, clock: Callable[[], float]) -> None:
        self.name = agent_name
        self.engine_id = engine_id
        self._nixl = nixl
        self._table = table
        self._fingerprint = fingerprint
        self._codec = codec
        self._zmq = context
        self._outcomes = outcomes
        self._clock = clock
        self.receives: dict[str, Receive] = {}
        self.links: dict[str, Link] = {}

    # -- commands ----------------------------------------------------------------------------

    def receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                first_block: int, timeout_s: float, tokens: int, digest: bytes) -> None:
        now = self._clock()
        rx = Receive(request_id, transfer_id, peer, blocks, first_block, tokens, digest,
                     timeout_s, started=now, deadline=now + timeout_s)
        if transfer_id in self.receives:
            # Another request took this transfer ID (one HTTP request that vLLM split into
            # several): a transfer fills one request's blocks; this one computes its own.
            self._release(rx, "another request is receiving under this transfer ID")
            return
        self.receives[transfer_id] = rx
        self._register(rx)

    def decline(self, transfer_id: str, peer: str) -> None:
        """Nothing is needed under `transfer_id`: no blocks of ours are at stake."""
        self._send(self._link(peer), sc.Cancel(agent=self.name, transfer_id=transfer_id))

    def cancel(self, transfer_id: str, reason: str) -> None:
        rx = self.receives.get(transfer_id)
        if rx is not None:
            self._give_up(rx, reason)

    # -- the side channel --------------------------------------------------------------------

    def on_readable(self, link: Link) -> None:
        while True:
            try:
                frames = link.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self._codec.decode(frames)
            except sc.Rejected as exc:
                self._outcomes.count(side_channel_rejected=1)
                log.warning("turnkv: dropped a side-channel message from %s: %s",
                            link.address, exc)
                continue
            self._on_message(link, message)

    def on_monitor(self, link: Link) -> None:
        while True:
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and link.agent is not None:
                # The connection to the sender dropped: its process died, or a network broke.
                # Until we know which, nothing new registers with that agent.
                link.suspect, link.agent, link.hello = link.agent, None, "none"
                self._hello_waiting(link)
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED and link.suspect is not None:
                # Nothing listens at its address: its side channel is closed, so its agent
                # (which lived in that process) writes nothing more.
                suspect, link.suspect = link.suspect, None
                # Or a broken network in between, which heals: then the writes it had posted
                # land late. Quarantined until it answers again.
                self._sender_gone(link, suspect, "the sender's side channel closed",
                                  restarted=False)

    def _on_message(self, link: Link, msg: sc.AnyMessage) -> None:
        if isinstance(msg, sc.HelloOk):
            for known in (link.agent, link.suspect):
                if known is not None and msg.agent != known:
                    self._sender_gone(link, known, "the sender restarted", restarted=True)
            for given_up in list(self.receives.values()):
                # Quarantined for an agent that another one now replaces at its address.
                if (given_up.peer == link.address and given_up.giving_up is not None
                        and given_up.registered_with not in (None, msg.agent)):
                    self._drain(given_up)
            link.suspect = None
            link.agent, link.hello, link.hello_wait_s = msg.agent, "ok", HELLO_RETRY_S
            waiting, link.waiting = link.waiting, []
            for transfer_id in waiting:
                rx = self.receives.get(transfer_id)
                if rx is not None and rx.giving_up is None:
                    self._register(rx)
        elif isinstance(msg, sc.HelloRefused):
            log.warning("turnkv: %s refused this engine: %s", link.address, msg.reason)
            link.hello = "none"
            waiting, link.waiting = link.waiting, []
            for transfer_id in waiting:
                rx = self.receives.get(transfer_id)
                if rx is not None and rx.registered_with is None:
                    self._release(rx, f"refused: {msg.reason}")
        elif isinstance(msg, sc.Pong):
            if link.agent is not None and msg.agent != link.agent:
                link.hello = "none"
                self._sender_gone(link, link.agent, "the sender restarted", restarted=True)
                return
            keep = self._clock() + SILENCE_S
            for transfer_id in msg.pending:
                rx = self.receives.get(transfer_id)
                if rx is not None and rx.giving_up is None:
                    rx.deadline = max(rx.deadline, keep)
        elif isinstance(msg, (sc.Cancelled, sc.Failed)):
            rx = self.receives.get(msg.transfer_id)
            if rx is None or rx.registered_with != msg.agent:
                return
            if rx.giving_up is not None:
                self._drain(rx)
            else:
                reason = msg.reason if isinstance(msg, sc.Failed) else "cancelled"
                self._release(rx, reason)
        elif isinstance(msg, sc.UnknownAgent):
            # The sender has no NIXL metadata of ours: it cannot write into our blocks.
            rx = self.receives.get(msg.transfer_id)
            link.hello = "none"
            if rx is None:
                return
            rx.registered_with = None
            if rx.giving_up is not None:
                self._drain(rx)
            elif rx.retried:
                self._release(rx, "the sender does not know this engine")
            else:
                rx.retried = True
                self._register(rx)

    def on_notification(self, message: bytes) -> None:
        if not message.startswith(NOTIF_PREFIX):
            return
        transfer_id = message[len(NOTIF_PREFIX):].decode(errors="replace")
        rx = self.receives.pop(transfer_id, None)
        if rx is None:
            # Our blocks for it were handed back already: the protocol's bounds were broken.
            # Say so loudly.
            log.error("turnkv: transfer %s completed after its receive was released",
                      transfer_id)
            return
        if rx.giving_up is not None:
            self._settle(rx, "its writes completed after all")
            return
        self._outcomes.received(
            rx.request_id, receives_done=1, blocks_received=len(rx.blocks),
            bytes_received=len(rx.blocks) * self._table.block_bytes,
            receive_seconds=self._clock() - rx.started)

    # -- time --------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for link in self.links.values():
            if link.hello == "sent" and now >= link.hello_sent_at + link.hello_wait_s:
                link.hello_wait_s = min(link.hello_wait_s * 2, HELLO_RETRY_MAX_S)
                self._send_hello(link)
        wanted: dict[str, list[Receive]] = {}
        for rx in list(self.receives.values()):
            if rx.giving_up is None and now > rx.deadline:
                self._give_up(rx, f"no KV within {rx.timeout_s:g} s")
            elif rx.giving_up is not None and now >= rx.release_at:
                self._settle(rx, "the grace after the sender's word passed" if rx.drained
                             else f"no word from the sender in {QUARANTINE_MAX_S:g} s",
                             expired=not rx.drained)
            elif rx.giving_up is None and rx.registered_with is not None:
                wanted.setdefault(rx.peer, []).append(rx)
        for address, live in wanted.items():
            link = self.links[address]
            if now - link.last_ping >= sc.PING_S:
                link.last_ping = now
                self._send(link, sc.Ping(agent=self.name,
                                         live=[rx.transfer_id for rx in live]))
                for rx in live:
                    rx.last_wanted = now

    def next_deadline(self) -> float:
        times = [rx.release_at if rx.giving_up else rx.deadline for rx in self.receives.values()]
        times += [link.hello_sent_at + link.hello_wait_s
                  for link in self.links.values() if link.hello == "sent"]
        return min(times, default=math.inf)

    def close(self) -> None:
        for link in self.links.values():
            link.socket.disable_monitor()
            link.monitor.close(linger=0)
            link.socket.close(linger=0)
        self.links.clear()

    # -- internals ---------------------------------------------------------------------------

    def _register(self, rx: Receive) -> None:
        link = self._link(rx.peer)
        if link.hello != "ok":
            if rx.transfer_id not in link.waiting:
                link.waiting.append(rx.transfer_id)
            if link.hello == "none":
                link.hello_wait_s = HELLO_RETRY_S
                self._send_hello(link)
            return
        assert link.agent is not None
        self._send(link, sc.Register(
            agent=self.name, transfer_id=rx.transfer_id, blocks=rx.blocks,
            first_block=rx.first_block, tokens=rx.tokens, digest=rx.digest,
            timeout_s=rx.timeout_s))
        rx.registered_with, rx.last_wanted = link.agent, self._clock()

    def _hello_waiting(self, link: Link) -> None:
        """Say hello again if receives wait on this link (nothing is sent for none)."""
        if any(rx.peer == link.address and rx.giving_up is None
               for rx in self.receives.values()):
            link.hello_wait_s = HELLO_RETRY_S
            self._send_hello(link)

    def _give_up(self, rx: Receive, reason: str) -> None:
        if rx.giving_up is not None:
            return
        if rx.registered_with is None:
            self._release(rx, reason)
            return
        rx.giving_up = reason
        rx.release_at = self._clock() + QUARANTINE_MAX_S
        log.warning("turnkv: receive %s for %s given up (%s); the request computes its prompt "
                    "in other blocks, these stay out of use until no write can land",
                    rx.transfer_id, rx.request_id, reason)
        self._outcomes.quarantined(rx.request_id, receives_cancelled=1, receives_failed=1,
                                   receives_quarantined=1)
        self._send(self._link(rx.peer), sc.Cancel(agent=self.name, transfer_id=rx.transfer_id))

    def _sender_gone(self, link: Link, agent: str, reason: str, restarted: bool) -> None:
        """The connection to `agent` dropped and cannot be restored (`restarted`: another
        agent answers at its address), or the sender says it does not know us."""
        for rx in list(self.receives.values()):
            if rx.peer == link.address and rx.registered_with == agent:
                self._give_up(rx, reason)
                if restarted:
                    self._drain(rx)

    def _drain(self, rx: Receive) -> None:
        """The sender settled the transfer's writes (or its process is gone): hand the blocks
        back once what the connection still carried has landed."""
        if not rx.drained:
            rx.drained, rx.release_at = True, self._clock() + sc.WRITE_GRACE_S

    def _settle(self, rx: Receive, reason: str, expired: bool = False) -> None:
        """The quarantine ends; `expired`: with no word from the sender at all."""
        if self.receives.get(rx.transfer_id) is rx:
            del self.receives[rx.transfer_id]
        (log.warning if expired else log.info)(
            "turnkv: the blocks of given-up receive %s go back into use: %s", rx.transfer_id,
            reason)
        self._outcomes.settled(rx.request_id, quarantines_expired=int(expired))

    def _release(self, rx: Receive, reason: str) -> None:
        if self.receives.get(rx.transfer_id) is rx:
            del self.receives[rx.transfer_id]
        log.warning("turnkv: receive %s for %s failed (%s); its blocks will be recomputed",
                    rx.transfer_id, rx.request_id, reason)
        self._outcomes.received(rx.request_id, rx.blocks, receives_failed=1)

    def _link(self, address: str) -> Link:
        link = self.links.get(address)
        if link is None:
            socket = self._zmq.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            monitor = socket.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
            socket.connect(f"tcp://{address}")
            link = self.links[address] = Link(address, socket, monitor)
        return link

    def _send_hello(self, link: Link) -> None:
        link.hello, link.hello_sent_at = "sent", self._clock()
        self._send(link, sc.Hello(agent=self.name, engine_id=self.engine_id,
                                  meta=self._nixl.get_agent_metadata(),
                                  table=self._table.to_wire(),
                                  fingerprint=self._fingerprint.to_wire()))

    def _send(self, link: Link, message: sc.Message) -> None:
        try:
            link.socket.send_multipart(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            # The queue towards an unreachable peer is full; hellos are retried and a
            # receive that cannot register gives up at its deadline.
            log.warning("turnkv: side channel to %s is full; dropped %s", link.address,
                        type(message).__name__)
