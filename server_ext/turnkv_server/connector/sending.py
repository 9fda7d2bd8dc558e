"""The sending end of transfers: check a registration, write the blocks, settle before replying.

Per transfer ID the sender learns, in any order: that its request exists (`expect`, with the
prompt's token IDs), that it finished normally (`send`, with its blocks and all its token IDs)
or will send nothing (`refuse`), and the receiver's registration. It writes only when:

- the registration's token digest equals the digest of its own tokens over the same range,
  all of them tokens whose KV it has (`outgoing.Outgoing.kv_tokens`; otherwise the two
  engines hold different histories: `Failed`, and the receiver recomputes);
- the receiver said it wants the transfer within `FENCE_S` (its registration or a ping): a
  receiver that gave up and went quiet can count on no write starting later than that.

While the request computes, layer writes may start as soon as the registration is checked
(`write_layer`); the last write, with the notification, goes once they have settled. Every
`Failed` or `Cancelled` reply also waits until NIXL reports no write of the transfer in
progress, and says whether one may still land (`writes_may_land`: NIXL failed it or would not
release it, `writes`): the receiver reuses its blocks on a "no", and holds them on a "yes".

Each transfer's step is guarded on its own: one that raises (a bug) ends alone, its writes
given up (and its receiver told they may land), and the others go on.

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
from turnkv_server.connector.incoming import NOTIF_PREFIX
from turnkv_server.connector.orders import LayerReady
from turnkv_server.connector.outcomes import Outcomes
from turnkv_server.connector.outgoing import CANCELLED, Outgoing, Outgoings, Registration
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
        # `token_ids`: all the request's tokens; vLLM never computed the last one's KV.
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
                    restart: bool, ready: LayerReady | None = None) -> None:
        """Layer `layer` of `blocks` ((index in the request, block ID)) is computed: write it
        if the receiver registered, once `ready` completes. `restart`: the request was
        preempted and computes again, so nothing streamed so far can be trusted."""
        out = self.transfers.get(transfer_id)
        reg = None if out is None else out.reg
        if out is None or reg is None:
            return
        wanted = out.to_stream(layer, blocks, restart, self._clock(),
                               len(self.writer.table.layer_ranges))
        peer = self.writer.peers.get(reg.agent)
        if not wanted or peer is None:
            return
        ranges = self.writer.table.layer_ranges[layer]
        if ready is not None:
            # A GPU runs ahead of the host: wait here, not in the step, for the layer's kernels.
            ready.synchronize()
        try:
            handle = self.writer.post(peer, [b for _, b in wanted],
                                      [reg.blocks[k - reg.first_block] for k, _ in wanted],
                                      ranges)
        except WriteError as exc:  # the last write reports it to the receiver
            log.warning("turnkv: layer write for %s failed: %s", transfer_id, exc)
            out.writes.failed = True
            out.writes.may_land |= exc.may_land
            return
        out.writes.add(handle, peer)
        out.streamed.setdefault(layer, set()).update(k for k, _ in wanted)
        out.streamed_bytes += len(wanted) * sum(self.writer.table.ranges[r][1] for r in ranges)

    # -- the side channel --------------------------------------------------------------------

    def on_readable(self) -> None:
        assert self._router is not None
        for identity, message in self._codec.receive_all(self._router, True, self._rejected):
            try:
                self._on_message(identity, message)
            except Exception:  # one message's fault must not leave the rest unread
                log.exception("turnkv: handling a %s from %s", type(message).__name__,
                              message.agent)

    def _rejected(self, exc: sc.Rejected) -> None:
        self._outcomes.count(side_channel_rejected=1)
        log.warning("turnkv: dropped a side-channel message: %s", exc)

    def _on_message(self, identity: bytes, msg: sc.AnyMessage) -> None:
        now = self._clock()
        self.peers.heard(msg.agent, now)
        if isinstance(msg, sc.Hello):
            try:
                refused = self.peers.admit(msg, drop=self._drop_peer,
                                           busy=self.transfers.registered_agents)
            except sc.Rejected as exc:
                self._rejected(exc)
                return
            self._reply(identity, sc.HelloOk(agent=self.name) if refused is None
                        else sc.HelloRefused(agent=self.name, reason=refused))
        elif isinstance(msg, sc.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, sc.Ping):
            pending = self.transfers.wanted(msg.agent, msg.live, now)
            self._reply(identity, sc.Pong(agent=self.name, pending=pending))
        elif isinstance(msg, sc.Cancel):
            out = self.transfers.get(msg.transfer_id)
            if out is None or out.reg is None:
                # Nothing registered now (never, or its transfer over and answered already):
                # answer at once, saying what is known of its writes, and let the request's
                # blocks go as soon as it has any.
                if out is None:
                    self.transfers.over(msg.transfer_id, CANCELLED)
                    may_land = self.transfers.may_land(msg.transfer_id)
                else:
                    self._end(out, CANCELLED, failed=False)
                    may_land = out.writes.may_land
                self._reply(identity, sc.Cancelled(agent=self.name, transfer_id=msg.transfer_id,
                                                   writes_may_land=may_land))
            elif out.reg.agent == msg.agent:
                self._end(out, CANCELLED, failed=False, reply=sc.Cancelled(
                    agent=self.name, transfer_id=msg.transfer_id))

    def _on_register(self, identity: bytes, msg: sc.Register) -> None:
        transfer_id, now = msg.transfer_id, self._clock()

        def fail(reason: str) -> None:
            # Nothing was written for this registration; a transfer over here that may still
            # land says so all the same.
            self._reply(identity, sc.Failed(agent=self.name, transfer_id=transfer_id,
                                            reason=reason,
                                            writes_may_land=self.transfers.may_land(transfer_id)))

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
            try:
                self._progress(out, now)
            except Exception as exc:
                self._fault(out, exc)
        self.transfers.expire(now)
        self.writer.retry_releases(now)
        self.peers.settle()

    def _progress(self, out: Outgoing, now: float) -> None:
        if out.writes:
            if not out.writes.settle(self.writer):
                return
            if out.ended is not None:
                self._close(out)
                return
            if out.final_posted:
                self._done(out)
                return
        if out.ended is not None:
            return  # kept until its request finishes
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

    def busy(self) -> bool:
        """Whether NIXL must be polled: writes in flight."""
        return self.transfers.busy()

    def next_deadline(self) -> float:
        return min(self.transfers.next_deadline(), self.writer.next_retry())

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
            out.writes.may_land |= exc.may_land
            self._end(out, str(exc), failed=True)
            self.peers.doom(peer)
            return
        out.writes.add(handle, peer)
        out.final_posted, out.final_started = True, self._clock()

    def _done(self, out: Outgoing) -> None:
        assert out.blocks is not None and out.reg is not None
        if out.writes.failed:
            # The notification may have gone with a failed write: the receiver cannot tell,
            # so it is told; it recomputes (in other blocks: the failed write may land).
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
             reply: sc.Cancelled | None = None) -> None:
        """The transfer is over here; the receiver hears it once NIXL reports no write of it
        in progress."""
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
            out.reply.writes_may_land = out.writes.may_land
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

    def _fault(self, out: Outgoing, exc: Exception) -> None:
        """A step of `out` raised: it ends alone. What it posted is given up (and may land);
        its receiver is told so."""
        log.error("turnkv: send %s ended by an internal error", out.transfer_id, exc_info=exc)
        try:
            out.writes.abandon(self.writer)
            if out.ended is None:
                self._end(out, f"an internal error: {exc}", failed=True)
            else:
                self._close(out)
        except Exception:
            # Its state is beyond use: drop it and let its blocks go; its receiver, told
            # nothing, gives up at its deadline and holds its blocks.
            log.exception("turnkv: dropping send %s", out.transfer_id)
            out.ended, out.writes.may_land = out.ended or "an internal error", True
            self.transfers.forget(out)
            if out.blocks is not None:
                self._outcomes.sent(out.request_id or "", sends_failed=1)

    def _drop_peer(self, name: str) -> None:
        """A receiver restarted under a new agent name: its old agent's transfers end."""
        for out in self.transfers.values():
            if out.reg is not None and out.reg.agent == name:
                self._end(out, "the receiver restarted", failed=True)
        self.peers.doom(self.writer.peers.get(name))

    def _reply(self, identity: bytes, message: sc.Message) -> None:
        if self._router is None:
            return
        try:
            self._router.send_multipart([identity, *self._codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a receiver that left: nothing to tell
            log.debug("turnkv: reply %s not sent: %s", type(message).__name__, exc)
