"""The sending end of transfers: check a registration, write the blocks, settle before replying.

Per transfer ID the sender learns, in any order: that its request exists (`expect`, with the
prompt's token IDs), that it finished normally (`send`, with its blocks and all its token IDs)
or will send nothing (`refuse`), and the receiver's registration. It writes only when:

- the registration's token digest equals the digest of its own tokens over the same range
  (otherwise the two engines hold different histories: `Failed`, and the receiver recomputes);
- the receiver said it wants the transfer within `FENCE_S` (its registration or a ping): a
  receiver that gave up and went quiet can count on no write starting later than that.

While the request computes, layer writes may start as soon as the registration is checked
(`write_layer`); the last write, with the notification, goes once they have settled. Every
`Failed` or `Cancelled` reply also waits until every write of the transfer has settled: the
receiver reuses its blocks on that word.

Deadlines follow pending work: a send waits `send_timeout_s` for its registration (then later
registrations fail at once); a registration whose request has not arrived here waits at most
its timeout; one whose request is queued or computing waits for it, as long as the receiver
keeps pinging.

`Sending` is the protocol: commands from the step thread, side-channel messages, the writes,
the replies. Each transfer's state, the token check and what the last write still carries are
in `outgoing`; which receiver agents may be written into, in `sending_peers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.identity import Fingerprint
from turnkv_server.connector.outcomes import Outcomes
from turnkv_server.connector.outgoing import CANCELLED, Outgoing, Outgoings, Registration
from turnkv_server.connector.receiving import NOTIF_PREFIX
from turnkv_server.connector.sending_peers import SendingPeers
from turnkv_server.connector.writes import WriteError, Writer

log = logging.getLogger(__name__)

# What one receiver agent may hold here.
MAX_REGISTRATIONS_PER_AGENT = 4096
# A registration whose request has not arrived waits at most this long (or its own timeout).
MAX_UNCLAIMED_S = 600.0


class Sending:
    def __init__(self, *, agent_name: str, writer: Writer, fingerprint: Fingerprint,
                 codec: sc.Codec, router: zmq.Socket[Any] | None, outcomes: Outcomes,
                 send_timeout_s: float, clock: Callable[[], float]) -> None:
        self.name = agent_name
        self.writer = writer
        self._codec = codec
        self._router = router
        self._outcomes = outcomes
        self.send_timeout_s = send_timeout_s
        self._clock = clock
        self.transfers = Outgoings(send_timeout_s, clock)
        self.peers = SendingPeers(writer, fingerprint, clock)

    # -- commands from the step thread -------------------------------------------------------

    def expect(self, transfer_id: str, token_ids: tuple[int, ...]) -> None:
        out = self.transfers.open(transfer_id)
        if out.token_ids is None:
            out.token_ids = tuple(token_ids)
        self._check_and_write(out)

    def send(self, request_id: str, transfer_id: str, blocks: list[int],
             token_ids: tuple[int, ...]) -> None:
        out = self.transfers.open(transfer_id)
        if out.request_id is not None:
            # A second request under one transfer ID (one HTTP request that vLLM split into
            # several): the receiver registered for one request's blocks only.
            self._outcomes.sent(request_id, sends_failed=1)
            return
        out.request_id, out.blocks, out.token_ids = request_id, list(blocks), tuple(token_ids)
        if out.ended is not None:
            # Cancelled or failed while the request ran: its blocks go now.
            self._close(out)
            return
        out.send_deadline = self._clock() + self.send_timeout_s
        self._check_and_write(out)

    def refuse(self, transfer_id: str, reason: str) -> None:
        """Nothing will be sent under `transfer_id` (its request did not finish normally)."""
        out = self.transfers.get(transfer_id)
        if out is None:
            self.transfers.over(transfer_id, reason)
            return
        out.token_ids = None  # the request is gone
        if out.ended is None:
            self._end(out, reason, failed=True)
        else:
            self._close(out)

    def abandon(self, transfer_id: str) -> None:
        """Give up a finished send nobody has registered for: this engine needs its blocks."""
        out = self.transfers.get(transfer_id)
        if out is None:
            # Its request has not shown up here yet (the router's abandon overtook it):
            # remember, so that its send and a registration end at once.
            self.transfers.over(transfer_id, "the sender gave the blocks up", replace=False)
            return
        if out.blocks is None or out.reg is not None or out.ended is not None:
            return  # still computing (it refuses when it ends), being written, or over
        self._outcomes.count(sends_abandoned=1)
        self._end(out, "the sender gave the blocks up", failed=True)

    def write_layer(self, transfer_id: str, layer: int, blocks: list[tuple[int, int]],
                    restart: bool) -> None:
        """Layer `layer` of `blocks` ((index in the request, block ID)) is final: write it if
        the receiver registered. `restart`: the request was preempted and computes again,
        so nothing streamed so far can be trusted."""
        out = self.transfers.get(transfer_id)
        if out is None or out.ended is not None or out.final_posted:
            return
        if restart and not out.stream_stopped and (out.streamed or out.writes):
            out.stream_stopped = True
            out.streamed.clear()
        reg = out.reg
        if reg is None or not reg.verified or out.stream_stopped or out.writes.failed \
                or not reg.fenced(self._clock()) \
                or layer >= len(self.writer.table.layer_ranges):
            return
        peer = self.writer.peers.get(reg.agent)
        if peer is None:
            return
        end = reg.first_block + len(reg.blocks)
        wanted = [(k, block) for k, block in blocks if reg.first_block <= k < end]
        if not wanted:
            return
        ranges = self.writer.table.layer_ranges[layer]
        try:
            handle = self.writer.post(peer, [b for _, b in wanted],
                                      [reg.blocks[k - reg.first_block] for k, _ in wanted],
                                      ranges)
        except WriteError as exc:  # the last write reports it to the receiver
            log.warning("turnkv: layer write for %s failed: %s", transfer_id, exc)
            out.writes.failed = True
            return
        out.writes.add(handle, peer)
        out.streamed.setdefault(layer, set()).update(k for k, _ in wanted)
        out.streamed_bytes += len(wanted) * sum(self.writer.table.ranges[r][1] for r in ranges)

    # -- the side channel --------------------------------------------------------------------

    def on_readable(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity, rest = frames[0], frames[1:]
            try:
                message = self._codec.decode(rest)
            except sc.Rejected as exc:
                self._outcomes.count(side_channel_rejected=1)
                log.warning("turnkv: dropped a side-channel message: %s", exc)
                continue
            self._on_message(identity, message)

    def _on_message(self, identity: bytes, msg: sc.AnyMessage) -> None:
        now = self._clock()
        self.peers.heard(msg.agent, now)
        if isinstance(msg, sc.Hello):
            refused = self.peers.admit(msg, drop=self._drop_peer, busy=self._busy_agents)
            self._reply(identity, sc.HelloOk(agent=self.name) if refused is None
                        else sc.HelloRefused(agent=self.name, reason=refused))
        elif isinstance(msg, sc.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, sc.Ping):
            pending = []
            for transfer_id in msg.live:
                out = self.transfers.get(transfer_id)
                if out is None or out.reg is None or out.reg.agent != msg.agent:
                    continue
                out.reg.last_wanted = now
                if out.expected and out.ended is None:
                    pending.append(transfer_id)
            self._reply(identity, sc.Pong(agent=self.name, pending=pending))
        elif isinstance(msg, sc.Cancel):
            cancelled = sc.Cancelled(agent=self.name, transfer_id=msg.transfer_id)
            out = self.transfers.get(msg.transfer_id)
            if out is None or out.reg is None:
                # Nothing registered, so nothing written: answer now, and let the request's
                # blocks go as soon as it has any.
                if out is None:
                    self.transfers.over(msg.transfer_id, CANCELLED)
                else:
                    self._end(out, CANCELLED, failed=False)
                self._reply(identity, cancelled)
            elif out.reg.agent == msg.agent:
                self._end(out, CANCELLED, failed=False, reply=cancelled)

    def _on_register(self, identity: bytes, msg: sc.Register) -> None:
        transfer_id, now = msg.transfer_id, self._clock()

        def fail(reason: str) -> None:
            self._reply(identity, sc.Failed(agent=self.name, transfer_id=transfer_id,
                                            reason=reason))

        if msg.agent not in self.writer.peers:
            self._reply(identity, sc.UnknownAgent(agent=self.name, transfer_id=transfer_id))
            return
        over = self.transfers.why_over(transfer_id)
        if over is not None:
            fail(over)
            return
        out = self.transfers.get(transfer_id)
        if out is not None and (out.reg is not None or out.ended is not None):
            fail("registered twice" if out.ended is None else out.ended)
            return
        if self.transfers.registrations(msg.agent) >= MAX_REGISTRATIONS_PER_AGENT:
            fail("too many registrations from one engine")
            return
        out = self.transfers.open(transfer_id)
        self.transfers.register(out, Registration(
            msg.agent, identity, list(msg.blocks), msg.first_block, msg.tokens,
            bytes(msg.digest), unclaimed_until=now + min(msg.timeout_s, MAX_UNCLAIMED_S),
            last_wanted=now))
        self._check_and_write(out)

    # -- progress ----------------------------------------------------------------------------

    def progress(self, now: float) -> None:
        for out in self.transfers.values():
            if out.writes:
                if not out.writes.settle(self.writer):
                    continue
                if out.ended is not None:
                    self._close(out)
                    continue
                if out.final_posted:
                    self._done(out)
                    continue
            if out.ended is not None:
                continue  # kept until its request finishes
            if out.reg is not None and not out.expected and now > out.reg.unclaimed_until:
                self._end(out, "the sender's request never came", failed=True)
            elif out.reg is not None and not out.reg.fenced(self._clock()):
                self._end(out, "the receiver went silent", failed=True)
            elif out.reg is None and out.blocks is not None and now > out.send_deadline:
                # Nobody registered in time: let the request's blocks go, and answer a late
                # registration at once rather than after another timeout.
                self._end(out, "no receiver registered in time", failed=True)
            else:
                self._check_and_write(out)
        self.transfers.expire(now)
        self.peers.settle()

    def busy(self) -> bool:
        """Whether NIXL must be polled: writes in flight."""
        return self.transfers.busy()

    def next_deadline(self) -> float:
        return self.transfers.next_deadline()

    def close(self) -> None:
        for out in self.transfers.values():
            for handle, _ in out.writes.handles:
                self.writer.release(handle)
        self.transfers.clear()

    # -- internals ---------------------------------------------------------------------------

    def _check_and_write(self, out: Outgoing) -> None:
        reg = out.reg
        if reg is None or out.ended is not None or out.token_ids is None:
            return
        if not reg.verified:
            mismatch = out.token_mismatch()
            if mismatch is not None:
                self._outcomes.count(transfers_mismatched=1)
                log.warning("turnkv: transfer %s refused: %s", out.transfer_id, mismatch)
                self._end(out, mismatch, failed=True)
                return
            if not reg.verified:
                return  # the prompt is shorter; the finished request may cover it
        if out.blocks is not None and not out.writes and not out.final_posted:
            self._write_last(out, reg)

    def _write_last(self, out: Outgoing, reg: Registration) -> None:
        source = out.last_write_source()
        peer = self.writer.peers.get(reg.agent)
        reason = out.last_write_problem(source, peer is not None, self._clock())
        if reason is not None:
            self._end(out, reason, failed=True)
            return
        assert peer is not None
        local, remote = out.remaining(source, self.writer.table, peer.table)
        try:
            handle = self.writer.post_indices(peer, local, remote,
                                              NOTIF_PREFIX + out.transfer_id.encode())
        except WriteError as exc:
            self._end(out, str(exc), failed=True)
            self.peers.doom(peer)
            return
        out.writes.add(handle, peer)
        out.final_posted, out.final_started = True, self._clock()

    def _done(self, out: Outgoing) -> None:
        assert out.blocks is not None and out.reg is not None
        if out.writes.failed:
            # The notification may have gone with a failed write: the receiver cannot tell,
            # so it is told; it recomputes.
            self._end(out, "a NIXL write failed", failed=True)
            self.peers.doom(self.writer.peers.get(out.reg.agent))
            return
        nblocks = len(out.reg.blocks)
        self.transfers.forget(out)
        self._outcomes.sent(
            out.request_id or "", sends_done=1, blocks_sent=nblocks,
            bytes_sent=nblocks * self.writer.table.block_bytes,
            bytes_streamed=out.streamed_bytes,
            send_seconds=self._clock() - out.final_started)

    def _end(self, out: Outgoing, reason: str, failed: bool,
             reply: sc.Message | None = None) -> None:
        """The transfer is over here; the receiver hears it once every write has settled."""
        if out.ended is not None:
            return
        out.ended, out.failed, out.stream_stopped = reason, failed, True
        if out.reg is not None:
            out.reply = reply or sc.Failed(agent=self.name, transfer_id=out.transfer_id,
                                           reason=reason)
        if failed:
            log.info("turnkv: send %s ended: %s", out.transfer_id, reason)
        self._close(out)

    def _close(self, out: Outgoing) -> None:
        """Once the writes of an ended transfer have settled: reply, let its blocks go."""
        if out.writes:
            return
        if out.reply is not None and out.reg is not None:
            self._reply(out.reg.identity, out.reply)
            out.reply = None
        if out.blocks is not None:
            self.transfers.forget(out)
            self._outcomes.sent(out.request_id or "", sends_failed=1 if out.failed else 0)
        elif out.expected:
            # The request still runs: keep the verdict for its `send` (or `refuse`).
            if out.reg is not None:
                self.transfers.unregister(out.reg)
                out.reg = None
        else:
            self.transfers.forget(out)

    def _drop_peer(self, name: str) -> None:
        """A receiver restarted under a new agent name: its old agent's transfers end."""
        for out in self.transfers.values():
            if out.reg is not None and out.reg.agent == name:
                self._end(out, "the receiver restarted", failed=True)
        self.peers.doom(self.writer.peers.get(name))

    def _busy_agents(self) -> set[str]:
        return {out.reg.agent for out in self.transfers.values() if out.reg is not None}

    def _reply(self, identity: bytes, message: sc.Message) -> None:
        if self._router is None:
            return
        try:
            self._router.send_multipart([identity, *self._codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a receiver that left: nothing to tell
            log.debug("turnkv: reply %s not sent: %s", type(message).__name__, exc)
