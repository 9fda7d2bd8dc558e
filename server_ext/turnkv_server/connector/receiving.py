"""The receiving end of transfers: register blocks with a sender, hand them back only when safe.

A receive's blocks belong to a request that waits for them. vLLM reuses them as soon as the
receive is reported finished, so they are handed back for the request to compute into only
when no write of the sender can still land in them:

- the notification of the agent it registered with arrived: every write is in, the KV is
  complete (a notification from any other agent is counted and ignored);
- the sender answered `Failed` before we gave up, saying no write of it may still land: it
  answers only once NIXL reports none in progress;
- the registration never left this engine (its hello was not answered): nobody can write.

Otherwise (the request was aborted, the deadline passed, the sender's connection dropped,
another agent answers at its address, or the sender says a write may still land) the receive
is *quarantined*: its request is reported as a failed receive, which makes vLLM free the
request's blocks and compute the prompt in other ones, while the scheduler side keeps these
blocks out of use (`BlockHolder.quarantine`). No time bound on a write makes it safe to hand
them back earlier: UCX over TCP delivers writes held up by a broken link whenever the link
comes back, long after the receiver last asked for them (docs/architecture.md, "What the
connector guarantees"). The quarantine ends (`settled`):

- when the notification arrives after all: every write is in;
- `WRITE_GRACE_S` after the sender answers our `Cancel` (`Cancelled` or `Failed`, sent once
  its writes settled) saying no write may still land, or after another agent answers at its
  address (it restarted): what the old connection still carried has drained by then;
- otherwise at `QUARANTINE_MAX_S`, longer than Linux keeps retransmitting on a TCP connection
  (`tcp_retries2`, about 15 minutes), with a warning: a sender that neither answers nor can
  be reached costs its receive's blocks for that long, never wrong KV.

A receive gives up (and cancels) when its request is aborted, or at its deadline: the
router's timeout from its start, extended for as long as the sender reports the request that
will send it alive (a prefill queued behind others is slow, not dead).

Hellos are retried with backoff until answered; a sender that restarted is met again.

NIXL's notifications are read at every pass of the transfer thread while a live receive waits;
while only quarantined ones do, every `SLOW_NOTIFICATIONS_S`, so that a thread holding only
quarantines sleeps. A receive whose step raises (a bug) leaves the table and is quarantined
until `QUARANTINE_MAX_S` (or its notification): its state cannot be trusted to say more.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import zmq

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.cluster_secret import ClusterKeys
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.incoming import (
    NOTIF_PREFIX,
    SILENCE_S,
    SLOW_NOTIFICATIONS_S,
    IncomingTransfer,
)
from turnkv_server.connector.outcomes import Outcomes
from turnkv_server.connector.sender_links import Link, SenderLinks

log = logging.getLogger(__name__)

# The longest a quarantined receive's blocks are held without word from its sender (above).
QUARANTINE_MAX_S = 1000.0


class Receiving:
    def __init__(self, *, agent_name: str, engine_id: str, nixl: Any, table: BlockTable,
                 fingerprint: Fingerprint, codec: sc.Codec, keys: ClusterKeys,
                 context: zmq.Context[Any], outcomes: Outcomes,
                 clock: Callable[[], float]) -> None:
        self.name = agent_name
        self.nixl = nixl
        self._table = table
        self._codec = codec
        self._outcomes = outcomes
        self._clock = clock
        self.receives: dict[str, IncomingTransfer] = {}
        self.senders = SenderLinks(agent_name=agent_name, engine_id=engine_id, nixl=nixl,
                                   table=table, fingerprint=fingerprint, codec=codec, keys=keys,
                                   context=context, clock=clock)
        self.links = self.senders.links
        # Receives whose step raised, out of the table: transfer ID -> (request ID, when
        # their blocks may go back).
        self._faulted: dict[str, tuple[str, float]] = {}
        self._slow_read_at = -math.inf

    # -- commands ----------------------------------------------------------------------------

    def receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                first_block: int, timeout_s: float, tokens: int, digest: bytes) -> None:
        now = self._clock()
        rx = IncomingTransfer(request_id, transfer_id, peer, blocks, first_block, tokens,
                              digest, timeout_s, started=now, deadline=now + timeout_s)
        if transfer_id in self.receives:
            # Another request took this transfer ID (one HTTP request that vLLM split into
            # several): a transfer fills one request's blocks; this one computes its own.
            self._release(rx, "another request is receiving under this transfer ID")
            return
        self.receives[transfer_id] = rx
        self._register(rx)

    def decline(self, transfer_id: str, peer: str) -> None:
        """Nothing is needed under `transfer_id`: no blocks of ours are at stake."""
        self._send_cancel(peer, transfer_id)

    def cancel(self, transfer_id: str, reason: str) -> None:
        rx = self.receives.get(transfer_id)
        if rx is not None:
            self._give_up(rx, reason)

    # -- the side channel --------------------------------------------------------------------

    def on_readable(self, link: Link) -> None:
        def rejected(exc: sc.Rejected) -> None:
            self._outcomes.count(side_channel_rejected=1)
            log.warning("turnkv: dropped a side-channel message from %s: %s", link.address, exc)

        for _, message in self._codec.receive_all(link.socket, False, rejected):
            try:
                self._on_message(link, message)
            except Exception:  # one message's fault must not leave the rest unread
                log.exception("turnkv: handling a %s from %s", type(message).__name__,
                              link.address)

    def on_monitor(self, link: Link) -> None:
        for event in self.senders.events(link):
            if event == zmq.EVENT_DISCONNECTED and link.agent is not None:
                # The connection to the sender dropped: its process died, or a network broke.
                # Until we know which, nothing new registers with that agent.
                link.suspect, link.agent, link.hello = link.agent, None, "none"
                self._hello_waiting(link)
            elif event == zmq.EVENT_CONNECT_RETRIED and link.suspect is not None:
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
                    self._drain(given_up, sender_gone=True)
            self.senders.answered(link, msg.agent)
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
            reason = msg.reason if isinstance(msg, sc.Failed) else "cancelled"
            if msg.writes_may_land:
                # NIXL failed a write of it, or would not let one go: it may land late.
                rx.writes_may_land = True
                self._give_up(rx, f"{reason}, and a write of it may still land", cancel=False)
            elif rx.giving_up is not None:
                self._drain(rx)
            else:
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

    def read_notifications(self, now: float) -> None:
        """Read NIXL's notifications: every pass while a live receive waits for one, every
        `SLOW_NOTIFICATIONS_S` while only given-up ones do."""
        if not self.receives and not self._faulted:
            return
        if not self.live() and now < self._slow_read_at:
            return
        self._slow_read_at = now + SLOW_NOTIFICATIONS_S
        try:
            notifs = self.nixl.get_new_notifs()
        except Exception as exc:
            log.warning("turnkv: reading NIXL notifications failed: %s", exc)
            return
        for agent, messages in notifs.items():
            for message in messages:
                try:
                    self.on_notification(agent, message)
                except Exception:
                    log.exception("turnkv: a notification from %s", agent)

    def on_notification(self, agent: str, message: bytes) -> None:
        """`agent` (the NIXL agent that wrote) notified `message`."""
        if not message.startswith(NOTIF_PREFIX):
            return
        transfer_id = message[len(NOTIF_PREFIX):].decode(errors="replace")
        rx = self.receives.get(transfer_id)
        if rx is None:
            faulted = self._faulted.pop(transfer_id, None)
            if faulted is not None:
                self._outcomes.settled(faulted[0])
                return
            # Our blocks for it were handed back already: the protocol's bounds were broken.
            # Say so loudly.
            log.error("turnkv: transfer %s completed after its receive was released",
                      transfer_id)
            return
        if agent != rx.registered_with:
            # Only the agent that took the registration writes into these blocks: whatever
            # another says, they hold nothing of its.
            self._outcomes.count(notifications_rejected=1)
            log.warning("turnkv: ignored a completion of transfer %s from agent %s; it is "
                        "registered with %s", transfer_id, agent, rx.registered_with)
            return
        del self.receives[transfer_id]
        if rx.giving_up is not None:
            self._settle(rx, "its writes completed after all")
            return
        self._outcomes.received(
            rx.request_id, receives_done=1, blocks_received=len(rx.blocks),
            bytes_received=len(rx.blocks) * self._table.block_bytes,
            receive_seconds=self._clock() - rx.started)

    # -- time --------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self.senders.retry_hellos(now)
        wanted: dict[str, list[IncomingTransfer]] = {}
        for rx in list(self.receives.values()):
            try:
                self._tick(rx, now, wanted)
            except Exception as exc:
                self._fault(rx, exc)
        for transfer_id, (request_id, release_at) in list(self._faulted.items()):
            if now >= release_at:
                del self._faulted[transfer_id]
                self._outcomes.settled(request_id, quarantines_expired=1)
        for address, live in wanted.items():
            link = self.links[address]
            if now - link.last_ping >= sc.PING_S:
                link.last_ping = now
                self.senders.send(link, sc.Ping(agent=self.name,
                                                live=[rx.transfer_id for rx in live]))
                for rx in live:
                    rx.last_wanted = now

    def _tick(self, rx: IncomingTransfer, now: float,
              wanted: dict[str, list[IncomingTransfer]]) -> None:
        if rx.giving_up is None and now > rx.deadline:
            self._give_up(rx, f"no KV within {rx.timeout_s:g} s")
        elif rx.giving_up is not None and now >= rx.release_at:
            self._settle(rx, "the grace after the sender's word passed" if rx.drained
                         else f"no word from the sender in {QUARANTINE_MAX_S:g} s",
                         expired=not rx.drained)
        elif rx.giving_up is None and rx.registered_with is not None:
            wanted.setdefault(rx.peer, []).append(rx)

    def live(self) -> bool:
        """Whether a receive not given up waits (NIXL's notifications are then read at
        every pass)."""
        return any(rx.giving_up is None for rx in self.receives.values())

    def next_deadline(self) -> float:
        times = [rx.release_at if rx.giving_up else rx.deadline for rx in self.receives.values()]
        times.append(self.senders.next_hello())
        times += [release_at for _, release_at in self._faulted.values()]
        if self.receives or self._faulted:
            times.append(self._slow_read_at)
        return min(times, default=math.inf)

    def close(self) -> None:
        self.senders.close()

    # -- internals ---------------------------------------------------------------------------

    def _register(self, rx: IncomingTransfer) -> None:
        link = self.senders.get(rx.peer)
        if link.hello != "ok":
            if rx.transfer_id not in link.waiting:
                link.waiting.append(rx.transfer_id)
            if link.hello == "none":
                self.senders.hello(link, again=True)
            return
        assert link.agent is not None
        self.senders.send(link, sc.Register(
            agent=self.name, transfer_id=rx.transfer_id, blocks=rx.blocks,
            first_block=rx.first_block, tokens=rx.tokens, digest=rx.digest,
            timeout_s=rx.timeout_s))
        rx.registered_with, rx.last_wanted = link.agent, self._clock()

    def _hello_waiting(self, link: Link) -> None:
        """Say hello again if receives wait on this link (nothing is sent for none)."""
        if any(rx.peer == link.address and rx.giving_up is None
               for rx in self.receives.values()):
            self.senders.hello(link, again=True)

    def _give_up(self, rx: IncomingTransfer, reason: str, cancel: bool = True) -> None:
        """Quarantine `rx` (`cancel`: and tell its sender we want nothing more)."""
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
        self._outcomes.quarantined(rx.request_id, receives_cancelled=int(cancel),
                                   receives_failed=1, receives_quarantined=1)
        if cancel:
            self._send_cancel(rx.peer, rx.transfer_id)

    def _fault(self, rx: IncomingTransfer, exc: Exception) -> None:
        """A step of `rx` raised: its state cannot be trusted, so it leaves the table, and its
        blocks are held until its notification or the longest bound."""
        log.error("turnkv: receive %s ended by an internal error; its blocks stay out of use "
                  "for up to %g s", rx.transfer_id, QUARANTINE_MAX_S, exc_info=exc)
        if self.receives.get(rx.transfer_id) is rx:
            del self.receives[rx.transfer_id]
        self._faulted[rx.transfer_id] = (rx.request_id, self._clock() + QUARANTINE_MAX_S)
        if rx.giving_up is None:
            self._outcomes.quarantined(rx.request_id, receives_failed=1,
                                       receives_quarantined=1)
            with contextlib.suppress(Exception):
                self._send_cancel(rx.peer, rx.transfer_id)

    def _sender_gone(self, link: Link, agent: str, reason: str, restarted: bool) -> None:
        """The connection to `agent` dropped and cannot be restored (`restarted`: another
        agent answers at its address), or the sender says it does not know us."""
        for rx in list(self.receives.values()):
            if rx.peer == link.address and rx.registered_with == agent:
                self._give_up(rx, reason)
                if restarted:
                    self._drain(rx, sender_gone=True)

    def _drain(self, rx: IncomingTransfer, sender_gone: bool = False) -> None:
        rx.drain(self._clock(), sc.WRITE_GRACE_S, sender_gone)

    def _settle(self, rx: IncomingTransfer, reason: str, expired: bool = False) -> None:
        """The quarantine ends; `expired`: with no word from the sender at all."""
        if self.receives.get(rx.transfer_id) is rx:
            del self.receives[rx.transfer_id]
        (log.warning if expired else log.info)(
            "turnkv: the blocks of given-up receive %s go back into use: %s", rx.transfer_id,
            reason)
        self._outcomes.settled(rx.request_id, quarantines_expired=int(expired))

    def _release(self, rx: IncomingTransfer, reason: str) -> None:
        if self.receives.get(rx.transfer_id) is rx:
            del self.receives[rx.transfer_id]
        log.warning("turnkv: receive %s for %s failed (%s); its blocks will be recomputed",
                    rx.transfer_id, rx.request_id, reason)
        self._outcomes.received(rx.request_id, rx.blocks, receives_failed=1)

    def _send_cancel(self, peer: str, transfer_id: str) -> None:
        self.senders.send(self.senders.get(peer),
                          sc.Cancel(agent=self.name, transfer_id=transfer_id))
